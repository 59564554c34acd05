"""Policy-optimisation objectives behind one interface: `obj(logp, old_logp, advantages, mask)`.

An `Objective` is a ratio (objectives/ratios.py), a surrogate (surrogates.py) and an aggregation
(aggregations.py); GSPO, GSPOToken and GRPO are three fixed compositions with the papers' flat settings, and
conf/objective/*.yaml composes the others (dapo, dr_grpo, cispo, sapo, gmpo, luspo, vespo, clip_cov, kl_cov,
dppo_tv, dppo_kl, gpg, dro) from the axes; Clip-Cov's and KL-Cov's surrogates are in covariance.py.
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
