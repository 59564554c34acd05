"""A benchmark workload in gspo-lab and in TRL's GRPOTrainer, alternated in one process: seconds per RL step
(one generation of prompts_per_step x group_size completions of exactly max_new_tokens tokens, then
train.minibatches optimizer steps) and their ratio.

`--workload bench_anchor` (default; conf/experiment/bench_anchor.yaml): 16 prompts x 8 completions of 32 tokens
from a random tiny Qwen3-MoE with the character tokenizer. `--workload bench_paper`: small_moe (8 layers x 32
experts top-4), the task_bpe tokenizer, reasoning-gym word_sorting prompts of about 115 tokens, 16 x 8
completions of 44 tokens. Both sides start from the same randomly initialised model, tokenizer and prompts,
GSPO (sequence-level importance sampling, the workload's clip range, beta 0). Both are timed the same
way: wall-clock intervals between the ends of consecutive RL steps, after `--warmup` steps. gspo-lab
additionally runs its routing diagnostics and mismatch forwards every step (TRL has none), so the comparison is
not tilted in its favour.

A third run per round times the floor of gspo-lab's step (`time_floor`): only the model's own forwards and
backwards that any framework must run for the step with this transformers model (the prompts' prefill, one
decode forward per new token, each mini-batch's forward+backward of the log-probs) and the optimizer steps;
no sampling, rewards, objective, diagnostics or Lightning. No framework built on this model and these kernels
can be faster than TRL / floor times TRL, so that ratio is printed as the ceiling.

TRL runs twice per round: with transformers' default MoE expert kernel (`grouped_mm`, what a TRL user gets)
and with gspo-lab's own (`index_add`, gspo_lab.models.experts), so the ratio is reported both with and
without that kernel's share. Extra arguments are Hydra overrides for the gspo-lab side; the `trainer.*` ones
(device and precision) apply to all three runs: TRL then runs on the same device (`use_cpu`) and with bf16
autocast under `bf16-mixed` (`bf16=True`), and the floor inside the trainer's precision context.
Needs the `bench` extra: pip install -e ".[bench]".

    python scripts/bench_vs_trl.py --steps 8 --rounds 3
    python scripts/bench_vs_trl.py --workload bench_paper --steps 8 --rounds 3
    python scripts/bench_vs_trl.py --workload bench_gpu --rounds 3 trainer=gpu   # on a GPU node
    python scripts/bench_vs_trl.py rollout.logprobs_from_generation=false   # gspo-lab with a second forward
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import tempfile
import time

import lightning as L
import torch
from datasets import Dataset
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from transformers import DynamicCache, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from gspo_lab import CONFIG_DIR
from gspo_lab.rollout.generation import generate, position_ids, prefill_distinct_prompts
from gspo_lab.rollout.logprobs import token_logprobs
from gspo_lab.tasks.base import Example
from gspo_lab.train import build


def now() -> float:
    """perf_counter once the GPU's queued work has finished (its kernels run asynchronously)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def median_interval(stamps: list[float], warmup: int) -> float:
    return statistics.median([b - a for a, b in itertools.pairwise(stamps)][warmup:])


class LightningClock(L.Callback):
    """Timestamps at the end of every gspo-lab RL step (one Lightning batch)."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def on_train_batch_end(self, *args, **kwargs) -> None:
        self.stamps.append(now())


class TrlClock(TrainerCallback):
    """Timestamps at the end of every TRL RL step (`minibatches` optimizer steps per generation)."""

    def __init__(self, minibatches: int) -> None:
        self.stamps: list[float] = []
        self.minibatches = minibatches

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.minibatches == 0:
            self.stamps.append(now())


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


def time_floor(workload: str, steps: int, warmup: int, trainer: list[str]) -> float:
    """Seconds per RL step of the model's forwards, backwards and optimizer steps alone (the module docstring),
    on one generation's completions replayed every step, with the workload's levers (shared prompt prefill and
    forward, expert kernel, log-prob chunking)."""
    with tempfile.TemporaryDirectory() as out:
        cfg = workload_config(workload, out, steps, trainer)
        run, module, _ = build(cfg)
    model, rollout, train_cfg = module.model.to(run.trainer.strategy.root_device), cfg.rollout, cfg.train
    prompts = [e.prompt for e in module.task.examples("train", rollout.prompts_per_step, seed=0)
               for _ in range(rollout.group_size)]
    with run.trainer.precision_plugin.train_step_context():  # bf16 autocast under bf16-mixed, as in the RL step
        done = generate(model, module.tokenizer, prompts, rollout.max_new_tokens, suppress_eos=True)
    ids = torch.cat([done.prompt_ids, done.completion_ids], 1)
    mask = torch.cat([done.prompt_mask, done.completion_mask], 1)
    prompt_len, new_tokens = done.prompt_ids.shape[1], done.completion_ids.shape[1]
    positions = position_ids(mask)
    optimizer = module.configure_optimizers()
    model.eval()  # as RLModule keeps it

    @torch.inference_mode()
    def decode() -> None:  # the cache grows in place; logits of the last position only
        shared = rollout.share_prompt_prefill
        cache = prefill_distinct_prompts(model, done.prompt_ids, done.prompt_mask) if shared else None
        cache, start = (DynamicCache(config=model.config), 0) if cache is None else (cache, prompt_len - 1)
        for end in range(prompt_len, prompt_len + new_tokens):  # the last new token is never fed back
            model(input_ids=ids[:, start:end], attention_mask=mask[:, :end], position_ids=positions[:, start:end],
                  past_key_values=cache, use_cache=True, logits_to_keep=1)
            start = end

    def update() -> None:
        for rows in torch.randperm(len(ids)).chunk(train_cfg.minibatches):
            logp, _ = token_logprobs(model, ids[rows], mask[rows], new_tokens, rollout.temperature,
                                     train_cfg.logprob_chunk_rows, share_prompts=train_cfg.share_prompt_forward)
            (logp * mask[rows, prompt_len:]).sum().backward()
            optimizer.step()
            optimizer.zero_grad()

    decoding, updating = [], []
    for _ in range(steps):
        with run.trainer.precision_plugin.train_step_context():
            started = now()
            decode()
            decoded = now()
            update()
            decoding.append(decoded - started)
            updating.append(now() - decoded)
    # the first warmup + 1 steps left out, as median_interval leaves out the first warmup intervals
    decode_s, update_s = (statistics.median(seconds[warmup + 1 :]) for seconds in (decoding, updating))
    print(f"  floor: decoding {decode_s:.3f} + updates {update_s:.3f} s/step", flush=True)
    return decode_s + update_s


def time_trl(workload: str, steps: int, warmup: int, seed: int, experts: str, trainer: list[str]) -> float:
    with tempfile.TemporaryDirectory() as out:
        cfg = workload_config(workload, out, steps, [f"model.experts_implementation={experts}", *trainer])
        prompts, group, new_tokens = cfg.rollout.prompts_per_step, cfg.rollout.group_size, cfg.rollout.max_new_tokens
        minibatches = cfg.train.minibatches
        task = instantiate(cfg.task)
        torch.manual_seed(seed)
        model, tokenizer = instantiate(cfg.model).load(task)
        examples = task.examples("train", prompts * (steps + 1), seed=seed)
        args = GRPOConfig(
            output_dir=out, use_cpu=cfg.trainer.accelerator == "cpu", bf16=cfg.trainer.precision == "bf16-mixed",
            report_to="none", save_strategy="no", logging_steps=10_000,
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
    parser.add_argument("--rounds", type=int, default=3, help="alternations of the four runs")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for the gspo-lab side")
    args = parser.parse_args()
    trainer = [o for o in args.overrides if o.startswith(("trainer=", "trainer."))]  # device, precision: all runs
    times: dict[str, list[float]] = {"gspo-lab": [], "TRL grouped_mm": [], "TRL index_add": [], "floor": []}
    for round_ in range(args.rounds):
        times["gspo-lab"].append(time_gspo_lab(args.workload, args.steps, args.warmup, args.overrides))
        times["floor"].append(time_floor(args.workload, args.steps, args.warmup, trainer))
        for experts in ("grouped_mm", "index_add"):
            seconds = time_trl(args.workload, args.steps, args.warmup, round_, experts, trainer)
            times[f"TRL {experts}"].append(seconds)
        print(f"round {round_}: " + ", ".join(f"{k} {v[-1]:.3f}" for k, v in times.items()) + " s/step", flush=True)
    median = {k: statistics.median(v) for k, v in times.items()}
    print(f"{args.workload}: median over {args.rounds} rounds, {torch.get_num_threads()} threads: "
          + ", ".join(f"{k} {v:.3f}" for k, v in median.items()) + " s/step")
    for trl in ("TRL grouped_mm", "TRL index_add"):
        print(f"  gspo-lab is {median[trl] / median['gspo-lab']:.2f}x faster than {trl}; "
              f"the floor (model and optimizer alone) would be {median[trl] / median['floor']:.2f}x")


if __name__ == "__main__":
    main()
