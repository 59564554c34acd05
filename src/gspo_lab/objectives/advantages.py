"""Advantage estimators, the `advantage` config group: each completion's reward against the other completions of
its prompt (its group of `group_size`, groups contiguous in the rollout batch).

- `group` (GroupAdvantage, the default): A_i = (r_i - mean_g) / (std_g + eps), the std over the group (GRPO,
  GSPO), over the batch, or none (Dr. GRPO, arXiv 2503.20783).
- `rloo` (RLOO): A_i = r_i - mean of the other n - 1 completions (Ahmadian et al. 2024, arXiv 2402.14740).
- `reinforce_plus_plus_baseline` (ReinforcePlusPlusBaseline): r_i - mean_g, whitened over the batch's tokens
  (REINFORCE++, arXiv 2501.03262).
- `passk` (PassAtK): only the group's best completion gets r_max - r_second (Tang et al. 2025, arXiv 2503.19595).
- `gdpo` (GDPO): each reward function's rewards normalised within the group, then summed with the functions'
  weights, then whitened over the batch (arXiv 2601.05242).

An estimator is called `estimator(rewards, group_size, **inputs)`: rewards [N] are the weighted totals, NaN for
a completion that no reward function scored (each returned None: unscorable), and `inputs` holds the further
tensors its class attribute `inputs` names, which the rollout passes (`scored_advantages`, from
gspo_lab.step.collector): `components` [N, F] (each reward function's rewards, NaN where it did not apply),
`weights` [F] (the functions' weights) and `token_counts` [N] (each completion's tokens in the loss).

An unscorable completion takes no part in any mean, std, leave-one-out sum or token count, and its advantage is 0,
as in TRL (`rewards[unscorable_mask] = torch.nan`, then nanmean, nanstd, and nan_to_num(0) of the advantages). A
group left with one scored completion is a group whose rewards are all equal: its advantage is 0, and it counts in
the batch's statistics as such a group does.

The formulas follow the peers' code (volcengine/verl `verl/trainer/ppo/core_algos.py` at b178a3cd, 0.8.0.dev;
huggingface/trl `trl/trainer/grpo_trainer.py` at f2cd5771, 1.10.0.dev), each test writing the peer's code out
(tests/objectives/test_advantages.py). Where they depart from the peer or its paper:

- Statistics over "the batch" (REINFORCE++'s and GDPO's whitening, `group`'s scale=batch) are this rank's rollout
  batch; verl takes the whole step's batch on its driver and TRL gathers every process's rewards first. With one
  rank they agree. Group statistics agree always: ranks hold whole groups.
- A group of one is refused (rollout.group_size >= 2 already); verl gives it its raw reward (RLOO, REINFORCE++).
- Unscorable completions: verl has none (a verl reward is a number); TRL's GRPO leaves them out of the statistics
  of `group` and `gdpo`, and here every estimator does the same.
- REINFORCE++-baseline: verl's `masked_whiten` over the response tokens (mean and Bessel-corrected variance of the
  token-level advantages, each completion weighted by its token count), which is the paper's normalisation over
  the batch of the token-level A_{q,o_t}. Where fewer than two tokens are in the loss (every completion masked by
  rollout.mask_truncated) there is nothing to whiten and the advantages are 0, where verl raises.
- pass@k: verl's `grpo_passk`, whose Bessel-corrected group std divides the gap by default; `scale: none` leaves
  the gap as the paper's leave-one-out max, max(r) - max(r without i).
- GDPO: TRL's `multi_objective_aggregation="normalize_then_sum"` (eps 1e-4, Bessel-corrected stds, a function
  that did not apply (NaN) left out of its group's statistics and of the sum). The paper's own TRL fork
  (NVlabs/GDPO) first counts such a reward as 0; TRL is followed because gspo-lab's rewards keep "did not
  apply" apart from 0 as TRL's do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from gspo_lab.tensors import as_groups, frac_zero_std, zero_std_groups  # noqa: F401 - re-exported

SCALES = ("group", "batch", "none")


class AdvantageEstimator:
    """The interface: rewards [N] (groups of `group_size` contiguous) and the `inputs` named -> advantages [N].

    A user's estimator is any callable with this signature (and an `inputs` attribute if it needs more). The
    reward of a completion that no reward function scored arrives as NaN: leave it out of every statistic
    (torch.nanmean, `nanstd`); whatever the estimator returns for that row, the rollout sets it to 0. A scored
    row's advantage must be finite, else the step stops naming the estimator (`scored_advantages`).
    """

    inputs: ClassVar[tuple[str, ...]] = ()  # the keywords the rollout passes: components, weights, token_counts

    def __call__(self, rewards: Tensor, group_size: int, **inputs: Tensor) -> Tensor:
        raise NotImplementedError


def scored_advantages(estimator, rewards: Tensor, scored: Tensor, group_size: int, **inputs: Tensor) -> Tensor:
    """The advantages [N] of rewards [N] from `estimator`, a row not `scored` ([N] bool: no reward function scored
    it) passed as NaN and given 0; a scored row's advantage that is not finite stops the step, naming the estimator.

    >>> scored_advantages(RLOO(), torch.tensor([1.0, 0.0, 0.0, 5.0]), torch.tensor([True, True, True, False]), 4)
    tensor([ 1.0000, -0.5000, -0.5000,  0.0000])
    """
    advantages = torch.where(scored, estimator(torch.where(scored, rewards, torch.nan), group_size, **inputs), 0.0)
    if not advantages.isfinite().all():
        name = getattr(estimator, "__name__", type(estimator).__name__)
        raise FloatingPointError(
            f"the advantage estimator {name} gave a non-finite advantage to {int((~advantages.isfinite()).sum())} of "
            f"the {int(scored.sum())} scored completions. It gets the reward of a completion that no reward function "
            "scored as NaN, to leave out of every mean and std (torch.nanmean, gspo_lab.objectives.advantages.nanstd); "
            "a division by a std of 0 (an all-equal group) needs advantage.eps > 0")
    return advantages


def check_eps(name: str, eps: float, positive: bool = False) -> None:
    """eps >= 0; > 0 where an all-equal group or batch would otherwise divide 0 by 0."""
    if not (eps > 0 if positive else eps >= 0):
        rule = "> 0 (an all-equal group or batch would divide 0 by 0)" if positive else ">= 0"
        raise ValueError(f"advantage.eps={eps!r} must be {rule} for advantage={name}")


def groups_of_two_or_more(rewards: Tensor, group_size: int, name: str) -> Tensor:
    """Rewards [N] as [G, group_size]; the estimators whose baseline is the rest of the group need a rest."""
    if group_size < 2:
        raise ValueError(f"group_size={group_size} is invalid for advantage={name}: it needs at least 2 completions "
                         "per prompt (its baseline comes from the other completions of the group)")
    return as_groups(rewards, group_size)


def nanstd(values: Tensor, dim: int | None = None, unbiased: bool = True) -> Tensor:
    """The Bessel-corrected std of the values that are not NaN (TRL's `nanstd`): NaN where fewer than two are.
    `unbiased=False`: the population std (divisor n), NaN where none is (0 for one value)."""
    mean = values.nanmean() if dim is None else values.nanmean(dim, keepdim=True)
    squares = (values - mean) ** 2
    count = (~values.isnan()).sum() if dim is None else (~values.isnan()).sum(dim, keepdim=True)
    total = squares.nansum() if dim is None else squares.nansum(dim, keepdim=True)
    return torch.where(count > int(unbiased), total / (count - int(unbiased)), torch.nan).sqrt()


def scored_std(values: Tensor, dim: int | None = None, unbiased: bool = True) -> Tensor:
    """The std of the values that are not NaN: torch.std's where none is (so that a batch without unscorable rows
    gets the advantages it always got, to the bit), `nanstd`'s where some are."""
    whole = values.std(unbiased=unbiased) if dim is None else values.std(dim, unbiased=unbiased, keepdim=True)
    some_nan = values.isnan().any() if dim is None else values.isnan().any(dim, keepdim=True)
    return torch.where(some_nan, nanstd(values, dim, unbiased), whole)


@dataclass(frozen=True)
class GroupAdvantage(AdvantageEstimator):
    """Turns rewards [G * group_size] (groups contiguous) into advantages of the same shape.

    Args:
        scale: "group" divides by each group's std, "batch" by the whole batch's std, "none" does not
            divide (Dr. GRPO). The std is the population std (divisor n).
        eps: added to the std before dividing.

    >>> adv = GroupAdvantage()(torch.tensor([1.0, 0.0, 1.0, 1.0]), group_size=2)
    >>> [round(a, 3) for a in adv.tolist()]  # group (1, 0): mean 0.5, std 0.5; group (1, 1): std 0
    [1.0, -1.0, 0.0, 0.0]
    """

    scale: str = "group"
    eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.scale not in SCALES:
            raise ValueError(f"advantage.scale={self.scale!r} must be one of {SCALES}")
        check_eps("group", self.eps)

    def __call__(self, rewards: Tensor, group_size: int) -> Tensor:
        groups = as_groups(rewards, group_size)  # [G, group_size], NaN: unscorable
        centred = groups - groups.nanmean(-1, keepdim=True)
        if self.scale == "group":
            centred = centred / (scored_std(groups, -1, unbiased=False) + self.eps)
        elif self.scale == "batch":
            centred = centred / (scored_std(rewards, unbiased=False) + self.eps)
        return torch.where(rewards.isnan(), 0.0, centred.reshape(rewards.shape))


@dataclass(frozen=True)
class RLOO(AdvantageEstimator):
    """REINFORCE leave-one-out (Kool et al. 2019; Ahmadian et al. 2024, arXiv 2402.14740 eq. 5; verl
    `compute_rloo_outcome_advantage`): A_i = r_i - (1/(n-1)) Σ_{j≠i} r_j = n/(n-1) (r_i - mean_g), undivided; n
    counts the group's scored completions (a lone one: 0).

    >>> RLOO()(torch.tensor([1.0, 0.0, 0.0, 3.0, 3.0, 3.0]), group_size=3).tolist()  # 1 - 0; 0 - 1/2; equal: 0
    [1.0, -0.5, -0.5, 0.0, 0.0, 0.0]
    """

    def __call__(self, rewards: Tensor, group_size: int) -> Tensor:
        groups = groups_of_two_or_more(rewards, group_size, "rloo")  # [G, group_size], NaN: unscorable
        count = (~groups.isnan()).sum(-1, keepdim=True)  # [G, 1] n, the scored completions
        others = (groups.nansum(-1, keepdim=True) - groups) / (count - 1)  # [G, group_size] mean of the other n - 1
        advantages = torch.where(count > 1, groups - others, 0.0).reshape(rewards.shape)
        return torch.where(rewards.isnan(), 0.0, advantages)


@dataclass(frozen=True)
class ReinforcePlusPlusBaseline(AdvantageEstimator):
    """REINFORCE++-baseline (Hu et al. 2025, arXiv 2501.03262; verl `reinforce_plus_plus_baseline`): the group's
    mean reward as baseline, a_i = r_i - mean_g, then the token-level advantages whitened over the batch, each
    completion counted once per token in the loss (L_i = token_counts[i]; one with none gets 0, as in verl; an
    unscorable one counts none):

        μ = Σ L_i a_i / Σ L_i,   σ² = Σ L_i (a_i - μ)² / (Σ L_i - 1),   A_i = (a_i - μ) / sqrt(σ² + eps)

    >>> adv = ReinforcePlusPlusBaseline()(torch.tensor([1.0, 0.0, 0.0, 0.0]), 2, token_counts=torch.ones(4))
    >>> [round(a, 4) for a in adv.tolist()]  # a = (0.5, -0.5, 0, 0): μ 0, σ² = 0.5 / 3
    [1.2247, -1.2247, 0.0, 0.0]
    """

    inputs: ClassVar[tuple[str, ...]] = ("token_counts",)
    eps: float = 1e-8  # added to the variance (verl's masked_whiten)

    def __post_init__(self) -> None:
        check_eps("reinforce_plus_plus_baseline", self.eps, positive=True)

    def __call__(self, rewards: Tensor, group_size: int, *, token_counts: Tensor) -> Tensor:
        groups = groups_of_two_or_more(rewards, group_size, "reinforce_plus_plus_baseline")  # [G, n], NaN: unscorable
        centred = (groups - groups.nanmean(-1, keepdim=True)).reshape(rewards.shape)  # [N] a_i
        weight = torch.where(rewards.isnan(), 0.0, token_counts.to(centred.dtype))  # [N] L_i
        centred = centred.nan_to_num(0.0)  # weighted 0 from here on: NaN · 0 would be NaN
        tokens = weight.sum()
        if tokens < 2:  # no token trains (or one): nothing to whiten
            return torch.zeros_like(centred)
        mean = (weight * centred).sum() / tokens  # μ over tokens
        variance = (weight * (centred - mean) ** 2).sum() / (tokens - 1)  # σ², Bessel-corrected
        return torch.where(weight > 0, (centred - mean) * torch.rsqrt(variance + self.eps), 0.0)  # none: 0


@dataclass(frozen=True)
class PassAtK(AdvantageEstimator):
    """The pass@k advantage for k = group_size (Tang et al. 2025, arXiv 2503.19595; verl `grpo_passk`): the group's
    best completion gets what it adds over the best of the rest, r_max - r_second (= max(r) - max(r without i));
    every other completion gets 0. A tie for the best, or fewer than two scored completions, gives the group 0.

    Args:
        scale: "group" divides the gap by the group's Bessel-corrected std + eps (verl's default,
            norm_adv_by_std_in_grpo), "none" does not.
        eps: added to the std before dividing.

    >>> PassAtK(scale="none")(torch.tensor([0.0, 1.0, 0.5, 1.0, 1.0, 0.0]), group_size=3).tolist()
    [0.0, 0.5, 0.0, 0.0, 0.0, 0.0]
    """

    scale: str = "group"
    eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.scale not in ("group", "none"):
            raise ValueError(f"advantage.scale={self.scale!r} must be one of ('group', 'none') for advantage=passk")
        check_eps("passk", self.eps, positive=True)

    def __call__(self, rewards: Tensor, group_size: int) -> Tensor:
        groups = groups_of_two_or_more(rewards, group_size, "passk")  # [G, n], NaN: unscorable
        top = groups.nan_to_num(-torch.inf).topk(2, dim=-1)  # values, indices [G, 2]; an unscorable row is never best
        gap = top.values[:, :1] - top.values[:, 1:]  # [G, 1] r_max - r_second
        if self.scale == "group":
            gap = gap / (scored_std(groups, -1) + self.eps)  # Bessel-corrected, as torch.std in verl
        gap = torch.where((~groups.isnan()).sum(-1, keepdim=True) > 1, gap, 0.0)  # no second: no gap
        return torch.zeros_like(groups).scatter(-1, top.indices[:, :1], gap).reshape(rewards.shape)


@dataclass(frozen=True)
class GDPO(AdvantageEstimator):
    """Group reward-Decoupled normalisation (Liu et al. 2026, arXiv 2601.05242; TRL
    `multi_objective_aggregation="normalize_then_sum"`). Each reward function k is normalised within the group on
    its own, the results summed with the functions' weights w_k, and the sums whitened over the batch:

        Â_ik = (r_ik - mean_g(r_k)) / (std_g(r_k) + eps),   s_i = Σ_k w_k Â_ik,
        A_i = (s_i - mean(s)) / (std(s) + eps)

    The stds are Bessel-corrected; NaN (a function that did not apply) is left out of each mean, std and sum, and
    a completion no function applied to (unscorable, NaN in `rewards`) takes no part in the batch's statistics and
    gets 0. The total reward `rewards` is not used: weighting before normalising would cancel every weight's size.

    >>> two = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0]])  # one group: two functions
    >>> adv = GDPO(eps=0.0)(two.sum(-1), 4, components=two, weights=torch.ones(2))
    >>> [round(a, 4) for a in adv.tolist()]  # Â_k = ±sqrt(3)/2; s = (0, 0, sqrt(3), -sqrt(3)), std sqrt(2)
    [0.0, 0.0, 1.2247, -1.2247]
    """

    inputs: ClassVar[tuple[str, ...]] = ("components", "weights")
    eps: float = 1e-4  # added to every std (TRL's)

    def __post_init__(self) -> None:
        check_eps("gdpo", self.eps)

    def __call__(self, rewards: Tensor, group_size: int, *, components: Tensor, weights: Tensor) -> Tensor:
        if components.shape != (len(rewards), len(weights)):
            raise ValueError(f"advantage=gdpo: components of shape {tuple(components.shape)} must be [N, F] = "
                             f"[{len(rewards)}, {len(weights)}] (one column per reward function)")
        groups_of_two_or_more(rewards, group_size, "gdpo")
        grouped = components.reshape(-1, group_size, components.shape[-1])  # [G, n, F]
        normalised = (grouped - grouped.nanmean(1, keepdim=True)) / (nanstd(grouped, 1) + self.eps)  # Â [G, n, F]
        summed = (normalised.reshape(components.shape) * weights.to(components.dtype)).nansum(-1)  # [N] s_i
        summed = torch.where(components.isnan().all(-1), torch.nan, summed)  # no function applied: left out
        whitened = (summed - summed.nanmean()) / (nanstd(summed) + self.eps)
        return whitened.nan_to_num(0.0)
