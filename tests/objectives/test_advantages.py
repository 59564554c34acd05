"""Advantage estimators. `group`: expected values derived by hand. The others: each against its peer's code written
out here, independently of gspo-lab's (loops over groups, as the peer runs them), on random rewards with several
groups, an all-equal group and groups of 2:

- RLOO, REINFORCE++-baseline, pass@k: volcengine/verl `verl/trainer/ppo/core_algos.py` at commit
  b178a3cd56f58b2d502255daba591e92833930a7 (0.8.0.dev, 2026-01-29): `compute_rloo_outcome_advantage`,
  `compute_reinforce_plus_plus_baseline_outcome_advantage`, `compute_grpo_passk_outcome_advantage`, with
  `masked_mean`, `masked_var`, `masked_whiten` of `verl/utils/torch_functional.py` at the same commit.
- GDPO: huggingface/trl `trl/trainer/grpo_trainer.py` at commit f2cd57710ae345ea6428ae95363267fcf38a3dc8
  (v1.9.0-26, 1.10.0.dev), the `multi_objective_aggregation == "normalize_then_sum"` branch of
  `_generate_and_score_completions`, with `nanstd` of `trl/trainer/utils.py` at the same commit.

Then the rollout's plumbing: the components, weights and token counts an estimator names reach it from a real run.
"""

import math
from collections import defaultdict

import pytest
import torch

from gspo_lab.objectives import (GDPO, RLOO, GroupAdvantage, PassAtK, ReinforcePlusPlusBaseline,
                                 frac_zero_std)
from gspo_lab.objectives.advantages import scored_advantages
from gspo_lab.train import build
from tests.numerics import assert_rounding_close

# --- the peers' code, written out --------------------------------------------------------------------------------


def verl_group_scores(scores: torch.Tensor, index: list[int]) -> tuple[dict, dict]:
    """The id2score and id2mean both of verl's estimators build: each group's scores, and their mean (0 for a
    group of one)."""
    id2score, id2mean = defaultdict(list), {}
    for i in range(len(scores)):
        id2score[index[i]].append(scores[i])
    for idx in id2score:
        id2mean[idx] = torch.mean(torch.stack(id2score[idx])) if len(id2score[idx]) > 1 else torch.tensor(0.0)
    return id2score, id2mean


def verl_rloo(scores: torch.Tensor, index: list[int]) -> torch.Tensor:
    """verl compute_rloo_outcome_advantage: r * n/(n-1) - mean * n/(n-1) per group; a group of one keeps r."""
    scores = scores.clone()
    id2score, id2mean = verl_group_scores(scores, index)
    for i in range(len(scores)):
        n = len(id2score[index[i]])
        if n > 1:
            scores[i] = scores[i] * n / (n - 1) - id2mean[index[i]] * n / (n - 1)
    return scores


def verl_masked_mean(values, mask):
    return (torch.where(mask.bool(), values, 0.0) * mask).sum() / (mask.sum() + 1e-8)


def verl_masked_var(values, mask):
    variance = verl_masked_mean((values - verl_masked_mean(values, mask)) ** 2, mask)
    mask_sum = mask.sum()
    return variance * (mask_sum / (mask_sum - 1))  # unbiased=True; verl raises for a mask sum of 0 or 1


def verl_masked_whiten(values, mask):
    return (values - verl_masked_mean(values, mask)) * torch.rsqrt(verl_masked_var(values, mask) + 1e-8)


def verl_reinforce_plus_plus_baseline(token_level_rewards, response_mask, index):
    """verl compute_reinforce_plus_plus_baseline_outcome_advantage: the group's mean subtracted, tiled over the
    response, whitened over the response tokens, masked; [bs, T]."""
    response_length = token_level_rewards.shape[-1]
    scores = token_level_rewards.sum(dim=-1)
    _, id2mean = verl_group_scores(scores, index)
    for i in range(len(scores)):
        scores[i] = scores[i] - id2mean[index[i]]
    scores = scores.unsqueeze(-1).tile([1, response_length]) * response_mask
    return verl_masked_whiten(scores, response_mask) * response_mask


def verl_grpo_passk(scores, index, norm_adv_by_std_in_grpo=True, epsilon=1e-6):
    """verl compute_grpo_passk_outcome_advantage: only the group's argmax gets r_max - r_second (/ std + eps)."""
    advantages = torch.zeros_like(scores)
    id2scores, id2indices = defaultdict(list), defaultdict(list)
    for i in range(len(scores)):
        id2scores[index[i]].append(scores[i])
        id2indices[index[i]].append(i)
    for idx in id2scores:
        rewards = torch.stack(id2scores[idx])
        topk, topk_idx = torch.topk(rewards, 2)
        advantage = topk[0] - topk[1]
        if norm_adv_by_std_in_grpo:
            advantage = advantage / (torch.std(rewards) + epsilon)
        advantages[id2indices[idx][topk_idx[0].item()]] = advantage
    return advantages


def trl_nanstd(tensor, dim=None):
    """trl.trainer.utils.nanstd (keepdim=True where a dim is given)."""
    mean = torch.nanmean(tensor, dim=dim, keepdim=True)
    variance = torch.nanmean((tensor - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(tensor), dim=dim, keepdim=True)
    correction = count / (count - 1)
    correction = torch.where(count > 1, correction, torch.full_like(correction, float("nan")))
    std = torch.sqrt(variance * correction)
    return std if dim is not None else std.squeeze()


def trl_normalize_then_sum(rewards_per_func, reward_weights, num_generations):
    """TRL's multi_objective_aggregation="normalize_then_sum" (GDPO), from rewards_per_func [N, F] to advantages."""
    unscorable_mask = torch.isnan(rewards_per_func).all(dim=1)
    grouped = rewards_per_func.view(-1, num_generations, rewards_per_func.shape[1])
    mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
    std_k = trl_nanstd(grouped, dim=1) if num_generations > 1 else torch.zeros_like(mean_k)
    reward_k = (grouped - mean_k) / (std_k + 1e-4)
    reward_k = reward_k.view(-1, rewards_per_func.shape[1])
    rewards = (reward_k * reward_weights.unsqueeze(0)).nansum(dim=1)
    rewards[unscorable_mask] = torch.nan
    std_rewards = trl_nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    advantages = (rewards - torch.nanmean(rewards)) / (std_rewards + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


# --- random rewards ----------------------------------------------------------------------------------------------


def random_rewards(groups: int, group_size: int, seed: int, binary: bool) -> torch.Tensor:
    """[groups * group_size] float64 rewards, 0/1 or continuous; group 0 all equal."""
    g = torch.Generator().manual_seed(seed)
    rewards = torch.rand(groups, group_size, generator=g, dtype=torch.float64)
    rewards = (rewards > 0.5).double() if binary else 3 * rewards - 1
    rewards[0] = rewards[0, 0]
    return rewards.flatten()


CASES = [(groups, group_size, seed, binary) for groups, group_size in ((5, 2), (4, 4), (3, 8))
         for seed in (0, 1) for binary in (True, False)]


def close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype = torch.float64) -> None:
    """Equal to `dtype`'s rounding, relative to the advantages' size (a few dozen operations each)."""
    assert_rounding_close(actual, expected, scale=max(1.0, float(expected.abs().max())), units=64, dtype=dtype)


# --- group (by hand) ---------------------------------------------------------------------------------------------


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


# --- the peers' estimators ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("groups, group_size, seed, binary", CASES)
def test_rloo_is_verl_s(groups, group_size, seed, binary):
    rewards = random_rewards(groups, group_size, seed, binary)
    index = [i // group_size for i in range(len(rewards))]
    adv = RLOO()(rewards, group_size)
    close(adv, verl_rloo(rewards, index))
    assert adv[:group_size].abs().max() < 1e-12  # the all-equal group: 0 up to the rounding of its mean
    # the definition: r_i minus the mean of the other completions of its group
    assert adv[group_size].item() == pytest.approx(
        (rewards[group_size] - rewards[group_size + 1 : 2 * group_size].mean()).item(), abs=1e-12)


@pytest.mark.parametrize("groups, group_size, seed, binary", CASES)
def test_reinforce_plus_plus_baseline_is_verl_s_token_whitening(groups, group_size, seed, binary):
    rewards = random_rewards(groups, group_size, seed, binary)
    g = torch.Generator().manual_seed(100 + seed)
    lengths = torch.randint(1, 9, (len(rewards),), generator=g)
    lengths[1] = 0  # a completion with no token in the loss (rollout.mask_truncated)
    T = 8
    response_mask = (torch.arange(T) < lengths[:, None]).double()  # [N, T] right-padded
    token_level = torch.zeros(len(rewards), T, dtype=torch.float64)
    token_level[:, -1] = rewards  # verl sums the token-level rewards: where it sits does not matter
    reference = verl_reinforce_plus_plus_baseline(token_level, response_mask, [i // group_size for i in
                                                                                range(len(rewards))])
    adv = ReinforcePlusPlusBaseline()(rewards, group_size, token_counts=lengths)
    # each completion's advantage on each of its tokens; to float32's rounding (the dtype runs take), as verl adds
    # 1e-8 to the mask sums of masked_mean: a 3e-10 relative change of 30 tokens' mean, visible in float64
    close(adv[:, None] * response_mask, reference, torch.float32)
    assert adv[1] == 0  # no tokens: 0, as verl's masked output
    assert abs((adv * lengths).sum().item()) < 1e-9  # whitened over tokens: the token mean is 0


def test_reinforce_plus_plus_baseline_without_trained_tokens_is_zero():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0])
    assert (ReinforcePlusPlusBaseline()(rewards, 2, token_counts=torch.zeros(4)) == 0).all()
    assert (ReinforcePlusPlusBaseline()(rewards, 2, token_counts=torch.tensor([0, 0, 1, 0])) == 0).all()


@pytest.mark.parametrize("scale", ["group", "none"])
@pytest.mark.parametrize("groups, group_size, seed, binary", CASES)
def test_passk_is_verl_s(groups, group_size, seed, binary, scale):
    rewards = random_rewards(groups, group_size, seed, binary)
    index = [i // group_size for i in range(len(rewards))]
    adv = PassAtK(scale=scale)(rewards, group_size)
    close(adv, verl_grpo_passk(rewards, index, norm_adv_by_std_in_grpo=scale == "group"))
    assert (adv[:group_size] == 0).all()  # the all-equal group
    assert ((adv != 0).reshape(groups, group_size).sum(-1) <= 1).all()  # at most the best of each group


def test_passk_by_hand():
    # (0, 1, 1): a tie for the best -> 0; (0, 0, 1): gap 1, Bessel std sqrt(1/3) -> sqrt(3) on the third only
    adv = PassAtK(eps=1e-12)(torch.tensor([0.0, 1.0, 1.0, 0.0, 0.0, 1.0]), group_size=3)
    assert adv.tolist() == pytest.approx([0, 0, 0, 0, 0, math.sqrt(3)])


def gdpo_components(groups: int, group_size: int, seed: int) -> torch.Tensor:
    """[N, 3] float64: a 0/1 accuracy, a continuous format score and a function that applies to some rows only
    (NaN elsewhere); group 0 equal in every function, one row where no function applied."""
    g = torch.Generator().manual_seed(seed)
    n = groups * group_size
    accuracy = (torch.rand(n, generator=g, dtype=torch.float64) > 0.5).double()
    fmt = torch.rand(n, generator=g, dtype=torch.float64)
    sparse = torch.where(torch.rand(n, generator=g) > 0.4, -torch.rand(n, generator=g, dtype=torch.float64), torch.nan)
    components = torch.stack([accuracy, fmt, sparse], -1)
    components[:group_size] = torch.tensor([1.0, 0.5, -0.25], dtype=torch.float64)
    components[group_size + 1] = torch.nan
    return components


@pytest.mark.parametrize("groups, group_size, seed", [(g, n, s) for g, n in ((5, 2), (4, 4), (3, 8)) for s in (0, 1)])
def test_gdpo_is_trl_s_normalize_then_sum(groups, group_size, seed):
    components = gdpo_components(groups, group_size, seed)
    weights = torch.tensor([1.0, 0.5, 2.0], dtype=torch.float64)
    totals = (components * weights).nansum(-1)
    adv = GDPO()(totals, group_size, components=components, weights=weights)
    # to float32's rounding (the dtype runs take): TRL's nanstd takes Bessel's count / (count - 1) from integer
    # counts, in the default dtype float32 (7e-9 relative from float64's)
    close(adv, trl_normalize_then_sum(components, weights, group_size), torch.float32)
    assert adv[group_size + 1] == 0  # no function applied
    assert len(set(adv[:group_size].tolist())) == 1  # the all-equal group: one value (the batch mean moves it)
    # the weights act after normalising: GRPO's total (weights before) would give other advantages
    assert not torch.allclose(adv, GDPO()(totals, group_size, components=components * weights,
                                          weights=torch.ones(3, dtype=torch.float64)))


def test_gdpo_by_hand():
    # one group of 4, two 0/1 functions weighted (3, 1): each column has mean 1/2 and Bessel std sqrt(1/3), so it
    # normalises to ±h, h = sqrt(3)/2; sums s = 3 Â_1 + Â_2 = (2h, -2h, 4h, -4h), mean 0, Bessel std
    # sqrt(40 h² / 3) = sqrt(10); A = s / sqrt(10) = (1, -1, 2, -2) x sqrt(0.3)
    two = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0]])
    adv = GDPO(eps=0.0)(two.sum(-1), 4, components=two, weights=torch.tensor([3.0, 1.0]))
    assert adv.tolist() == pytest.approx([k * math.sqrt(0.3) for k in (1, -1, 2, -2)], abs=1e-6)


# --- unscorable completions (every reward function returned None) ------------------------------------------------

ESTIMATORS = {"group": GroupAdvantage(), "group_batch": GroupAdvantage(scale="batch"),
              "group_none": GroupAdvantage(scale="none"), "rloo": RLOO(), "reinforce_plus_plus_baseline":
              ReinforcePlusPlusBaseline(), "passk": PassAtK(), "passk_none": PassAtK(scale="none"), "gdpo": GDPO()}
GROUPS, GROUP_SIZE = 5, 4
# the rows no reward function scored, and the group size of what is left
UNSCORABLE = {"a whole group": ([8, 9, 10, 11], 4), "a row of each group": ([0, 5, 10, 15, 16], 3),
              "a group and a row of each other": ([8, 9, 10, 11, 0, 5, 15, 16], 3)}


def scored_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Components [N, 2] (a 0/1 accuracy and a penalty in [-1, 0]), weights [2] and token counts [N] of GROUPS
    groups of GROUP_SIZE, float64: group 0 equal in both, group 1 wrong throughout (its totals below 0, where a 0
    put in for an unscorable row would be the best)."""
    g = torch.Generator().manual_seed(seed)
    n = GROUPS * GROUP_SIZE
    components = torch.stack([(torch.rand(n, generator=g, dtype=torch.float64) > 0.5).double(),
                              -torch.rand(n, generator=g, dtype=torch.float64)], -1)
    components[:GROUP_SIZE] = torch.tensor([1.0, -0.5], dtype=torch.float64)
    components[GROUP_SIZE : 2 * GROUP_SIZE, 0] = 0.0
    return components, torch.tensor([1.0, 0.5], dtype=torch.float64), torch.randint(1, 9, (n,), generator=g)


def rollout_advantages(estimator, components, weights, token_counts, group_size) -> torch.Tensor:
    """The advantages the rollout gives: a row whose components are all NaN is unscorable, its total 0 (`Scores`)."""
    totals = (components * weights).nansum(-1)
    available = {"components": components, "weights": weights, "token_counts": token_counts}
    return scored_advantages(estimator, totals, ~components.isnan().all(-1), group_size,
                             **{name: available[name] for name in estimator.inputs})


@pytest.mark.parametrize("unscorable", UNSCORABLE)
@pytest.mark.parametrize("name", ESTIMATORS)
def test_unscorable_completions_take_no_part_in_any_estimator(name, unscorable):
    """The scored rows' advantages are the estimator's on the batch without the unscorable rows; theirs are 0."""
    rows, reduced_size = UNSCORABLE[unscorable]
    components, weights, token_counts = scored_batch(seed=0)
    kept = torch.ones(len(components), dtype=torch.bool)
    kept[rows] = False
    without = rollout_advantages(ESTIMATORS[name], components[kept], weights, token_counts[kept], reduced_size)
    components[rows] = torch.nan
    adv = rollout_advantages(ESTIMATORS[name], components, weights, token_counts, GROUP_SIZE)
    close(adv[kept], without)
    assert (adv[~kept] == 0).all()


@pytest.mark.parametrize("name", ["group", "group_none", "rloo", "passk", "passk_none"])
def test_a_group_that_loses_rows_gets_the_estimator_of_what_is_left(name):
    """Groups losing 1, 2, 0, 3 and 4 of their 4 rows: each group's scored rows get the estimator of the rows left
    (a group of one: 0)."""
    estimator = ESTIMATORS[name]
    rewards = random_rewards(GROUPS, GROUP_SIZE, seed=3, binary=False).reshape(GROUPS, GROUP_SIZE)
    scored = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 0], [1, 1, 1, 1], [0, 0, 1, 0], [0, 0, 0, 0]], dtype=torch.bool)
    adv = estimator(torch.where(scored, rewards, torch.nan).flatten(), GROUP_SIZE).reshape(GROUPS, GROUP_SIZE)
    for group in range(GROUPS - 1):  # the last has no row left: the line below
        left = rewards[group][scored[group]]
        expected = estimator(left, len(left)) if len(left) > 1 else torch.zeros_like(left)
        close(adv[group][scored[group]], expected)
    assert (adv[~scored] == 0).all()


def test_reinforce_plus_plus_baseline_whitens_the_scored_rows_tokens_only_as_verl_would_without_the_rest():
    """Groups losing 1, 2, 0, 1 and 4 rows: verl's estimator on the scored rows, grouped by their prompt."""
    rewards = random_rewards(GROUPS, GROUP_SIZE, seed=4, binary=True)
    lengths = torch.randint(1, 9, (len(rewards),), generator=torch.Generator().manual_seed(4))
    scored = torch.tensor([1, 1, 0, 1, 0, 1, 1, 0, 1, 1, 1, 1, 1, 0, 1, 1, 0, 0, 0, 0], dtype=torch.bool)
    adv = ReinforcePlusPlusBaseline()(torch.where(scored, rewards, torch.nan), GROUP_SIZE, token_counts=lengths)
    response_mask = (torch.arange(8) < lengths[scored][:, None]).double()  # [n, T]
    token_level = torch.zeros(int(scored.sum()), 8, dtype=torch.float64)
    token_level[:, -1] = rewards[scored]
    index = (torch.arange(len(rewards)) // GROUP_SIZE)[scored].tolist()
    close(adv[scored][:, None] * response_mask, verl_reinforce_plus_plus_baseline(token_level, response_mask, index),
          torch.float32)
    assert (adv[~scored] == 0).all()


def test_a_group_with_one_scored_completion_is_an_all_equal_group():
    # groups (1, -, -, -) and (1, 0, 0, 1): the lone completion gets 0 ...
    rewards = torch.tensor([1.0, torch.nan, torch.nan, torch.nan, 1.0, 0.0, 0.0, 1.0])
    for estimator in (GroupAdvantage(), GroupAdvantage(scale="none"), RLOO(), PassAtK(), PassAtK(scale="none")):
        assert estimator(rewards, 4)[:4].tolist() == [0, 0, 0, 0]
    # ... and counts in the batch's statistics. REINFORCE++: a = (0 | 0.5, -0.5, -0.5, 0.5) on one token each, μ 0,
    # σ² = 4 x 0.25 / (5 - 1) = 0.25 (without the lone one 1/3); GDPO (one function): Â = (NaN | ±sqrt(3)/2), s =
    # (0 | ±sqrt(3)/2), Bessel std sqrt(3)/2: A = (0 | ±1)
    adv = ReinforcePlusPlusBaseline()(rewards, 4, token_counts=torch.ones(8))
    assert adv.tolist() == pytest.approx([0, 0, 0, 0, 1, -1, -1, 1], abs=1e-6)
    adv = GDPO(eps=0.0)(rewards, 4, components=rewards[:, None], weights=torch.ones(1))
    assert adv.tolist() == pytest.approx([0, 0, 0, 0, 1, -1, -1, 1], abs=1e-6)
    # group, scale=batch: the scored rewards (1 | 1, 0, 0, 1), mean 0.6, population std sqrt(0.24)
    adv = GroupAdvantage(scale="batch", eps=0.0)(rewards, 4)
    assert adv.tolist() == pytest.approx([0, 0, 0, 0] + [k * 0.5 / math.sqrt(0.24) for k in (1, -1, -1, 1)])


@pytest.mark.parametrize("scored_rows", [[], [2]], ids=["none scored", "one scored"])
@pytest.mark.parametrize("name", ESTIMATORS)
def test_a_batch_with_no_scored_completion_or_one_gets_zeros(name, scored_rows):
    components, weights, token_counts = scored_batch(seed=1)
    unscorable = torch.ones(len(components), dtype=torch.bool)
    unscorable[scored_rows] = False
    components[unscorable] = torch.nan
    assert (rollout_advantages(ESTIMATORS[name], components, weights, token_counts, GROUP_SIZE) == 0).all()


def test_a_user_s_estimator_gets_unscorable_rewards_as_nan():
    def centred(rewards, group_size):  # r - the group's mean, leaving NaN out
        groups = rewards.reshape(-1, group_size)
        return (groups - groups.nanmean(-1, keepdim=True)).flatten()

    def centred_with_nan(rewards, group_size):  # the same with mean(): NaN for the whole group
        groups = rewards.reshape(-1, group_size)
        return (groups - groups.mean(-1, keepdim=True)).flatten()

    rewards, scored = torch.tensor([1.0, 0.0, 0.0, 0.0]), torch.tensor([True, True, True, False])
    assert scored_advantages(centred, rewards, scored, 4).tolist() == pytest.approx([2 / 3, -1 / 3, -1 / 3, 0])
    with pytest.raises(FloatingPointError, match=r"the advantage estimator centred_with_nan gave a non-finite "
                                                 r"advantage to 3 of the 3 scored completions\. .* as NaN"):
        scored_advantages(centred_with_nan, rewards, scored, 4)
    assert scored_advantages(centred_with_nan, rewards, torch.ones(4, dtype=torch.bool), 4).tolist() == [
        0.75, -0.25, -0.25, -0.25]  # nothing unscorable: nothing changes


# --- refusals ----------------------------------------------------------------------------------------------------


def test_errors_name_the_key_and_the_rule():
    with pytest.raises(ValueError, match=r"advantage\.scale='std'.*one of"):
        GroupAdvantage(scale="std")
    with pytest.raises(ValueError, match="group_size=3"):
        GroupAdvantage()(torch.zeros(4), 3)
    with pytest.raises(ValueError, match=r"advantage\.scale='batch' must be one of \('group', 'none'\) for "
                                         r"advantage=passk"):
        PassAtK(scale="batch")
    for estimator in (ReinforcePlusPlusBaseline, PassAtK):
        with pytest.raises(ValueError, match=r"advantage\.eps=0\.0 must be > 0 .*divide 0 by 0"):
            estimator(eps=0.0)
    with pytest.raises(ValueError, match=r"advantage\.eps=-1\.0 must be >= 0 for advantage=gdpo"):
        GDPO(eps=-1.0)


@pytest.mark.parametrize("estimator, inputs", [
    (RLOO(), {}), (PassAtK(), {}), (ReinforcePlusPlusBaseline(), {"token_counts": torch.ones(3)}),
    (GDPO(), {"components": torch.zeros(3, 1), "weights": torch.ones(1)}),
])
def test_a_group_of_one_is_refused(estimator, inputs):
    with pytest.raises(ValueError, match=r"group_size=1 is invalid for advantage=\w+: it needs at least 2"):
        estimator(torch.zeros(3), 1, **inputs)


def test_gdpo_refuses_components_that_are_not_one_column_per_function():
    with pytest.raises(ValueError, match=r"advantage=gdpo: components of shape \(4, 2\) must be \[N, F\] = \[4, 3\]"):
        GDPO()(torch.zeros(4), 2, components=torch.zeros(4, 2), weights=torch.ones(3))


# --- the rollout's plumbing --------------------------------------------------------------------------------------


class Recording:
    """An estimator that takes every input the rollout offers, records them, and passes the wrapped one its own."""

    inputs = ("components", "weights", "token_counts")

    def __init__(self, estimator):
        self.estimator, self.calls = estimator, []

    def __call__(self, rewards, group_size, **inputs):
        self.calls.append((rewards, inputs))
        return self.estimator(rewards, group_size, **{k: inputs[k] for k in self.estimator.inputs})


@pytest.mark.parametrize("shuffled", [False, True])
def test_each_reward_function_s_rewards_reach_the_estimator_with_their_completions(shuffled, compose, rl_overrides):
    """Two reward functions (the checker, DAPO's overlong punishment), advantage=gdpo: the estimator gets their
    rewards as columns whose weighted sum is the total it gets beside them, row by row, also when the
    shuffled-reward control permutes the totals; and each completion's token count in the loss."""
    cfg = compose(rl_overrides + ["advantage=gdpo", "reward=dapo_overlong", "reward.functions.1.weight=0.5",
                                  "train.steps=1", f"train.shuffle_rewards={shuffled}"])
    run, module, _ = build(cfg)
    assert isinstance(module.collector.advantage, GDPO)
    module.collector.advantage = Recording(module.collector.advantage)
    run.trainer.fit(module)
    (rewards, inputs), = module.collector.advantage.calls
    components, weights, token_counts = inputs["components"], inputs["weights"], inputs["token_counts"]
    assert components.shape == (16, 2) and weights.tolist() == [1.0, 0.5]
    assert torch.equal((components * weights).nansum(-1), rewards)
    assert set(components[:, 1].tolist()) <= {0.0, -1.0} and components[:, 0].unique().numel() > 1
    first = module.history[0]
    assert token_counts.sum().item() == pytest.approx(first["completion/len_mean"] * 16)
    assert 0 < first["grad_norm"] < math.inf


def test_an_unscorable_completion_reaches_the_estimator_as_nan(compose, rl_overrides):
    """A reward that scores only the completions of an even number of tokens: the others reach the estimator as
    NaN, and the step trains."""
    cfg = compose(rl_overrides + ["advantage=rloo", "train.steps=1",
                                  "reward.functions=[{_target_:tests.rewards.user_rewards.even_length}]"])
    run, module, _ = build(cfg)
    module.collector.advantage = Recording(module.collector.advantage)
    run.trainer.fit(module)
    (rewards, inputs), = module.collector.advantage.calls
    lengths = inputs["token_counts"]
    assert 0 < (lengths % 2).sum() < len(lengths)  # both kinds in the batch
    assert torch.equal(rewards.isnan(), lengths % 2 == 1)
    assert torch.equal(rewards[~rewards.isnan()], lengths[lengths % 2 == 0].float())
    assert 0 < module.history[0]["grad_norm"] < math.inf
