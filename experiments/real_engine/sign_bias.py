"""A diagnostic after the result (not one of the study's hypotheses): on the first, on-policy mini-batch of each RL
step, where π_θ is still the trainer at rollout time and π_old the engine's log-probs (rollout.logprobs_from_
generation=true), GSPO's sequence ratio s_i = exp(mean_t log π_θ/π_old) is the engine mismatch alone. GSPO's clip
drops a sequence's gradient when s_i > 1 + 4e-4 with A_i > 0, or s_i < 1 - 3e-4 with A_i < 0. This prints, per
engine, the mean log s_i of positive- and negative-advantage sequences and the share of each whose gradient the
clip drops on that first mini-batch.

    GSPO_LAB_CACHE=<the study's cache> .venv-vllm/bin/python experiments/real_engine/sign_bias.py \
        --steps 25 --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from mismatch_positions import fit_gspo  # noqa: E402  (this folder's other diagnostic: one GSPO run per seed)

ENGINES = {"real (vLLM bf16)": [], "simulated (hf bf16)": ["rollout.backend=hf", "rollout.engine.precision=bf16"]}


class Recording:
    """The objective, recording (log s_i, A_i) of every valid row of each call."""

    def __init__(self, objective) -> None:
        self.objective, self.calls = objective, []

    def __getattr__(self, name):
        return getattr(self.objective, name)

    def __call__(self, logp, old_logp, advantages, mask, *args, **kwargs):
        valid = mask.bool()
        rows = valid.any(-1)
        log_s = ((logp.detach() - old_logp) * valid).sum(-1) / valid.sum(-1).clamp(min=1)
        adv = advantages if advantages.dim() == 1 else advantages[:, 0]
        self.calls.append((log_s[rows].double(), adv[rows].double()))
        return self.objective(logp, old_logp, advantages, mask, *args, **kwargs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    args = parser.parse_args()

    def record(module) -> Recording:
        module.updater.objective = recording = Recording(module.updater.objective)
        return recording

    for name, engine in ENGINES.items():
        first = []
        for seed in args.seeds:
            cfg, recording = fit_gspo(engine, seed, args.steps, record)
            first += recording.calls[::cfg.train.minibatches]  # each step's first mini-batch
        log_s = torch.cat([c[0] for c in first])
        adv = torch.cat([c[1] for c in first])
        pos, neg = adv > 0, adv < 0
        dropped_pos = (log_s[pos] > torch.log1p(torch.tensor(4e-4, dtype=torch.float64))).double().mean()
        dropped_neg = (log_s[neg] < torch.log1p(torch.tensor(-3e-4, dtype=torch.float64))).double().mean()
        print(f"{name:20s} rows {len(adv)}: mean log s  A>0 {log_s[pos].mean():+.2e}  A<0 {log_s[neg].mean():+.2e}  "
              f"|log s| {log_s.abs().mean():.2e};  gradient dropped by the clip  A>0 {dropped_pos:.3f}  "
              f"A<0 {dropped_neg:.3f}", flush=True)


if __name__ == "__main__":
    main()
