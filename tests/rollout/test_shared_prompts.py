"""Prompts computed once per group. The shared-prompt forward (train.share_prompt_forward;
gspo_lab.rollout.logprobs.shared_prompt_hidden) must give the log-probs and gradients of one full forward on every
supported architecture, run the decoder on the distinct prompts only, and fall back to the full forward where the
cache is not keys and values or blocks are checkpointed. The shared prefill of generation
(rollout.share_prompt_prefill; gspo_lab.rollout.generation.prefill_distinct_prompts) must decode the same tokens
with the same log-probs and record the same experts for every row. Under routing replay a shared forward gives
each prompt its first row's recorded experts, which the module allows only where a prompt's rows agree."""

import logging
import warnings
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch
from transformers.utils import logging as transformers_logging

from gspo_lab.decoder import decoder_of
from gspo_lab.models.builders import checkpoint_blocks
from gspo_lab.step.policy import PolicyForwards
from gspo_lab.rollout import RolloutBatch, generate, logprobs, token_logprobs
from gspo_lab.routing import RoutingTrace, record_routing, replay_routing
from gspo_lab.routing.adapters import find_routers
from gspo_lab.rollout.generation import position_ids
from tests.numerics import assert_rounding_close, logit_scale

FAMILIES = ["tiny_moe", "tiny_dense", "tiny_mixtral", "tiny_olmoe", "tiny_qwen2_moe", "tiny_deepseek_v3",
            "tiny_gpt_oss", "tiny_glm4_moe", "tiny_llama4", "tiny_minimax_m2", "tiny_ernie4_5_moe", "tiny_dots1",
            "tiny_solar_open", "tiny_exaone_moe"]
LINEAR_ATTENTION = ["tiny_qwen3_next", "tiny_qwen3_5_moe"]  # their cache holds recurrent state: no sharing
# 4 prompts of different lengths (left padding), 3 completions each, the rows not grouped (as in a mini-batch)
PROMPTS = [p for _ in range(3) for p in ["123+456=", "1+2=", "77+8=", "500+500="]]


@pytest.fixture(autouse=True)
def share_small_batches(monkeypatch):
    """These batches are tiny: let them share whatever the token count saved (the share of tokens still counts)."""
    monkeypatch.setattr(logprobs, "MIN_SAVED_TOKENS", 0)


def rollout(name: str, tiny_family):
    model, tokenizer = tiny_family(name)
    out = generate(model, tokenizer, PROMPTS, 6)
    ids = torch.cat([out.prompt_ids, out.completion_ids], 1)
    mask = torch.cat([out.prompt_mask, out.completion_mask], 1)
    return model, ids, mask, out.completion_ids.shape[1], out.completion_mask.bool()


def scale_of(model, ids, mask) -> float:
    """The magnitude the log-probs' rounding grows from (tests/numerics.py): these models' logits / T."""
    with torch.no_grad():
        return logit_scale(model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask)).logits)


def assert_same_gradients(full_grads, shared_grads) -> None:
    """Sums over every token of rounding-sized differences: 256 roundings of each tensor's largest entry."""
    for a, b in zip(full_grads, shared_grads):
        assert_rounding_close(b, a, scale=a.abs().max(), units=256)


def logprobs_and_grads(model, ids, mask, completion_len, share: bool):
    model.zero_grad()
    calls = []
    hook = decoder_of(model).register_forward_pre_hook(
        lambda module, args, kwargs: calls.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    logp, _ = token_logprobs(model, ids, mask, completion_len, share_prompts=share)
    hook.remove()
    logp.sum().backward()
    grads = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in model.parameters()]
    return logp.detach(), grads, calls


def test_the_kv_cache_goes_by_the_name_the_installed_transformers_gives_it(tiny_family):
    """transformers 5.24 renamed `past_key_values` to `cache` and warns at every use of the old name, as argument
    or output field; 5.19 knows only the old one (gspo_lab.decoder.CACHE). Neither shared path warns."""
    logged, handler = [], logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())
    library = logging.getLogger("transformers")
    library.addHandler(handler)
    transformers_logging.warning_once.cache_clear()  # a message it logged before would not be logged again
    try:
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            model, tokenizer = tiny_family("tiny_moe")
            out = generate(model, tokenizer, PROMPTS, 3, share_prompts=True)
            ids = torch.cat([out.prompt_ids, out.completion_ids], 1)
            mask = torch.cat([out.prompt_mask, out.completion_mask], 1)
            token_logprobs(model, ids, mask, out.completion_ids.shape[1], share_prompts=True)
    finally:
        library.removeHandler(handler)
    said = logged + [str(warning.message) for warning in warned]
    assert not [message for message in said if "past_key_values" in message], said


@pytest.mark.numerics
@pytest.mark.parametrize("name", FAMILIES)
def test_sharing_prompts_gives_the_full_forwards_logprobs_and_gradients(name, tiny_family):
    model, ids, mask, C, completion = rollout(name, tiny_family)
    full, full_grads, full_calls = logprobs_and_grads(model, ids, mask, C, share=False)
    shared, shared_grads, calls = logprobs_and_grads(model, ids, mask, C, share=True)
    P = ids.shape[1] - C
    assert full_calls == [(12, P + C)]
    assert calls == [(4, P), (12, C)]  # the 4 distinct prompts once, then the 12 rows' completion columns
    # float rounding of a different summation order (attention over a cache, other GEMM shapes)
    assert_rounding_close(shared[completion], full[completion], scale=scale_of(model, ids, mask), units=16)
    assert_same_gradients(full_grads, shared_grads)


@pytest.mark.parametrize("name", LINEAR_ATTENTION)
def test_a_linear_attention_cache_falls_back_to_the_full_forward(name, tiny_family):
    model, ids, mask, C, _ = rollout(name, tiny_family)
    full, _, _ = logprobs_and_grads(model, ids, mask, C, share=False)
    shared, _, calls = logprobs_and_grads(model, ids, mask, C, share=True)
    assert calls == [tuple(ids.shape)]  # one full forward, no prompt forward tried first
    assert torch.equal(shared, full)  # bitwise: the same full forward on the same shapes in one process


def test_checkpointed_blocks_and_small_savings_use_the_full_forward(monkeypatch, tiny_family):
    model, ids, mask, C, _ = rollout("tiny_moe", tiny_family)
    # rows 0 and 4 share a prompt, 1 and 2 do not: sharing would save P of 4 (P + C) tokens, under a quarter
    rows = torch.tensor([0, 4, 1, 2])
    _, _, calls = logprobs_and_grads(model, ids[rows], mask[rows], C, share=True)
    assert calls == [(4, ids.shape[1])]
    P = ids.shape[1] - C
    monkeypatch.setattr(logprobs, "MIN_SAVED_TOKENS", 8 * P + 1)  # the whole batch saves 8 P tokens: too few
    _, _, calls = logprobs_and_grads(model, ids, mask, C, share=True)
    assert calls == [tuple(ids.shape)]
    checkpoint_blocks(model)
    _, _, calls = logprobs_and_grads(model, ids, mask, C, share=True)
    assert calls == [tuple(ids.shape)]


@pytest.mark.numerics
@pytest.mark.parametrize("name", FAMILIES + LINEAR_ATTENTION)
def test_prefilling_each_prompt_once_decodes_the_same_tokens_and_records_the_same_experts(name, tiny_family):
    model, tokenizer = tiny_family(name)
    outputs = {}
    for share in (False, True):
        calls = []
        hook = decoder_of(model).register_forward_pre_hook(
            lambda module, args, kwargs: calls.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
        with record_routing(model) if name != "tiny_dense" else nullcontext() as trace:
            out = generate(model, tokenizer, PROMPTS, 8, greedy=True, return_logprobs=True, share_prompts=share)
        hook.remove()
        outputs[share] = out, trace, calls
    (full, full_trace, full_calls), (shared, shared_trace, shared_calls) = outputs[False], outputs[True]
    P = full.prompt_ids.shape[1]
    assert full_calls[0] == (12, P)
    assert shared_calls[:2] == [(4, P - 1), (12, 1)]  # 4 distinct prompts but their last token, then all 12 rows
    assert torch.equal(shared.completion_ids, full.completion_ids)
    completion = full.completion_mask.bool()
    ids = torch.cat([full.prompt_ids, full.completion_ids], 1)
    mask = torch.cat([full.prompt_mask, full.completion_mask], 1)
    assert_rounding_close(shared.logprobs[completion], full.logprobs[completion], scale=scale_of(model, ids, mask),
                          units=16)
    if full_trace is not None:  # every row's prompt experts too, though its prompt ran once
        assert torch.equal(shared_trace.indices, full_trace.indices)


@pytest.mark.parametrize("name", ["tiny_moe", "tiny_deepseek_v3", "tiny_llama4"])
def test_a_shared_forward_records_every_rows_experts(name, tiny_family):
    model, ids, mask, C, _ = rollout(name, tiny_family)
    traces = []
    for share in (False, True):
        with torch.no_grad(), record_routing(model) as trace:
            token_logprobs(model, ids, mask, C, share_prompts=share)
        traces.append(trace)
    assert traces[1].indices.shape == traces[0].indices.shape == (2, 12, ids.shape[1], traces[0].indices.shape[-1])
    assert torch.equal(traces[1].indices, traces[0].indices)  # r2 replays such a trace in unshared forwards


@pytest.mark.numerics
@pytest.mark.parametrize("name", ["tiny_moe", "tiny_deepseek_v3", "tiny_llama4"])
def test_a_shared_forward_under_replay_uses_every_rows_recorded_experts(name, tiny_family):
    model, ids, mask, C, _ = rollout(name, tiny_family)
    with torch.no_grad(), record_routing(model) as old:  # a shared forward: a prompt's rows record alike
        token_logprobs(model, ids, mask, C, share_prompts=True)
    with torch.no_grad():
        for _, router, _ in find_routers(model, "test"):
            router.weight.add_(torch.randn_like(router.weight))  # a large update: routing must change
    results = {}
    for share in (False, True):
        model.zero_grad()
        with replay_routing(model, old, mask) as stats, record_routing(model) as used:
            logp, _ = token_logprobs(model, ids, mask, C, share_prompts=share)
            logp.sum().backward()
        grads = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in model.parameters()]
        results[share] = logp.detach(), grads, used, stats
    (full, full_grads, _, _), (shared, shared_grads, used, stats) = results[False], results[True]
    assert torch.equal(used.indices, old.indices)  # every row's layers used the recorded experts
    assert stats.override_frac > 0.1
    completion = mask[:, -C:].bool()
    with replay_routing(model, old, mask):
        scale = scale_of(model, ids, mask)
    assert_rounding_close(shared[completion], full[completion], scale=scale, units=16)
    assert_same_gradients(full_grads, shared_grads)


def test_replay_allows_sharing_only_where_a_prompts_rows_agree():
    ids = torch.tensor([[5, 6, 1, 1], [5, 6, 2, 2], [7, 8, 3, 3]])  # rows 0 and 1 share a prompt of P = 2
    trace = RoutingTrace(torch.zeros(1, 3, 4, 2, dtype=torch.uint8), torch.ones(3, 4, dtype=torch.bool), 2)
    batch = RolloutBatch(ids, torch.ones_like(ids), torch.ones(3, 2), torch.zeros(3, 2), torch.zeros(3),
                         torch.zeros(3), torch.zeros(3, dtype=torch.bool), routing_trace=trace)
    module = SimpleNamespace(routing=SimpleNamespace(replays_in_training=True))
    assert PolicyForwards.replay_allows_sharing(module, batch)
    trace.indices[0, 1, 3] = 5  # a completion column may differ
    assert PolicyForwards.replay_allows_sharing(module, batch)
    trace.indices[0, 1, 0] = 5  # a prompt column may not: that prompt would replay row 0's experts for row 1
    assert not PolicyForwards.replay_allows_sharing(module, batch)
    assert PolicyForwards.replay_allows_sharing(SimpleNamespace(routing=SimpleNamespace(replays_in_training=False)), batch)
