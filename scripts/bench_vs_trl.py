"""The anchor workload in gspo-lab and in TRL's GRPOTrainer, alternated in one process: seconds per RL step
(one generation of 16 prompts x 8 completions of exactly 32 tokens, then 4 optimizer steps) and their ratio.

Both start from the same randomly initialised tiny Qwen3-MoE and character tokenizer, GSPO (sequence-level
importance sampling, clip 3e-4 / 4e-4, beta 0), on CPU. Both are timed the same way: wall-clock intervals
between the ends of consecutive RL steps, after `--warmup` steps. gspo-lab additionally runs its routing
diagnostics forward every step (TRL has none), so the comparison is not tilted in its favour.

TRL runs twice per round: with transformers' default MoE expert kernel (`grouped_mm`, what a TRL user gets)
and with gspo-lab's own (`index_add`, gspo_lab.models.experts), so the ratio is reported both with and
without that kernel's share. Extra arguments are Hydra overrides for the gspo-lab side only.
Needs the `bench` extra: pip install -e ".[bench]".

    python scripts/bench_vs_trl.py --steps 8 --rounds 3
    python scripts/bench_vs_trl.py rollout.logprobs_from_generation=false   # gspo-lab with a second forward
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import lightning as L
import torch
from datasets import Dataset
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from gspo_lab import CONFIG_DIR
from gspo_lab.tasks.base import Example
from gspo_lab.train import build

PROMPTS, GROUP, NEW_TOKENS, MINIBATCHES = 16, 8, 32, 4


def median_interval(stamps: list[float], warmup: int) -> float:
    return statistics.median([b - a for a, b in zip(stamps, stamps[1:])][warmup:])


class LightningClock(L.Callback):
    """Timestamps at the end of every gspo-lab RL step (one Lightning batch)."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def on_train_batch_end(self, *args, **kwargs) -> None:
        self.stamps.append(time.perf_counter())


class TrlClock(TrainerCallback):
    """Timestamps at the end of every TRL RL step (`MINIBATCHES` optimizer steps per generation)."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % MINIBATCHES == 0:
            self.stamps.append(time.perf_counter())


def anchor_config(out: str, steps: int, overrides: list[str] = ()):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return compose("train", overrides=["experiment=bench_anchor", f"train.steps={steps}", f"paths.output_dir={out}",
                                           "callbacks.progress.refresh_rate=0", "logger=[]", *overrides])


def time_gspo_lab(steps: int, warmup: int, overrides: list[str]) -> float:
    with tempfile.TemporaryDirectory() as out:
        run, module, _ = build(anchor_config(out, steps, overrides))
        clock = LightningClock()
        run.trainer.callbacks.append(clock)
        run.trainer.fit(module)
    return median_interval(clock.stamps, warmup)


def time_trl(steps: int, warmup: int, seed: int, experts: str) -> float:
    with tempfile.TemporaryDirectory() as out:
        cfg = anchor_config(out, steps, [f"model.experts_implementation={experts}"])
        torch.manual_seed(seed)
        model, tokenizer = instantiate(cfg.model).load()
        task = instantiate(cfg.task)
        examples = task.examples("train", PROMPTS * (steps + 1), seed=seed)
        args = GRPOConfig(
            output_dir=out, use_cpu=True, bf16=False, report_to="none", save_strategy="no", logging_steps=10_000,
            seed=seed, max_steps=steps * MINIBATCHES, per_device_train_batch_size=PROMPTS * GROUP // MINIBATCHES,
            steps_per_generation=MINIBATCHES, num_generations=GROUP, max_completion_length=NEW_TOKENS,
            generation_kwargs={"min_new_tokens": NEW_TOKENS}, importance_sampling_level="sequence",
            loss_type="grpo", epsilon=3e-4, epsilon_high=4e-4, beta=0.0, learning_rate=cfg.train.lr,
            temperature=1.0, top_k=0, top_p=1.0, disable_dropout=True, max_grad_norm=cfg.train.grad_clip,
        )
        clock = TrlClock()

        def reward(prompts, completions, answer, **_):  # TRL passes the dataset's other columns by name
            return [task.reward(Example(p, a), c) for p, a, c in zip(prompts, answer, completions)]

        trainer = GRPOTrainer(
            model=model, reward_funcs=reward, args=args, processing_class=tokenizer, callbacks=[clock],
            train_dataset=Dataset.from_list([{"prompt": e.prompt, "answer": e.answer} for e in examples]),
        )
        trainer.train()
    return median_interval(clock.stamps, warmup)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8, help="RL steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="first step intervals not timed")
    parser.add_argument("--rounds", type=int, default=3, help="alternations of the three runs")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for the gspo-lab side")
    args = parser.parse_args()
    times: dict[str, list[float]] = {"gspo-lab": [], "TRL grouped_mm": [], "TRL index_add": []}
    for round_ in range(args.rounds):
        times["gspo-lab"].append(time_gspo_lab(args.steps, args.warmup, args.overrides))
        times["TRL grouped_mm"].append(time_trl(args.steps, args.warmup, round_, "grouped_mm"))
        times["TRL index_add"].append(time_trl(args.steps, args.warmup, round_, "index_add"))
        print(f"round {round_}: " + ", ".join(f"{k} {v[-1]:.3f}" for k, v in times.items()) + " s/step", flush=True)
    median = {k: statistics.median(v) for k, v in times.items()}
    print(f"median over {args.rounds} rounds, {torch.get_num_threads()} threads: "
          + ", ".join(f"{k} {v:.3f}" for k, v in median.items()) + " s/step")
    for trl in ("TRL grouped_mm", "TRL index_add"):
        print(f"  gspo-lab is {median[trl] / median['gspo-lab']:.2f}x faster than {trl}")


if __name__ == "__main__":
    main()
