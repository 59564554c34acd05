"""Behaviour every objective shares: on-policy inputs, padding, empty rows, dtypes, errors, KL, clamp,
and a property test against a per-sequence reference written straight from the paper's equations."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gspo_lab.objectives import GRPO, GSPO, GSPOToken, NonFiniteLossError

ALL = [GSPO(0.2, 0.25), GSPOToken(0.2, 0.25), GRPO(0.2, 0.27), GSPO(0.2, 0.25, length_norm=False),
       GRPO(0.2, 0.27, length_norm=False, max_len=8)]
IDS = ["gspo", "gspo_token", "grpo", "gspo_raw", "dr_grpo"]


@pytest.mark.parametrize("obj", ALL, ids=IDS)
def test_on_policy_ratio_is_one_and_nothing_clips(obj, random_batch):
    _, old, adv, mask = random_batch()
    out = obj(old, old, adv, mask)
    m = out.metrics
    assert all(m[f"ratio/{level}/{stat}"] == 1 for level in ("seq", "token") for stat in ("mean", "min", "max"))
    assert m["clip/frac"] == 0 and m["clip/seq_frac"] == 0 and m["kl/old"] == 0


@pytest.mark.parametrize("obj", ALL, ids=IDS)
def test_extra_padded_columns_change_nothing(obj, random_batch):
    logp, old, adv, mask = random_batch()
    logp = logp.clone().requires_grad_(True)
    out = obj(logp, old, adv, mask)
    out.loss.backward()
    garbage = torch.full((5, 4), float("nan"), dtype=torch.float64)  # padding may hold anything
    wide_logp = torch.cat([logp.detach(), garbage], 1).requires_grad_(True)
    wide = obj(wide_logp, torch.cat([old, garbage], 1), adv, torch.cat([mask, torch.zeros(5, 4).long()], 1))
    wide.loss.backward()
    assert wide.loss.item() == pytest.approx(out.loss.item(), abs=1e-12)
    assert torch.allclose(wide_logp.grad[:, :7], logp.grad, atol=1e-12)
    assert (wide_logp.grad[:, 7:] == 0).all()
    for key, value in out.metrics.items():
        assert wide.metrics[key].item() == pytest.approx(value.item(), abs=1e-12), key


@pytest.mark.parametrize("obj", ALL, ids=IDS)
def test_empty_rows_are_left_out_and_counted(obj, random_batch):
    logp, old, adv, mask = random_batch()
    without = obj(logp[1:], old[1:], adv[1:], mask[1:])
    mask = mask.clone()
    mask[0] = 0
    with_empty = obj(logp, old, adv, mask)
    assert with_empty.loss.item() == pytest.approx(without.loss.item(), abs=1e-12)
    assert with_empty.metrics["mask/empty_rows"] == 1 and without.metrics["mask/empty_rows"] == 0
    all_empty = obj(logp, old, adv, torch.zeros_like(mask))
    assert all_empty.loss.item() == 0 and all_empty.metrics["clip/frac"] == 0


@pytest.mark.parametrize("obj", ALL, ids=IDS)
def test_low_precision_inputs_are_computed_in_float32(obj, random_batch):
    logp, old, adv, mask = random_batch(dtype=torch.bfloat16)
    out = obj(logp, old, adv, mask)
    assert out.loss.dtype == torch.float32 and out.metrics["clip/frac"].dtype == torch.float32
    assert obj(*random_batch(dtype=torch.float64)).loss.dtype == torch.float64


@pytest.mark.parametrize("obj", ALL, ids=IDS)
def test_non_finite_loss_raises_naming_the_objective(obj, random_batch):
    logp, old, adv, mask = random_batch()
    logp = logp.clone()
    logp[0, 0] = float("nan")  # a valid token
    with pytest.raises(NonFiniteLossError, match=type(obj).__name__):
        obj(logp, old, adv, mask)


def test_metrics_are_detached_and_loss_carries_gradient(random_batch):
    logp, old, adv, mask = random_batch()
    out = GSPO(0.2, 0.25)(logp.requires_grad_(True), old, adv, mask)
    assert out.loss.requires_grad
    assert all(not v.requires_grad and v.dim() == 0 for v in out.metrics.values())


def test_log_ratio_clamp_fires_and_is_counted():
    old = torch.zeros(1, 2, dtype=torch.float64)
    logp = torch.tensor([[0.3, 0.05]], dtype=torch.float64)
    adv = torch.tensor([1.0], dtype=torch.float64)
    grpo = GRPO(0.5, 0.5, log_ratio_clamp=0.1)(logp, old, adv, torch.ones(1, 2))
    assert grpo.metrics["ratio/clamp_frac"].item() == pytest.approx(0.5)  # only the 0.3 token
    assert grpo.metrics["ratio/token/max"].item() == pytest.approx(math.exp(0.3))  # the ratio, before the clamp
    assert GRPO(0.5, 0.5)(logp, old, adv, torch.ones(1, 2)).metrics["ratio/clamp_frac"] == 0
    gspo = GSPO(0.5, 0.5, log_ratio_clamp=0.1)(logp, old, adv, torch.ones(1, 2))  # seq log-ratio 0.175
    assert gspo.metrics["ratio/clamp_frac"].item() == 1


def test_kl_penalty_to_reference():
    # on-policy with A = 0, so the policy term is 0; one token with log π = -1, log π_ref = -1.5:
    # k3 = e^(ref - logp) - 1 - (ref - logp) = e^-0.5 - 1 + 0.5 = 0.1065307, times beta = 0.5
    logp, ref = torch.tensor([[-1.0]]), torch.tensor([[-1.5]])
    out = GSPO(beta=0.5)(logp, logp, torch.zeros(1), torch.ones(1, 1), ref_logp=ref)
    assert out.loss.item() == pytest.approx(0.5 * (math.exp(-0.5) - 0.5))
    assert out.metrics["kl/ref"].item() == pytest.approx(math.exp(-0.5) - 0.5)
    with pytest.raises(ValueError, match="needs ref_logp"):
        GSPO(beta=0.5)(logp, logp, torch.zeros(1), torch.ones(1, 1))


def test_shape_errors_name_the_shapes():
    with pytest.raises(ValueError, match=r"\(2, 3\)"):
        GRPO()(torch.zeros(2, 3), torch.zeros(2, 4), torch.zeros(2), torch.ones(2, 3))
    with pytest.raises(ValueError, match="advantages"):
        GRPO()(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(3), torch.ones(2, 3))


@given(
    clip_low=st.one_of(st.floats(max_value=0.0), st.floats(min_value=1.0), st.just(float("nan"))),
    cls=st.sampled_from([GSPO, GSPOToken, GRPO]),
)
def test_bad_clip_low_is_rejected_with_key_value_and_rule(clip_low, cls):
    with pytest.raises(ValueError, match=r"objective\.clip_low=.*0 < clip_low < 1"):
        cls(clip_low=clip_low, clip_high=0.2)


@given(clip_high=st.one_of(st.floats(max_value=0.0), st.just(float("nan"))))
def test_bad_clip_high_is_rejected(clip_high):
    with pytest.raises(ValueError, match=r"objective\.clip_high=.*must be > 0"):
        GSPO(clip_low=0.1, clip_high=clip_high)


# A reference written straight from the equations, one sequence at a time, in plain Python floats.
def reference_loss(kind, logp, old, adv, mask, clip_low, clip_high, length_norm):
    terms = []
    for i in range(logp.shape[0]):
        idx = [t for t in range(logp.shape[1]) if mask[i, t]]
        if not idx:
            continue
        a = adv[i].item()
        if kind == "grpo":  # eq. 2: (1/|y_i|) Σ_t min(w A, clip(w) A)
            ws = [math.exp(logp[i, t].item() - old[i, t].item()) for t in idx]
            terms.append(sum(min(w * a, min(max(w, 1 - clip_low), 1 + clip_high) * a) for w in ws) / len(idx))
        else:  # eqs. 5-7: s_i = exp((1/|y_i|) Σ_t log ratio), min(s A, clip(s) A)
            log_sum = sum(logp[i, t].item() - old[i, t].item() for t in idx)
            s = math.exp(log_sum / len(idx) if length_norm else log_sum)
            terms.append(min(s * a, min(max(s, 1 - clip_low), 1 + clip_high) * a))
    return -sum(terms) / len(terms) if terms else 0.0


@settings(max_examples=60, deadline=None)
@given(
    B=st.integers(1, 6),
    T=st.integers(1, 9),
    seed=st.integers(0, 10_000),
    spread=st.sampled_from([1e-4, 1e-2, 0.3]),
    kind=st.sampled_from(["gspo", "gspo_token", "grpo"]),
    length_norm=st.booleans(),
)
def test_matches_paper_equations_on_random_float64(B, T, seed, spread, kind, length_norm, random_batch):
    logp, old, adv, _ = random_batch(B, T, seed, spread=spread)
    mask = (torch.rand(B, T, generator=torch.Generator().manual_seed(seed + 1)) > 0.4).long()
    clip_low, clip_high = (3e-4, 4e-4) if spread < 1e-3 else (0.2, 0.27)
    cls = {"gspo": GSPO, "gspo_token": GSPOToken, "grpo": GRPO}[kind]
    ln = length_norm or kind == "grpo"  # GRPO's length_norm=False is Dr. GRPO, tested by hand
    out = cls(clip_low, clip_high, length_norm=ln)(logp, old, adv, mask)
    expected = reference_loss(kind, logp, old, adv, mask, clip_low, clip_high, ln)
    assert out.loss.item() == pytest.approx(expected, abs=1e-9, rel=1e-9)
    assert 0 <= out.metrics["clip/frac"] <= 1
    assert out.metrics["clip/frac"] == pytest.approx(
        (out.metrics["clip/frac_low"] + out.metrics["clip/frac_high"]).item()
    )
