"""The objective and advantage YAMLs instantiate through Hydra with the paper's values, and clip_scale
scales the clip range."""

import pytest
from hydra.utils import instantiate

from gspo_lab.objectives import GRPO, GSPO, GroupAdvantage, GSPOToken


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
