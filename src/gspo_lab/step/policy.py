"""The policy's forwards, in one place: its log-probs and entropy of a batch's completion tokens (every prompt once
where allowed), the old policy's in no-grad forwards under routing replay's old-policy context, and the frozen
reference's for the KL penalty. gspo_lab.rollout.logprobs computes them; this file decides which model, which
rows at a time, and whether prompts are shared.
"""

from __future__ import annotations

import copy
from contextlib import nullcontext

import torch

from gspo_lab.config import RolloutConfig, TrainConfig
from gspo_lab.models.lora import LoraPolicy
from gspo_lab.rollout import RolloutBatch, token_logprobs
from gspo_lab.rollout.generation import distinct_prompts
from gspo_lab.rollout.packing import packs_exactly
from gspo_lab.routing import RoutingReplay
from gspo_lab.routing.trace import RoutingTrace
from gspo_lab.sharding import is_sharded
from gspo_lab.step.budget import micro_batch_parts
from gspo_lab.step.ranks import Ranks


class PolicyForwards:
    """Forwards of the policy `model` (and of the KL penalty's frozen `reference`, or under LoRA of the model with
    its adapters disabled), at the rollout's temperature, in the rows and chunks train.* sets."""

    def __init__(self, model: torch.nn.Module, reference: torch.nn.Module | None, lora: LoraPolicy | None,
                 routing: RoutingReplay, rollout: RolloutConfig, train: TrainConfig) -> None:
        self.model, self.reference, self.lora, self.routing = model, reference, lora, routing
        self.temperature, self.train_cfg = rollout.temperature, train
        self.packed = train.padding_free and packs_exactly(model)  # one probe forward per run

    def logprobs(self, batch: RolloutBatch, model: torch.nn.Module | None = None,
                 share_prompts: bool = False, entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs and entropy of the batch's completion tokens under `model` (default: the policy);
        `share_prompts` (train.share_prompt_forward, never with routing hooks or FSDP): each prompt runs once;
        `entropy_grad`: the entropy with its gradient (the entropy bonus)."""
        share = share_prompts and self.train_cfg.share_prompt_forward and not is_sharded(self.model)
        return token_logprobs(
            self.model if model is None else model, batch.input_ids, batch.attention_mask, batch.completion_len,
            self.temperature, self.train_cfg.logprob_chunk_rows, share_prompts=share,
            chunk_tokens=self.train_cfg.logprob_chunk_tokens, entropy_grad=entropy_grad, packed=self.packed,
            pack_min_saving=self.train_cfg.pack_min_saving,
        )

    def shared_logprobs(self, batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """`logprobs` of the policy with each prompt run once, for forwards that only record routing."""
        return self.logprobs(batch, share_prompts=True)

    def replay_allows_sharing(self, minibatch: RolloutBatch) -> bool:
        """Whether a training forward may run each distinct prompt once: always without replay; under replay when
        the rows of each prompt replay the same experts on its columns (so do traces that shared forwards and
        prefills recorded, the defaults), for a shared prompt can only replay one row's experts."""
        if not self.routing.replays_in_training:
            return True
        _, inverse, first = distinct_prompts(minibatch.input_ids, minibatch.attention_mask, minibatch.completion_len)
        prompt, same = slice(0, minibatch.input_ids.shape[1] - minibatch.completion_len), first[inverse].cpu()
        trace = minibatch.routing_trace
        return (torch.equal(trace.indices[:, :, prompt], trace.indices[:, same, prompt])
                and torch.equal(trace.recorded[:, prompt], trace.recorded[same, prompt]))

    def forward_parts(self, batch: RolloutBatch, ranks: Ranks | None = None) -> list[tuple[RolloutBatch, bool]]:
        """The batch as its no-grad forwards take it, each part with whether its result counts (False: a rank's
        spare forward, for FSDP's all-gathers): train.micro_batch_size rows or train.micro_batch_tokens tokens at
        a time, as training's forwards, the same number on every rank (gspo_lab.step.budget); else the rank's
        whole batch at once, which a long-generation recipe cannot hold: 512 rows x 4,608 tokens of a 1.5B
        model's MLP activations are about 127 GB."""
        parts = micro_batch_parts(batch.attention_mask, self.train_cfg.micro_batch_size,
                                  self.train_cfg.micro_batch_tokens, None if ranks is None else ranks.agree)
        if len(parts) == 1:
            return [(batch, True)]
        device = batch.input_ids.device
        return [(batch.rows(torch.tensor(part.rows, device=device)), part.weight) for part in parts]

    def old_logprobs(self, batch: RolloutBatch, ranks: Ranks | None = None
                     ) -> tuple[torch.Tensor, RoutingTrace | None]:
        """π_old of the batch's completion tokens [B, C] and the old policy's routing trace, in no-grad forwards
        of `forward_parts` (whose counted parts hold the rows in order); r3 replays the engine's experts there, off
        and r2 record them."""
        logps, traces = [], []
        for part, counts in self.forward_parts(batch, ranks):
            with torch.no_grad(), self.routing.old_policy(part) as trace:
                share = self.routing.mode != "r3" or self.replay_allows_sharing(part)
                logp = self.logprobs(part, share_prompts=share)[0]
            if counts:
                logps.append(logp)
                traces.append(trace)
        if len(logps) == 1:
            return logps[0], traces[0]
        return torch.cat(logps), None if traces[0] is None else RoutingTrace.cat(traces)

    def reference_logprobs(self, batch: RolloutBatch, ranks: Ranks | None = None) -> torch.Tensor:
        """The frozen reference policy's log-probs [B, C] of the batch's completion tokens (objective.beta > 0),
        each prompt once; the reference routes with its own routers (no replay context is open here)."""
        with torch.no_grad(), self.lora.disabled() if self.lora is not None else nullcontext():
            parts = [(self.logprobs(part, self.reference, share_prompts=True)[0], counts)
                     for part, counts in self.forward_parts(batch, ranks)]
        return torch.cat([logp for logp, counts in parts if counts])


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` that never trains (the KL reference): no gradients, and the optimizer never sees it (it only
    gets the policy's parameters). It is saved in checkpoints, so a resumed run keeps the same reference."""
    reference = copy.deepcopy(model)
    reference.requires_grad_(False)
    return reference
