"""Generation tensors, log-probs (chunked, temperature, gradients) and the prompt schedule."""

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gspo_lab.decoder import CACHE
from gspo_lab.models import TinyModel
from gspo_lab.rollout import PromptSchedule, generate, token_logprobs
from gspo_lab.rollout import sampling
from gspo_lab.rollout.generation import StepLogprobs, position_ids
from gspo_lab.rollout.sampling import RowSampler, inverse_cdf
from gspo_lab.tasks import Arithmetic
from tests.numerics import assert_rounding_close, logit_scale

SMALL = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
         "head_dim": 16, "intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2,
         "moe_intermediate_size": 16}


@pytest.fixture(scope="module")
def policy():
    torch.manual_seed(0)
    return TinyModel(arch="qwen3_moe", config=SMALL).load()


def full_logsoftmax(model, ids, mask, C, temperature):
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -C - 1 : -1] / temperature
    return logits.log_softmax(-1).gather(-1, ids[:, -C:, None]).squeeze(-1)


def test_completions_are_cut_at_eos_and_masked(policy):
    model, tok = policy
    torch.manual_seed(3)
    out = generate(model, tok, ["1+2="] * 16, max_new_tokens=12)
    for ids, mask, truncated in zip(out.completion_ids, out.completion_mask, out.truncated):
        eos = (ids == tok.eos_token_id).nonzero()
        if truncated:
            assert len(eos) == 0 and mask.all()
        else:
            first = eos[0].item()
            assert mask[: first + 1].all() and not mask[first + 1 :].any()  # EOS itself is in the loss
            assert (ids[first + 1 :] == tok.pad_token_id).all()
    fixed = generate(model, tok, ["1+2="] * 4, max_new_tokens=5, suppress_eos=True)
    assert fixed.completion_ids.shape[1] == 5 and fixed.truncated.all()


@pytest.mark.numerics
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_equal_a_full_log_softmax_with_gradients(policy, temperature):
    model, tok = policy
    out = generate(model, tok, ["12+3=", "1=", "999+1=", "4+4=", "5+5="], 6, temperature=temperature)
    ids = torch.cat([out.prompt_ids, out.completion_ids], 1)
    mask = torch.cat([out.prompt_mask, out.completion_mask], 1)
    C = out.completion_ids.shape[1]
    model.zero_grad()
    chunked, entropy = token_logprobs(model, ids, mask, C, temperature, chunk_rows=2)
    (chunked * out.completion_mask).sum().backward()
    chunked_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    reference = full_logsoftmax(model, ids, mask, C, temperature)
    (reference * out.completion_mask).sum().backward()
    logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask)).logits[:, -C - 1 : -1]
    # the same log_softmax per row, but 2-row chunks and the 5-row batch take other GEMM blockings: equal to
    # rounding of the logits (1 rounding measured across CPU kernels and thread counts)
    assert_rounding_close(chunked, reference, scale=logit_scale(logits, temperature), units=16)
    for a, p in zip(chunked_grads, model.parameters()):
        # gradients: sums over all 5 x C tokens of rounding-sized differences, relative to the gradient's size
        assert_rounding_close(a, p.grad, scale=p.grad.abs().max(), units=256)
    assert (entropy >= 0).all() and not entropy.requires_grad
    # entropy from the full distribution: -sum_v p log p, rounding relative to the logits as the log-probs
    full = (logits.float() / temperature).log_softmax(-1)
    assert_rounding_close(entropy, -(full.exp() * full).sum(-1).detach(), scale=logit_scale(logits, temperature),
                          units=16)


@pytest.mark.numerics
@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_logprobs_from_generation_match_the_forward(policy, top_p):
    """Both are the un-truncated log softmax(logits / T), also when top_p filters what is sampled."""
    model, tok = policy
    torch.manual_seed(4)
    out = generate(model, tok, ["12+3=", "1=", "999+1="], 6, temperature=0.8, top_p=top_p, return_logprobs=True)
    ids = torch.cat([out.prompt_ids, out.completion_ids], 1)
    mask = torch.cat([out.prompt_mask, out.completion_mask], 1)
    with torch.no_grad():
        forward, _ = token_logprobs(model, ids, mask, out.completion_ids.shape[1], 0.8)
    valid = out.completion_mask.bool()
    ids_mask = {"input_ids": ids, "attention_mask": mask, "position_ids": position_ids(mask)}
    with torch.no_grad():
        scale = logit_scale(model(**ids_mask).logits, 0.8)
    # decoding over a cache and one forward over the whole rows: other shapes, equal to rounding of the logits
    assert_rounding_close(out.logprobs[valid], forward[valid], scale=scale, units=16)


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.8)])
def test_the_row_sampler_draws_from_the_tempered_nucleus(temperature, top_p):
    """20,000 rows of the same logits, each with its own seed: every token's frequency within 4.5 standard errors
    of softmax(logits / T) renormalised over the top_p nucleus, and no token outside it ever drawn."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    rows = 20_000
    sampler = RowSampler(torch.arange(rows), steps=1, temperature=temperature, top_p=top_p)
    scores = sampler(torch.zeros(rows, 1, dtype=torch.long), logits.expand(rows, -1).clone())  # [rows, V]
    assert (torch.isfinite(scores).sum(-1) == 1).all()  # one token left per row, for generate's greedy choice
    counts = torch.bincount(scores.argmax(-1), minlength=len(logits)).double()
    probs = (logits.double() / temperature).softmax(-1)
    # the nucleus: the fewest most likely tokens whose mass reaches top_p (transformers' TopPLogitsWarper)
    kept = probs.cumsum(-1) - probs < top_p
    expected = torch.where(kept, probs, 0.0) / probs[kept].sum()
    assert (counts[~kept] == 0).all()
    error = (expected * (1 - expected) / rows).sqrt()
    assert ((counts / rows - expected).abs() <= 4.5 * error).all(), (counts / rows, expected)


def one_level_inverse_cdf(probs, u):
    """The plain inverse CDF the two-level search stands for: the first float64 cumulative sum past u · total,
    never past the last token with probability."""
    cdf = probs.double().cumsum(-1)
    drawn = torch.searchsorted(cdf, u[:, None] * cdf[:, -1:], right=True)
    return torch.minimum(drawn, torch.searchsorted(cdf, cdf[:, -1:].contiguous())).squeeze(-1)


@pytest.mark.parametrize("vocab", [1, 99, 1024])
def test_a_vocabulary_within_one_block_draws_what_the_two_level_search_draws(vocab):
    """inverse_cdf's one-block path (the anchor's 99-token vocabulary) against the two-level search run with one
    block: the same tokens bit for bit, for exact zeros, u at 0, 1 - 2^-53 and at the cumulative sums themselves."""
    generator = torch.Generator().manual_seed(vocab)
    probs = torch.rand(64, vocab, generator=generator) * (torch.rand(64, vocab, generator=generator) > 0.3)
    probs[:, 0] += 1e-3  # every row has mass; some end in zeros
    probs = probs / probs.sum(-1, keepdim=True)
    cdf = probs.double().cumsum(-1)
    columns = [torch.rand(64, dtype=torch.float64, generator=generator) for _ in range(50)]
    columns += [torch.zeros(64, dtype=torch.float64), torch.full((64,), 1 - 2**-53, dtype=torch.float64),
                cdf[:, vocab // 2] / cdf[:, -1]]
    for u in columns:
        assert torch.equal(inverse_cdf(probs, u), sampling._two_levels(probs, u, vocab)[0])
    with pytest.raises(ValueError, match=r"rows \[1\] have no finite positive probability mass"):
        inverse_cdf(torch.stack([probs[0], torch.zeros(vocab)]), torch.zeros(2))


@pytest.mark.parametrize("block", [7, 1024, 4096])
def test_the_two_level_inverse_cdf_is_the_plain_one(block):
    """3,000 tokens (not a multiple of 7 or 1,024; fewer than 4,096), exact zeros everywhere, a row whose mass sits
    only in the last, shorter block, a one-token row; u at 0, at 1 - 2^-53 and at block boundaries: the plain
    inverse CDF's token, or where float32 block sums round a boundary the other way a neighbour, never a token
    without probability."""
    generator = torch.Generator().manual_seed(0)
    vocab, rows = 3000, 6
    probs = torch.rand(rows, vocab, generator=generator) * (torch.rand(rows, vocab, generator=generator) > 0.5)
    probs[1] = 0.0
    probs[1, -3:] = torch.tensor([0.2, 0.0, 0.5])  # mass only in the last (partial) block
    probs[2] = 0.0
    probs[2, 1500] = 1.0  # one token
    probs = probs / probs.sum(-1, keepdim=True)
    cdf = probs.double().cumsum(-1)
    boundaries = [cdf[0, min(block, vocab) - 1].item(), cdf[0, 2 * block - 1].item() if 2 * block <= vocab else 0.5]
    for u_value in [0.0, 1 - 2**-53, *boundaries, 0.25, 0.999]:
        u = torch.full((rows,), u_value, dtype=torch.float64)
        drawn = inverse_cdf(probs, u, block=block)
        assert (probs.gather(1, drawn[:, None]) > 0).all(), u_value
        assert ((drawn - one_level_inverse_cdf(probs, u)).abs() <= 1).all(), u_value
    u = torch.rand(rows, 500, dtype=torch.float64, generator=generator)
    for column in u.T:  # random u: the plain token itself all but (at most) a few times in 3,000
        assert (probs.gather(1, inverse_cdf(probs, column, block=block)[:, None]) > 0).all()
    exact = sum(int((inverse_cdf(probs, c, block=block) == one_level_inverse_cdf(probs, c)).sum()) for c in u.T)
    assert exact >= 3000 - 3
    with pytest.raises(ValueError, match=r"rows \[0\] have no finite positive probability mass"):
        inverse_cdf(torch.full((1, vocab), float("nan")), torch.zeros(1), block=block)


@pytest.mark.numerics
def test_a_rows_sample_does_not_depend_on_the_rows_beside_it(policy):
    """The same row seeds give each row the same tokens whether the 6 prompts (of different lengths, so other
    left padding) are decoded together, two calls of 3, or one by one; the log-probs to rounding of the logits."""
    model, tok = policy
    prompts = ["12+3=", "1=", "999+1=", "12+3=", "4+4=", "77+8="]
    seeds = torch.tensor([11, 12, 13, 14, 15, 16])

    def decoded(size):
        parts = [generate(model, tok, prompts[i : i + size], 10, temperature=0.9, return_logprobs=True,
                          row_seeds=seeds[i : i + size]) for i in range(0, len(prompts), size)]
        rows = [(ids[mask.bool()], logp[mask.bool()]) for part in parts
                for ids, mask, logp in zip(part.completion_ids, part.completion_mask, part.logprobs)]
        return rows, [text for part in parts for text in part.texts]

    whole, texts = decoded(6)
    assert len(set(texts)) > 2  # rows do differ (4 distinct prompts, 6 seeds)
    for size in (3, 1):
        rows, other_texts = decoded(size)
        assert other_texts == texts
        for (ids, logp), (whole_ids, whole_logp) in zip(rows, whole):
            assert torch.equal(ids, whole_ids)
            assert_rounding_close(logp, whole_logp, scale=logp.abs().max() + 1, units=64)
    reseeded = generate(model, tok, prompts, 10, temperature=0.9, row_seeds=seeds + 100)
    assert reseeded.texts != texts  # the seeds, not the prompts alone, decide


def test_step_logprobs_keep_the_returned_tokens_and_drop_later_decode_steps(policy):
    """Decoding by hand as generate does: a prompt call, then each sampled token fed back. generate never feeds
    back its last token; under FSDP's synced_gpus a finished rank feeds its last token again, which must not
    count."""
    model, tok = policy
    prompt = tok(["12+3="], return_tensors="pt")["input_ids"]  # [1, P]
    tokens = torch.tensor([[7, 9, 4]])  # what was "sampled": their log-probs are what we ask for

    def decode(fed: list[int]) -> tuple[StepLogprobs, list[torch.Tensor]]:
        recorder, logits = StepLogprobs(temperature=0.5), []
        with torch.no_grad(), recorder.hooked(model):
            out = model(input_ids=prompt, use_cache=True)
            logits.append(out.logits[:, -1])
            for t in fed:
                out = model(input_ids=tokens[:, t : t + 1], use_cache=True, **{CACHE: getattr(out, CACHE)})
                logits.append(out.logits[:, -1])
        return recorder, logits

    recorder, logits = decode([0, 1])  # as generate: tokens 0 and 1 fed back, token 2 never
    expected = torch.stack([(logits[t] / 0.5).log_softmax(-1)[0, tokens[0, t]] for t in range(3)])
    assert torch.equal(recorder.of(tokens)[0], expected)  # bitwise: the hook sees these very logits
    synced, _ = decode([0, 1, 2, 2, 2])  # token 2 fed back, then twice more by a finished rank
    assert torch.equal(synced.of(tokens)[0], expected)


class ReusedGraphOutputs:
    """A torch.compile backend that treats what compiled code returns as CUDA graph trees do on a GPU
    (torch._inductor.cudagraph_trees): each call of the compiled function starts a new generation, whose replays
    reuse the memory of the last generation's outputs. Here they are overwritten with NaN (floating outputs that
    are not the graph's own inputs: parameters and caches stay), so what outlives its step shows."""

    def __init__(self) -> None:
        self.outputs: list[torch.Tensor] = []
        self.graphs = 0

    def compile(self, function):
        compiled = torch.compile(function, backend=self.backend)

        def call(*args, **kwargs):
            for output in self.outputs:
                output.fill_(math.nan)
            self.outputs = []
            return compiled(*args, **kwargs)
        return call

    def backend(self, graph, example_inputs):
        self.graphs += 1

        def run(*args):
            inputs = {arg.untyped_storage().data_ptr() for arg in args if isinstance(arg, torch.Tensor)}
            outputs = graph(*args)
            self.outputs += [out for out in outputs if isinstance(out, torch.Tensor) and out.is_floating_point()
                             and out.untyped_storage().data_ptr() not in inputs]
            return outputs
        return run


def test_step_logprobs_keep_nothing_that_cuda_graphs_overwrite():
    """generate(cache_implementation="static") compiles each decode step on a GPU (CUDA graphs: each step's
    outputs are overwritten by the next one's). The hooks run outside the compiled code, so the log-probs they
    keep are their own tensors: those of the uncompiled run, not NaN."""
    torch.manual_seed(0)
    model, tok = TinyModel(arch="qwen3", config={**SMALL, "intermediate_size": 64}).load()
    prompts, seeds = ["12+3=", "1=", "999+1="], torch.arange(3)
    eager = generate(model, tok, prompts, 6, return_logprobs=True, row_seeds=seeds, cache_implementation="static")
    graphs = ReusedGraphOutputs()
    model._valid_auto_compile_criteria = lambda *args: True  # generate's own test: a GPU and a static cache
    model.get_compiled_call = lambda compile_config: graphs.compile(model.__call__)
    compiled = generate(model, tok, prompts, 6, return_logprobs=True, row_seeds=seeds, cache_implementation="static")
    assert graphs.graphs and graphs.outputs  # the decode steps ran compiled, and their outputs were handed on
    assert torch.equal(compiled.completion_ids, eager.completion_ids)
    # the graph's ops may round differently from the eager ones (|log p| <= ~5, float32); NaN fails
    torch.testing.assert_close(compiled.logprobs, eager.logprobs, rtol=0, atol=1e-5)


def test_a_saved_generation_config_changes_no_sample():
    """generate fills every setting it is not given from the model's generation_config; a checkpoint's
    repetition_penalty, min_p, top_k and no_repeat_ngram_size must not reach sampling or greedy decoding."""
    prompts = ["12+3=", "1=", "999+1=", "4+4="]
    decoded = []
    for saved in ({}, {"repetition_penalty": 5.0, "min_p": 0.5, "top_k": 5, "no_repeat_ngram_size": 1}):
        torch.manual_seed(0)
        model, tok = TinyModel(arch="qwen3_moe", config=SMALL).load()
        model.generation_config.update(**saved)
        torch.manual_seed(5)
        sampled = generate(model, tok, prompts, 8, temperature=0.9, return_logprobs=True)
        greedy = generate(model, tok, prompts, 8, greedy=True)
        decoded.append((sampled.completion_ids, sampled.logprobs, greedy.completion_ids))
    plain, configured = decoded
    assert all(torch.equal(a, b) for a, b in zip(plain, configured))  # bitwise: the same calls, settings ignored


def test_prompt_schedule_shards_whole_prompts_by_rank():
    schedule = PromptSchedule(Arithmetic(), prompts_per_step=8, seed=5)
    step = schedule.for_step(3)
    shards = [schedule.for_step(3, rank, 2) for rank in (0, 1)]
    assert shards[0] + shards[1] == step and not set(e.prompt for e in shards[0]) & set(e.prompt for e in shards[1])
    assert schedule.for_step(3) == step and schedule.for_step(4) != step


class HostWaits(TorchDispatchMode):
    """Counts the operations that make the host wait for the device (a tensor read as a Python bool or number)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.is_nonzero.default, torch.ops.aten._local_scalar_dense.default):
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("vocab", [99, 3000])  # one block, and the two-level search
def test_the_row_sampler_never_waits_for_the_device_and_names_a_row_without_mass_after_generate(vocab):
    """A decode step of generate already waits for the device (its stopping check); the sampler adds no wait of
    its own per step: a row without probability mass is named once, by check() after generate."""
    sampler = RowSampler(torch.arange(3), steps=4, temperature=1.0, top_p=1.0)
    scores = torch.randn(3, vocab)
    scores[1] = float("nan")
    with HostWaits() as waits:
        for _ in range(4):
            tokens = sampler(None, scores.clone()).argmax(-1)
    assert waits.count == 0
    assert ((tokens >= 0) & (tokens < vocab)).all()  # a row without mass still gets a token of the vocabulary
    with pytest.raises(ValueError, match=r"sampling: rows \[1\] have no finite positive probability mass"):
        sampler.check()
    healthy = RowSampler(torch.arange(3), steps=4, temperature=1.0, top_p=1.0)
    healthy(None, torch.randn(3, vocab))
    healthy.check()
