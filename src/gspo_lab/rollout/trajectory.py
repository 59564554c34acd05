"""One multi-turn rollout row as the loop builds it (`Trajectory`), the rows as `Completions` with their turns and
counts (`assemble`), and what readers take of them: a checker's text (`final_text`) and the samples tables' turn by
turn view (`trajectories`). gspo_lab.rollout.multi_turn runs the loop.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import Tensor

from gspo_lab.rollout.completions import Completions, Generated
from gspo_lab.routing.trace import RoutingTrace
from gspo_lab.tools import ToolCall


@dataclass
class Trajectory:
    """One row's rollout so far."""

    prompt_ids: list[int]
    key: str  # its environment's slot in the worker
    seed: int = 0  # its environment's and tools' calls are seeded from it (multi_turn.environment_seed)
    tokens: list[int] = field(default_factory=list)  # completion tokens: the model's and the tools'
    turns: list[int] = field(default_factory=list)  # t >= 1 on the model's tokens of turn t, 0 on the tools'
    logprobs: list[float] = field(default_factory=list)  # the engine's, 0 on the tools' tokens
    messages: list[dict] = field(default_factory=list)  # the assistant and tool messages, in order
    calls: Counter = field(default_factory=Counter)  # tool name -> calls made
    failures: int = 0
    rounds: int = 0  # turns that called tools
    pending: list[ToolCall] = field(default_factory=list)  # the calls of its last turn
    # the engine's experts over the whole row ([layers, L, k], [L]), from its last turn's call: that call's prefill
    # ran every earlier position, the last token of each earlier turn included (NeMo-RL#3485's refresh)
    trace: tuple[Tensor, Tensor] | None = None
    truncated: bool = False
    rolled_back: bool = False  # its last round's tool results did not fit its budget: not appended, the row ended
    done: bool = False
    lost: bool = False
    reward: float = math.nan
    reward_failed: bool = False  # its environment's get_reward() raised

    def add(self, tokens: list[int], turn: int, logprobs: list[float] | None = None) -> None:
        self.tokens += tokens
        self.turns += [turn] * len(tokens)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(tokens)


def assemble(tokenizer, rows: list[Trajectory], tool_names: list[str]) -> Generated:
    """The trajectories as `Completions` (prompts left-padded, completions right-padded) with their `turns`, and
    the per-row counts in `extra`."""
    pad = tokenizer.pad_token_id
    width = max(len(row.prompt_ids) for row in rows)
    length = max(1, max(len(row.tokens) for row in rows))

    def right(values: list, fill) -> list:
        return values + [fill] * (length - len(values))

    prompt_ids = torch.tensor([[pad] * (width - len(r.prompt_ids)) + r.prompt_ids for r in rows])  # [N, P]
    prompt_mask = torch.tensor([[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids) for r in rows])
    completion_ids = torch.tensor([right(r.tokens, pad) for r in rows])  # [N, C]
    completion_mask = torch.tensor([right([1] * len(r.tokens), 0) for r in rows])
    turns = torch.tensor([right(r.turns, 0) for r in rows])  # [N, C]
    logprobs = torch.tensor([right(r.logprobs, 0.0) for r in rows], dtype=torch.float32)
    texts = [final_text(r.messages) for r in rows]
    completions = Completions(prompt_ids, prompt_mask, completion_ids, completion_mask,
                              torch.tensor([r.truncated for r in rows]), texts, logprobs, turns,
                              [r.messages for r in rows])
    traced = [r.trace for r in rows if r.trace is not None]
    trace = None
    if traced:  # every row's span placed where its tokens are: its prompt right-aligned to `width`
        layers, _, k = traced[0][0].shape
        indices = traced[0][0].new_zeros(layers, len(rows), width + length, k)
        recorded = torch.zeros(len(rows), width + length, dtype=torch.bool)
        for n, row in enumerate(rows):
            if row.trace is not None:
                start = width - len(row.prompt_ids)
                indices[:, n, start : start + row.trace[0].shape[1]] = row.trace[0]
                recorded[n, start : start + row.trace[1].shape[0]] = row.trace[1]
        trace = RoutingTrace(indices, recorded, width)
    extra = {
        "tool_calls": torch.tensor([float(sum(r.calls.values())) for r in rows]),
        "tool_failures": torch.tensor([float(r.failures) for r in rows]),
        "turns": torch.tensor([float(max(r.turns, default=0)) for r in rows]),
        "lost": torch.tensor([float(r.lost) for r in rows]),
        "rolled_back": torch.tensor([float(r.rolled_back) for r in rows]),
        "environment_reward": torch.tensor([r.reward for r in rows]),
        "environment_reward_failed": torch.tensor([float(r.reward_failed) for r in rows]),
        **{f"tool_calls/{name}": torch.tensor([float(r.calls[name]) for r in rows]) for name in tool_names},
    }
    return Generated(completions, trace, extra)


def final_text(messages: list[dict]) -> str:
    """What a task's checker reads of a trajectory: the content of its last assistant turn."""
    replies = [m for m in messages if m["role"] == "assistant"]
    return replies[-1]["content"] if replies else ""


def trajectories(tokenizer, completions: Completions) -> list[str | None]:
    """Each multi-turn row turn by turn, as the samples tables show it: the model's turns as it wrote them, each
    tool result marked as ⟦tool: ...⟧ (None for every row of a single-turn batch).

    >>> from gspo_lab.models.tokenizer import char_tokenizer
    >>> tok = char_tokenizer(); ids = tok("ab12c", add_special_tokens=False)["input_ids"]
    >>> turns = torch.tensor([[1, 1, 0, 0, 2]])
    >>> rows = Completions(None, None, torch.tensor([ids]), torch.ones(1, 5), None, [""], turns=turns)
    >>> trajectories(tok, rows)
    ['ab⟦tool: 12⟧c']
    """
    if completions.turns is None:
        return [None] * len(completions.completion_ids)
    shown = []
    for ids, turns, mask in zip(completions.completion_ids.tolist(), completions.turns.tolist(),
                                completions.completion_mask.tolist()):
        pieces = []
        for is_model, run in itertools.groupby(zip(ids, turns, mask), key=lambda t: t[1] > 0):
            tokens = [token for token, _, real in run if real]
            if tokens:
                text = tokenizer.decode(tokens, skip_special_tokens=False)
                pieces.append(text if is_model else f"⟦tool: {text}⟧")
        shown.append("".join(pieces))
    return shown
