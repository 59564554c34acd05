"""trainer=ddp on CPU: two gloo processes through Lightning's own DDP strategy and launcher (one step in
`make test`, four in the full suite: longer, with dynamic sampling, with LoRA)."""

import csv
import os
import subprocess
import sys

import pytest


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
