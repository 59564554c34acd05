"""Every objective and advantage YAML instantiates through Hydra into the class it names."""

from pathlib import Path

import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

from gspo_lab.objectives import GRPO, GSPO, GroupAdvantage, GSPOToken

CONF = Path(__file__).resolve().parents[2] / "conf"


@pytest.mark.parametrize(
    "name, cls", [("gspo", GSPO), ("gspo_token", GSPOToken), ("grpo", GRPO)]
)
def test_objective_yaml_instantiates(name, cls):
    obj = instantiate(OmegaConf.load(CONF / "objective" / f"{name}.yaml"))
    assert type(obj) is cls
    assert (obj.clip_low, obj.clip_high) == ((3e-4, 4e-4) if name != "grpo" else (0.2, 0.27))


def test_advantage_yaml_instantiates():
    assert instantiate(OmegaConf.load(CONF / "advantage" / "group.yaml")) == GroupAdvantage("group", 1e-6)
