"""Padding-free forwards (train.padding_free): a batch's rows with their padding removed, concatenated into bins.

A padded batch [B, L] computes B x L tokens, of which only the real ones (attention_mask 1) matter; with answers
of 10 to 400 tokens about half are padding. `pack` lays the real tokens of each row end to end in bins of W
columns (W: the longest row, so that no row is split), first-fit decreasing, with each row's positions counted
from 0 again. transformers builds the attention mask of such a batch itself when the decoder gets position ids
and no attention mask (masking_utils.find_packed_sequence_indices: a position that does not follow the one before
starts a sequence): causal within each row, nothing across rows. So every real token sees exactly the tokens it
sees in the padded batch, and the bins cost about Σ_b len_b tokens instead of B x L. The slack at a bin's end
(token 0, positions continuing the last row's) is attended to by no real token.

W is the longest row rather than one bin for all rows because this mask is dense: sdpa and eager compute every
[W, W] score of a bin, so one bin of all the rows would cost (Σ len)² attention instead of about B/R x W².
flash-attention kernels (flash_attention_2/3 on a GPU) take varlen sequences from the same position ids and
compute no cross-row score at all; there one wider bin costs no more.

`Packing` keeps the map back: each real token's batch (row, column) and its flat index in the bins, so log-probs,
entropies and routing traces (gspo_lab.routing.hooks) return to the [B, L] layout the rest of the step uses.
`packs_exactly` checks, once per model, that this architecture's forward really keeps rows apart (linear attention
carries a recurrent state from one row into the next; gpt-oss's sliding-window layers ignore the packed mask).
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass

import torch
from torch import Tensor

from gspo_lab.decoder import decoder_of
from gspo_lab.rollout.generation import position_ids
from gspo_lab.routing.hooks import CallView, call_view

log = logging.getLogger(__name__)


def first_fit_decreasing(lengths: list[int], width: int) -> list[list[int]]:
    """Rows into bins of at most `width` tokens: longest first, each into the first bin it fits (ties in row
    order, so the same lengths always give the same bins); each bin's rows in row order.

    >>> first_fit_decreasing([3, 7, 2, 5, 1], 7)
    [[1], [2, 3], [0, 4]]
    """
    bins: list[list[int]] = []
    room: list[int] = []
    for row in sorted(range(len(lengths)), key=lambda r: -lengths[r]):
        fits = next((i for i, free in enumerate(room) if lengths[row] <= free), None)
        if fits is None:
            bins.append([row])
            room.append(width - lengths[row])
        else:
            bins[fits].append(row)
            room[fits] -= lengths[row]
    return [sorted(rows) for rows in bins]


@dataclass(frozen=True)
class Packing:
    """A [B, L] batch's real tokens in R bins of W columns, and the map between the two layouts.

    input_ids, position_ids: [R, W] what the decoder runs on; rows: [N] the batch row of each of the N real tokens
    (row-major, as attention_mask.nonzero lists them), columns: [N] its batch column, flat: [N] its index in the
    bins flattened to [R W]. batch_shape: (B, L).
    """

    input_ids: Tensor
    position_ids: Tensor
    rows: Tensor
    columns: Tensor
    flat: Tensor
    batch_shape: tuple[int, int]

    def unpacked(self, packed: Tensor, fill=0) -> Tensor:
        """A [R, W, ...] tensor of the bins back in the batch's layout [B, L, ...]; `fill` where the batch pads."""
        flat = packed.reshape(-1, *packed.shape[2:])[self.flat]  # [N, ...]
        out = flat.new_full((*self.batch_shape, *packed.shape[2:]), fill)
        out[self.rows, self.columns] = flat
        return out

    def packed(self, batch: Tensor, fill=0) -> Tensor:
        """A [B, L, ...] tensor of the batch in the bins' layout [R, W, ...]; `fill` on the slack."""
        out = batch.new_full((self.input_ids.numel(), *batch.shape[2:]), fill)
        out[self.flat] = batch[self.rows, self.columns]
        return out.view(*self.input_ids.shape, *batch.shape[2:])


MIN_SAVING = 0.1  # the default share of a padded batch's tokens the bins must save (train.pack_min_saving)


def pack(input_ids: Tensor, attention_mask: Tensor, min_saving: float = 0.0) -> Packing | None:
    """The real tokens of a [B, L] batch in bins as wide as its longest row (`first_fit_decreasing`). A row's
    tokens keep their order and get positions 0..len-1, as `position_ids` gives them in the padded batch. None
    where the bins would hold more than (1 - min_saving) of the batch's B x L tokens."""
    real = attention_mask.bool()
    host_lengths = real.sum(1).tolist()  # one copy to the host per forward
    width = max(1, max(host_lengths))
    bins = first_fit_decreasing(host_lengths, width)
    if len(bins) * width > (1 - min_saving) * input_ids.numel():
        return None
    start = [0] * len(host_lengths)  # each row's first flat index in the bins
    for index, rows in enumerate(bins):
        offset = index * width
        for row in rows:
            start[row] = offset
            offset += host_lengths[row]
    rows, columns = real.nonzero(as_tuple=True)  # [N], [N], row-major
    positions = position_ids(attention_mask)[rows, columns]  # [N] 0..len-1 within each row
    flat = torch.tensor(start, device=input_ids.device)[rows] + positions  # [N]
    size = len(bins) * width
    packed_ids = input_ids.new_zeros(size)
    packed_ids[flat] = input_ids[rows, columns]
    packed_positions = torch.arange(size, device=input_ids.device) % width  # the slack: its column in its bin
    packed_positions[flat] = positions
    return Packing(packed_ids.view(len(bins), width), packed_positions.view(len(bins), width), rows, columns, flat,
                   tuple(input_ids.shape))


def completion_positions(packing: Packing, completion_len: int) -> tuple[Tensor, Tensor, Tensor]:
    """For each real completion token with a token before it in its row: the flat index of the position that
    predicts it (the token before), its batch row and its completion column, each [M]."""
    length = packing.batch_shape[1]
    target = packing.columns >= length - completion_len
    first = torch.ones_like(target)  # a row's first token has no predictor
    first[1:] = packing.rows[1:] != packing.rows[:-1]
    target &= ~first
    return packing.flat[target] - 1, packing.rows[target], packing.columns[target] - (length - completion_len)


def packed_hidden(decoder: torch.nn.Module, packing: Packing, completion_len: int) -> tuple[Tensor, tuple]:
    """The decoder's hidden states at the positions that predict the completion tokens, [M, H], from one forward
    over the bins, and where those M positions go in the [B, C] layout (rows, columns). Routing hooks map the
    bins' tokens to the batch's (gspo_lab.routing.hooks.CallView.packing)."""
    with call_view(CallView(slice(None), packing=packing)):
        hidden = decoder(input_ids=packing.input_ids, position_ids=packing.position_ids, attention_mask=None,
                         use_cache=False).last_hidden_state  # [R, W, H]
    predictors, rows, columns = completion_positions(packing, completion_len)
    return hidden.reshape(-1, hidden.shape[-1])[predictors], (rows, columns)  # [M, H]


_PROBED: weakref.WeakKeyDictionary[torch.nn.Module, bool] = weakref.WeakKeyDictionary()  # model -> packs_exactly


def packs_exactly(model: torch.nn.Module) -> bool:
    """Whether packed forwards of `model` give its padded forward's hidden states, to float rounding: one tiny
    no-grad probe of three rows (two of them share a bin) in eval mode, once per model object (the answer is its
    architecture's, so the trainer's forwards and a backend scoring on the same model share it). False, with a
    warning naming the architecture and the difference, where rows see each other (linear attention's recurrent
    state; gpt-oss's sliding-window layers). A model on the meta device is not probed (True)."""
    if next(model.parameters()).is_meta:
        return True
    if model not in _PROBED:
        _PROBED[model] = _probe(model)
    return _PROBED[model]


def _probe(model: torch.nn.Module) -> bool:
    parameter = next(model.parameters())
    decoder = decoder_of(model)
    vocab = model.get_input_embeddings().num_embeddings
    input_ids = (torch.arange(24, device=parameter.device).view(3, 8) * (vocab // 24 + 1) + 1) % vocab  # [3, 8]
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :5] = 0  # lengths 3, 8, 5: rows 0 and 2 share a bin of 8
    attention_mask[2, :3] = 0
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            padded = decoder(input_ids=input_ids, attention_mask=attention_mask,
                             position_ids=position_ids(attention_mask), use_cache=False).last_hidden_state
            packing = pack(input_ids, attention_mask)
            packed = decoder(input_ids=packing.input_ids, position_ids=packing.position_ids, attention_mask=None,
                             use_cache=False).last_hidden_state
    finally:
        model.train(was_training)
    real = attention_mask.bool()
    difference = (packing.unpacked(packed)[real] - padded[real]).abs().max().item()
    tolerance = 64 * torch.finfo(padded.dtype).eps * (1 + padded[real].abs().max().item())
    if difference <= tolerance:
        return True
    log.warning("train.padding_free: %s (model_type %r) does not keep packed rows apart (hidden states differ from "
                "the padded forward's by %.3g, rounding allows %.3g), so its forwards stay padded",
                type(model).__name__, model.config.model_type, difference, tolerance)
    return False
