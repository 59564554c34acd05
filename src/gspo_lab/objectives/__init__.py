"""Policy-optimisation objectives behind one interface: `obj(logp, old_logp, advantages, mask)`.

An `Objective` is a ratio (objectives/ratios.py), a surrogate (surrogates.py) and an aggregation
(aggregations.py); GSPO, GSPOToken and GRPO are three fixed compositions with the papers' flat settings, and
conf/objective/*.yaml composes the others (dapo, dr_grpo, cispo, sapo, gmpo, luspo, vespo) from the axes.
"""

from gspo_lab.objectives.advantages import (GDPO, RLOO, AdvantageEstimator, GroupAdvantage, PassAtK,
                                             ReinforcePlusPlusBaseline, frac_zero_std)
from gspo_lab.objectives.base import NonFiniteLossError, Objective, ObjectiveOutput
from gspo_lab.objectives.grpo import GRPO
from gspo_lab.objectives.gspo import GSPO, GSPOToken

__all__ = [
    "AdvantageEstimator",
    "GDPO",
    "GRPO",
    "GSPO",
    "GSPOToken",
    "GroupAdvantage",
    "NonFiniteLossError",
    "Objective",
    "ObjectiveOutput",
    "PassAtK",
    "RLOO",
    "ReinforcePlusPlusBaseline",
    "frac_zero_std",
]
