"""Entropy control in real runs (a one-layer model without a cold start, seconds each): the keys reach the loss and
the logged metrics, the adaptive coefficient moves every optimizer step and carries across a resume, and the bonus's
update does not depend on train.micro_batch_size. The formulas themselves are tested against TRL in
tests/objectives/test_entropy.py and tests/rollout/test_logprobs_entropy.py."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gspo_lab.train import build
from tests.test_micro_batch_training import first_step_gradients

TIMING = ("time/", "throughput/")


def distinct_characters(completions, **kwargs):
    """A reward that the random initial model's completions differ in (the task's checker scores them all 0)."""
    return [float(len(set(completion))) for completion in completions]


@pytest.fixture
def no_cold_start(rl_overrides) -> list[str]:
    """The fast RL run from the random initial model: one rollout of 16 completions per step, no evaluation, rewarded
    for the distinct characters of each completion, so that groups have advantages."""
    return rl_overrides + ["sft.enabled=false", "train.eval_every=0",
                           "reward.functions=[{_target_:tests.test_entropy_control.distinct_characters}]"]


def fit(compose, overrides: list[str], ckpt_path: str | None = None):
    run, module, _ = build(compose(overrides))
    run.trainer.fit(module, ckpt_path=ckpt_path, weights_only=True)
    return module


def test_the_bonus_and_the_mask_reach_the_loss(compose, no_cold_start, tmp_path):
    """One mini-batch per step, so step 0's update is the first: the same samples and weights in every run, the
    policy loss equal, the total lower by exactly c x the logged entropy (H̄ over every valid token); the top-entropy
    mask keeps a fifth of the tokens and changes the policy loss. The default logs none of the new metrics."""
    base = no_cold_start + ["train.minibatches=1"]
    runs = {name: fit(compose, base + extra + [f"paths.output_dir={tmp_path / name}"]) for name, extra in [
        ("default", []), ("bonus", ["objective.entropy_coef=0.05"]), ("mask", ["objective.top_entropy_quantile=0.2"])]}
    default, bonus, mask = (runs[name].history[0] for name in ("default", "bonus", "mask"))
    assert not any(key.startswith(("entropy/", "loss/entropy")) for key in default)
    assert bonus["loss/policy"] == default["loss/policy"]  # bitwise: the same forward before any update
    assert bonus["entropy/coef"] == 0.05
    assert bonus["loss/entropy_bonus"] == pytest.approx(0.05 * bonus["entropy"], rel=1e-6)
    assert bonus["loss/total"] == pytest.approx(default["loss/total"] - bonus["loss/entropy_bonus"], rel=1e-6)
    assert bonus["loss/entropy_bonus"] > 1e-3  # a bonus large enough to tell apart
    assert 0.2 <= mask["entropy/kept_frac"] < 0.3 and mask["entropy/kept_mean"] > mask["entropy"]
    assert mask["loss/policy"] != default["loss/policy"]
    pairs = zip(runs["default"].model.parameters(), runs["bonus"].model.parameters())
    assert any(not torch.equal(a, b) for a, b in pairs)  # the bonus's gradient reached the weights


ADAPTIVE = ["objective.entropy_target=100.0", "objective.entropy_coef=0.0", "objective.entropy_coef_delta=0.01"]


def test_the_adaptive_coefficient_moves_every_optimizer_step_and_is_logged(compose, no_cold_start, tmp_path):
    """A target of 100 nats, above any entropy over the vocabulary (log V < 5): every update raises c by 0.01. Two
    mini-batches per step, each logging c after its update, the step their mean: 0.015, 0.035, 0.055. The first
    update applies no bonus (no entropy measured yet), the second applies 0.01."""
    module = fit(compose, no_cold_start + ADAPTIVE + ["train.steps=3", f"paths.output_dir={tmp_path}"])
    coefs = [row["entropy/coef"] for row in module.history]
    assert coefs == pytest.approx([0.015, 0.035, 0.055], abs=1e-12)
    first = module.history[0]
    # the mean of 0 and 0.01 x the second mini-batch's H̄, which is near the step's
    assert first["loss/entropy_bonus"] == pytest.approx(0.01 * first["entropy"] / 2, rel=0.2)
    assert module.updater.entropy_control.coef == pytest.approx(0.06) and 0 < module.updater.entropy_control.last_entropy < 100


def test_a_resumed_run_goes_on_with_the_same_coefficient(compose, no_cold_start, tmp_path):
    """4 steps at once, and 2 + 2 from the checkpoint: the same rows and weights; the checkpoint holds c and the last
    entropy (without them the resumed run would restart at c = 0 and apply no bonus in its first update)."""
    overrides = no_cold_start + ADAPTIVE + ["objective.entropy_coef_max=0.025"]  # c also reaches its bound
    whole = fit(compose, overrides + ["train.steps=4", f"paths.output_dir={tmp_path / 'whole'}"])
    fit(compose, overrides + ["train.steps=2", f"paths.output_dir={tmp_path / 'part'}"])
    checkpoint = tmp_path / "part" / "checkpoints" / "last.ckpt"
    saved = torch.load(checkpoint, weights_only=True)["entropy_control"]
    assert saved["coef"] == pytest.approx(0.025) and saved["last_entropy"] < 100
    resumed = fit(compose, overrides + ["train.steps=4", f"paths.output_dir={tmp_path / 'resumed'}"], str(checkpoint))
    strip = [{k: v for k, v in row.items() if not k.startswith(TIMING)} for row in whole.history]
    assert [{k: v for k, v in row.items() if not k.startswith(TIMING)} for row in resumed.history] == strip
    assert [row["entropy/coef"] for row in whole.history] == pytest.approx([0.015, 0.025, 0.025, 0.025])
    for (name, a), b in zip(whole.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), name  # bitwise: the same operations on the same shapes in one process


def test_the_bonus_s_update_does_not_depend_on_the_micro_batch_size(compose, no_cold_start, tmp_path):
    """The bonus is a token mean weighted by each micro-batch's share of the tokens, GSPO's loss a sequence mean by
    its share of the rows: 8-row mini-batches whole and in micro-batches of 3, 3 and 2 rows give the same gradient
    to float32 rounding. Every other token id stops a completion, so lengths differ and the two shares do too."""
    overrides = [o for o in no_cold_start if not o.startswith("paths.output_dir")]
    stops = f"rollout.stop_token_ids=[{','.join(map(str, range(4, 60, 2)))}]"
    gradients = {size: first_step_gradients(compose, overrides + [
        "objective.entropy_coef=0.05", f"train.micro_batch_size={size}", "train.steps=1", stops,
        f"paths.output_dir={tmp_path / size}"]) for size in ("null", "3")}
    whole = gradients["null"]
    assert max(g.abs().max().item() for g in whole) > 0
    for got, expected in zip(gradients["3"], whole, strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=64 * 1.2e-7 * expected.abs().max().item() + 1e-12)


@pytest.mark.slow
def test_two_ranks_run_the_adaptive_coefficient_and_the_mask(no_cold_start, tmp_path):
    """Two gloo ranks, each masking by its own tokens' quantile, the coefficient's H̄ reduced over both (the path
    runs; its value is not checked here): identical replicas, and the coefficient each update raises."""
    overrides = [o for o in no_cold_start if not o.startswith("paths.output_dir")]
    result = subprocess.run(
        [sys.executable, "-m", "gspo_lab.train", *overrides, *ADAPTIVE, "objective.top_entropy_quantile=0.5",
         "trainer=ddp", "trainer.devices=2", "train.steps=2", f"hydra.run.dir={tmp_path}"],
        cwd=tmp_path, env={**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": str(Path(__file__).parents[1])},
        capture_output=True, text=True, timeout=600)  # PYTHONPATH: the reward function lives in this module
    assert result.returncode == 0, result.stderr[-3000:]
    with open(tmp_path / "metrics.csv", newline="") as file:
        rows = list(csv.DictReader(file))
    assert [float(row["entropy/coef"]) for row in rows[:2]] == pytest.approx([0.015, 0.035], abs=1e-12)
    assert 0.45 <= float(rows[0]["entropy/kept_frac"]) < 0.6 and float(rows[-1]["params/rank_spread"]) == 0
