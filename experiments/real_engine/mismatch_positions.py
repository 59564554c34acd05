"""A diagnostic for the 2026-11-28 follow-up (issue 50, part 1): where GSPO's engine π_old differs from the trainer's.
GSPO runs with the engine's log-probs as π_old (rollout.logprobs_from_generation=true), and every rollout is also
scored by a no-grad trainer forward (the π_old that rollout.logprobs_from_generation=false would use; the forward
draws no random numbers, so the run is the one the study ran). Printed per engine:

1. the mismatch by completion position: mean and mean |log π_trainer - log π_engine| per token, in bins of 10
   positions, and each bin's share of the sequences' |mean log-ratio| (what GSPO's clip sees);
2. the mini-batches: for each of the step's train.minibatches updates (the first on-policy, the rest after 1, 2,
   3 updates), the mean |policy change| (log π_θ - log π_trainer-old, per-token mean per row), the mean |engine
   mismatch| of the same rows, the share of rows whose gradient GSPO's clip drops when anchored on the engine's
   π_old and when anchored on the trainer's, and the mean advantage of the rows that keep a gradient under each
   anchor (a clip that drops more positive than negative rows pushes it below the batch's own mean).

    GSPO_LAB_CACHE=<the study's cache> .venv-vllm/bin/python experiments/real_engine/mismatch_positions.py \
        --steps 25 --seeds 0 1 2 [--engines real simulated] [--overrides rollout.vllm.dtype=float32]
"""

from __future__ import annotations

import argparse
import math
import tempfile
from collections import defaultdict

import torch
from hydra import compose, initialize_config_dir

from gspo_lab import CONFIG_DIR
from gspo_lab.train import build

ENGINES = {"real": [], "simulated": ["rollout.backend=hf", "rollout.engine.precision=bf16"]}
BIN = 10  # completion positions per bin


class Recorder:
    """Keeps each rollout's trainer π_old by row, and what every update's objective call sees."""

    def __init__(self, module) -> None:
        self.module, self.trainer_old, self.current = module, {}, None
        self.positions = defaultdict(lambda: [0.0, 0.0, 0])  # bin -> [sum diff, sum |diff|, tokens]
        self.seq_share = defaultdict(float)  # bin -> sum over rows of |that bin's part of the mean log-ratio|
        self.calls = []  # (minibatch index, d_pol [b], d_mis [b], advantage [b])
        collect, accumulate = module.collector.collect, module.updater.accumulate
        objective = module.updater.objective

        def collect_scored(step, ranks):
            rollout = collect(step, ranks)
            self.score(rollout.batch)
            return rollout

        def accumulate_kept(minibatch, *args, **kwargs):
            self.current = minibatch
            return accumulate(minibatch, *args, **kwargs)

        def objective_seen(logp, old_logp, advantages, mask, *args, **kwargs):
            self.see(logp.detach(), old_logp, advantages, mask)
            return objective(logp, old_logp, advantages, mask, *args, **kwargs)

        module.collector.collect, module.updater.accumulate = collect_scored, accumulate_kept
        module.updater.objective = ObjectiveView(objective, objective_seen)

    @torch.no_grad()
    def score(self, batch) -> None:
        trainer, _ = self.module.policy.old_logprobs(batch)  # [B, C]
        mask = batch.loss_mask.bool()
        diff = (trainer - batch.old_logp).double() * mask  # [B, C] log π_trainer - log π_engine
        lengths = mask.sum(-1).clamp(min=1)
        for start in range(0, diff.shape[1], BIN):
            part, keep = diff[:, start:start + BIN], mask[:, start:start + BIN]
            cell = self.positions[start // BIN]
            cell[0] += part[keep].sum().item()
            cell[1] += part[keep].abs().sum().item()
            cell[2] += int(keep.sum())
            self.seq_share[start // BIN] += (part.sum(-1) / lengths).abs().sum().item()
        self.trainer_old.update({bytes(row.cpu().numpy()): logp for row, logp in zip(batch.input_ids, trainer)})
        self.minibatch = 0

    def see(self, logp, old_logp, advantages, mask) -> None:
        trainer = torch.stack([self.trainer_old[bytes(row.cpu().numpy())] for row in self.current.input_ids])
        valid = mask.bool()
        tokens = valid.sum(-1).clamp(min=1)
        d_pol = ((logp - trainer).double() * valid).sum(-1) / tokens  # [b] policy change since the rollout
        d_mis = ((trainer - old_logp).double() * valid).sum(-1) / tokens  # [b] trainer - engine
        adv = advantages if advantages.dim() == 1 else advantages[:, 0]
        rows = valid.any(-1)
        self.calls.append((self.minibatch, d_pol[rows], d_mis[rows], adv[rows].double()))
        self.minibatch += 1


class ObjectiveView:
    """The objective, called through `call`; every attribute the updater reads passes to it."""

    def __init__(self, objective, call) -> None:
        self.objective, self.call = objective, call

    def __getattr__(self, name):
        return getattr(self.objective, name)

    def __call__(self, *args, **kwargs):
        return self.call(*args, **kwargs)


def dropped(log_s: torch.Tensor, adv: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """Rows whose gradient GSPO's clip drops: s > 1 + high with A > 0, s < 1 - low with A < 0."""
    return ((adv > 0) & (log_s > math.log1p(high))) | ((adv < 0) & (log_s < math.log1p(-low)))


def report(name: str, recorders: list[Recorder], low: float, high: float) -> None:
    print(f"\n== {name}: mismatch by completion position (log π_trainer - log π_engine per token)")
    print("positions | tokens | mean diff | mean |diff| | share of |seq log-ratio|")
    bins = sorted({b for r in recorders for b in r.positions})
    total_share = sum(r.seq_share[b] for r in recorders for b in bins)
    for b in bins:
        s, a, n = (sum(r.positions[b][i] for r in recorders) for i in range(3))
        share = sum(r.seq_share[b] for r in recorders) / total_share
        print(f"{b * BIN:3d}-{b * BIN + BIN - 1:<3d} | {n:6d} | {s / n:+.2e} | {a / n:.2e} | {share:.3f}")
    print(f"== {name}: by mini-batch (clip band [1 - {low:g}, 1 + {high:g}])")
    print("minibatch | rows | mean |policy change| | mean |mismatch| | dropped, engine anchor | trainer anchor | "
          "mean A kept, engine | trainer | batch mean A")
    by_m = defaultdict(list)
    for r in recorders:
        for m, d_pol, d_mis, adv in r.calls:
            by_m[m].append((d_pol, d_mis, adv))
    for m in sorted(by_m):
        d_pol, d_mis, adv = (torch.cat([c[i] for c in by_m[m]]) for i in range(3))
        engine = dropped(d_pol + d_mis, adv, low, high)
        trainer = dropped(d_pol, adv, low, high)
        print(f"{m:9d} | {len(adv):4d} | {d_pol.abs().mean():.2e} | {d_mis.abs().mean():.2e} | "
              f"{engine.double().mean():.3f} | {trainer.double().mean():.3f} | {adv[~engine].mean():+.4f} | "
              f"{adv[~trainer].mean():+.4f} | {adv.mean():+.4f}")


def fit_gspo(engine: list[str], seed: int, steps: int, instrument, *overrides: str):
    """One GSPO run of experiment=real_engine on the engine's log-probs as π_old (`engine`: overrides naming it),
    in a temporary folder, with `instrument(module)` called before it trains; returns its config and what
    `instrument` returned. sign_bias.py runs its engines through this too."""
    with tempfile.TemporaryDirectory() as out, initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("train", overrides=["experiment=real_engine", "algorithm=gspo", f"seed={seed}",
                                          "rollout.logprobs_from_generation=true", f"train.steps={steps}",
                                          "train.eval_every=0", f"paths.output_dir={out}", "logger=[]",
                                          "callbacks.progress.refresh_rate=0", *engine, *overrides])
        run, module, _ = build(cfg)
        instrumented = instrument(module)
        run.trainer.fit(module)
        module.close()
    return cfg, instrumented


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    parser.add_argument("--overrides", nargs="*", default=[], help="further Hydra overrides for every run")
    args = parser.parse_args()
    for name in args.engines:
        recorders = []
        for seed in args.seeds:
            cfg, recorder = fit_gspo(ENGINES[name], seed, args.steps, Recorder, *args.overrides)
            recorders.append(recorder)
        report(name, recorders, cfg.objective.clip_low, cfg.objective.clip_high)

if __name__ == "__main__":
    main()
