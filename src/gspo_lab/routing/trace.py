"""A routing trace: the top-k experts of every MoE layer at every position of a batch, stored compactly.

indices [layers, B, L, k] (uint8 for up to 256 experts, else int16) on CPU (replay copies a mini-batch's to
the model's device once: `to`), aligned with the batch's input_ids [B, L] column for column, so left padding
and the prompt/completion split (`prompt_len`) carry over; `recorded` [B, L] marks positions whose choice was
recorded (a trace from `generate` has no entry for the last token, which is never fed back).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def compact_dtype(num_experts: int) -> torch.dtype:
    return torch.uint8 if num_experts <= 256 else torch.int16


@dataclass
class RoutingTrace:
    indices: Tensor  # [layers, B, L, k] expert ids, compact integer dtype, CPU (under replay the model's device)
    recorded: Tensor  # [B, L] bool
    prompt_len: int | None = None  # columns before this are prompt (left-padded), after it completion

    @property
    def num_layers(self) -> int:
        return self.indices.shape[0]

    def rows(self, index: Tensor) -> RoutingTrace:
        """The trace of batch rows `index` (for a mini-batch)."""
        index = index.cpu()
        return RoutingTrace(self.indices[:, index], self.recorded[index], self.prompt_len)

    def view(self, rows: Tensor | None, columns: slice) -> RoutingTrace:
        """The trace of batch rows `rows` (None: all) and `columns`, for a decoder call that covers only them."""
        indices, recorded = self.indices, self.recorded
        if rows is not None:
            rows = rows.to(indices.device)
            indices, recorded = indices[:, rows], recorded[rows]
        return RoutingTrace(indices[:, :, columns], recorded[:, columns], None)

    def to(self, device: torch.device) -> RoutingTrace:
        """The same trace on `device`."""
        return RoutingTrace(self.indices.to(device), self.recorded.to(device), self.prompt_len)

    def extend_to(self, length: int) -> RoutingTrace:
        """The same trace over `length` columns; the added columns are marked not recorded."""
        missing = length - self.indices.shape[2]
        if missing < 0:
            raise ValueError(f"routing trace has {self.indices.shape[2]} columns, more than {length}")
        layers, rows, _, k = self.indices.shape
        indices = torch.cat([self.indices, self.indices.new_zeros(layers, rows, missing, k)], dim=2)
        recorded = torch.cat([self.recorded, self.recorded.new_zeros(rows, missing)], dim=1)
        return RoutingTrace(indices, recorded, self.prompt_len)

    def realigned(self, prompt_len: int, length: int) -> RoutingTrace:
        """The same trace re-padded for a wider batch: `prompt_len` prompt columns (left padding added) and
        `length` columns in all (right padding added); the added columns are marked not recorded."""
        missing = prompt_len - (self.prompt_len or 0)
        if self.prompt_len is None or missing < 0:
            raise ValueError(f"cannot realign a trace with prompt_len={self.prompt_len} to prompt_len={prompt_len}")
        layers, rows, _, k = self.indices.shape
        indices = torch.cat([self.indices.new_zeros(layers, rows, missing, k), self.indices], dim=2)
        recorded = torch.cat([self.recorded.new_zeros(rows, missing), self.recorded], dim=1)
        return RoutingTrace(indices, recorded, prompt_len).extend_to(length)

    @staticmethod
    def cat(traces: list[RoutingTrace]) -> RoutingTrace:
        """The traces of several batches with the same columns, as one batch (rows in order)."""
        if len({(t.indices.shape[2], t.prompt_len) for t in traces}) != 1:
            raise ValueError("RoutingTrace.cat needs traces with the same columns and prompt_len; realign them first")
        return RoutingTrace(torch.cat([t.indices for t in traces], 1), torch.cat([t.recorded for t in traces]),
                            traces[0].prompt_len)

    def layer(self, i: int, rows: int, length: int) -> tuple[Tensor, Tensor]:
        """Layer i's choices for a [rows, length] forward, flattened as the router sees tokens: [N, k], [N]."""
        if self.indices.shape[1:3] != (rows, length):
            raise ValueError(
                f"routing trace covers [{self.indices.shape[1]}, {self.indices.shape[2]}] tokens but the forward "
                f"is [{rows}, {length}]; replay needs the same batch rows and columns that were recorded"
            )
        return self.indices[i].reshape(rows * length, -1), self.recorded.reshape(-1)

    def bytes_per_token(self) -> float:
        """Memory of the stored choices per (row, column) position."""
        tokens = self.recorded.numel()
        return (self.indices.numel() * self.indices.element_size() + tokens * self.recorded.element_size()) / tokens


def changed_fraction(old: RoutingTrace, new: RoutingTrace, valid: Tensor) -> dict[str, float]:
    """How often the top-k expert *set* differs between two traces of the same batch.

    valid [B, L] selects the (row, column) positions compared (real tokens recorded in both).
    Returns routing/changed_frac over (token, layer) pairs, routing/changed_tokens_frac over tokens with any
    layer changed, and routing/changed_frac/layer_i.
    """
    valid = (valid.cpu().bool() & old.recorded & new.recorded)  # [B, L]
    old_sets = old.indices.long().sort(-1).values  # [layers, B, L, k]
    new_sets = new.indices.long().sort(-1).values
    changed = (old_sets != new_sets).any(-1) & valid  # [layers, B, L]
    count = valid.sum().clamp(min=1).item()
    metrics = {
        "routing/changed_frac": changed.sum().item() / (count * old.num_layers),
        "routing/changed_tokens_frac": changed.any(0).sum().item() / count,
    }
    for i in range(old.num_layers):
        metrics[f"routing/changed_frac/layer_{i}"] = changed[i].sum().item() / count
    return metrics
