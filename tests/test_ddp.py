"""trainer=ddp on CPU: two gloo processes through Lightning's own DDP strategy and launcher (one step in
`make test`, four in the full suite: longer, with dynamic sampling, with LoRA), and how ranks' metrics and reward
error counts combine (summed, across a resume too)."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from lightning.pytorch.strategies import DDPStrategy

from gspo_lab.step.metrics import across_ranks


# dynamic sampling: each rank filters its own groups, and both sample every further round in lockstep
DYNAMIC = ["rollout.filter_zero_std_groups=true", "rollout.group_size=2", "rollout.prompts_per_step=8"]
# LoRA adapters with the KL reference as the adapters-disabled model: only adapters are all-reduced and stepped
LORA = ["model.lora.enabled=true", "model.lora.rank=4", "objective.beta=0.04"]


@pytest.mark.parametrize("steps, sampling", [(1, []), pytest.param(3, [], marks=pytest.mark.slow),
                                             pytest.param(2, DYNAMIC, marks=pytest.mark.slow),
                                             pytest.param(2, LORA, marks=pytest.mark.slow)])
def test_ddp_two_processes_shard_prompts_and_keep_parameters_identical(steps, sampling, rl_overrides, tmp_path):
    overrides = [o for o in rl_overrides if not o.startswith("paths.output_dir")] + sampling
    run_dir = tmp_path / "ddp"
    result = subprocess.run(
        [sys.executable, "-m", "gspo_lab.train", *overrides, "trainer=ddp", "trainer.devices=2", f"train.steps={steps}",
         f"train.eval_every={steps}", f"hydra.run.dir={run_dir}"],
        cwd=tmp_path, env={**os.environ, "WANDB_MODE": "offline"}, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "GLOBAL_RANK: 1" in result.stdout + result.stderr  # a second process really ran
    with open(run_dir / "metrics.csv", newline="") as file:
        rows = list(csv.DictReader(file))
    assert [r["step"] for r in rows] == [str(step) for step in range(steps + 1)]  # written once, by rank 0
    # 4 prompts x 4 completions (or 8 x 2) split over 2 ranks: whole groups, 8 completions each
    assert all(float(r["rollout/completions"]) == 8 for r in rows[:steps])
    assert float(rows[0]["grad_norm"]) > 0  # updates happened...
    assert float(rows[-1]["params/rank_spread"]) == 0  # ...and all-reduced gradients kept the ranks identical
    if sampling == LORA:  # the adapters moved the policy from the adapters-disabled reference; both saved
        assert float(rows[1]["kl/ref"]) > 0 and (run_dir / "final" / "adapter" / "adapter_config.json").is_file()
    if sampling == DYNAMIC:  # some step needed a further round on some rank, and no batch kept a zero-std group
        assert max(float(r["rollout/sampling_rounds"]) for r in rows[:steps]) > 1
        assert all(float(r["trained/reward/frac_zero_std"]) == 0 for r in rows[:steps])
    assert list(run_dir.glob("checkpoints/*.ckpt")) and (run_dir / "final" / "config.json").is_file()


# rank 0's and rank 1's metrics of one RL step: reward error and timeout counts are each rank's own completions'
RANK_METRICS = [{"reward/errors": 1.0, "reward/flaky/timeouts": 0.0, "reward/mean": 0.2, "ratio/seq/max": 1.5},
                {"reward/errors": 3.0, "reward/flaky/timeouts": 2.0, "reward/mean": 0.6, "ratio/seq/max": 1.1}]


def reduce_on_rank(rank: int, init_file: str, out_file: str) -> None:
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        reduced = across_ranks(RANK_METRICS[rank], DDPStrategy(), torch.device("cpu"))
        if rank == 0:
            with open(out_file, "w") as file:
                json.dump(reduced, file)
    finally:
        torch.distributed.destroy_process_group()


def test_two_ranks_log_the_sum_of_their_reward_error_counts(tmp_path):
    """Two gloo ranks: counts add up (1 + 3 errors = 4, 0 + 2 timeouts = 2; the mean logged 2 and 1), a mean is
    the mean (0.2, 0.6 -> 0.4), a */max the max (1.5)."""
    out = tmp_path / "reduced.json"
    mp.spawn(reduce_on_rank, args=(str(tmp_path / "init"), str(out)), nprocs=2)
    reduced = json.loads(out.read_text())
    assert reduced == {"reward/errors": 4.0, "reward/flaky/timeouts": 2.0, "reward/mean": pytest.approx(0.4),
                       "ratio/seq/max": 1.5}


FLAKY = ("reward.functions=[{_target_:gspo_lab.rewards.TaskReward},"
         "{_target_:tests.rewards.user_rewards.flaky,weight:0.5}]")  # raises on completions containing '7'


@pytest.mark.slow
@pytest.mark.long
def test_two_ranks_count_reward_errors_across_a_resume(rl_overrides, tmp_path):
    """A checkpoint holds both ranks' error counts summed, and rank 0 alone resumes with them: resumed in place
    after 2 of 4 RL steps, the logged totals are the uninterrupted run's (when each rank restored the count rank 0
    saved, its own, the sum counted rank 0's errors twice and rank 1's never)."""
    overrides = [o for o in rl_overrides if not o.startswith("paths.output_dir")] + [FLAKY, "train.eval_every=0"]
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": str(Path(__file__).parents[1])}

    def fit(run_dir, *extra):
        result = subprocess.run([sys.executable, "-m", "gspo_lab.train", *overrides, "trainer=ddp", "trainer.devices=2",
                                 *extra, f"hydra.run.dir={run_dir}"],
                                cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        with open(run_dir / "metrics.csv", newline="") as file:
            return [float(row["reward/flaky/errors"]) for row in csv.DictReader(file) if row["reward/flaky/errors"]]

    whole = fit(tmp_path / "whole", "train.steps=4")
    fit(tmp_path / "part", "train.steps=2")
    resumed = fit(tmp_path / "part", "train.steps=4", "ckpt_path=last")
    assert whole[1] > 0  # the flaky reward raised in the first two steps
    assert resumed == whole
