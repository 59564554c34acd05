"""A batch's rows into micro-batches: train.micro_batch_size rows each, or by a token budget
(train.micro_batch_tokens, verl's ppo_max_token_len_per_gpu with use_dynamic_bsz), the same number on every rank.

By budget, rows go in their order (the mini-batch's, already shuffled) into a micro-batch until the next row would
take it past the budget of real tokens; a row longer than the budget is a micro-batch of its own. The gradient
does not depend on how rows are grouped (gspo_lab.objectives.micro_batches weighs each micro-batch by its share of
the mini-batch's count), only the float rounding does, and the grouping depends only on the rows' lengths in
their order.

Under DDP and FSDP each micro-batch's forward and backward hold collectives (the gradient all-reduce of the last
one, FSDP's all-gathers and reduce-scatters, the check that no rank's loss is non-finite), so every rank must run
as many as every other: the ranks agree on the largest count (one all-reduce), and a rank that needs fewer splits
its heaviest micro-batches in two (at the row that halves its tokens) until it has as many. A rank with fewer
rows than that count runs its last ones again with weight 0 (`Part.weight`): collectives, no gradient. The parts
of weight 1 hold the rows in order, each once, so their results concatenate to the batch's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from gspo_lab.tensors import micro_slices


@dataclass(frozen=True)
class Part:
    rows: list[int]  # the micro-batch's rows, indices into the batch
    weight: bool = True  # False: a rank's spare micro-batch, run for its collectives only (loss x 0, no metrics)
    added: bool = False  # made to match another rank's count: a split's second half, or a spare


def by_budget(lengths: list[int], budget: int) -> list[list[int]]:
    """Rows in order into groups of at most `budget` tokens (a longer row alone).

    >>> by_budget([3, 4, 2, 9, 1, 1], 8)
    [[0, 1], [2], [3], [4, 5]]
    """
    groups: list[list[int]] = []
    used = budget + 1  # no group open
    for row, length in enumerate(lengths):
        if used + length > budget:
            groups.append([])
            used = 0
        groups[-1].append(row)
        used += length
    return groups


def split_to(groups: list[list[int]], lengths: list[int], count: int) -> list[Part]:
    """`groups` made `count` parts: the group of most tokens (the first such) split where its tokens halve, while
    fewer and one has two rows; then spare parts of weight 0 re-running the last group.

    >>> [p.rows for p in split_to([[0, 1, 2], [3]], [2, 2, 4, 3], 3)]
    [[0, 1], [2], [3]]
    >>> [(p.rows, p.weight, p.added) for p in split_to([[0]], [5], 2)]
    [([0], True, False), ([0], False, True)]
    """
    groups = [(list(g), False) for g in groups]  # (rows, added)
    while len(groups) < count:
        splittable = [i for i, (g, _) in enumerate(groups) if len(g) > 1]
        if not splittable:
            break
        heaviest = max(splittable, key=lambda i: sum(lengths[r] for r in groups[i][0]))
        group, added = groups[heaviest]
        total, running, cut = sum(lengths[r] for r in group), 0, 1
        for position, row in enumerate(group[:-1], start=1):
            running += lengths[row]
            cut = position
            if 2 * running >= total:
                break
        groups[heaviest:heaviest + 1] = [(group[:cut], added), (group[cut:], True)]
    parts = [Part(g, added=added) for g, added in groups]
    return parts + [Part(groups[-1][0], weight=False, added=True)] * (count - len(parts))


def micro_batch_parts(attention_mask: torch.Tensor, size: int | None, budget: int | None,
                      agree: Callable[[int], int] | None = None) -> list[Part]:
    """The rows of a batch with this [B, L] mask as micro-batches: of `size` rows, or of at most `budget` real
    tokens, or all at once; `agree(count)` -> the largest count over the ranks (None: one rank)."""
    rows = attention_mask.shape[0]
    if budget is None:
        groups = [list(range(s.start, s.stop)) for s in micro_slices(rows, size)]
        lengths = [1] * rows
    else:
        lengths = attention_mask.sum(1).tolist()  # one copy to the host per batch
        groups = by_budget(lengths, budget) or [[]]
    count = len(groups) if agree is None or budget is None else agree(len(groups))  # rows split ranks alike
    return split_to(groups, lengths, count)
