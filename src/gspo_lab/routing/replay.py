"""How an RL step uses routing replay, by mode (`routing.replay`), and the routing diagnostics.

Generation always records the rollout engine's experts (the rollout trace). Then, by mode:
    off  the old-policy forward (if any) records the trainer's experts; nothing is replayed
    r2   the old-policy forward records; every training forward of that rollout batch replays (needs
         rollout.logprobs_from_generation=false)
    r3   the old-policy forward (if any) and every training forward replay the rollout trace
Whatever the mode, the trainer's own experts (no replay) are recorded on some rows of the rollout batch before the
updates (compared with the engine's as routing/rollout_disagreement and routing/rollout_disagreement_tokens;
`measured_before`) and again after them (`diagnostics`: routing/changed_frac and per layer,
routing/changed_tokens_frac; under replay also routing/override_frac), on at most `routing.diagnostics_rows` rows.
Without replay the first mini-batch's training forwards, which run before any update, are the before-update
forward when it holds that many rows (`measures_in_training`, `recording`); otherwise (and under r2 and r3, whose
training forwards replay) the first diagnostics_rows rows of the batch get a no-grad forward of their own
(`before_update`).
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Callable, Iterator

import torch

from gspo_lab.config import REPLAY_MODES
from gspo_lab.routing.adapters import ADAPTERS, find_routers
from gspo_lab.routing.hooks import ReplayStats, record_routing, replay_routing
from gspo_lab.routing.trace import RoutingTrace, changed_fraction


def is_moe(model: torch.nn.Module) -> bool:
    return any(type(m).__name__ in ADAPTERS for m in model.modules())


class RoutingReplay:
    """The module's view of routing for one model and mode; a dense model gets no routing metrics."""

    def __init__(self, model: torch.nn.Module, mode: str, diagnostics_rows: int | None = None) -> None:
        if mode not in REPLAY_MODES:
            raise ValueError(f"routing.replay={mode!r} must be one of {list(REPLAY_MODES)}")
        self.model, self.mode = model, mode
        self.moe = is_moe(model)
        if mode != "off" and not self.moe:
            find_routers(model, f"routing.replay={mode}")  # raises: dense or unsupported MoE
        self.diagnostics_rows = diagnostics_rows
        self._generation_trace: RoutingTrace | None = None
        self._before: RoutingTrace | None = None  # the trainer's experts on the diagnostics rows, before updates
        self._rows = None  # those rows (a RolloutBatch)
        self._stats = ReplayStats()

    @contextmanager
    def generation(self, engine_model: torch.nn.Module) -> Iterator[None]:
        """Around generate on the rollout engine's model (the trainer's own, or the engine's copy): records
        its experts."""
        if not self.moe:
            yield
            return
        with record_routing(engine_model) as trace:
            yield
        self._generation_trace = trace

    def generation_trace(self, prompt_len: int, length: int) -> RoutingTrace | None:
        """The trace recorded during generation, widened to the batch's [B, length] columns."""
        trace, self._generation_trace = self._generation_trace, None
        if trace is None:
            return None
        if trace.indices.shape[2] > length:  # FSDP: decode steps run after this rank's sequences ended (synced_gpus)
            trace = trace.view(None, slice(0, length))
        trace.prompt_len = prompt_len
        return trace.extend_to(length)

    @contextmanager
    def old_policy(self, batch) -> Iterator[RoutingTrace | None]:
        """Around the old-policy forward; yields the batch's trace (filled when the context exits if this
        forward is the one that records)."""
        if not self.moe:
            yield batch.routing_trace
        elif self.mode == "r3":
            with replay_routing(self.model, batch.routing_trace, batch.attention_mask):
                yield batch.routing_trace
        else:
            with record_routing(self.model, batch.input_ids.shape[1] - batch.completion_len) as trace:
                yield trace

    @property
    def replays_in_training(self) -> bool:
        """Whether training forwards run under replay hooks (which expect one [B, L] forward per call)."""
        return self.mode != "off" and self.moe

    def training(self, minibatch):
        """Around a training forward and its backward (gradient checkpointing recomputes inside it)."""
        if not self.replays_in_training:
            return nullcontext()
        return self._replay_counting(minibatch)

    @contextmanager
    def _replay_counting(self, minibatch):
        with replay_routing(self.model, minibatch.routing_trace, minibatch.attention_mask) as stats:
            yield
        self._stats.overridden += stats.overridden  # device tensors, read once by `diagnostics`
        self._stats.replayed += stats.replayed

    def diagnostic_rows(self, batch):
        """The first `diagnostics_rows` rows of the batch (whole groups), measured by `before_update`."""
        return batch.rows(torch.arange(self.measured_rows(len(batch.rewards)), device=batch.input_ids.device))

    def measured_rows(self, available: int) -> int:
        """How many of `available` rows the diagnostics measure: diagnostics_rows of them (null: all)."""
        return available if self.diagnostics_rows is None else min(self.diagnostics_rows, available)

    def measures_in_training(self, minibatch_rows: int, batch_rows: int) -> bool:
        """Whether the first mini-batch's forwards, which run before any update, stand for the before-update
        forward (`recording`): when training forwards route as the trainer itself does (no replay hooks) and the
        mini-batch holds as many rows as the diagnostics measure."""
        return not self.replays_in_training and minibatch_rows >= self.measured_rows(batch_rows)

    def recording(self):
        """Around a forward that stands for the before-update one: records its experts (yields the trace; None
        for a dense model). Only the forward: a checkpointed backward's recomputation must not add calls."""
        return record_routing(self.model) if self.moe else nullcontext()

    def before_update(self, rows, logprobs: Callable) -> tuple[torch.Tensor, dict[str, float]]:
        """The trainer's own log-probs of `rows` before the updates (no grad, no replay) and `measured_before`'s
        metrics."""
        with torch.no_grad(), self.recording() as trace:
            train_logp, _ = logprobs(rows)
        return train_logp, self.measured_before(rows, trace)

    def measured_before(self, rows, trace: RoutingTrace | None) -> dict[str, float]:
        """The trainer's experts `trace` on `rows` before the updates: kept for `diagnostics` on the first
        diagnostics_rows of them, and compared with the engine's on all of them."""
        if not self.moe:
            return {}
        kept = torch.arange(self.measured_rows(len(rows.rewards)))
        self._rows, self._before = rows.rows(kept.to(rows.input_ids.device)), trace.rows(kept)
        if rows.rollout_trace is None:
            return {}
        differ = changed_fraction(rows.rollout_trace, trace, rows.attention_mask)
        return {"routing/rollout_disagreement": differ["routing/changed_frac"],
                "routing/rollout_disagreement_tokens": differ["routing/changed_tokens_frac"]}

    def diagnostics(self, logprobs: Callable, measure: bool = True) -> dict[str, float]:
        """Routing change of the rows `measured_before` kept, after the updates (one more no-grad forward; not
        when `measure` is false), and under replay the step's override fraction."""
        if not self.moe:
            return {}
        metrics = {}
        if measure and self._before is not None:
            with torch.no_grad(), record_routing(self.model) as current:
                logprobs(self._rows)
            metrics = changed_fraction(self._before, current, self._rows.attention_mask)
            metrics["routing/trace_bytes_per_token"] = self._before.bytes_per_token()
        if self.mode != "off":
            metrics["routing/override_frac"] = self._stats.override_frac
            self._stats = ReplayStats()
        self._before = self._rows = None
        return metrics
