"""What the proxy prefers: the reward model's score of a policy's greedy answers against its score of the right
answers, from gspo-eval's samples.jsonl (every completion, with its reference), one file per policy.

    gspo-eval checkpoint=<run dir> hydra.run.dir=<out>          # writes <out>/samples.jsonl
    python experiments/overoptimization/probe.py ~/.cache/gspo-lab/reward_models/overoptimization \
        <out>/samples.jsonl ...

Per file: the checker's accuracy; among the wrong answers, the share the proxy scores above the right answer to the
same prompt (a wrong answer the proxy prefers to the truth is what optimising it finds); the mean proxy score of
the policy's answers and of the right ones.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from gspo_lab.rewards import RewardModel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reward_model")
    parser.add_argument("samples", nargs="+", type=Path)
    args = parser.parse_args()
    scorer = RewardModel(args.reward_model, batch_size=256)
    print("| samples | answers | accuracy | wrong answers the proxy prefers to the right one | proxy: policy's | "
          "proxy: right |")
    print("| --- | --- | --- | --- | --- | --- |")
    for path in args.samples:
        rows = [json.loads(line) for line in open(path)]
        rows = [r for r in rows if r["mode"] == "greedy"]
        prompts = [r["prompt"] for r in rows]
        answered = np.array(scorer(prompts, [r["completion"] for r in rows]))
        right = np.array(scorer(prompts, [r["reference"] for r in rows]))
        wrong = np.array([not r["correct"] for r in rows])
        preferred = float((answered[wrong] > right[wrong]).mean()) if wrong.any() else float("nan")
        print(f"| {path} | {len(rows)} | {1 - wrong.mean():.3f} | {preferred:.3f} ({wrong.sum()}) | "
              f"{answered.mean():+.3f} | {right.mean():+.3f} |")


if __name__ == "__main__":
    main()
