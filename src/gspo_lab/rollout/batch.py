"""The rollout batch: everything one RL step's updates need, as tensors with documented shapes.

B completions (prompts_per_step x group_size on this rank, groups contiguous), P prompt positions
(left-padded), C completion positions (right-padded after EOS).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor


@dataclass
class RolloutBatch:
    input_ids: Tensor  # [B, P + C] prompt tokens then completion tokens
    attention_mask: Tensor  # [B, P + C] 1 on real tokens (prompt, completion up to EOS)
    loss_mask: Tensor  # [B, C] completion tokens entering the loss (truncated rows zeroed if configured)
    old_logp: Tensor  # [B, C] log-probs of the completion tokens under the policy that sampled them
    rewards: Tensor  # [B]
    advantages: Tensor  # [B] group-relative
    truncated: Tensor  # [B] bool, no EOS within max_new_tokens
    routing_trace: Any = None  # expert choices to replay (gspo_lab.routing), or None
    ref_logp: Tensor | None = None  # [B, C] log-probs under the frozen reference policy (objective.beta > 0)
    rollout_logp: Tensor | None = None  # [B, C] the rollout engine's own log-probs of the sampled tokens
    rollout_trace: Any = None  # the rollout engine's expert choices during generation (MoE), or None
    # [B, C] multi-turn: t >= 1 on the model's tokens of its turn t, 0 on the tools' and padding; None: one turn.
    # loss_mask is then 1 on the model's tokens only; attention_mask covers the tools' too (they are context)
    turns: Tensor | None = None
    # [B] int64, the weight version that generated each row (rollout.max_staleness > 0; gspo_lab.rollout.sources.lagged)
    versions: Tensor | None = None

    @property
    def completion_len(self) -> int:
        return self.loss_mask.shape[1]

    @property
    def policy_mask(self) -> Tensor:
        """[B, C] 1 on the completion tokens the model wrote (truncated rows included): what the mismatch metrics
        and |y| count."""
        mask = self.attention_mask[:, -self.completion_len :]
        return mask if self.turns is None else mask * (self.turns > 0).to(mask.dtype)

    def rows(self, index: Tensor) -> RolloutBatch:
        """The mini-batch made of rows `index` (the routing trace is sliced alongside)."""
        sliced: dict[str, Any] = {}
        for field in fields(self):
            value = getattr(self, field.name)
            if isinstance(value, Tensor):
                sliced[field.name] = value[index]
            elif value is not None:
                sliced[field.name] = value.rows(index)
            else:
                sliced[field.name] = None
        return RolloutBatch(**sliced)

    def to(self, device: torch.device) -> RolloutBatch:
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        for name, value in moved.items():
            if isinstance(value, Tensor):
                moved[name] = value.to(device)
        return RolloutBatch(**moved)
