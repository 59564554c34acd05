"""Group-relative advantages; expected values derived by hand."""

import pytest
import torch

from gspo_lab.objectives import GroupAdvantage, frac_zero_std


def test_group_scale():
    # group (1, 0, 0, 1): mean 0.5, population std 0.5 -> (1, -1, -1, 1); group (0, 0, 0, 1): mean 0.25,
    # std sqrt(3/16) = 0.4330127 -> (-0.57735, -0.57735, -0.57735, 1.7320508)
    rewards = torch.tensor([1.0, 0, 0, 1, 0, 0, 0, 1])
    adv = GroupAdvantage(eps=0.0)(rewards, group_size=4)
    expected = torch.tensor([1.0, -1, -1, 1, -0.5773503, -0.5773503, -0.5773503, 1.7320508])
    assert torch.allclose(adv, expected, atol=1e-6)


def test_batch_and_none_scales():
    rewards = torch.tensor([1.0, 0, 0, 0])  # batch mean 0.25, batch population std 0.4330127
    centred = torch.tensor([0.5, -0.5, 0, 0])  # minus each group's mean (0.5, 0)
    assert torch.allclose(GroupAdvantage(scale="none")(rewards, 2), centred)
    assert torch.allclose(GroupAdvantage(scale="batch", eps=0.0)(rewards, 2), centred / 0.4330127, atol=1e-6)


def test_equal_rewards_give_zero_advantage():
    rewards = torch.tensor([3.0, 3.0, 3.0, 0.0, 1.0, 2.0])
    adv = GroupAdvantage()(rewards, 3)
    assert (adv[:3] == 0).all() and adv[3:].abs().sum() > 0
    assert frac_zero_std(rewards, 3).item() == pytest.approx(0.5)


def test_errors_name_the_key_and_the_rule():
    with pytest.raises(ValueError, match=r"advantage\.scale='std'.*one of"):
        GroupAdvantage(scale="std")
    with pytest.raises(ValueError, match="group_size=3"):
        GroupAdvantage()(torch.zeros(4), 3)
