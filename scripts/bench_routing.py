"""Routing replay overhead and trace memory: seconds per RL step on the tiny MoE with routing.replay off,
r2 and r3, alternated in one process so drift hits every mode alike, and the trace's bytes per token.

Every mode pays the same routing diagnostics after the updates (one recorded no-grad forward per step) and
computes old log-probs the same way, with a forward (rollout.logprobs_from_generation=false, which r2 needs).
The diagnostics before the updates differ (without replay the first mini-batch's forwards measure them, under r2
and r3 a forward of their own), so their time (time/mismatch_s) is left out of every mode's step: the difference
is the cost of recording in generation (r3) and of replay in the old-policy and training forwards.

    python scripts/bench_routing.py --steps 30 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

from hydra import compose, initialize_config_dir

from gspo_lab import CONFIG_DIR
from gspo_lab.report.run import step_rows
from gspo_lab.train import train

MODES = {"off": ["algorithm=grpo"], "r2": ["algorithm=grpo_rr"], "r3": ["algorithm=grpo", "routing.replay=r3"]}


def seconds_per_step(mode: str, steps: int, extra: list[str]) -> tuple[float, float]:
    """Median (rollout + update) seconds over the run's steps after the first, and trace bytes per token."""
    with tempfile.TemporaryDirectory() as out, initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("train", overrides=MODES[mode] + extra + [
            f"paths.output_dir={out}", "sft.enabled=false", f"train.steps={steps}", "train.eval_every=0",
            "callbacks.progress.refresh_rate=0", "task.eval_size=8", "rollout.logprobs_from_generation=false",
        ])
        train(cfg)
        rows = step_rows(out, skip=1)
    step = statistics.median(r["time/rollout_s"] + r["time/update_s"] - r["time/mismatch_s"] for r in rows)
    return step, next(r["routing/trace_bytes_per_token"] for r in reversed(rows)
                      if r["routing/trace_bytes_per_token"] == r["routing/trace_bytes_per_token"])  # not NaN


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30, help="RL steps per run (the first is not timed)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of off/r2/r3")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides, e.g. model.config.num_hidden_layers=8")
    args = parser.parse_args()
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    memory = {}
    for _ in range(args.repeats):
        for mode in MODES:
            step, memory[mode] = seconds_per_step(mode, args.steps, args.overrides)
            times[mode].append(step)
    off = statistics.median(times["off"])
    print(f"{'mode':<5} {'s/step (median of repeats)':>28} {'vs off':>8} {'trace bytes/token':>18}")
    for mode, values in times.items():
        median = statistics.median(values)
        print(f"{mode:<5} {median:>28.4f} {100 * (median / off - 1):>+7.1f}% {memory[mode]:>18.1f}")


if __name__ == "__main__":
    main()
