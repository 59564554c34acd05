"""The hf backend's sampling: transformers' `generate` (KV cache), cut at the stop tokens, as `Completions`.

Sampling follows the arguments alone (`sampling_config`, `RowSampler`): nothing of a checkpoint's saved
`generation_config` (repetition_penalty, min_p, its top_k default, stop strings, ...) reaches `generate`, so the
distribution the old log-probs describe is the one sampled from. Each row samples from its own random stream
(`row_seeds`), so a row's tokens do not depend on which rows share its `generate` call
(rollout.generation_batch_size). N prompts, P prompt positions (left-padded), C completion positions
(right-padded after EOS).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager, nullcontext

import torch
from torch import Tensor
from transformers import Cache, GenerationConfig, LogitsProcessorList, PreTrainedModel, PreTrainedTokenizerBase
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, grouped_mm_experts_forward

from gspo_lab.decoder import CACHE, decoder_of
from gspo_lab.rollout.completions import Completions, cut_at_stop, stop_ids
from gspo_lab.rollout.sampling import RowSampler, SuppressTokens, draw_row_seeds
from gspo_lab.routing.hooks import CallView, call_view
from gspo_lab.sharding import is_sharded

# transformers' grouped_mm under a name of its own, which generate's decode steps do not swap (experts_kernel_kept)
KEPT_GROUPED_MM = "grouped_mm_kept"
ALL_EXPERTS_FUNCTIONS.register(KEPT_GROUPED_MM, grouped_mm_experts_forward)


def position_ids(attention_mask: Tensor) -> Tensor:
    """Positions counted over real tokens only, as `generate` builds them for left-padded batches. [N, L]"""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def generate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str] | list[list[int]],
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


def encode_prompts(tokenizer, prompts: list[str] | list[list[int]], add_special_tokens: bool = True):
    """The prompts as a left-padded batch (`input_ids`, `attention_mask`); prompts given as token ids (a
    multi-turn rollout continuing from what was generated) are taken as they are, never re-tokenised.

    >>> from gspo_lab.models.tokenizer import char_tokenizer
    >>> encode_prompts(char_tokenizer(), [[5, 6, 7], [8]])["input_ids"].tolist()
    [[5, 6, 7], [0, 0, 8]]
    """
    if prompts and not isinstance(prompts[0], str):
        return tokenizer.pad({"input_ids": [list(ids) for ids in prompts]}, padding=True, padding_side="left",
                             return_tensors="pt")
    return tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=add_special_tokens)


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
    encoded = encode_prompts(tokenizer, prompts, add_special_tokens).to(device)
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


