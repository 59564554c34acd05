"""Every conf/objective/*.yaml, instantiated with no overrides, through the same checks: a new YAML is tested by
being there. Metric convention the on-policy check relies on: what a surrogate limits is reported as a
fraction (a name with `frac`, 0 on-policy) or a mean weight (a name ending `_mean`, 1 on-policy); a surrogate
that limits nothing reports nothing (LIMIT_NOTHING), and Clip-Cov's and KL-Cov's cov/* describe a selection by
covariance that does not depend on the ratio, so it selects on-policy too (test_verl_policy_losses.py checks
them). Clip-Cov draws at random from torch's global generator: tests that compare two calls seed it before each.
"""

import re
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate

from gspo_lab import CONFIG_DIR
from gspo_lab.objectives import NonFiniteLossError, ObjectiveOutput

NAMES = sorted(p.stem for p in (Path(CONFIG_DIR) / "objective").glob("*.yaml"))
SHARED = ("ratio/", "kl/", "mask/", "loss/")  # reported by every objective, checked by name below
SELECTION = ("cov/",)  # Clip-Cov's and KL-Cov's token selection, the same on- and off-policy
LIMIT_NOTHING = {"gpg", "dro"}  # -A log π, and DRO's quadratic penalty (in loss/policy): no clip, gate or weight


@pytest.fixture(scope="module", params=NAMES)
def objective(request, compose):
    return instantiate(compose([f"objective={request.param}"]).objective)


def test_the_list_is_the_folder():
    assert {"gspo", "gspo_token", "grpo", "dapo", "dr_grpo", "cispo", "sapo", "gmpo", "luspo", "vespo", "clip_cov",
            "kl_cov", "dppo_tv", "dppo_kl", "gpg", "dro"} <= set(NAMES)


def test_named_as_its_file_and_callable(objective, request, random_batch):
    assert objective.name == request.node.callspec.params["objective"]
    out = objective(*random_batch())
    assert isinstance(out, ObjectiveOutput) and out.loss.dim() == 0
    assert all(not v.requires_grad and v.dim() == 0 for v in out.metrics.values())


def test_on_policy_ratio_is_one_and_nothing_is_clipped_or_gated(objective, random_batch):
    _, old, adv, mask = random_batch()
    logp = old.clone().requires_grad_(True)
    out = objective(logp, old, adv, mask)
    m = out.metrics
    assert all(m[f"ratio/{level}/{stat}"] == 1 for level in ("seq", "token") for stat in ("mean", "min", "max"))
    assert m["kl/old"] == 0
    own = {k: v.item() for k, v in m.items() if not k.startswith(SHARED)}
    assert bool(own) != (objective.name in LIMIT_NOTHING), "the surrogate or the ratio reports what it limits"
    for key, value in own.items():
        if key.startswith(SELECTION):
            continue
        if "frac" in key:
            assert value == 0, key
        else:
            assert key.endswith("_mean") and value == pytest.approx(1, abs=1e-12), key
    out.loss.backward()
    assert torch.isfinite(logp.grad).all() and logp.grad.abs().sum() > 0


def test_off_policy_gradients_are_finite(objective, random_batch):
    logp, old, adv, mask = random_batch(spread=0.5)
    logp = logp.requires_grad_(True)
    out = objective(logp, old, adv, mask)
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(logp.grad).all()
    assert (logp.grad[mask == 0] == 0).all()


def test_shape_error_names_the_objective(objective):
    with pytest.raises(ValueError, match=rf"{re.escape(objective.label)}: .*\(2, 3\), \(2, 4\)"):
        objective(torch.zeros(2, 3), torch.zeros(2, 4), torch.zeros(2), torch.ones(2, 3))
    with pytest.raises(ValueError, match=rf"{re.escape(objective.label)}: advantages"):
        objective(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(3), torch.ones(2, 3))


def test_non_finite_loss_names_the_objective(objective, random_batch):
    logp, old, adv, mask = random_batch()
    logp = logp.clone()
    logp[0, 0] = float("nan")  # a valid token
    with pytest.raises(NonFiniteLossError, match=re.escape(objective.label)):
        objective(logp, old, adv, mask)


def test_padding_is_masked(objective, random_batch):
    """Extra padded columns holding NaN change no loss, gradient or metric, and get no gradient."""
    logp, old, adv, mask = random_batch()
    logp = logp.clone().requires_grad_(True)
    torch.manual_seed(0)
    out = objective(logp, old, adv, mask)
    out.loss.backward()
    garbage = torch.full((5, 4), float("nan"), dtype=torch.float64)
    wide_logp = torch.cat([logp.detach(), garbage], 1).requires_grad_(True)
    torch.manual_seed(0)
    wide = objective(wide_logp, torch.cat([old, garbage], 1), adv, torch.cat([mask, torch.zeros(5, 4).long()], 1))
    wide.loss.backward()
    assert wide.loss.item() == pytest.approx(out.loss.item(), abs=1e-12)
    assert torch.allclose(wide_logp.grad[:, :7], logp.grad, atol=1e-12)
    assert (wide_logp.grad[:, 7:] == 0).all()
    for key, value in out.metrics.items():
        assert wide.metrics[key].item() == pytest.approx(value.item(), abs=1e-12), key


def test_empty_rows_are_left_out_and_counted(objective, random_batch):
    logp, old, adv, mask = random_batch()
    torch.manual_seed(0)
    without = objective(logp[1:], old[1:], adv[1:], mask[1:])
    mask = mask.clone()
    mask[0] = 0
    torch.manual_seed(0)
    with_empty = objective(logp, old, adv, mask)
    assert with_empty.loss.item() == pytest.approx(without.loss.item(), abs=1e-12)
    assert with_empty.metrics["mask/empty_rows"] == 1
    assert objective(logp, old, adv, torch.zeros_like(mask)).loss.item() == 0


def test_low_precision_inputs_are_computed_in_float32(objective, random_batch):
    out = objective(*random_batch(dtype=torch.bfloat16))
    assert out.loss.dtype == torch.float32 and out.metrics["ratio/seq/mean"].dtype == torch.float32
