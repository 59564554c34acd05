"""The update half of an RL step, `Updater.update`: `train.minibatches` shuffled mini-batches, each accumulated over
micro-batches of train.micro_batch_size rows or train.micro_batch_tokens tokens (gspo_lab.step.budget; one gradient
all-reduce per mini-batch under DDP), then one optimizer step with gradient clipping, or a skip when the loss or the
gradient is non-finite. The updater owns the state that changes with updates: the entropy bonus's coefficient
(adaptive with objective.entropy_target) and the count of consecutive skipped updates, saved in checkpoints
(`state_dict`).
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from pathlib import Path
from typing import Callable

import torch
from lightning.pytorch.strategies import ParallelStrategy
from torch.distributed.tensor import DTensor

from gspo_lab.config import TrainConfig
from gspo_lab.objectives import NonFiniteLossError, Objective
from gspo_lab.objectives import micro_batches
from gspo_lab.objectives.entropy import EntropyCoefficient
from gspo_lab.rollout import RolloutBatch
from gspo_lab.routing import RoutingReplay
from gspo_lab.step.failures import RunStopped
from gspo_lab.step.budget import micro_batch_parts
from gspo_lab.step.metrics import combine, combine_micro_batches
from gspo_lab.step.policy import PolicyForwards
from gspo_lab.step.probe import FirstForwards, MismatchProbe
from gspo_lab.step.ranks import Ranks
from gspo_lab.tensors import masked_mean

log = logging.getLogger(__name__)


class TooManySkippedUpdates(RunStopped):
    """Raised after `train.max_consecutive_skips` updates in a row were skipped for NaN/Inf."""


class Updater:
    """The optimizer steps of each RL step on the policy `model`: the `objective`'s loss of `policy`'s forwards,
    backward through Lightning (`backward`: the module's manual_backward), under routing replay where it applies.
    `save_last` writes the last checkpoint and returns its path (too many skipped updates in a row)."""

    def __init__(self, model: torch.nn.Module, objective: Objective, policy: PolicyForwards, routing: RoutingReplay,
                 probe: MismatchProbe, train: TrainConfig, backward: Callable[[torch.Tensor], None],
                 save_last: Callable[[], Path]) -> None:
        self.model, self.objective, self.policy, self.routing, self.probe = model, objective, policy, routing, probe
        self.train_cfg, self.backward, self.save_last = train, backward, save_last
        self.entropy_control = EntropyCoefficient.of(objective)  # objective.entropy_coef / entropy_target
        self.consecutive_skips = 0

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the updates (keys of the checkpoint itself)."""
        return {"consecutive_skips": self.consecutive_skips, "entropy_control": self.entropy_control.state_dict()}

    def load_state_dict(self, checkpoint: dict) -> None:
        self.consecutive_skips = checkpoint["consecutive_skips"]
        if "entropy_control" in checkpoint:  # absent from checkpoints written before entropy control
            self.entropy_control.load_state_dict(checkpoint["entropy_control"])

    def update(self, batch: RolloutBatch, optimizer, ranks: Ranks, step: int) -> dict[str, float]:
        """The mini-batches' optimizer steps, and their metrics combined (gspo_lab.step.metrics.combine), with the
        probe's before-update measurement where the first mini-batch's forwards make it."""
        collected: list[dict[str, float]] = []
        skipped = 0
        diagnostics: dict[str, float] = {}
        for index, rows in enumerate(torch.randperm(len(batch.rewards)).chunk(self.train_cfg.minibatches)):
            minibatch = batch.rows(rows.to(ranks.device))
            before = self.probe.first_forwards(batch) if index == 0 else None
            metrics = self.accumulate(minibatch, ranks, step, before)
            if before is not None:
                diagnostics.update(self.probe.measured(before, minibatch))
            if metrics is None:
                optimizer.zero_grad()  # a micro-batch before the non-finite one may have left gradients
                skipped += self.skip_update("non-finite loss", step)
                continue
            grad_norm = self.grad_norm(ranks.device)
            if not torch.isfinite(grad_norm):  # identical on every rank: gradients are all-reduced
                optimizer.zero_grad()
                skipped += self.skip_update(f"gradient norm {grad_norm.item()}", step)
                continue
            self.consecutive_skips = 0
            if self.clips(grad_norm):  # by the norm just computed: Lightning's clip_gradients refuses fused
                # optimizers under any mixed precision, bf16's too (no grad scaler there; Lightning issue #21435)
                torch.nn.utils.clip_grads_with_norm_(self.model.parameters(), self.train_cfg.grad_clip, grad_norm)
            optimizer.step()
            optimizer.zero_grad()
            if self.entropy_control.enabled:  # the coefficient for the next update (adaptive), as TRL logs it
                self.entropy_control.update(self.loss_tokens_entropy(metrics, ranks))
                metrics["entropy/coef"] = self.entropy_control.coef
            collected.append({**metrics, "grad_norm": grad_norm.item()})
        metrics = combine(collected)
        metrics["train/skipped_updates"] = float(skipped)
        metrics.update(diagnostics)
        return metrics

    def accumulate(self, minibatch: RolloutBatch, ranks: Ranks, step: int, before: FirstForwards | None = None
                   ) -> dict[str, float] | None:
        """The mini-batch's gradient, accumulated over micro-batches of train.micro_batch_size rows or
        train.micro_batch_tokens tokens (gspo_lab.step.budget), each loss weighted by its share D_m / D of the
        aggregation's count (gspo_lab.objectives.micro_batches), and its metrics; None when a loss was non-finite
        (on every rank). Under DDP only the last micro-batch's backward all-reduces (`gradient_sync`). `before`
        keeps the forwards' log-probs and experts."""
        parts = micro_batch_parts(minibatch.attention_mask, self.train_cfg.micro_batch_size,
                                  self.train_cfg.micro_batch_tokens, ranks.agree)
        split = len(parts) > 1
        total = micro_batches.denominator(self.objective, minibatch.loss_mask).clamp(min=1) if split else None
        tokens = minibatch.loss_mask.sum().clamp(min=1) if split else None  # the entropy bonus's count
        keys, collected = None, []
        for index, part in enumerate(parts):
            micro = minibatch.rows(torch.tensor(part.rows, device=ranks.device)) if split else minibatch
            share = micro_batches.denominator(self.objective, micro.loss_mask) / total if split else None
            token_share = micro.loss_mask.sum() / tokens if split else None
            if not part.weight:  # a spare micro-batch: this rank's collectives, no gradient and no metrics
                share, token_share = share * 0, token_share * 0
            with self.gradient_sync(ranks, last=index == len(parts) - 1):
                out, entropy = self.forward_backward(micro, ranks, step, share, before, token_share)
            if out is None:
                return None
            if not part.weight:
                continue
            mask = micro.loss_mask
            keys = keys or [*out.metrics, "entropy"]
            metrics = {**out.metrics, "entropy": masked_mean(entropy, mask.to(entropy.dtype))}
            counts = [mask.sum(), mask.bool().any(-1).sum(), torch.ones(()) if share is None else share]
            collected.append(torch.stack([v.detach().double().to(ranks.device) for v in
                                          [*(metrics[k] for k in keys), *counts]]))  # [K + 3]
        host = torch.stack(collected).cpu().tolist()  # one copy to the host per mini-batch, not one per metric
        metrics = combine_micro_batches(self.objective, [(dict(zip(keys, row[:-3])), *row[-3:]) for row in host])
        if self.train_cfg.micro_batch_tokens is not None:  # the budget's micro-batches, and those added to match
            metrics["train/micro_batches"] = float(len(parts))  # the rank that needs most (gspo_lab.step.budget)
            metrics["train/micro_batches_added"] = float(sum(part.added for part in parts))
        return metrics

    @staticmethod
    def gradient_sync(ranks: Ranks, last: bool):
        """Around a micro-batch's backward: under DDP, no all-reduce but in a mini-batch's last micro-batch (Lightning's
        `block_backward_sync`, DDP's `no_sync`), whose all-reduce then carries the sum accumulated locally; one per
        optimizer step instead of one per micro-batch. FSDP reduce-scatters every micro-batch: deferring that would
        hold the whole model's unsharded gradients on every rank (`set_requires_gradient_sync`)."""
        if last or not isinstance(ranks.strategy, ParallelStrategy):
            return nullcontext()
        return ranks.strategy.block_backward_sync()

    def forward_backward(self, minibatch: RolloutBatch, ranks: Ranks, step: int, share: torch.Tensor | None = None,
                         before: FirstForwards | None = None, token_share: torch.Tensor | None = None):
        """Objective and gradient of one (micro-)batch, its loss weighted by `share` (None: 1) and its entropy bonus by
        `token_share` (micro_batches.weighted_loss); (None, None) on every rank when any rank's loss is non-finite.
        Backward runs inside the replay context, so recomputed forwards replay too. `before` (no replay) keeps the
        forward's log-probs and experts (recorded in the forward only)."""
        coef = self.entropy_control.applied if self.entropy_control.enabled else None
        with self.routing.training(minibatch):
            with self.routing.recording() if before is not None else nullcontext() as trace:
                shared = self.policy.replay_allows_sharing(minibatch)
                logp, entropy = self.policy.logprobs(minibatch, share_prompts=shared,
                                                     entropy_grad=bool(coef))  # the bonus's gradient, where it acts
            if before is not None:
                before.keep(logp, trace)
            try:
                needs_entropy = getattr(self.objective, "needs_entropy", False)  # a user's objective may not take it
                entropy_inputs = {"entropy": entropy, "entropy_coef": coef} if needs_entropy else {}
                # a multi-turn batch's turns (a single-turn batch passes none: a user's objective may not take them)
                turn_inputs = {"turns": minibatch.turns} if minibatch.turns is not None else {}
                out = self.objective(logp, minibatch.old_logp, minibatch.advantages, minibatch.loss_mask,
                                     ref_logp=minibatch.ref_logp, rollout_logp=minibatch.rollout_logp,
                                     **entropy_inputs, **turn_inputs)
            except NonFiniteLossError as error:
                log.warning("RL step %d: %s", step, error)
                out = None
            if ranks.any(out is None):  # any rank -> all skip
                return None, None
            self.backward(out.loss if share is None else micro_batches.weighted_loss(out, share, token_share))
        return out, entropy.detach()

    def loss_tokens_entropy(self, metrics: dict[str, float], ranks: Ranks) -> float:
        """The mean entropy over the tokens the policy loss kept in this mini-batch, over all ranks (each rank's
        sum and count reduced, as TRL's controller): what the adaptive coefficient steers (`EntropyCoefficient`)."""
        mean = metrics.get("entropy/kept_mean", metrics["entropy"])
        count = metrics["mask/valid_tokens"] * metrics.get("entropy/kept_frac", 1.0)
        if ranks.world == 1:
            return mean
        totals = ranks.strategy.reduce(torch.tensor([mean * count, count], device=ranks.device,
                                                    dtype=torch.float64), reduce_op="sum")
        return (totals[0] / totals[1].clamp(min=1)).item()

    def grad_norm(self, device: torch.device) -> torch.Tensor:
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        if not grads:
            return torch.zeros((), device=device)
        norm = torch.nn.utils.get_total_norm(grads)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm  # FSDP: the norm over all shards

    def clips(self, grad_norm: torch.Tensor) -> bool:
        """Whether train.grad_clip scales the gradients: torch's clip_grads_with_norm_ multiplies them by
        min(1, grad_clip / (norm + 1e-6)), so by exactly 1 (a pass over every gradient that changes nothing) unless
        this holds. The host already waited for the norm (the finiteness check above)."""
        clip = self.train_cfg.grad_clip
        return clip > 0 and bool(clip / (grad_norm + 1e-6) < 1)

    def skip_update(self, reason: str, step: int) -> int:
        """Count a skipped update; too many in a row stop the run with a clear message and the last checkpoint."""
        self.consecutive_skips += 1
        log.warning("RL step %d: update skipped (%s)", step, reason)
        if self.consecutive_skips >= self.train_cfg.max_consecutive_skips:
            checkpoint = self.save_last()  # the weights are the last good ones: skips change nothing
            raise TooManySkippedUpdates(
                f"{self.consecutive_skips} consecutive updates were skipped for NaN/Inf loss or gradients "
                f"(train.max_consecutive_skips={self.train_cfg.max_consecutive_skips}); stopped at RL step "
                f"{step} with checkpoint {checkpoint}. Lower train.lr or set objective.log_ratio_clamp, "
                "then resume with ckpt_path=last."
            )
        return 1


def warn_half_precision_weights(trained: list[torch.nn.Parameter]) -> bool:
    """Warns (and returns True) where the optimizer would train bfloat16 or float16 weights, which small updates
    leave unchanged."""
    half = {str(p.dtype).removeprefix("torch.") for p in trained} & {"bfloat16", "float16"}
    if not half:
        return False
    log.warning(
        "the trained weights are %s (model.dtype): an optimizer step smaller than half the spacing of that "
        "format at a weight (|w|/256 to |w|/128 in bfloat16) leaves it unchanged, so at small learning rates "
        "most weights never move (the anchor model in bfloat16 at train.lr=3e-5: 27%% of its weights changed "
        "in 8 updates, 97%% in float32). Keep model.dtype=float32 with trainer.precision=bf16-mixed, or "
        "train LoRA adapters (model.lora.enabled=true).", ", ".join(sorted(half)))
    return True
