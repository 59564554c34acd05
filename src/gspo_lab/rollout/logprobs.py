"""Per-token log-probs of completion tokens without a [B, T, V] float32 log-softmax for the whole batch.

The decoder runs once over the batch (with `packed`, over its rows' real tokens only, packed into bins:
gspo_lab.rollout.packing; with `share_prompts`, once over each distinct prompt and then over every
row's completion tokens, attending to its prompt's keys and values: the same maths, computed once per group
instead of once per row; `shared_prompt_hidden`); the LM head, the architecture's own post-processing of the
head's output (`head_transform`: a logit scale, Gemma-style soft-capping), the temperature and the log-softmax
then run on chunks of the completion positions only: `chunk_rows` rows at a time, and of those rows at most
`chunk_tokens` (row, token) positions at a time (a chunk of r rows spans chunk_tokens // r completion columns),
so the largest [*, V] tensor alive has at most `chunk_tokens` positions whatever the completion length (Qwen3's
151,936-row vocabulary: 32 rows x 1,024 tokens in float32 is 19.9 GB per [rows, C, V] tensor; a chunk holds at
most two of them in the forward and three in the backward, and 8,192 positions bound each to 5 GB). In training each chunk is activation-checkpointed, so
its logits are recomputed in the backward pass instead of kept: peak memory is one chunk's logits. Each row's
log-softmax is the same `log_softmax` a full [B, T, V] computation (or generation) runs, so the values are
identical to it, bit for bit (tested), not merely close. `check_logprobs_match` refuses, when a model loads, an
architecture whose own logits this path does not reproduce.
"""

from __future__ import annotations

import operator
from typing import Callable

import torch
from torch import Tensor
from torch.distributed._composable.contract import _get_registry
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

from gspo_lab.decoder import CACHE, decoder_of
from gspo_lab.rollout.generation import distinct_prompts, position_ids
from gspo_lab.rollout.packing import pack, packed_hidden
from gspo_lab.routing.hooks import CallView, call_view

# model_type -> (config attribute, op): its ForCausalLM.forward returns logits = op(lm_head(h), config.<attribute>)
# (transformers' models/<model_type>/modeling_<model_type>.py)
LOGIT_SCALES: dict[str, tuple[str, Callable[[Tensor, float], Tensor]]] = {
    **{t: ("logit_scale", operator.mul) for t in ("cohere", "cohere2", "cohere2_moe")},
    **{t: ("logits_scaling", operator.truediv)
       for t in ("granite", "granite_swa", "granitemoe", "granitemoe_swa", "granitemoeshared", "granitemoehybrid")},
    "hyperclovax": ("logits_scaling", operator.mul),
    "falcon_h1": ("lm_head_multiplier", operator.mul),
}


def head_transform(model: PreTrainedModel) -> Callable[[Tensor], Tensor]:
    """What the model's forward does to lm_head(h) before it returns logits, in the head's dtype as it does:
    the scale of LOGIT_SCALES, and Gemma-style soft-capping where the config sets `final_logit_softcapping`
    (Gemma 2/3/3n/4, VaultGemma, NanoChat). Anything else is the identity; `check_logprobs_match` refuses
    architectures that do more."""
    config = model.config.get_text_config()
    scale = LOGIT_SCALES.get(config.model_type)
    cap = getattr(config, "final_logit_softcapping", None)

    def transform(logits: Tensor) -> Tensor:
        if scale is not None:
            attribute, op = scale
            logits = op(logits, getattr(config, attribute))
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap  # soft-capping: z = cap * tanh(z / cap), |z| < cap
        return logits

    return transform


def _chunk_logprobs(hidden: Tensor, targets: Tensor, head: torch.nn.Module, transform, temperature: float,
                    entropy_grad: bool = False):
    """hidden [R, C, H], targets [R, C] -> log p(target) [R, C] and entropy [R, C] (with a gradient only under
    `entropy_grad`, through `LogProbEntropy`). At most two [R, C, V] tensors alive in the forward (the logits are
    freed once the log-softmax is taken, the entropy's p log p is formed in place) and three in the backward (the
    log-softmax and two gradients); with `entropy_grad`, two and a block in either (`LogProbEntropy`)."""
    logits = transform(head(hidden)).float()  # [R, C, V]: the model's logits
    if temperature != 1:  # generation's warper; x / 1 is x, so skipping it changes no value
        logits = logits / temperature
    if entropy_grad:
        return LogProbEntropy.apply(logits, targets)
    log_probs = logits.log_softmax(-1)  # [R, C, V], the very op a full log-softmax and generation use
    del logits
    logp = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # [R, C] log p(target)
    with torch.no_grad():
        entropy = -log_probs.exp().mul_(log_probs).sum(-1)  # H = -sum_v p log p
    return logp, entropy


ENTROPY_ROWS = 128  # positions per block of p in LogProbEntropy (TRL's entropy_from_logits chunk_size)


class LogProbEntropy(torch.autograd.Function):
    """logits [R, C, V], targets [R, C] -> log p(target) [R, C] and the entropy H = -sum_v p_v log p_v [R, C], both
    differentiable (the entropy bonus, objective.entropy_coef), keeping one [R, C, V] tensor for the backward, the
    log-softmax (autograd of -(p * log p).sum(-1) would keep p too). p is formed ENTROPY_ROWS positions at a time,
    so the forward holds the logits, the log-softmax and one block, the backward the log-softmax, one gradient and
    one block. With z the logits, g and h the gradients of log p(y) and of H:
        d log p(y) / dz_v = [v = y] - p_v,    dH / dz_v = -p_v (log p_v + H),
        dL / dz_v = g [v = y] - p_v (g + h (log p_v + H)).
    """

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        log_probs = logits.log_softmax(-1)  # [R, C, V], as the no-grad path
        logp = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # [R, C]
        flat = log_probs.view(-1, log_probs.shape[-1])  # [R C, V]
        entropy = torch.cat([-block.exp().mul_(block).sum(-1) for block in flat.split(ENTROPY_ROWS)])  # [R C]
        entropy = entropy.view(logp.shape)  # [R, C]
        ctx.save_for_backward(log_probs, targets, entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: Tensor, grad_entropy: Tensor) -> tuple[Tensor, None]:
        log_probs, targets, entropy = ctx.saved_tensors
        grad = log_probs + entropy.unsqueeze(-1)  # log p_v + H  [R, C, V]
        grad.mul_(grad_entropy.unsqueeze(-1)).add_(grad_logp.unsqueeze(-1))  # g + h (log p_v + H)
        flat = log_probs.view(-1, log_probs.shape[-1])
        for block, out in zip(flat.split(ENTROPY_ROWS), grad.view_as(flat).split(ENTROPY_ROWS)):
            out.mul_(block.exp()).neg_()  # -p_v (g + h (log p_v + H))
        grad.scatter_add_(-1, targets.unsqueeze(-1), grad_logp.unsqueeze(-1))  # + g [v = y]
        return grad, None


def is_checkpointed(model: torch.nn.Module) -> bool:
    """Whether blocks of `model` recompute activations in backward (gspo_lab.models.builders.checkpoint_blocks)."""
    return any("checkpoint" in (_get_registry(m) or {}) for m in model.modules())


KV_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer)  # cache layers holding keys and values only
# the shared forward runs two decoder calls and gathers a cache, which costs more than it saves unless it saves at
# least this share of the decoder's tokens and this many tokens (docs/performance.md: the anchor's mini-batches,
# 13% and ~180 tokens saved, and the default experiment's, ~31% and ~180, ran slower; bench_paper's, ~42% and
# ~2,300, 32% faster)
MIN_TOKEN_SAVING = 0.25
MIN_SAVED_TOKENS = 1024


def kv_cache(decoder: torch.nn.Module) -> DynamicCache | None:
    """An empty cache of the decoder's layer types, or None when a layer keeps more than keys and values
    (Qwen3-Next's and Qwen3.5's linear attention update their state in place, which autograd refuses)."""
    config = getattr(decoder, "config", None)
    if config is None:
        return None
    cache = DynamicCache(config=config.get_text_config())
    return cache if all(type(layer) in KV_LAYERS for layer in cache.layers) else None


def shared_prompt_hidden(decoder: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor,
                         completion_len: int, most_tokens: int | None = None) -> Tensor | None:
    """The decoder's hidden states at the positions that predict the completion tokens, [B, C, H], computed
    with each distinct prompt run once: a forward over the U distinct (prompt, prompt mask) rows keeps their
    keys and values; those are gathered to the B rows (autograd carries their gradient back) and a second
    forward runs the completion columns only, attending to them as incremental decoding does. The same
    function as one forward over [B, P + C], to float rounding (tested), in about (U P + B C) / (B (P + C)) of
    the decoder's work. None (the caller runs the full forward) when that saves less than MIN_TOKEN_SAVING of
    the tokens or fewer than MIN_SAVED_TOKENS, or the architecture's cache is not plain keys and values
    (`kv_cache`), or it would run at least `most_tokens` tokens (a packed forward's count)."""
    rows, prompt_len = input_ids.shape[0], input_ids.shape[1] - completion_len
    distinct, inverse, first = distinct_prompts(input_ids, attention_mask, completion_len)
    all_tokens = rows * (prompt_len + completion_len)
    saved = all_tokens - (len(distinct) * prompt_len + rows * completion_len)
    if saved < MIN_TOKEN_SAVING * all_tokens or saved < MIN_SAVED_TOKENS:
        return None
    if most_tokens is not None and all_tokens - saved >= most_tokens:
        return None
    cache = kv_cache(decoder)
    if cache is None:
        return None
    prompt_ids, prompt_mask = distinct[:, :prompt_len], distinct[:, prompt_len:]
    # a recorder stores this call's experts for all B rows; replay gives each prompt its first row's experts
    with call_view(CallView(slice(0, prompt_len), rows=first, expand=inverse)):
        prefix = decoder(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=position_ids(prompt_mask),
                         use_cache=True, **{CACHE: cache})  # [U, P, H]; the prompts' keys and values in cache
    cache.reorder_cache(inverse)  # every cache layer: rows u -> rows b (index_select)
    with call_view(CallView(slice(prompt_len, None))):
        completions = decoder(
            input_ids=input_ids[:, prompt_len:], attention_mask=attention_mask,
            position_ids=position_ids(attention_mask)[:, prompt_len:], use_cache=True, **{CACHE: cache},
        ).last_hidden_state  # [B, C, H]
    last_prompt = prefix.last_hidden_state[inverse, -1:]  # [B, 1, H]: predicts the first completion token
    return torch.cat([last_prompt, completions[:, :-1]], 1)  # [B, C, H]


def token_logprobs(
    model: PreTrainedModel,
    input_ids: Tensor,
    attention_mask: Tensor,
    completion_len: int,
    temperature: float = 1.0,
    chunk_rows: int = 32,
    share_prompts: bool = False,
    chunk_tokens: int | None = None,
    entropy_grad: bool = False,
    packed: bool = False,
    pack_min_saving: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """log π(y_t | x, y_<t) and the policy entropy at each of the last `completion_len` positions: log_softmax of
    the model's own logits / temperature, in whatever mode the model is in (RLModule keeps it in eval mode).

    input_ids, attention_mask: [B, P + C]; returns two [B, C] tensors (log-probs carry the gradient when
    grad is enabled; the entropy only with `entropy_grad`, for the entropy bonus, else it is detached).
    `share_prompts`: run each distinct prompt once (`shared_prompt_hidden`); routing recorders still get every
    row's experts, and replay gives each prompt the experts of its first row (the caller checks that its rows
    agree); ignored for a model with activation checkpointing (a block recomputed with a KV cache would append to
    it twice). `chunk_tokens` bounds the (row, token) positions of one chunk's logits (None: whole rows); a chunk
    that fits in it is the one a row-only chunking computes, so values are the same bit for bit, and smaller
    chunks agree to float rounding. `packed`: the decoder runs on the rows' real tokens only, in bins
    (gspo_lab.rollout.packing; train.padding_free): the same values to float rounding, 0 where the batch pads; padded
    where the bins save less than `pack_min_saving` of the tokens; with `share_prompts` the shared forward runs
    instead where it computes fewer tokens.
    """
    decoder = decoder_of(model)
    head = model.get_output_embeddings()
    transform = head_transform(model)
    hidden = None
    if share_prompts and not is_checkpointed(model):
        packed_tokens = int(attention_mask.sum()) if packed else None  # what the packed forward would run
        hidden = shared_prompt_hidden(decoder, input_ids, attention_mask, completion_len, packed_tokens)
    packing = pack(input_ids, attention_mask, pack_min_saving) if hidden is None and packed else None
    if packing is not None:
        hidden, (rows, columns) = packed_hidden(decoder, packing, completion_len)  # [M, H]
        targets = input_ids[rows, columns + input_ids.shape[1] - completion_len]  # [M]
        width = chunk_tokens or chunk_rows * completion_len  # a padded chunk's positions at most
        logp, entropy = _chunked(hidden[None], targets[None], (head, transform, temperature, entropy_grad), 1, width)
        out = torch.zeros(input_ids.shape[0], completion_len, device=logp.device, dtype=logp.dtype)  # [B, C]
        logp = out.index_put((rows, columns), logp[0])  # differentiable in logp; 0 where the batch pads
        entropy = out.index_put((rows, columns), entropy[0])
        return logp, entropy if entropy_grad else entropy.detach()
    if hidden is None:
        hidden = decoder(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids(attention_mask),
            use_cache=False,
        ).last_hidden_state  # [B, P + C, H]
        hidden = hidden[:, -completion_len - 1 : -1]  # position t predicts token t + 1  [B, C, H]
    targets = input_ids[:, -completion_len:]  # [B, C]
    if chunk_tokens is not None:
        chunk_rows = min(chunk_rows, chunk_tokens)  # a chunk of one column still holds one position per row
    logp, entropy = _chunked(hidden, targets, (head, transform, temperature, entropy_grad), chunk_rows, chunk_tokens)
    return logp, entropy if entropy_grad else entropy.detach()


def _chunked(hidden: Tensor, targets: Tensor, head: tuple, chunk_rows: int, chunk_tokens: int | None
             ) -> tuple[Tensor, Tensor]:
    """hidden [R, C, H], targets [R, C] -> log-probs and entropies [R, C], `chunk_rows` rows and at most
    `chunk_tokens` positions (None: whole rows) per `_chunk_logprobs` call; `head`: (lm head, head_transform,
    temperature, entropy_grad). Each chunk is activation-checkpointed under grad."""
    completion_len = targets.shape[1]
    logps, entropies = [], []
    for rows in range(0, hidden.shape[0], chunk_rows):
        h, y = hidden[rows : rows + chunk_rows], targets[rows : rows + chunk_rows]  # [r, C, H], [r, C]
        width = completion_len if chunk_tokens is None else max(1, chunk_tokens // len(y))  # columns per chunk
        row_logps, row_entropies = [], []
        for column in range(0, completion_len, width):
            piece = (h[:, column : column + width], y[:, column : column + width], *head)
            if torch.is_grad_enabled():
                logp, entropy = checkpoint(_chunk_logprobs, *piece, use_reentrant=False)
            else:
                logp, entropy = _chunk_logprobs(*piece)
            row_logps.append(logp)
            row_entropies.append(entropy)
        logps.append(torch.cat(row_logps, 1) if len(row_logps) > 1 else row_logps[0])
        entropies.append(torch.cat(row_entropies, 1) if len(row_entropies) > 1 else row_entropies[0])
    return torch.cat(logps), torch.cat(entropies)


def check_logprobs_match(model: PreTrainedModel) -> None:
    """Refuse a model whose own logits the chunked path does not reproduce: its forward post-processes the
    decoder's output in a way `head_transform` does not know, so on-policy ratios would not be 1.

    One tiny probe in eval mode without gradients: a forward of two rows of 8 tokens spread over the vocabulary
    (the second left-padded by 3) whose decoder output is captured; the chunked path's log-probs of the last 4
    tokens from that very output must equal log_softmax(logits) of the forward to float rounding,
    4 eps(dtype) (1 + max |logit|) (one decoder run, so run-to-run noise of GPU kernels cannot enter). Raises
    ValueError naming the class, the model_type and the largest difference. A model on the meta device (shapes
    only) is not checked.
    """
    parameter = next(model.parameters())
    if parameter.is_meta:
        return
    name = f"{type(model).__name__} (model_type {model.config.model_type!r})"
    vocab = model.get_input_embeddings().num_embeddings
    input_ids = (torch.arange(16, device=parameter.device).view(2, 8) * (vocab // 16)) % vocab  # [2, 8]
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :3] = 0  # left padding
    C = 4
    decoder_outputs = []
    hook = decoder_of(model).register_forward_hook(lambda *call: decoder_outputs.append(call[2]))
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits = model(input_ids=input_ids, attention_mask=attention_mask,
                           position_ids=position_ids(attention_mask)).logits[:, -C - 1 : -1]  # [2, C, V]
            hidden = getattr(decoder_outputs[-1] if decoder_outputs else None, "last_hidden_state", None)
            if hidden is None:
                raise ValueError(f"{name}: its forward does not return its decoder's "
                                 "last_hidden_state to the LM head, which the chunked log-prob path needs")
            logp, _ = _chunk_logprobs(hidden[:, -C - 1 : -1], input_ids[:, -C:], model.get_output_embeddings(),
                                      head_transform(model), 1.0)  # [2, C]
    finally:
        hook.remove()
        model.train(was_training)
    reference = logits.float().log_softmax(-1).gather(-1, input_ids[:, -C:, None]).squeeze(-1)  # [2, C]
    difference = (logp - reference).abs().max().item()
    tolerance = 4 * torch.finfo(logits.dtype).eps * (1 + logits.abs().max().item())
    if not difference <= tolerance:  # also refuses NaN
        raise ValueError(
            f"{name}: training log-probs differ from the model's own log_softmax(logits) by up to {difference:.3g} "
            f"(float rounding allows {tolerance:.3g}): its forward post-processes the decoder's output in a way "
            "gspo_lab.rollout.logprobs.head_transform does not know, so on-policy ratios would not be 1. Add the "
            "transform to LOGIT_SCALES / head_transform, or use another architecture."
        )
