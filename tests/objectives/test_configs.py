"""The objective and advantage YAMLs instantiate through Hydra with the paper's values (the plan accepts every
`advantage=<name>`), and clip_scale scales the clip range."""

import math
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate

from gspo_lab import CONFIG_DIR
from gspo_lab.objectives import GDPO, GRPO, GSPO, RLOO, GroupAdvantage, GSPOToken, PassAtK, ReinforcePlusPlusBaseline
from gspo_lab.train import ConfigError, plan

# each `advantage=<name>` and its estimator with the peers' constants (objectives/advantages.py)
ESTIMATORS = {"group": GroupAdvantage("group", 1e-6), "rloo": RLOO(),
              "reinforce_plus_plus_baseline": ReinforcePlusPlusBaseline(eps=1e-8), "passk": PassAtK("group", 1e-6),
              "gdpo": GDPO(eps=1e-4)}


@pytest.mark.parametrize(
    "algorithm, cls, paper_clip", [("gspo", GSPO, (3e-4, 4e-4)), ("gspo_token", GSPOToken, (3e-4, 4e-4)),
                                   ("grpo", GRPO, (0.2, 0.27))]
)
def test_objective_yaml_has_the_paper_clip_range(algorithm, cls, paper_clip, compose):
    obj = instantiate(compose([f"algorithm={algorithm}"]).objective)
    assert type(obj) is cls and (obj.clip_low, obj.clip_high) == paper_clip  # exactly: 1.0 x value
    scaled = instantiate(compose([f"algorithm={algorithm}", "clip_scale=2.0"]).objective)
    assert (scaled.clip_low, scaled.clip_high) == (2 * paper_clip[0], 2 * paper_clip[1])


def test_advantage_yaml_instantiates(base_cfg):
    assert instantiate(base_cfg.advantage) == GroupAdvantage("group", 1e-6)


def test_the_advantage_options_are_the_tested_ones():
    assert sorted(p.stem for p in (Path(CONFIG_DIR) / "advantage").glob("*.yaml")) == sorted(ESTIMATORS)


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_each_advantage_option_is_accepted_by_the_plan(name, compose, tmp_path):
    run = plan(compose([f"advantage={name}", f"paths.output_dir={tmp_path}"]))
    assert run.advantage == ESTIMATORS[name]  # a dataclass: equal class and fields


def test_dr_grpo_s_undivided_advantages_go_with_the_estimators_that_have_a_scale(compose, tmp_path):
    """algorithm=dr_grpo sets advantage.scale=none: passk takes it (the gap undivided); an estimator without a
    scale refuses it in the plan, and `~advantage.scale` drops it."""
    out = f"paths.output_dir={tmp_path}"
    assert plan(compose(["algorithm=dr_grpo", "advantage=passk", out])).advantage == PassAtK("none", 1e-6)
    with pytest.raises(ConfigError, match=r"advantage.scale='none' is not a setting of RLOO .*drop it with "
                       r"~advantage.scale"):
        plan(compose(["algorithm=dr_grpo", "advantage=rloo", out]))
    assert plan(compose(["algorithm=dr_grpo", "advantage=rloo", "~advantage.scale", out])).advantage == RLOO()


def test_dr_grpo_normaliser_is_the_generation_budget_whatever_the_batch_width(compose):
    """With length_norm=false the loss divides by B x max_len; max_len defaults to rollout.max_new_tokens, so
    a rollout whose completions happen to be shorter (a narrower padded batch) keeps the same normaliser."""
    cfg = compose(["algorithm=grpo", "objective.length_norm=false", "rollout.max_new_tokens=12"])
    obj = instantiate(cfg.objective)
    assert obj.max_len == 12
    logp, old = torch.tensor([[-0.9, -1.2]]), torch.tensor([[-1.0, -1.0]])  # log-ratios 0.1, -0.2: unclipped
    narrow = obj(logp, old, torch.tensor([1.0]), torch.ones(1, 2)).loss
    wide = obj(torch.cat([logp, torch.zeros(1, 3)], 1), torch.cat([old, torch.zeros(1, 3)], 1), torch.tensor([1.0]),
               torch.tensor([[1, 1, 0, 0, 0]])).loss
    assert narrow.item() == pytest.approx(-(math.exp(0.1) + math.exp(-0.2)) / 12)  # Σ w A / (1 x 12)
    assert wide.item() == narrow.item()
