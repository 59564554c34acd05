"""train.padding_free in a real run: 20 RL steps with packed forwards (train.pack_min_saving=0: these rows of 11-16
tokens would save too little to pack by default) log the metrics of 20 padded ones to float rounding (the same samples, rewards and updates; timings aside), and the plan refuses a token budget beside a row
count, naming both keys."""

from __future__ import annotations

import math

import pytest

from gspo_lab.train import ConfigError, plan, train
from tests.test_train import read_rows

TIMED = ("time/", "throughput/")


@pytest.mark.slow
def test_twenty_steps_log_the_same_metrics_packed_and_padded(compose, rl_overrides, tmp_path):
    runs = {}
    for packed in ("true", "false"):
        overrides = [o for o in rl_overrides if not o.startswith("paths.output_dir")]
        train(compose(overrides + ["train.steps=20", "train.eval_every=10", f"train.padding_free={packed}",
                                   "train.pack_min_saving=0", f"paths.output_dir={tmp_path / packed}"]))
        runs[packed] = read_rows(tmp_path / packed)
    packed, padded = runs["true"], runs["false"]
    assert len(packed) == len(padded) >= 20
    compared, largest = 0, (0.0, None)
    for a, b in zip(packed, padded, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            if key.startswith(TIMED) or a[key] == b[key]:
                continue
            assert a[key] and b[key], (a.get("step"), key, a[key], b[key])  # logged in one run only
            x, y = float(a[key]), float(b[key])
            assert math.isclose(x, y, rel_tol=1e-4, abs_tol=1e-5), (a.get("step"), key, x, y)
            compared += 1
            if max(abs(x), abs(y)) > 1e-3:  # below, rounding noise itself (mismatch/kl of a float32 engine: 1e-9)
                largest = max(largest, (abs(x - y) / max(abs(x), abs(y)), key))
    print(f"{compared} values differ; of those above 1e-3 the largest relative difference is {largest[0]:.2g} "
          f"({largest[1]})")
    assert compared > 0  # rounding moved some numbers: the runs did not share one code path
    assert max(float(row["grad_norm"]) for row in packed if row.get("grad_norm")) > 0  # the runs learned


def test_a_token_budget_beside_a_row_count_is_refused(compose, tmp_path):
    cfg = compose(["train.micro_batch_size=2", "train.micro_batch_tokens=64", f"paths.output_dir={tmp_path}"])
    with pytest.raises(ConfigError, match=r"train.micro_batch_tokens.*train.micro_batch_size=2"):
        plan(cfg)
