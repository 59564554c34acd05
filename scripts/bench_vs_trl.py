"""A benchmark workload in gspo-lab and in TRL's GRPOTrainer, alternated in one process: seconds per RL step
(one generation of prompts_per_step x group_size completions of exactly max_new_tokens tokens, then
train.minibatches optimizer steps) and their ratio.

`--workload bench_anchor` (default; conf/experiment/bench_anchor.yaml): 16 prompts x 8 completions of 32 tokens
from a random tiny Qwen3-MoE with the character tokenizer. `--workload bench_paper`: small_moe (8 layers x 32
experts top-4), the task_bpe tokenizer, reasoning-gym word_sorting prompts of about 115 tokens, 16 x 8
completions of 44 tokens. Both sides start from the same randomly initialised model, tokenizer and prompts,
GSPO (sequence-level importance sampling, the workload's clip range, beta 0), on CPU. Both are timed the same
way: wall-clock intervals between the ends of consecutive RL steps, after `--warmup` steps. gspo-lab
additionally runs its routing diagnostics and mismatch forwards every step (TRL has none), so the comparison is
not tilted in its favour.

TRL runs twice per round: with transformers' default MoE expert kernel (`grouped_mm`, what a TRL user gets)
and with gspo-lab's own (`index_add`, gspo_lab.models.experts), so the ratio is reported both with and
without that kernel's share. Extra arguments are Hydra overrides for the gspo-lab side only.
Needs the `bench` extra: pip install -e ".[bench]".

    python scripts/bench_vs_trl.py --steps 8 --rounds 3
    python scripts/bench_vs_trl.py --workload bench_paper --steps 8 --rounds 3
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


def median_interval(stamps: list[float], warmup: int) -> float:
    return statistics.median([b - a for a, b in zip(stamps, stamps[1:])][warmup:])


class LightningClock(L.Callback):
    """Timestamps at the end of every gspo-lab RL step (one Lightning batch)."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def on_train_batch_end(self, *args, **kwargs) -> None:
        self.stamps.append(time.perf_counter())


class TrlClock(TrainerCallback):
    """Timestamps at the end of every TRL RL step (`minibatches` optimizer steps per generation)."""

    def __init__(self, minibatches: int) -> None:
        self.stamps: list[float] = []
        self.minibatches = minibatches

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.minibatches == 0:
            self.stamps.append(time.perf_counter())


def workload_config(workload: str, out: str, steps: int, overrides: list[str] = ()):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return compose("train", overrides=[f"experiment={workload}", f"train.steps={steps}", f"paths.output_dir={out}",
                                           "callbacks.progress.refresh_rate=0", "logger=[]", *overrides])


def time_gspo_lab(workload: str, steps: int, warmup: int, overrides: list[str]) -> float:
    with tempfile.TemporaryDirectory() as out:
        run, module, _ = build(workload_config(workload, out, steps, overrides))
        clock = LightningClock()
        run.trainer.callbacks.append(clock)
        run.trainer.fit(module)
    return median_interval(clock.stamps, warmup)


def time_trl(workload: str, steps: int, warmup: int, seed: int, experts: str) -> float:
    with tempfile.TemporaryDirectory() as out:
        cfg = workload_config(workload, out, steps, [f"model.experts_implementation={experts}"])
        prompts, group, new_tokens = cfg.rollout.prompts_per_step, cfg.rollout.group_size, cfg.rollout.max_new_tokens
        minibatches = cfg.train.minibatches
        task = instantiate(cfg.task)
        torch.manual_seed(seed)
        model, tokenizer = instantiate(cfg.model).load(task)
        examples = task.examples("train", prompts * (steps + 1), seed=seed)
        args = GRPOConfig(
            output_dir=out, use_cpu=True, bf16=False, report_to="none", save_strategy="no", logging_steps=10_000,
            seed=seed, max_steps=steps * minibatches, per_device_train_batch_size=prompts * group // minibatches,
            steps_per_generation=minibatches, num_generations=group, max_completion_length=new_tokens,
            generation_kwargs={"min_new_tokens": new_tokens}, importance_sampling_level="sequence",
            loss_type="grpo", epsilon=cfg.objective.clip_low, epsilon_high=cfg.objective.clip_high, beta=0.0,
            learning_rate=cfg.train.lr, temperature=1.0, top_k=0, top_p=1.0, disable_dropout=True,
            max_grad_norm=cfg.train.grad_clip,
        )
        clock = TrlClock(minibatches)

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
    parser.add_argument("--workload", default="bench_anchor", help="conf/experiment/<workload>.yaml")
    parser.add_argument("--steps", type=int, default=8, help="RL steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="first step intervals not timed")
    parser.add_argument("--rounds", type=int, default=3, help="alternations of the three runs")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for the gspo-lab side")
    args = parser.parse_args()
    times: dict[str, list[float]] = {"gspo-lab": [], "TRL grouped_mm": [], "TRL index_add": []}
    for round_ in range(args.rounds):
        times["gspo-lab"].append(time_gspo_lab(args.workload, args.steps, args.warmup, args.overrides))
        times["TRL grouped_mm"].append(time_trl(args.workload, args.steps, args.warmup, round_, "grouped_mm"))
        times["TRL index_add"].append(time_trl(args.workload, args.steps, args.warmup, round_, "index_add"))
        print(f"round {round_}: " + ", ".join(f"{k} {v[-1]:.3f}" for k, v in times.items()) + " s/step", flush=True)
    median = {k: statistics.median(v) for k, v in times.items()}
    print(f"{args.workload}: median over {args.rounds} rounds, {torch.get_num_threads()} threads: "
          + ", ".join(f"{k} {v:.3f}" for k, v in median.items()) + " s/step")
    for trl in ("TRL grouped_mm", "TRL index_add"):
        print(f"  gspo-lab is {median[trl] / median['gspo-lab']:.2f}x faster than {trl}")


if __name__ == "__main__":
    main()
