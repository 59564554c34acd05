"""Sampling completions with transformers' `generate` (KV cache), cut at EOS, with documented shapes.

Sampling follows the arguments alone (`sampling_config`): nothing of a checkpoint's saved `generation_config`
(repetition_penalty, min_p, its top_k default, stop strings, ...) reaches `generate`, so the distribution the
old log-probs describe is the one sampled from. N prompts, P prompt positions (left-padded), C completion
positions (right-padded after EOS).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, fields

import torch
from torch import Tensor
from transformers import Cache, GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from gspo_lab.decoder import decoder_of
from gspo_lab.routing.hooks import CallView, call_view
from gspo_lab.sharding import is_sharded


@dataclass
class Completions:
    prompt_ids: Tensor  # [N, P] left-padded prompt tokens
    prompt_mask: Tensor  # [N, P] 1 on prompt tokens
    completion_ids: Tensor  # [N, C] sampled tokens, pad after EOS
    completion_mask: Tensor  # [N, C] 1 on sampled tokens up to and including EOS
    truncated: Tensor  # [N] bool, no EOS within max_new_tokens
    texts: list[str]  # decoded completions, EOS and padding removed
    logprobs: Tensor | None = None  # [N, C] log-probs of the sampled tokens (return_logprobs=True only)

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
            else:  # logprobs absent from every part
                values[f.name] = None
        return Completions(**values)


def position_ids(attention_mask: Tensor) -> Tensor:
    """Positions counted over real tokens only, as `generate` builds them for left-padded batches. [N, L]"""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def generate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    greedy: bool = False,
    suppress_eos: bool = False,
    return_logprobs: bool = False,
    share_prompts: bool = False,
    stop_token_ids: Sequence[int] = (),
    add_special_tokens: bool = True,
) -> Completions:
    """Generate one completion per prompt (repeat prompts for groups), in eval mode. No top-k truncation is
    applied, so samples come from softmax(logits / temperature), optionally nucleus-filtered by `top_p`, and from
    nothing else (`sampling_config`). With `return_logprobs`, log softmax(logits / temperature) at each sampled
    token is returned as well (the model's raw logits: the un-truncated distribution, as training computes it,
    also when `top_p` < 1), gathered step by step (`StepLogprobs`). Decoding runs under `torch.inference_mode` (5-9%
    faster than `no_grad` at the anchor workload's size, same numbers; `no_grad` for an FSDP-sharded model,
    whose gathered parameters must stay ordinary tensors); the tensors returned are ordinary ones.
    `share_prompts`: a prompt repeated in `prompts` (a group) is prefilled once (`prefill_distinct_prompts`; not for
    an FSDP-sharded model, whose ranks must make the same decoder calls).
    A completion ends at its first stop token (`stop_ids`: the tokenizer's EOS, every EOS of the checkpoint's
    generation config, and `stop_token_ids`), which it keeps. `add_special_tokens=False` for prompts already
    rendered by a chat template, which hold their own special tokens (TRL tokenizes them so too)."""
    sharded = is_sharded(model)
    stop = stop_ids(tokenizer, model, stop_token_ids)
    with torch.no_grad() if sharded else torch.inference_mode():
        completions = _sample(model, tokenizer, prompts, max_new_tokens, temperature, top_p, greedy, suppress_eos,
                              return_logprobs, share_prompts, sharded, stop, add_special_tokens)
    return completions.cloned()


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


def sampling_config(tokenizer, max_new_tokens, temperature=1.0, top_p=1.0, greedy=False,
                    suppress_eos=False, stop: Sequence[int] | None = None) -> GenerationConfig:
    """Every setting `generate` decodes with, from the arguments alone (greedy, or sampling from softmax(logits /
    temperature) with only the `top_p` nucleus filter: top_k=0 overrides transformers' default of 50); decoding
    stops at any of `stop` (default the tokenizer's EOS)."""
    eos = list(stop) if stop else [tokenizer.eos_token_id]
    sampling = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0)
    return GenerationConfig(
        **sampling,
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens if suppress_eos else 0,
        suppress_tokens=eos if suppress_eos else None,
        eos_token_id=eos if len(eos) > 1 else eos[0],
        pad_token_id=tokenizer.pad_token_id,
        use_cache=True,
        return_dict_in_generate=True,
    )


@contextmanager
def only_this_generation_config(model: PreTrainedModel, generation_config: GenerationConfig):
    """`generate` fills every field its `generation_config` leaves unset from `model.generation_config` (a
    checkpoint's repetition_penalty, min_p, top_k, ...): this config stands in for the model's meanwhile."""
    saved = model.generation_config
    model.generation_config = generation_config
    try:
        yield
    finally:
        model.generation_config = saved


def distinct_prompts(input_ids: Tensor, attention_mask: Tensor, completion_len: int) -> tuple[Tensor, Tensor, Tensor]:
    """The U distinct (prompt, prompt mask) rows of a [B, P + C] batch [U, 2P], the distinct row of each batch
    row [B], and the first batch row of each distinct prompt [U].

    >>> ids = torch.tensor([[5, 6, 1], [7, 8, 2], [5, 6, 3]]); _, inverse, first = distinct_prompts(ids, ids > 0, 1)
    >>> inverse.tolist(), first.tolist()
    ([0, 1, 0], [0, 1])
    """
    prompt_len = input_ids.shape[1] - completion_len
    prompts = torch.cat([input_ids[:, :prompt_len], attention_mask[:, :prompt_len].to(input_ids.dtype)], 1)
    distinct, inverse = torch.unique(prompts, dim=0, return_inverse=True)  # [U, 2P], [B]
    rows = torch.arange(len(inverse), device=inverse.device)
    first = torch.full((len(distinct),), len(inverse), device=inverse.device).scatter_reduce(0, inverse, rows, "amin")
    return distinct, inverse, first


def prefill_distinct_prompts(model: PreTrainedModel, input_ids: Tensor, attention_mask: Tensor) -> Cache | None:
    """The KV cache of every prompt but its last token, computed once per distinct prompt and gathered to the
    N rows, for `generate` to continue from (it then runs only the last prompt token and the new ones): a
    group's prompt is prefilled once instead of group_size times. The same function to float rounding (tested).
    A routing recorder stores the call's experts for all N rows (gspo_lab.routing.hooks.CallView).
    None when nothing repeats or a distinct prompt has a single token."""
    distinct, inverse, _ = distinct_prompts(input_ids, attention_mask, completion_len=0)  # [U, 2P], [N]
    prompt_len = input_ids.shape[1]
    mask = distinct[:, prompt_len:-1]  # [U, P - 1]: all but the last prompt position (never padding)
    if len(distinct) == len(inverse) or not bool((mask.sum(-1) > 0).all()):
        return None
    with call_view(CallView(slice(0, prompt_len - 1), expand=inverse)):
        cache = decoder_of(model)(input_ids=distinct[:, : prompt_len - 1], attention_mask=mask,
                                  position_ids=position_ids(mask), use_cache=True).past_key_values
    cache.reorder_cache(inverse)  # every cache layer: rows u -> rows n
    return cache


class StepLogprobs:
    """log softmax(logits / temperature) of each token `generate` samples, gathered step by step from the model's
    raw logits (before any processor: the un-truncated distribution training computes). A forward hook keeps the
    last call's [N, V] log-probs until the next call's input_ids, the tokens sampled from them, pick theirs, so one
    step's logits are held instead of all of them (`output_logits` keeps N x C x V floats: 80 GB for 128 x 1,024
    tokens at a 152k vocabulary). Decode steps beyond the returned ones (FSDP's synced_gpus) are dropped."""

    def __init__(self, temperature: float) -> None:
        self.temperature = temperature
        self.pending: Tensor | None = None  # [N, V] the last call's log-probs
        self.steps: list[Tensor] = []  # [N, 1] per sampled token

    @contextmanager
    def hooked(self, model: torch.nn.Module):
        handles = [model.register_forward_pre_hook(self._before, with_kwargs=True),
                   model.register_forward_hook(self._after, with_kwargs=True)]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()

    def _before(self, module, args, kwargs) -> None:
        if self.pending is not None:  # this call feeds the tokens sampled from the last one's logits
            self.steps.append(self.pending.gather(-1, kwargs["input_ids"][:, -1:]))
            self.pending = None

    def _after(self, module, args, kwargs, output) -> None:
        self.pending = (output.logits[:, -1].float() / self.temperature).log_softmax(-1)  # [N, V]

    def of(self, completion_ids: Tensor) -> Tensor:
        """The [N, C] log-probs of the returned completion tokens."""
        steps = self.steps[: completion_ids.shape[1]]
        if len(steps) < completion_ids.shape[1]:  # the last token: generate stopped before feeding it back
            steps.append(self.pending.gather(-1, completion_ids[:, len(steps) : len(steps) + 1]))
        return torch.cat(steps, 1)


def _sample(model, tokenizer, prompts, max_new_tokens, temperature, top_p, greedy, suppress_eos,
            return_logprobs, share_prompts, sharded, stop, add_special_tokens) -> Completions:
    device = next(model.parameters()).device
    encoded = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=add_special_tokens).to(device)
    config = sampling_config(tokenizer, max_new_tokens, temperature, top_p, greedy, suppress_eos, stop)
    was_training = model.training
    model.eval()
    # FSDP: every decoder call gathers parameters from all ranks, so every rank must make the same calls: no
    # prefill that a rank may skip, and decoding until the last rank's sequences finish (transformers turns
    # synced_gpus on by itself only for models sharded through its own FSDP integration)
    synced = sharded and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
    cache = None
    if share_prompts and not sharded:
        cache = prefill_distinct_prompts(model, encoded["input_ids"], encoded["attention_mask"])
    prefilled = {} if cache is None else {"past_key_values": cache}
    step_logprobs = StepLogprobs(temperature) if return_logprobs else None
    with only_this_generation_config(model, config), step_logprobs.hooked(model) if step_logprobs else nullcontext():
        output = model.generate(**encoded, generation_config=config, synced_gpus=synced, **prefilled)
    model.train(was_training)
    prompt_len = encoded["input_ids"].shape[1]
    completion_ids = output.sequences[:, prompt_len:]
    logprobs = None if step_logprobs is None else step_logprobs.of(completion_ids)
    # a stop token, not the pad id (often the EOS itself): keep tokens up to and including the first one
    is_eos = torch.isin(completion_ids, torch.tensor(stop, device=completion_ids.device))
    after_eos = (is_eos.long().cumsum(-1) - is_eos.long()) > 0
    completion_mask = (~after_eos).long()
    completion_ids = completion_ids.masked_fill(after_eos, tokenizer.pad_token_id)
    truncated = ~is_eos.any(-1)
    texts = tokenizer.batch_decode(completion_ids.masked_fill(is_eos, tokenizer.pad_token_id), skip_special_tokens=True)
    return Completions(
        encoded["input_ids"], encoded["attention_mask"], completion_ids, completion_mask, truncated, texts, logprobs
    )
