"""The two LoRA syncs of rollout.backend=vllm against each other: rollout.vllm.lora_sync=merged (every wrapped weight
W + scale·BA through vLLM's in-place reload) and adapter (the adapters alone, which vLLM serves as a LoRA adapter),
as whole `gspo-train` runs alternated A B A B, on a dense model (on CPU vLLM's LoRA serves no MoE).

    python scripts/bench_lora_sync.py                    # 3 rounds of 8 RL steps each
    python scripts/bench_lora_sync.py --rounds 5 model.config.hidden_size=1024

Printed per mode, from each run's metrics.csv without its first step (which starts the engine and loads the base):
time/engine_sync_s and time/generate_s per step, min / median / max over every step of every round, and the
ratio adapter / merged of the medians. Run it in the environment that has vLLM (make test-vllm builds .venv-vllm),
with nothing else computing.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

# a dense Qwen3 of 4 layers at hidden 512 (about 19M parameters), LoRA rank 16 on the attention projections;
# fixed-length rollouts of 8 x 8 completions of 64 tokens, no cold start, no evaluation
WORKLOAD = ["model=tiny_dense", "model.config.hidden_size=512", "model.config.num_attention_heads=8",
            "model.config.num_key_value_heads=4", "model.config.head_dim=64", "model.config.intermediate_size=2048",
            "model.lora.enabled=true", "model.lora.rank=16", "rollout.backend=vllm", "sft.enabled=false",
            "rollout.prompts_per_step=8", "rollout.group_size=8", "rollout.max_new_tokens=64",
            "rollout.suppress_eos=true", "train.eval_every=0", "logger=[csv]", "callbacks.progress.refresh_rate=0"]
MODES = ("merged", "adapter")
TIMES = ("time/engine_sync_s", "time/generate_s")


def run(mode: str, steps: int, extra: list[str], folder: Path) -> list[dict[str, str]]:
    """One run's metrics.csv rows of its RL steps."""
    out = folder / f"{mode}"
    subprocess.run([sys.executable, "-m", "gspo_lab.train", *WORKLOAD, f"rollout.vllm.lora_sync={mode}",
                    f"train.steps={steps}", *extra, f"hydra.run.dir={out}"], check=True, capture_output=True,
                   env={**os.environ, "WANDB_MODE": "offline"})
    with open(out / "metrics.csv", newline="") as file:
        return [row for row in csv.DictReader(file) if row.get(TIMES[0])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("overrides", nargs="*", help="gspo-train overrides for both modes")
    args = parser.parse_args()
    times = {mode: {key: [] for key in TIMES} for mode in MODES}
    for round_ in range(args.rounds):
        for mode in MODES:
            with tempfile.TemporaryDirectory() as folder:
                rows = run(mode, args.steps, args.overrides, Path(folder))[1:]  # the first step starts the engine
            for key in TIMES:
                times[mode][key] += [float(row[key]) for row in rows]
            print(f"round {round_ + 1} {mode}: " + ", ".join(
                f"{key} median {statistics.median(float(r[key]) for r in rows):.4f}" for key in TIMES), flush=True)
    for key in TIMES:
        for mode in MODES:
            values = times[mode][key]
            print(f"{key:20s} {mode:8s} min {min(values):.4f}  median {statistics.median(values):.4f}  "
                  f"max {max(values):.4f}  ({len(values)} steps)")
        ratio = statistics.median(times["adapter"][key]) / statistics.median(times["merged"][key])
        print(f"{key:20s} adapter / merged (medians): {ratio:.2f}")


if __name__ == "__main__":
    main()
