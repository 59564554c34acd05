"""Steps per hour of rollout.async_mode=overlap (a vLLM engine process on its own cores, generating the next step's
rollout while the trainer trains; k = 1), with and without partial rollouts (rollout.partial: new weights interrupt
the engine's unfinished rows), against the synchronous step (vLLM colocated in the trainer's process, on every
core), as whole `gspo-train` runs alternated A B C A B C.

    python scripts/bench_overlap.py                         # bench_anchor on vLLM, 3 rounds of 4 and 24 steps
    python scripts/bench_overlap.py --rounds 5 rollout.max_new_tokens=64

Each round runs both arms at two lengths (--short and --long steps). Whole-run seconds include the process start
and vLLM's (tens of seconds on CPU), so the steady-state seconds per step are taken as (T(long) - T(short)) /
(long - short) within the round, and steps per hour as 3,600 over that. Printed: each arm's whole-run seconds and
seconds per step (min, median, max over rounds), the per-round ratio sync / overlap of seconds per step (the
speed-up in steps per hour), and from each overlapped arm's metrics.csv the medians of time/wait_s,
time/generate_s, off_policy/overlap_frac, and under partial off_policy/mixed_frac and token_staleness_mean. Both arms take π_old from the engine (bypass), so neither runs a
no-grad forward the other does not. Run it in the environment that has vLLM (make test-vllm builds .venv-vllm),
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
import time
from pathlib import Path

WORKLOAD = ["experiment=bench_anchor", "rollout.backend=vllm", "rollout.logprobs_from_generation=true",
            "model.config.head_dim=32"]  # vLLM's CPU attention takes head sizes in multiples of 32
OVERLAP = ["rollout.max_staleness=1", "rollout.async_mode=overlap"]
ARMS = {"sync": [], "overlap": OVERLAP, "partial": OVERLAP + ["rollout.partial=true"]}
MEDIANS = ("time/wait_s", "time/generate_s", "off_policy/overlap_frac", "off_policy/mixed_frac",
           "off_policy/token_staleness_mean")


def run(overrides: list[str], steps: int, folder: Path) -> tuple[float, list[dict]]:
    """One whole gspo-train run: its wall-clock seconds and its metrics.csv rows."""
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "gspo_lab.train", *overrides, f"train.steps={steps}",
                             f"hydra.run.dir={folder}"], capture_output=True, text=True,
                            env={**os.environ, "WANDB_MODE": "offline"})
    seconds = time.perf_counter() - started
    if result.returncode != 0:
        sys.exit(f"gspo-train {' '.join(overrides)} failed:\n{result.stderr[-3000:]}")
    with open(folder / "metrics.csv", newline="") as file:
        return seconds, list(csv.DictReader(file))


def spread(values: list[float]) -> str:
    return f"{min(values):8.2f} {statistics.median(values):8.2f} {max(values):8.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--short", type=int, default=4, help="RL steps of the short runs")
    parser.add_argument("--long", type=int, default=24, help="RL steps of the long runs")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of the workload, both arms")
    args = parser.parse_args()
    workload = WORKLOAD + args.overrides
    whole = {arm: [] for arm in ARMS}
    per_step = {arm: [] for arm in ARMS}
    overlapped = {arm: [] for arm in ARMS if arm != "sync"}  # metrics.csv rows of the long runs after step 0
    with tempfile.TemporaryDirectory(prefix="bench-overlap-") as scratch:
        for round_ in range(args.rounds):
            for arm, extra in ARMS.items():
                times = {}
                for steps in (args.short, args.long):
                    folder = Path(scratch) / f"{arm}-{round_}-{steps}"
                    times[steps], rows = run(workload + extra, steps, folder)
                    if arm in overlapped and steps == args.long:
                        overlapped[arm] += [r for r in rows if r.get("time/wait_s") and int(r["step"]) > 0]
                whole[arm].append(times[args.long])
                per_step[arm].append((times[args.long] - times[args.short]) / (args.long - args.short))
                print(f"round {round_} {arm:8s} {args.long} steps {times[args.long]:7.1f} s, "
                      f"{per_step[arm][-1]:.3f} s/step", flush=True)
    print(f"\nworkload: {' '.join(workload)}; {args.rounds} rounds, {args.short} and {args.long} steps")
    print(f"{'':34s} {'min':>8s} {'median':>8s} {'max':>8s}")
    for arm in ARMS:
        print(f"{arm + f' whole run of {args.long} steps, s':34s} {spread(whole[arm])}")
        print(f"{arm + ' seconds per step':34s} {spread(per_step[arm])}")
    for faster, slower in (("overlap", "sync"), ("partial", "sync"), ("partial", "overlap")):
        ratios = [s / f for s, f in zip(per_step[slower], per_step[faster])]
        print(f"{f'steps per hour, {faster} / {slower}':34s} {spread(ratios)}")
    for arm, rows in overlapped.items():
        for key in MEDIANS:
            values = [float(r[key]) for r in rows if r.get(key)]
            if values:
                print(f"{arm} median {key}: {statistics.median(values):.3f}")


if __name__ == "__main__":
    main()
