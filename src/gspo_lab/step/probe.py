"""The engine-trainer mismatch probe: before any update, the trainer's own log-probs and experts (no replay) against
the rollout engine's, as mismatch/* (R3, arXiv 2510.11370) and routing/rollout_disagreement*; after the updates,
the routing change of the same rows (routing/changed_frac, ...; gspo_lab.routing.replay).

Whichever forward makes the before-update measurement, this probe owns it: without replay, the first mini-batch's
training forwards run before any update, so when that mini-batch holds routing.diagnostics_rows rows they are the
measurement (`in_update`: the updater keeps them in a `FirstForwards`); otherwise, on diagnostic steps
(routing.diagnostics_every), a no-grad forward of the diagnostic rows of its own, at the end of the rollout
(`own_forward`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from gspo_lab.rollout import RolloutBatch
from gspo_lab.routing import RoutingReplay
from gspo_lab.routing.trace import RoutingTrace
from gspo_lab.step.policy import PolicyForwards
from gspo_lab.tensors import k3, masked_mean


@dataclass
class FirstForwards:
    """The log-probs [b, C] and experts of the first mini-batch's micro-batches, in order: the trainer's own (no
    replay) before any update."""

    logp: list[Tensor] = field(default_factory=list)
    traces: list[RoutingTrace | None] = field(default_factory=list)

    def keep(self, logp: Tensor, trace: RoutingTrace | None) -> None:
        """One micro-batch's forward."""
        self.logp.append(logp.detach())
        self.traces.append(trace)


class MismatchProbe:
    """The before- and after-update measurements of one run (routing.diagnostics_every, routing.diagnostics_rows)."""

    def __init__(self, routing: RoutingReplay, policy: PolicyForwards, minibatches: int,
                 diagnostics_every: int) -> None:
        self.routing, self.policy = routing, policy
        self.minibatches, self.diagnostics_every = minibatches, diagnostics_every

    def due(self, step: int) -> bool:
        """Whether RL step `step` runs the forwards that serve only the diagnostics (routing.diagnostics_every)."""
        return step % self.diagnostics_every == 0

    def in_update(self, batch: RolloutBatch) -> bool:
        """Whether the first mini-batch's forwards (torch.chunk's first: ceil(B / minibatches) rows) measure the
        mismatch and the routing before the updates, instead of a forward of their own."""
        first = -(-len(batch.rewards) // self.minibatches)
        return self.routing.measures_in_training(first, len(batch.rewards))

    def own_forward(self, batch: RolloutBatch, step: int) -> dict[str, float]:
        """At the end of the rollout, on diagnostic steps where the updates do not measure it: a no-grad forward of
        the diagnostic rows of the batch of its own (routing replay's training forwards replay the engine's
        experts), and its time (time/mismatch_s)."""
        if self.in_update(batch) or not self.due(step):
            return {}
        started = time.perf_counter()
        rows = self.routing.diagnostic_rows(batch)
        train_logp, metrics = self.routing.before_update(rows, self.policy.shared_logprobs)
        return {**metrics, **engine_mismatch(rows, train_logp), "time/mismatch_s": time.perf_counter() - started}

    def first_forwards(self, batch: RolloutBatch) -> FirstForwards | None:
        """What the first mini-batch's forwards keep for `measured`, where they make the measurement."""
        return FirstForwards() if self.in_update(batch) else None

    def measured(self, forwards: FirstForwards, minibatch: RolloutBatch) -> dict[str, float]:
        """mismatch/* and routing/rollout_disagreement* of the first mini-batch's forwards, on the rows forwarded
        (all of the mini-batch's, unless a non-finite loss stopped it early), and their time."""
        started = time.perf_counter()
        logp = torch.cat(forwards.logp)  # [b, C]
        rows = minibatch.rows(torch.arange(len(logp), device=logp.device))
        trace = None if forwards.traces[0] is None else RoutingTrace.cat(forwards.traces)
        metrics = {**self.routing.measured_before(rows, trace), **engine_mismatch(rows, logp)}
        return {**metrics, "time/mismatch_s": time.perf_counter() - started}

    def after_updates(self, step: int) -> dict[str, float]:
        """The routing change of the measured rows after the updates (one no-grad forward, on diagnostic steps),
        and under replay the step's override fraction."""
        return self.routing.diagnostics(self.policy.shared_logprobs, measure=self.due(step))


def engine_mismatch(rows: RolloutBatch, train_logp: Tensor) -> dict[str, float]:
    """mismatch/* of the trainer's log-probs [B, C] of `rows` against the engine's (`mismatch_metrics`)."""
    return mismatch_metrics(train_logp, rows.rollout_logp, rows.policy_mask)


def mismatch_metrics(train_logp: Tensor, engine_logp: Tensor, mask: Tensor) -> dict[str, float]:
    """How far the engine's log-probs of the sampled tokens are from the trainer's (R3, arXiv 2510.11370).
    train_logp, engine_logp, mask: [B, C]. With ρ_t = π_train(y_t) / π_engine(y_t):
        mismatch/kl                  mean over tokens of k3 = ρ - 1 - log ρ
        mismatch/extreme_frac        fraction of tokens with max(ρ, 1/ρ) > 2 (R3's F(2))
        mismatch/seq_log_ratio_abs   mean over sequences of |mean_t log ρ_t|

    >>> m = mismatch_metrics(torch.tensor([[0.0, -1.0]]), torch.tensor([[0.0, -2.0]]), torch.ones(1, 2))
    >>> round(m["mismatch/kl"], 6), m["mismatch/extreme_frac"], m["mismatch/seq_log_ratio_abs"]  # ρ = 1, e
    (0.359141, 0.5, 0.5)
    """
    valid = mask.bool()
    tokens = valid.double()  # [B, C]
    train, engine = (torch.where(valid, logp.double(), 0.0) for logp in (train_logp, engine_logp))  # padding: 0
    log_rho = train - engine  # [B, C] log ρ_t
    seq_mean = masked_mean(log_rho, tokens, dim=-1)  # [B] mean_t log ρ_t
    return {
        "mismatch/kl": masked_mean(k3(train, engine), tokens).item(),  # k3 = ρ - 1 - log ρ, ρ = π_train / π_engine
        "mismatch/extreme_frac": masked_mean((log_rho.abs() > math.log(2)).double(), tokens).item(),
        "mismatch/seq_log_ratio_abs": masked_mean(seq_mean.abs(), valid.any(-1).double()).item(),  # rows with tokens
    }
