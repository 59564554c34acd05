"""Per-row seeded sampling, whatever the backend: each row draws from its own random stream, so a row's tokens do
not depend on which rows share a call (rollout.generation_batch_size) nor on the batch's order. The seeds are
drawn once for a round's rows (`draw_row_seeds`); transformers' `generate` samples with `RowSampler`, vLLM with
`SamplingParams(seed=...)`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor
from transformers import LogitsProcessor, TemperatureLogitsWarper, TopPLogitsWarper


def draw_row_seeds(rows: int) -> Tensor:
    """[rows] int64 seeds of rows' sampling streams, drawn from torch's global generator (one draw whatever
    the rows' later split into `generate` calls)."""
    return torch.randint(0, 2**62, (rows,), dtype=torch.int64)


class RowSampler(LogitsProcessor):
    """Sampling from softmax(logits / temperature), nucleus-filtered by `top_p` (transformers' own warpers), with
    row n's t-th token drawn by inverse CDF from its own uniform u[n, t] (`row_uniforms`): the first token whose
    cumulative probability exceeds u[n, t] (`inverse_cdf`). What it returns keeps only that token (0, the rest
    -inf), so `generate`'s greedy choice takes it. A row's draws depend on its seed alone, not on the rows beside
    it (vLLM seeds each request's sampling the same way). Runs after the other processors (`SuppressTokens`), as
    its warpers would. Memory: the [N, V] probabilities, nothing larger."""

    def __init__(self, row_seeds: Tensor, steps: int, temperature: float, top_p: float) -> None:
        self.uniforms = row_uniforms(row_seeds, steps)  # [N, steps] float64, CPU
        self.warpers = ([TemperatureLogitsWarper(float(temperature))] if temperature != 1 else []) + \
            ([TopPLogitsWarper(float(top_p))] if top_p < 1 else [])  # x / 1 is x: a temperature of 1 changes nothing
        self.step = 0
        self.missing: Tensor | None = None  # [N] bool: rows that had no probability mass at some step

    def check(self) -> None:
        """After generate: ValueError naming the rows that had no probability mass to sample from at some step
        (they got a token within the vocabulary meanwhile). Checked once per call, not at every decode step:
        one wait for the device instead of one per step besides generate's own."""
        if self.missing is not None:
            _raise_if_missing(self.missing)

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        for warper in self.warpers:
            scores = warper(input_ids, scores)  # [N, V]
        if self.step == 0:
            self.uniforms = self.uniforms.to(scores.device)
        u = self.uniforms[:, min(self.step, self.uniforms.shape[1] - 1)]  # [N]; FSDP's synced steps reuse the last
        self.step += 1
        tokens, missing = _search(scores.float().softmax(-1), u)  # [N], [N]: no wait for the device here
        self.missing = missing if self.missing is None else self.missing | missing
        # generate's own [N, V] scores, a fresh copy every step, overwritten: one pass less than a new tensor
        return scores.fill_(-math.inf).scatter_(-1, tokens[:, None], 0.0)


class SuppressTokens(LogitsProcessor):
    """-inf at `tokens` (suppress_eos: the stop tokens) in every step's scores, greedy or sampled: what transformers'
    SuppressTokensLogitsProcessor gives, written into `generate`'s own fresh copy of the scores, without its [V]
    mask and new [N, V] tensor per step."""

    def __init__(self, tokens: Sequence[int]) -> None:
        self.tokens = torch.tensor(list(tokens), dtype=torch.long)

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        self.tokens = self.tokens.to(scores.device)  # a no-op after the first step
        return scores.index_fill_(-1, self.tokens, -math.inf)


def row_uniforms(row_seeds: Tensor, steps: int) -> Tensor:
    """[N, steps] float64 uniforms in [0, 1), row n's from a generator seeded with row_seeds[n] alone.

    >>> a, b = row_uniforms(torch.tensor([7, 8]), 3), row_uniforms(torch.tensor([8]), 3)
    >>> torch.equal(a[1], b[0]), bool(a[0].ne(a[1]).all())
    (True, True)
    """
    streams = [torch.Generator().manual_seed(seed) for seed in row_seeds.tolist()]
    return torch.stack([torch.rand(steps, dtype=torch.float64, generator=g) for g in streams])


def inverse_cdf(probs: Tensor, u: Tensor, block: int = 1024) -> Tensor:
    """[N] the first token of each row of probs [N, V] whose cumulative probability exceeds u [N] of the row's
    total: token i with probability probs[i]. Two levels, so no [N, V] cumulative sum is formed (4x faster at a
    152k vocabulary): the block of `block` tokens where the row's mass crosses u · total, from the float64
    cumulative sums of the blocks' sums (float32, as the probabilities), then the token inside that block (a
    float64 cumulative sum of its `block` probabilities). A zero-probability token is never drawn, even where
    rounding puts u · total at or past the end of its block. A vocabulary within one block takes the one-level
    path (`_one_block`), the same tokens bit for bit.

    >>> probs = torch.tensor([[0.5, 0.25, 0.25], [0.5, 0.5, 0.0], [0.5, 0.5, 0.0]])
    >>> inverse_cdf(probs, torch.tensor([0.6, 0.2, 1.0])).tolist()  # cdf [0.5, 0.75, 1]: 0.6 falls in token 1's
    [1, 0, 1]
    >>> inverse_cdf(probs, torch.tensor([0.6, 0.2, 1.0]), block=2).tolist()  # blocks [0, 1] and [2]: the same
    [1, 0, 1]
    """
    tokens, missing = _search(probs, u, block)
    _raise_if_missing(missing)
    return tokens


def _search(probs: Tensor, u: Tensor, block: int = 1024) -> tuple[Tensor, Tensor]:
    """`inverse_cdf` without its check: the tokens [N] (within the vocabulary also for a row without mass) and
    which rows had no finite positive probability mass [N] bool, with no wait for the device."""
    if probs.shape[1] <= block:  # one block: the same tokens, a third of the operations (no block search or gather)
        tokens, total = _one_block(probs, u)
    else:
        tokens, total = _two_levels(probs, u, block)
    missing = ~(torch.isfinite(total[:, -1]) & (total[:, -1] > 0))  # [N]
    return tokens.clamp(0, probs.shape[1] - 1), missing


def _one_block(probs: Tensor, u: Tensor) -> tuple[Tensor, Tensor]:
    """`_two_levels` with a single block of the whole vocabulary, whose block search always picks block 0."""
    total = probs.reshape(len(probs), 1, -1).sum(-1).double()  # [N, 1], as _two_levels sums
    return _first_past(probs.double().cumsum(-1), u[:, None].to(total) * total).squeeze(-1), total


def _first_past(cdf: Tensor, target: Tensor) -> Tensor:
    """[N, 1] the first position of each row of the cumulative sums `cdf` [N, K] above `target` [N, 1], never past
    the row's last position that adds mass (where rounding puts the target at or beyond the row's end)."""
    return torch.minimum(torch.searchsorted(cdf, target, right=True),
                         torch.searchsorted(cdf, cdf[:, -1:].contiguous()))


def _raise_if_missing(missing: Tensor) -> None:
    """ValueError naming the rows of `missing` [N] bool, those with no probability mass (a wait for the device)."""
    if bool(missing.any()):
        raise ValueError(f"sampling: rows {missing.nonzero().flatten().tolist()} have no finite positive probability "
                         "mass (NaN or infinite logits, or every token suppressed)")


def _two_levels(probs: Tensor, u: Tensor, block: int) -> tuple[Tensor, Tensor]:
    """`inverse_cdf`'s two-level search; `block` at most the vocabulary. The tokens [N] and each row's mass [N, 1]."""
    rows, vocab = probs.shape
    whole = vocab - vocab % block
    sums = [probs[:, :whole].reshape(rows, -1, block).sum(-1)] if whole else []  # [N, V // b]
    if whole < vocab:
        sums.append(probs[:, whole:].sum(-1, keepdim=True))  # the shorter last block
    before = torch.cat(sums, 1).double().cumsum(-1)  # [N, blocks]: the mass up to the end of each block
    target = u[:, None].to(before) * before[:, -1:]  # [N, 1] u · total
    chosen = _first_past(before, target)  # the block where the mass crosses the target
    start = chosen * block  # [N, 1]
    columns = start + torch.arange(block, device=probs.device)  # [N, b]
    inside = probs.gather(1, columns.clamp(max=vocab - 1)).masked_fill(columns >= vocab, 0.0)  # [N, b]
    offset = torch.where(chosen > 0, before.gather(1, (chosen - 1).clamp(min=0)), 0.0)  # [N, 1] mass before it
    cdf = offset + inside.double().cumsum(-1)  # [N, b]
    return (start + _first_past(cdf, target)).squeeze(-1), before[:, -1:]
