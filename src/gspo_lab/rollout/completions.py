"""What every rollout backend returns: completions as documented tensors (`Completions`), cut at the first stop
token (`cut_at_stop`, `stop_ids`), in a typed result with a slot for what a backend returns beyond tokens
(`Generated`), and what reward functions get of them (`reward_inputs`). N prompts, P prompt positions
(left-padded), C completion positions (right-padded after the stop token).
"""

from __future__ import annotations

import math

from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import torch
from torch import Tensor

from gspo_lab.routing.trace import RoutingTrace
from gspo_lab.tasks.base import Example
from gspo_lab.tools.runner import EnvironmentRewardFailed


@dataclass
class Completions:
    prompt_ids: Tensor  # [N, P] left-padded prompt tokens
    prompt_mask: Tensor  # [N, P] 1 on prompt tokens
    completion_ids: Tensor  # [N, C] sampled tokens, pad after EOS
    completion_mask: Tensor  # [N, C] 1 on sampled tokens up to and including EOS
    truncated: Tensor  # [N] bool, no EOS within max_new_tokens
    texts: list[str]  # decoded completions, EOS and padding removed
    logprobs: Tensor | None = None  # [N, C] log-probs of the sampled tokens (return_logprobs=True only)
    # multi-turn (gspo_lab.rollout.multi_turn): [N, C] t >= 1 on the model's tokens of its turn t, 0 on the tools'
    # tokens and padding; None: one turn, every completion token the model's
    turns: Tensor | None = None
    messages: list[list[dict]] | None = None  # multi-turn: each row's assistant and tool messages, in order
    # [N, C] int64, the weight version that wrote each completion token (a stale source's; gspo_lab.rollout.sources),
    # or None: every token the current step's
    versions: Tensor | None = None

    @property
    def policy_mask(self) -> Tensor:
        """[N, C] 1 on the tokens the model wrote (not the tools' results, not padding): what the loss sees."""
        return self.completion_mask if self.turns is None else (self.turns > 0).to(self.completion_mask.dtype)

    def cloned(self) -> Completions:
        """A copy whose tensors are ordinary ones (tensors made under inference mode cannot enter autograd)."""
        values = (getattr(self, f.name) for f in fields(self))
        return Completions(*(v.clone() if isinstance(v, Tensor) else v for v in values))

    def rows(self, index: Tensor) -> Completions:
        """The completions of rows `index`, in that order."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return Completions(**{name: value[index] if isinstance(value, Tensor) else
                              [value[i] for i in index.tolist()] if isinstance(value, list) else value
                              for name, value in values.items()})

    def padded(self, prompt_len: int, completion_len: int, pad_id: int) -> Completions:
        """These completions with their prompts left-padded to `prompt_len` and completions right-padded to
        `completion_len` columns (pad tokens, mask 0, log-prob 0)."""
        left, right = prompt_len - self.prompt_ids.shape[1], completion_len - self.completion_ids.shape[1]
        pad = torch.nn.functional.pad
        return Completions(
            prompt_ids=pad(self.prompt_ids, (left, 0), value=pad_id),
            prompt_mask=pad(self.prompt_mask, (left, 0), value=0),
            completion_ids=pad(self.completion_ids, (0, right), value=pad_id),
            completion_mask=pad(self.completion_mask, (0, right), value=0),
            truncated=self.truncated,
            texts=self.texts,
            logprobs=None if self.logprobs is None else pad(self.logprobs, (0, right), value=0.0),
            turns=None if self.turns is None else pad(self.turns, (0, right), value=0),
            messages=self.messages,
            versions=None if self.versions is None else pad(self.versions, (0, right), value=0),
        )

    @staticmethod
    def cat(parts: list[Completions]) -> Completions:
        """Several batches of the same prompt and completion widths, as one (rows in order)."""
        first = parts[0]
        values = {}
        for f in fields(first):
            column = [getattr(part, f.name) for part in parts]
            if isinstance(column[0], Tensor):
                values[f.name] = torch.cat(column)
            elif isinstance(column[0], list):
                values[f.name] = [item for part in column for item in part]
            else:  # logprobs, turns, messages or versions absent from every part
                values[f.name] = None
        return Completions(**values)


def stop_ids(tokenizer, model, extra: Sequence[int] = ()) -> list[int]:
    """The tokens that end a completion: the tokenizer's EOS, every id of the checkpoint's
    `generation_config.eos_token_id` (an int or a list; Qwen2.5's names <|endoftext|> where its tokenizer names
    <|im_end|>) and `extra` (rollout.stop_token_ids), as TRL 1.16 takes them.

    >>> from types import SimpleNamespace as NS
    >>> stop_ids(NS(eos_token_id=7), NS(generation_config=NS(eos_token_id=[7, 9])), [3])
    [7, 9, 3]
    """
    found = [tokenizer.eos_token_id]
    saved = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    found += saved if isinstance(saved, (list, tuple)) else [saved]
    found += list(extra)
    return list(dict.fromkeys(int(i) for i in found if i is not None))


def cut_at_stop(tokenizer, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor, stop: Sequence[int],
                logprobs: Tensor | None = None, generated: Tensor | None = None) -> Completions:
    """Completions from what an engine sampled ([N, C]; `generated`: the positions a row sampled, default all):
    each row keeps its tokens up to and including its first stop token, then padding (mask 0); a row without one
    is truncated. Texts are decoded without the stop token and special tokens."""
    # a stop token, not the pad id (often the EOS itself): keep tokens up to and including the first one
    is_eos = torch.isin(completion_ids, torch.tensor(stop, dtype=completion_ids.dtype, device=completion_ids.device))
    after_eos = (is_eos.long().cumsum(-1) - is_eos.long()) > 0
    if generated is not None:
        after_eos = after_eos | ~generated
    completion_mask = (~after_eos).long()
    completion_ids = completion_ids.masked_fill(after_eos, tokenizer.pad_token_id)
    truncated = ~is_eos.any(-1)
    texts = tokenizer.batch_decode(completion_ids.masked_fill(is_eos, tokenizer.pad_token_id), skip_special_tokens=True)
    return Completions(prompt_ids, prompt_mask, completion_ids, completion_mask, truncated, texts, logprobs)


def from_token_lists(tokenizer, prompt_ids: list[list[int]], tokens: list[list[int]],
                     logprobs: list[list[float]] | None, stop: list[int]) -> Completions:
    """Sampled rows as `Completions`: prompts left-padded, completions right-padded to the longest, each cut after
    its first stop token, with the log-prob of each sampled token (0 on padding) where given."""
    pad = tokenizer.pad_token_id
    width = max(len(ids) for ids in prompt_ids)
    prompts = torch.tensor([[pad] * (width - len(ids)) + ids for ids in prompt_ids])  # [N, P]
    prompt_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompt_ids])
    length = max(1, max(len(ids) for ids in tokens))
    completion = torch.full((len(tokens), length), pad, dtype=torch.long)  # [N, C]
    values = torch.zeros(len(tokens), length)
    for row, ids in enumerate(tokens):
        completion[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        if logprobs is not None:
            values[row, : len(ids)] = torch.tensor(logprobs[row])
    generated = torch.tensor([[1] * len(ids) + [0] * (length - len(ids)) for ids in tokens]).bool()
    return cut_at_stop(tokenizer, prompts, prompt_mask, completion, stop, values if logprobs is not None else None,
                       generated)


@dataclass
class Generated:
    """What a backend's `generate` returns (gspo_lab.rollout.backend): the completions, and what it knows of them
    beyond tokens. `routing_trace`: the experts the engine chose ([B, P + C] columns), where routing records them
    (the hf backend on an MoE); None otherwise. `extra`: further per-row tensors by name, [N] or [N, C] (a
    multi-turn backend's mask of the tokens the policy wrote, an asynchronous one's policy version of each row),
    which `cat` keeps with their rows."""

    completions: Completions
    routing_trace: RoutingTrace | None = None
    extra: dict[str, Tensor] = field(default_factory=dict)

    @staticmethod
    def cat(parts: list[Generated], pad_id: int) -> Generated:
        """The results of several `generate` calls as one batch, re-padded to the widest prompt (left) and
        completion (right), their routing traces and extra tensors with them ([N, C] ones right-padded with 0)."""
        if len(parts) == 1:
            return parts[0]
        prompt_len = max(part.completions.prompt_ids.shape[1] for part in parts)
        completion_len = max(part.completions.completion_ids.shape[1] for part in parts)
        completions = Completions.cat([part.completions.padded(prompt_len, completion_len, pad_id) for part in parts])
        trace = None
        if parts[0].routing_trace is not None:
            trace = RoutingTrace.cat([part.routing_trace.realigned(prompt_len, prompt_len + completion_len)
                                      for part in parts])
        extra = {name: torch.cat([widened(part.extra[name], completion_len) for part in parts])
                 for name in parts[0].extra}
        return Generated(completions, trace, extra)


def widened(values: Tensor, completion_len: int) -> Tensor:
    """An extra tensor of `Generated`: [N] as it is, [N, C'] right-padded with 0 to `completion_len` columns."""
    if values.dim() < 2:
        return values
    return torch.nn.functional.pad(values, (0, completion_len - values.shape[1]), value=0)


def reward_inputs(examples: list[Example], completions: Completions, extra: dict[str, Tensor] | None = None,
                  environments: list | None = None) -> tuple[list, list, list[list[int]], dict]:
    """What reward functions get for these completions of `examples` (one example per completion): the prompts,
    the completions (as assistant messages when the prompts are conversational: a multi-turn one's every
    assistant and tool message; else the text, a multi-turn one's last turn), their token ids up to and
    including the stop token, and the columns (the reference `answer`, every other column of the data, and a
    multi-turn rollout's `environment_reward` (`extra`), None where the environment gave none, and its rows'
    `environments` (gspo_lab.tools.runner.RemoteEnvironment), where given)."""
    conversational = bool(examples) and isinstance(examples[0].prompt, list)
    texts = completions.texts
    replies = texts
    if conversational:
        replies = completions.messages or [[{"role": "assistant", "content": text}] for text in texts]
    # one copy to the host for the whole round (a GPU sync per row otherwise)
    lengths = completions.completion_mask.sum(-1).tolist()
    ids = [row[:n] for row, n in zip(completions.completion_ids.tolist(), lengths)]  # right-padded rows
    columns = {"answer": [e.answer for e in examples]}
    for key in examples[0].meta if examples else ():
        columns[key] = [e.meta.get(key) for e in examples]
    if extra is not None and "environment_reward" in extra:
        failed = extra.get("environment_reward_failed", torch.zeros(len(examples))).tolist()
        columns["environment_reward"] = [
            EnvironmentRewardFailed("this row's environment's get_reward() raised (its first error is logged with "
                                    "its traceback)") if bad else None if math.isnan(r) else r
            for r, bad in zip(extra["environment_reward"].tolist(), failed)]
    if environments is not None:
        columns["environments"] = list(environments)
    return [e.prompt for e in examples], replies, ids, columns
