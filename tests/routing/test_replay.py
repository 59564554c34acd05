"""Routing record/replay on every supported architecture: exact replay, replay after weight changes,
router gradients, generate-vs-forward alignment, gradient checkpointing, left padding, and the errors; and
traces from an external engine (vLLM/SGLang `routed_experts`): exact column placement, a round trip through
the engine's layout that replays bit for bit on the completion tokens, errors that name the row and the rule."""


import numpy as np
import pytest
import torch

from gspo_lab.models import TinyModel
from gspo_lab.rollout import generate, token_logprobs
from gspo_lab.rollout.generation import position_ids
from gspo_lab.rollout.engine import noisy_routers
from gspo_lab.routing import RoutingReplay, changed_fraction, record_routing, replay_routing, trace_from_routed_experts
from gspo_lab.routing.adapters import find_routers
from tests.numerics import assert_rounding_close, logit_scale

# every family with a routing adapter, each a tiny config of transformers' own classes (conf/model/tiny_*.yaml)
MOE_MODELS = ["tiny_moe", "tiny_mixtral", "tiny_olmoe", "tiny_qwen2_moe", "tiny_deepseek_v3", "tiny_gpt_oss",
              "tiny_glm4_moe", "tiny_qwen3_next", "tiny_qwen3_5_moe", "tiny_llama4", "tiny_minimax_m2",
              "tiny_ernie4_5_moe", "tiny_dots1", "tiny_solar_open", "tiny_exaone_moe"]
PROMPTS = ["123+456=", "1+2=", "77+8=", "500+500="]  # different lengths: left padding


def rollout(model, tokenizer, n_new=6):
    torch.manual_seed(1)
    with record_routing(model) as generation_trace:
        out = generate(model, tokenizer, PROMPTS, n_new)
    ids = torch.cat([out.prompt_ids, out.completion_ids], 1)
    mask = torch.cat([out.prompt_mask, out.completion_mask], 1)
    return ids, mask, out.completion_ids.shape[1], generation_trace


def record(model, ids, mask, completion_len):
    """The experts of one no-grad forward over the batch."""
    with torch.no_grad(), record_routing(model) as trace:
        token_logprobs(model, ids, mask, completion_len)
    return trace


def top_k(model) -> int:
    return find_routers(model, "test")[0][1].top_k


def perturb_routers(model):
    """A large random update to every router's weight."""
    with torch.no_grad():
        for _, router, _ in find_routers(model, "test"):
            router.weight.add_(torch.randn_like(router.weight))


@pytest.mark.numerics
@pytest.mark.parametrize("name", MOE_MODELS)
def test_replay_with_unchanged_weights_is_exact(name, tiny_family):
    model, tok = tiny_family(name)
    ids, mask, C, _ = rollout(model, tok)
    with torch.no_grad(), record_routing(model) as trace:
        natural, _ = token_logprobs(model, ids, mask, C)
    assert trace.indices.dtype == torch.uint8 and trace.indices.shape == (2, 4, ids.shape[1], top_k(model))
    with torch.no_grad(), replay_routing(model, trace) as stats, record_routing(model) as replayed:
        replayed_logp, _ = token_logprobs(model, ids, mask, C)
    assert torch.equal(replayed_logp, natural)  # bitwise: the same experts, operations and shapes in one process
    assert torch.equal(replayed.indices, trace.indices)
    assert stats.override_frac == 0 and stats.replayed > 0


@pytest.mark.parametrize("name", MOE_MODELS)
def test_after_a_weight_change_replay_keeps_the_recorded_experts(name, tiny_family):
    model, tok = tiny_family(name)
    ids, mask, C, _ = rollout(model, tok)
    old = record(model, ids, mask, C)
    perturb_routers(model)  # a large update: routing must change
    natural = record(model, ids, mask, C)
    assert changed_fraction(old, natural, mask)["routing/changed_frac"] > 0.1
    # under replay the experts the layers actually use are the recorded ones (seen by an inner recorder)
    with torch.no_grad(), replay_routing(model, old, mask) as stats, record_routing(model) as used:
        token_logprobs(model, ids, mask, C)
    assert torch.equal(used.indices, old.indices)
    assert stats.override_frac > 0.1


@pytest.mark.parametrize("name", MOE_MODELS)
def test_router_gets_gradient_under_replay(name, tiny_family):
    model, tok = tiny_family(name)
    ids, mask, C, _ = rollout(model, tok)
    trace = record(model, ids, mask, C)
    with replay_routing(model, trace):
        logp, _ = token_logprobs(model, ids, mask, C)
        logp.sum().backward()
    for _, router, _ in find_routers(model, "test"):
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("name", MOE_MODELS)
def test_generation_trace_lines_up_with_a_full_forward(name, tiny_family):
    model, tok = tiny_family(name)
    ids, mask, C, generation_trace = rollout(model, tok)
    # generate never feeds back its last token: the trace covers all but the last column
    assert generation_trace.indices.shape[2] == ids.shape[1] - 1
    generation_trace = generation_trace.extend_to(ids.shape[1])
    full = record(model, ids, mask, C)
    valid = mask.bool() & generation_trace.recorded
    same = (generation_trace.indices.sort(-1).values == full.indices.sort(-1).values).all(-1)[:, valid]
    assert same.float().mean() >= 0.99  # KV-cache and full-forward numerics may flip a rare near-tie


@pytest.mark.parametrize("name", MOE_MODELS)
def test_the_engines_router_noise_moves_experts_through_each_adapter(name, tiny_family):
    """rollout.engine.router_noise on every family: the noisy top-k (seen by a recorder inside) differs from the
    natural choice, and the forward stays finite with the gate weights that family computes for it."""
    model, tok = tiny_family(name)
    ids, mask, C, _ = rollout(model, tok)
    natural = record(model, ids, mask, C)
    torch.manual_seed(2)
    with torch.no_grad(), noisy_routers(model, 0.5), record_routing(model) as noisy:
        logp, _ = token_logprobs(model, ids, mask, C)
    assert changed_fraction(natural, noisy, mask)["routing/changed_frac"] > 0.05
    assert torch.isfinite(logp).all()


@pytest.mark.parametrize("name", MOE_MODELS)
def test_gradient_checkpointing_recomputes_with_the_replayed_experts(name, tiny_family):
    grads = {}
    for checkpointing in (False, True):
        model, tok = tiny_family(name, gradient_checkpointing=checkpointing)
        ids, mask, C, _ = rollout(model, tok)
        trace = record(model, ids, mask, C)
        perturb_routers(model)  # replay now overrides many choices
        model.train()
        with replay_routing(model, trace):
            logp, _ = token_logprobs(model, ids, mask, C)
            logp.sum().backward()  # inside the context: the recomputed forward replays too
        grads[checkpointing] = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    assert torch.allclose(grads[True], grads[False], atol=1e-5, rtol=1e-4)
    # backward outside the context recomputes with natural routing; torch's checkpoint refuses the mismatch
    with replay_routing(model, trace):
        logp, _ = token_logprobs(model, ids, mask, C)
    with pytest.raises(torch.utils.checkpoint.CheckpointError):
        logp.sum().backward()


@pytest.mark.parametrize("name", MOE_MODELS)
def test_left_padding_does_not_change_a_rows_routing(name, tiny_family):
    model, tok = tiny_family(name)
    alone = tok(["1+2="], return_tensors="pt")
    padded = tok(["1+2=", "123456+654321="], return_tensors="pt", padding=True)
    with torch.no_grad(), record_routing(model) as a:
        token_logprobs(model, alone["input_ids"], alone["attention_mask"], 1)
    with torch.no_grad(), record_routing(model) as b:
        token_logprobs(model, padded["input_ids"], padded["attention_mask"], 1)
    width = alone["input_ids"].shape[1]
    assert torch.equal(a.indices[:, 0], b.indices[:, 0, -width:])


@pytest.mark.numerics
@pytest.mark.parametrize("name", MOE_MODELS)
def test_trace_slices_by_rows_for_minibatches(name, tiny_family):
    model, tok = tiny_family(name)
    ids, mask, C, _ = rollout(model, tok)
    with torch.no_grad(), record_routing(model) as trace:
        full, _ = token_logprobs(model, ids, mask, C)
    rows = torch.tensor([3, 1])
    with torch.no_grad(), replay_routing(model, trace.rows(rows)):
        part, _ = token_logprobs(model, ids[rows], mask[rows], C)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask)).logits
    # a 2-row and a 4-row batch take other GEMM blockings: equal to rounding of the logits
    assert_rounding_close(part, full[rows], scale=logit_scale(logits), units=16)
    assert trace.bytes_per_token() == 2 * top_k(model) + 1  # 2 layers x top-k uint8, plus the recorded flag


def test_errors_name_the_model_class(tiny_family):
    dense, _ = TinyModel(arch="qwen3", config={"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                                              "num_key_value_heads": 1, "head_dim": 16, "intermediate_size": 32}).load()
    with pytest.raises(ValueError, match="Qwen3ForCausalLM is a dense model"):
        RoutingReplay(dense, "r2")
    assert RoutingReplay(dense, "off").diagnostics(None) == {}
    unknown, _ = TinyModel(arch="phimoe", config={"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                                                 "num_key_value_heads": 1, "intermediate_size": 32,
                                                 "num_local_experts": 4, "num_experts_per_tok": 2}).load()
    with pytest.raises(ValueError, match="PhimoeForCausalLM is a mixture-of-experts architecture without a routing adapter"):
        RoutingReplay(unknown, "r3")
    model, tok = tiny_family("tiny_moe")
    ids, mask, C, _ = rollout(model, tok)
    trace = record(model, ids, mask, C)
    with pytest.raises(ValueError, match="replay needs the same batch rows and columns"), replay_routing(model, trace):
        token_logprobs(model, ids[:2], mask[:2], C)
    with pytest.raises(ValueError, match="nothing was recorded"), record_routing(model):
        pass


# ---- traces from an external inference engine -------------------------------------------------------------

def test_each_token_lands_in_its_padded_column():
    # row 0: 2 prompt tokens + 2 completion tokens -> 3 entries; row 1: 3 + 3 -> 5 entries. P = 3, L = 6.
    # row 0's prompt sits in columns 1-2 (one column of left padding), its first completion token in column 3.
    row0 = np.array([10, 11, 12], dtype=np.int32).reshape(3, 1, 1)  # [tokens, layers, k]
    row1 = np.array([20, 21, 22, 23, 24], dtype=np.int32).reshape(5, 1, 1)
    trace = trace_from_routed_experts([row0, row1], prompt_lens=[2, 3], prompt_len=3, length=6, num_experts=32)
    assert trace.prompt_len == 3 and trace.indices.shape == (1, 2, 6, 1) and trace.indices.dtype == torch.uint8
    assert trace.indices[0, :, :, 0].tolist() == [[0, 10, 11, 12, 0, 0], [20, 21, 22, 23, 24, 0]]
    assert trace.recorded.tolist() == [[False, True, True, True, False, False], [True, True, True, True, True, False]]


def engine_layout(trace, mask):
    """What vLLM would return for each row: its real tokens but the last, as [tokens, layers, k] int32."""
    rows = []
    for i in range(mask.shape[0]):
        columns = mask[i].nonzero().squeeze(-1)[:-1]
        rows.append(trace.indices[:, i, columns].permute(1, 0, 2).numpy().astype(np.int32))
    return rows


def test_a_trace_in_the_engine_layout_replays_exactly_like_the_recorded_one(tiny_family):
    model, tok = tiny_family("tiny_moe")
    torch.manual_seed(1)
    with record_routing(model) as recorded:
        out = generate(model, tok, PROMPTS, 6)
    ids = torch.cat([out.prompt_ids, out.completion_ids], 1)
    mask = torch.cat([out.prompt_mask, out.completion_mask], 1)
    P, C = out.prompt_ids.shape[1], out.completion_ids.shape[1]
    recorded = recorded.extend_to(ids.shape[1])
    loaded = trace_from_routed_experts(engine_layout(recorded, mask), out.prompt_mask.sum(1).tolist(), P,
                                       ids.shape[1], num_experts=model.config.num_experts)
    both = loaded.recorded
    assert torch.equal(loaded.indices[:, both], recorded.indices[:, both])
    assert (both == (mask.bool() & recorded.recorded)).sum() > 0
    perturb_routers(model)  # the live routers now disagree: only replay keeps the engine's experts
    completion = out.completion_mask.bool()
    with torch.no_grad(), replay_routing(model, recorded):
        expected, _ = token_logprobs(model, ids, mask, C)
    with torch.no_grad(), replay_routing(model, loaded) as stats:
        actual, _ = token_logprobs(model, ids, mask, C)
    assert torch.equal(actual[completion], expected[completion])
    assert stats.override_frac > 0.1


def test_bad_engine_traces_name_the_row_and_the_rule():
    good = np.zeros((3, 2, 2), dtype=np.int32)
    with pytest.raises(ValueError, match="2 rows but prompt_lens has 1"):
        trace_from_routed_experts([good, good], [2], 3, 6, 8)
    with pytest.raises(ValueError, match="same layers and top_k"):
        trace_from_routed_experts([good, np.zeros((3, 1, 2), dtype=np.int32)], [2, 2], 3, 6, 8)
    with pytest.raises(ValueError, match="row 0: 3 entries with prompt_lens\\[0\\]=4 mean a 4-token prompt"):
        trace_from_routed_experts([good], [4], 3, 6, 8)
    with pytest.raises(ValueError, match="row 0: expert ids must lie in \\[0, 8\\); got 0..9"):
        trace_from_routed_experts([np.concatenate([good, np.full((1, 2, 2), 9, dtype=np.int32)])], [2], 3, 6, 8)
