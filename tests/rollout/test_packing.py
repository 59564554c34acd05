"""Padding-free forwards (train.padding_free; gspo_lab.rollout.packing): rows packed end to end, with attention kept
within each row, must give the padded forward's log-probs, entropies and gradients to float rounding on every
architecture that packs, per token and per sequence; record the same experts at every real token; replay a trace
(the router's own or another) to the same log-probs as a padded forward replaying it; and an architecture whose rows
would see each other (linear attention, gpt-oss's sliding window) must be found out and left padded."""

import pytest
import torch

from gspo_lab.decoder import decoder_of
from gspo_lab.rollout import token_logprobs
from gspo_lab.rollout.generation import position_ids
from gspo_lab.rollout.packing import first_fit_decreasing, pack, packs_exactly
from gspo_lab.routing import RoutingTrace, record_routing, replay_routing
from tests.numerics import assert_rounding_close, logit_scale

PACKING = ["tiny_moe", "tiny_dense", "tiny_mixtral", "tiny_olmoe", "tiny_qwen2_moe", "tiny_deepseek_v3",
           "tiny_glm4_moe", "tiny_ernie4_5_moe"]
NOT_PACKING = ["tiny_gpt_oss", "tiny_qwen3_next"]
# (left padding of the prompt, completion tokens) of 6 rows of a [6, 5 + 9] batch: real lengths 14, 7, 10, 4, 12
# and 3, which first-fit decreasing puts in 4 bins of 14: [0], [4], [2, 3], [1, 5]
SHAPES = [(0, 9), (3, 5), (1, 6), (4, 3), (2, 9), (4, 2)]
P, C = 5, 9


def batch(vocab: int):
    """A [6, P + C] batch: left-padded prompts, right-padded completions of SHAPES."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (len(SHAPES), P + C), generator=generator)
    mask = torch.zeros_like(ids)
    for row, (left, completion) in enumerate(SHAPES):
        mask[row, left : P + completion] = 1
    return ids, mask


def forward(model, ids, mask, packed: bool):
    """Log-probs, entropies and the gradient of the sum of the real tokens' log-probs, and the decoder's calls."""
    model.zero_grad()
    calls = []
    hook = decoder_of(model).register_forward_pre_hook(
        lambda module, args, kwargs: calls.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    logp, entropy = token_logprobs(model, ids, mask, C, packed=packed)
    hook.remove()
    (logp * mask[:, -C:]).sum().backward()
    grads = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in model.parameters()]
    return logp.detach(), entropy, grads, calls


def test_rows_pack_longest_first_into_bins_as_wide_as_the_longest_row():
    ids, mask = batch(50)
    packing = pack(ids, mask)
    lengths = mask.sum(1).tolist()
    assert lengths == [14, 7, 10, 4, 12, 3]
    # 14, 12, 10 and 7 open bins; 4 fits the third (room 4), 3 the fourth (room 7)
    assert first_fit_decreasing(lengths, 14) == [[0], [4], [2, 3], [1, 5]]
    assert packing.input_ids.shape == (4, 14)
    # every real token once, in its row's order, positions from 0 again
    assert torch.equal(packing.input_ids.flatten()[packing.flat], ids[mask.bool()])
    assert torch.equal(packing.position_ids.flatten()[packing.flat], position_ids(mask)[mask.bool()])
    assert len(set(packing.flat.tolist())) == int(mask.sum())
    back = packing.unpacked(packing.input_ids, fill=-1)
    assert torch.equal(back, torch.where(mask.bool(), ids, -1))


def test_a_batch_whose_bins_save_too_little_runs_padded(tiny_family):
    """The bins of SHAPES hold 4 x 14 of the batch's 6 x 14 tokens, a saving of a third: packed at a minimum saving
    of 0.3, padded at 0.4 (train.pack_min_saving), where the forward is the padded one."""
    model, _ = tiny_family("tiny_moe")
    ids, mask = batch(model.config.vocab_size)
    assert pack(ids, mask, 0.3) is not None and pack(ids, mask, 0.4) is None
    calls = []
    hook = decoder_of(model).register_forward_pre_hook(
        lambda module, args, kwargs: calls.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    with torch.no_grad():
        padded, _ = token_logprobs(model, ids, mask, C)
        unpacked, _ = token_logprobs(model, ids, mask, C, packed=True, pack_min_saving=0.4)
    hook.remove()
    assert calls == [(6, P + C), (6, P + C)]
    assert torch.equal(unpacked, padded)  # bitwise: the same padded forward on the same shapes


@pytest.mark.numerics
@pytest.mark.parametrize("name", PACKING)
def test_packed_forwards_give_the_padded_logprobs_entropies_and_gradients(name, tiny_family):
    model, _ = tiny_family(name)
    assert packs_exactly(model)
    ids, mask = batch(model.config.vocab_size)
    padded, padded_entropy, padded_grads, padded_calls = forward(model, ids, mask, packed=False)
    packed, packed_entropy, packed_grads, calls = forward(model, ids, mask, packed=True)
    assert padded_calls == [(6, P + C)]
    assert calls == [(4, P + C)]  # 6 rows in 4 bins
    real = mask[:, -C:].bool()
    with torch.no_grad():
        scale = logit_scale(model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask)).logits)
    assert_rounding_close(packed[real], padded[real], scale=scale, units=16)  # per token
    assert_rounding_close((packed * real).sum(1), (padded * real).sum(1), scale=scale, units=16 * C)  # per sequence
    assert_rounding_close(packed_entropy[real], padded_entropy[real], scale=scale, units=16)
    assert torch.equal(packed[~real], torch.zeros_like(packed[~real]))  # 0 where the batch pads
    for a, b in zip(padded_grads, packed_grads, strict=True):
        assert_rounding_close(b, a, scale=a.abs().max(), units=256)
    assert max(g.abs().max() for g in packed_grads) > 0


@pytest.mark.parametrize("name", NOT_PACKING)
def test_an_architecture_whose_rows_would_see_each_other_is_found_out(name, tiny_family, caplog):
    model, _ = tiny_family(name)
    assert not packs_exactly(model)
    assert "does not keep packed rows apart" in caplog.text and model.config.model_type in caplog.text


@pytest.mark.numerics
@pytest.mark.parametrize("name", ["tiny_moe", "tiny_deepseek_v3"])
def test_packed_forwards_record_and_replay_the_padded_forwards_experts(name, tiny_family):
    """Recorded in a packed forward, the experts of every real token are the padded forward's (padding: expert 0).
    Replayed, a trace of other experts than the routers' own (each token's choice shifted by one expert) gives the
    log-probs a padded forward replaying it gives, and the override counts match: the bins read the right rows."""
    model, _ = tiny_family(name)
    ids, mask = batch(model.config.vocab_size)
    real = mask.bool()
    traces = {}
    with torch.no_grad():
        for packed in (False, True):
            with record_routing(model) as trace:
                token_logprobs(model, ids, mask, C, packed=packed)
            traces[packed] = trace
    assert traces[True].indices.shape == traces[False].indices.shape
    assert torch.equal(traces[True].indices[:, real], traces[False].indices[:, real])
    experts = model.config.num_experts if hasattr(model.config, "num_experts") else model.config.n_routed_experts
    other = RoutingTrace((traces[False].indices.long() + 1) % experts, traces[False].recorded.clone())
    other.indices = other.indices.to(traces[False].indices.dtype)
    results = {}
    with torch.no_grad():
        for packed in (False, True):
            with replay_routing(model, other, valid=mask) as stats:
                logp, _ = token_logprobs(model, ids, mask, C, packed=packed)
            results[packed] = logp, stats.override_frac
        own, _ = token_logprobs(model, ids, mask, C, packed=True)
    completion = mask[:, -C:].bool()
    assert results[True][1] == results[False][1] > 0.5
    assert (results[True][0] - own)[completion].abs().max() > 1e-3  # the replayed experts change the log-probs
    assert_rounding_close(results[True][0][completion], results[False][0][completion], scale=20.0, units=16)
