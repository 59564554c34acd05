"""Policy-optimisation objectives behind one interface: `obj(logp, old_logp, advantages, mask)`."""

from gspo_lab.objectives.advantages import GroupAdvantage, frac_zero_std
from gspo_lab.objectives.base import NonFiniteLossError, Objective, ObjectiveOutput
from gspo_lab.objectives.grpo import GRPO
from gspo_lab.objectives.gspo import GSPO, GSPOToken

__all__ = [
    "GRPO",
    "GSPO",
    "GSPOToken",
    "GroupAdvantage",
    "NonFiniteLossError",
    "Objective",
    "ObjectiveOutput",
    "frac_zero_std",
]
