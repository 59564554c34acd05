"""Sampling completions with transformers' `generate` (KV cache), cut at EOS, with documented shapes.

Sampling follows the arguments alone (`sampling_config`, `RowSampler`): nothing of a checkpoint's saved
`generation_config` (repetition_penalty, min_p, its top_k default, stop strings, ...) reaches `generate`, so the
distribution the old log-probs describe is the one sampled from. Each row samples from its own random stream
(`row_seeds`), so a row's tokens do not depend on which rows share its `generate` call
(rollout.generation_batch_size). N prompts, P prompt positions (left-padded), C completion positions
(right-padded after EOS).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, fields

import torch
from torch import Tensor
from transformers import (
    Cache,
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    TemperatureLogitsWarper,
    TopPLogitsWarper,
)
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, grouped_mm_experts_forward

from gspo_lab.decoder import CACHE, decoder_of
from gspo_lab.routing.hooks import CallView, call_view
from gspo_lab.sharding import is_sharded

# transformers' grouped_mm under a name of its own, which generate's decode steps do not swap (experts_kernel_kept)
KEPT_GROUPED_MM = "grouped_mm_kept"
ALL_EXPERTS_FUNCTIONS.register(KEPT_GROUPED_MM, grouped_mm_experts_forward)


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
    row_seeds: Tensor | None = None,
    decode_experts_kernel: str = "keep",
    cache_implementation: str | None = None,
) -> Completions:
    """Generate one completion per prompt (repeat prompts for groups), in eval mode. No top-k truncation is
    applied, so samples come from softmax(logits / temperature), optionally nucleus-filtered by `top_p`, and from
    nothing else (`sampling_config`, `RowSampler`). Row n samples from its own stream, seeded by `row_seeds[n]`
    ([N] int64; default: drawn from torch's global generator), so a row's completion is the same whatever other
    rows share the call (to float rounding of the logits). With `return_logprobs`, log softmax(logits /
    temperature) at each sampled token is returned as well (the model's raw logits: the un-truncated distribution,
    as training computes it, also when `top_p` < 1), gathered step by step (`StepLogprobs`). Decoding runs under
    `torch.inference_mode` (5-9% faster than `no_grad` at the anchor workload's size, same numbers; `no_grad` for
    an FSDP-sharded model, whose gathered parameters must stay ordinary tensors); the tensors returned are ordinary
    ones.
    `share_prompts`: a prompt repeated in `prompts` (a group) is prefilled once (`prefill_distinct_prompts`; not for
    an FSDP-sharded model, whose ranks must make the same decoder calls).
    A completion ends at its first stop token (`stop_ids`: the tokenizer's EOS, every EOS of the checkpoint's
    generation config, and `stop_token_ids`), which it keeps. `add_special_tokens=False` for prompts already
    rendered by a chat template, which hold their own special tokens (TRL tokenizes them so too).
    `decode_experts_kernel`: "keep" (an MoE's experts run the model's own kernel in every phase;
    `experts_kernel_kept`) or "transformers" (transformers' choice: `batched_mm` in the decode steps on a GPU).
    `cache_implementation`: transformers' KV cache, e.g. "static" (preallocated; on a GPU `generate` then compiles
    the decode forward itself); None: its dynamic cache. Not with `share_prompts`, whose prefill builds a dynamic
    cache."""
    if decode_experts_kernel not in ("keep", "transformers"):
        raise ValueError(f"generate: decode_experts_kernel={decode_experts_kernel!r}; use 'keep' or 'transformers'")
    if cache_implementation is not None and share_prompts:
        raise ValueError(f"generate: cache_implementation={cache_implementation!r} with share_prompts=True; the "
                         "shared prefill builds a dynamic cache, so give one or the other")
    sharded = is_sharded(model)
    stop = stop_ids(tokenizer, model, stop_token_ids)
    sampler = None
    if not greedy:
        if row_seeds is None:
            row_seeds = draw_row_seeds(len(prompts))
        if len(row_seeds) != len(prompts):
            raise ValueError(f"generate: {len(row_seeds)} row_seeds for {len(prompts)} prompts; give one per prompt")
        sampler = RowSampler(row_seeds, max_new_tokens, temperature, top_p)
    with torch.no_grad() if sharded else torch.inference_mode():
        kernel = experts_kernel_kept(model) if decode_experts_kernel == "keep" else nullcontext()
        with kernel:
            completions = _sample(model, tokenizer, prompts, max_new_tokens, temperature, sampler, suppress_eos,
                                  return_logprobs, share_prompts, sharded, stop, add_special_tokens,
                                  cache_implementation)
    return completions.cloned()


@contextmanager
def experts_kernel_kept(model: PreTrainedModel):
    """Meanwhile an MoE's experts run the model's own kernel in every phase of `generate`. transformers'
    `generate` (5.x, `GenerationMixin._optimize_model_for_decode`) swaps every `grouped_mm` experts kernel for
    `batched_mm` during the decode steps on any device but the CPU. `batched_mm` copies the weights of each
    (token, expert) pair's expert: on bench_gpu (256 rows, top-4 of 16 experts, 3 MiB of bf16 weights per expert
    and layer, 12 layers) about 36 GiB copied and read again per decode step, where `grouped_mm` reads each of
    the 192 expert-layers once (576 MiB). An RL rollout decodes hundreds of rows at once, so here `grouped_mm`
    stays: under another name, `KEPT_GROUPED_MM` (the same function), which the swap does not match. Other
    kernels (index_add, eager) are never swapped and stay as they are."""
    current = model.get_experts_implementation() if hasattr(model, "get_experts_implementation") else {}
    if "grouped_mm" not in current.values():
        yield
        return
    model.set_experts_implementation({k: KEPT_GROUPED_MM if v == "grouped_mm" else v for k, v in current.items()})
    try:
        yield
    finally:
        model.set_experts_implementation(current)


def draw_row_seeds(rows: int) -> Tensor:
    """[rows] int64 seeds of rows' sampling streams, drawn from torch's global generator (one draw whatever
    the rows' later split into `generate` calls)."""
    return torch.randint(0, 2**62, (rows,), dtype=torch.int64)


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


def sampling_config(tokenizer, max_new_tokens, stop: Sequence[int] | None = None) -> GenerationConfig:
    """Every setting `generate` decodes with, from the arguments alone: its own choice is the greedy one, which
    for sampling is the token a `RowSampler` left (no top-k of 50, no other default of transformers' sampling);
    decoding stops at any of `stop` (default the tokenizer's EOS). No min_new_tokens or suppress_tokens: those
    processors build a [V] mask and a new [N, V] tensor every step (`SuppressTokens` does it in place)."""
    eos = list(stop) if stop else [tokenizer.eos_token_id]
    return GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
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
        cache = getattr(decoder_of(model)(input_ids=distinct[:, : prompt_len - 1], attention_mask=mask,
                                          position_ids=position_ids(mask), use_cache=True), CACHE)
    cache.reorder_cache(inverse)  # every cache layer: rows u -> rows n
    return cache


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


class StepLogprobs:
    """log softmax(logits / temperature) of each token `generate` samples, gathered step by step from the model's
    raw logits (before any processor: the un-truncated distribution training computes). A forward hook keeps the
    last call's [N, V] log-probs until the next call's input_ids, the tokens sampled from them, pick theirs, so one
    step's logits are held instead of all of them (`output_logits` keeps N x C x V floats: 80 GB for 128 x 1,024
    tokens at a 152k vocabulary). Decode steps beyond the returned ones (FSDP's synced_gpus) are dropped.
    The hooks run outside compiled code (`torch.compiler.disable`): where `generate` compiles its decode steps (a
    static cache on a GPU, CUDA graphs), what they keep is a tensor of their own, computed from the step's logits
    while those are valid, not a graph output that the next step's replay overwrites."""

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

    @torch.compiler.disable
    def _before(self, module, args, kwargs) -> None:
        if self.pending is not None:  # this call feeds the tokens sampled from the last one's logits
            self.steps.append(self.pending.gather(-1, kwargs["input_ids"][:, -1:]))
            self.pending = None

    @torch.compiler.disable
    def _after(self, module, args, kwargs, output) -> None:
        logits = output.logits[:, -1].float()  # [N, V]; x / 1 is x: no pass over it at temperature 1
        self.pending = (logits if self.temperature == 1 else logits / self.temperature).log_softmax(-1)

    def of(self, completion_ids: Tensor) -> Tensor:
        """The [N, C] log-probs of the returned completion tokens."""
        steps = self.steps[: completion_ids.shape[1]]
        if len(steps) < completion_ids.shape[1]:  # the last token: generate stopped before feeding it back
            steps.append(self.pending.gather(-1, completion_ids[:, len(steps) : len(steps) + 1]))
        return torch.cat(steps, 1)


def _sample(model, tokenizer, prompts, max_new_tokens, temperature, sampler, suppress_eos,
            return_logprobs, share_prompts, sharded, stop, add_special_tokens, cache_implementation) -> Completions:
    device = next(model.parameters()).device
    encoded = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=add_special_tokens).to(device)
    config = sampling_config(tokenizer, max_new_tokens, stop)
    config.cache_implementation = cache_implementation
    processors = ([SuppressTokens(stop)] if suppress_eos else []) + ([sampler] if sampler else [])
    was_training = model.training
    model.eval()
    # FSDP: every decoder call gathers parameters from all ranks, so every rank must make the same calls: no
    # prefill that a rank may skip, and decoding until the last rank's sequences finish (transformers turns
    # synced_gpus on by itself only for models sharded through its own FSDP integration)
    synced = sharded and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
    cache = None
    if share_prompts and not sharded:
        cache = prefill_distinct_prompts(model, encoded["input_ids"], encoded["attention_mask"])
    prefilled = {} if cache is None else {CACHE: cache}
    step_logprobs = StepLogprobs(temperature) if return_logprobs else None
    with only_this_generation_config(model, config), step_logprobs.hooked(model) if step_logprobs else nullcontext():
        output = model.generate(**encoded, generation_config=config, synced_gpus=synced, **prefilled,
                                logits_processor=LogitsProcessorList(processors))
    model.train(was_training)
    if sampler is not None:
        sampler.check()
    prompt_len = encoded["input_ids"].shape[1]
    completion_ids = output.sequences[:, prompt_len:]
    logprobs = None if step_logprobs is None else step_logprobs.of(completion_ids)
    return cut_at_stop(tokenizer, encoded["input_ids"], encoded["attention_mask"], completion_ids, stop, logprobs)


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
