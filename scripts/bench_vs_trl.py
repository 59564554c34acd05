"""A benchmark workload in gspo-lab and in TRL's GRPOTrainer, alternated in one process: seconds per RL step
(one generation of prompts_per_step x group_size completions of exactly max_new_tokens tokens, then
train.minibatches optimizer steps) and their ratio.

`--workload bench_anchor` (default; conf/experiment/bench_anchor.yaml): 16 prompts x 8 completions of 32 tokens
from a random tiny Qwen3-MoE with the character tokenizer. `--workload bench_paper`: small_moe (8 layers x 32
experts top-4), the task_bpe tokenizer, reasoning-gym word_sorting prompts of about 115 tokens, 16 x 8
completions of 44 tokens. Both sides start from the same randomly initialised model, tokenizer and prompts,
GSPO (sequence-level importance sampling, the workload's clip range, beta 0), gradient checkpointing as the
workload's model.gradient_checkpointing says (off in every bench workload; TRL's GRPOConfig turns it on unless
told, and before 2026-11-25 this script let it, which cost TRL a recomputed forward per backward and saved it
activation memory). Both are timed the same way: the mean wall-clock interval between the ends of consecutive RL
steps, after `--warmup` steps (a mean, so work done every k steps counts at its share). gspo-lab additionally runs
its diagnostics (TRL has none): the mismatch to the engine every step, measured on the first mini-batch's own
forwards, and on an MoE the routing forward after the updates every routing.diagnostics_every steps (4 in
bench_anchor and bench_paper, 1 by default).

A third run per round times the floor of gspo-lab's step (`time_floor`): only the model's own forwards and
backwards that any framework must run for the step with this transformers model (the prompts' prefill, one
decode forward per new token, each mini-batch's forward+backward of the log-probs) and the optimizer steps;
no sampling, rewards, objective, diagnostics or Lightning. No framework built on this model and these kernels
can be faster than TRL / floor times TRL, so that ratio is printed as the ceiling.

TRL runs twice per round: with transformers' default MoE expert kernel (`grouped_mm`, what a TRL user gets)
and with gspo-lab's own (`index_add`, gspo_lab.models.experts), so the ratio is reported both with and
without that kernel's share. Extra arguments are Hydra overrides for the gspo-lab side; the `trainer.*`,
`model.*`, `rollout.*` and `train.*` ones (device and precision, the model, the rollout's and the mini-batches'
sizes) apply to all three runs: TRL then runs on the same device (`use_cpu`) and with bf16 autocast under
`bf16-mixed` (`bf16=True`), and the floor inside the trainer's precision context.
Each run is a process of its own, which also reports its peak memory over the RL steps (the model and optimizer
already built): the peak resident set on CPU (Linux's /proc/self/clear_refs, then VmHWM), torch.cuda's peak
allocated memory on a GPU. `--lengths` repeats every run at several completion lengths (rollout.max_new_tokens;
TRL's max_completion_length). Both sides split a mini-batch the workload's way: gspo-lab in
train.micro_batch_size rows (log-probs train.logprob_chunk_tokens positions at a time), TRL in
per_device_train_batch_size = the same rows with gradient_accumulation_steps to the mini-batch.
`--padded` adds a gspo-lab run with train.padding_free=false to each round (padded forwards against packed ones,
gspo_lab.rollout.packing; the floor follows the workload's train.padding_free). `--workload bench_varlen` answers
of 10 to 400 tokens replayed from a file (conf/experiment/bench_varlen.yaml): no TRL, which always generates; the
floor's "decoding" is the replay backend's one no-grad forward of the recorded tokens.
`--paired` times gspo-lab against its floor alone, their steps alternated one by one in one process per round
(`time_paired`): this CPU's speed moves 20-40% between runs a minute apart, which separate processes cannot tell
from a difference between the sides; the paired ratio can.
Its TRL runs need the `bench` extra (pip install -e ".[bench]"); without it the script times gspo-lab and its floor.

    python scripts/bench_vs_trl.py --steps 8 --rounds 3
    python scripts/bench_vs_trl.py --workload bench_vocab --steps 4 --rounds 1 --lengths 128 256 512 1024
    python scripts/bench_vs_trl.py --workload bench_paper --steps 8 --rounds 3
    python scripts/bench_vs_trl.py --workload bench_gpu --rounds 3 trainer=gpu   # on a GPU node
    python scripts/bench_vs_trl.py --workload bench_varlen --padded --steps 6 --rounds 3   # packed vs padded
    python scripts/bench_vs_trl.py --workload bench_paper --padded --steps 8 --rounds 3
    python scripts/bench_vs_trl.py --workload bench_vocab --padded --lab-only --steps 4 --warmup 1 --lengths 256
    python scripts/bench_vs_trl.py rollout.logprobs_from_generation=false   # gspo-lab with a second forward
    python scripts/bench_vs_trl.py --paired --steps 23 --rounds 4   # gspo-lab against its floor, step by step
                                    # (23 steps: 20 timed, every 4th with bench_anchor's routing forward)
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import lightning as L
import torch
from torch import Tensor
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from transformers import DynamicCache, TrainerCallback

from gspo_lab import CONFIG_DIR
from gspo_lab.decoder import CACHE
from gspo_lab.rollout.generation import generate, position_ids, prefill_distinct_prompts
from gspo_lab.rollout.backend import Sampling
from gspo_lab.rollout.logprobs import token_logprobs
from gspo_lab.rollout.packing import MIN_SAVING
from gspo_lab.routing import is_moe
from gspo_lab.tasks.base import Example
from gspo_lab.train import build

from bench import PhasePeaks  # scripts/bench.py: the peak memory of a stretch of this process


def now() -> float:
    """perf_counter once the GPU's queued work has finished (its kernels run asynchronously)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def mean_interval(stamps: list[float], warmup: int) -> float:
    """The mean interval after the first `warmup`: a mean, not a median, so that work done every k steps (the
    routing forward of routing.diagnostics_every) counts at its share instead of vanishing from the statistic."""
    return statistics.mean([b - a for a, b in itertools.pairwise(stamps)][warmup:])


class LightningClock(L.Callback):
    """Timestamps at the end of every gspo-lab RL step (one Lightning batch)."""

    def __init__(self, peaks: PhasePeaks | None = None) -> None:
        self.stamps: list[float] = []
        self.peaks = peaks

    def on_train_start(self, *args, **kwargs) -> None:  # the model is on its device now
        if self.peaks is not None:
            self.peaks.reset()

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


def time_gspo_lab(workload: str, steps: int, warmup: int, overrides: list[str], peaks: PhasePeaks) -> float:
    with tempfile.TemporaryDirectory() as out:
        run, module, _ = build(workload_config(workload, out, steps, overrides))
        clock = LightningClock(peaks)
        run.trainer.callbacks.append(clock)
        run.trainer.fit(module)
    return mean_interval(clock.stamps, warmup)


def floor_step(workload: str, steps: int, shared: list[str]) -> Callable[[], tuple[float, float]]:
    """One RL step of the floor, the model's forwards, backwards and optimizer steps alone (the module docstring),
    on one generation's completions replayed every step, with the workload's levers (shared prompt prefill and
    forward, expert kernel, log-prob chunking, micro-batches): a function running it, returning its decoding and
    its updates' seconds."""
    with tempfile.TemporaryDirectory() as out:
        cfg = workload_config(workload, out, steps, shared)
        run, module, _ = build(cfg)
    model, rollout, train_cfg = module.model.to(run.trainer.strategy.root_device), cfg.rollout, cfg.train
    prompts = [e.prompt for e in module.task.examples("train", rollout.prompts_per_step, seed=0)
               for _ in range(rollout.group_size)]
    replayed = rollout.backend == "replay"  # bench_varlen: recorded completions, scored in one no-grad forward
    with run.trainer.precision_plugin.train_step_context():  # bf16 autocast under bf16-mixed, as in the RL step
        if replayed:
            sampling = Sampling.of_rollout(module.rollout_cfg, module.render.add_special_tokens)
            done = module.engine.generate(module.tokenizer, prompts, sampling).completions
        else:
            done = generate(model, module.tokenizer, prompts, rollout.max_new_tokens, suppress_eos=True)
    ids = torch.cat([done.prompt_ids, done.completion_ids], 1)
    mask = torch.cat([done.prompt_mask, done.completion_mask], 1)
    prompt_len, new_tokens = done.prompt_ids.shape[1], done.completion_ids.shape[1]
    positions = position_ids(mask)
    optimizer = module.configure_optimizers()
    model.eval()  # as RLModule keeps it

    @torch.inference_mode()
    def decode() -> None:
        if replayed:  # what the replay backend computes: the log-probs of the recorded tokens
            token_logprobs(model, ids, mask, new_tokens, rollout.temperature, packed=module.policy.packed,
                           pack_min_saving=MIN_SAVING)
            return
        shared = rollout.share_prompt_prefill
        cache = prefill_distinct_prompts(model, done.prompt_ids, done.prompt_mask) if shared else None
        floor_decode(model, ids, mask, positions, prompt_len, new_tokens, cache)

    def update() -> None:
        for minibatch in torch.randperm(len(ids)).chunk(train_cfg.minibatches):
            for rows in minibatch.split(train_cfg.micro_batch_size or len(minibatch)):
                logp, _ = token_logprobs(model, ids[rows], mask[rows], new_tokens, rollout.temperature,
                                         train_cfg.logprob_chunk_rows, share_prompts=train_cfg.share_prompt_forward,
                                         chunk_tokens=train_cfg.logprob_chunk_tokens, packed=module.policy.packed,
                                         pack_min_saving=train_cfg.pack_min_saving)
                (logp * mask[rows, prompt_len:]).sum().backward()
            optimizer.step()
            optimizer.zero_grad()

    def step() -> tuple[float, float]:
        with run.trainer.precision_plugin.train_step_context():
            started = now()
            decode()
            decoded = now()
            update()
            return decoded - started, now() - decoded

    return step


@torch.inference_mode()
def floor_decode(model, ids: Tensor, mask: Tensor, positions: Tensor, prompt_len: int, new_tokens: int,
                 cache: DynamicCache | None = None) -> None:
    """The floor's decoding of the [B, prompt_len + new_tokens] `ids`: the prompts' prefill (from the last prompt
    token on when `cache` holds the rest, `prefill_distinct_prompts`), then one forward per new token, the cache
    growing in place and logits of the last position only; the last new token is never fed back."""
    cache, start = (DynamicCache(config=model.config), 0) if cache is None else (cache, prompt_len - 1)
    for end in range(prompt_len, prompt_len + new_tokens):
        model(input_ids=ids[:, start:end], attention_mask=mask[:, :end], position_ids=positions[:, start:end],
              use_cache=True, logits_to_keep=1, **{CACHE: cache})
        start = end


def floor_means(seconds: list[tuple[float, float]], warmup: int) -> tuple[float, float]:
    """Means of the decoding and the updates, the first warmup + 1 steps left out, as mean_interval leaves
    out the first warmup intervals."""
    decode_s, update_s = (statistics.mean(phase[warmup + 1 :]) for phase in zip(*seconds))
    print(f"  floor: decoding {decode_s:.3f} + updates {update_s:.3f} s/step", flush=True)
    return decode_s, update_s


def time_floor(workload: str, steps: int, warmup: int, shared: list[str], peaks: PhasePeaks) -> float:
    """Seconds per RL step of the floor (`floor_step`)."""
    step = floor_step(workload, steps, shared)
    peaks.reset()
    return sum(floor_means([step() for _ in range(steps)], warmup))


class FloorBetweenSteps(L.Callback):
    """After each gspo-lab RL step, one floor step (`floor_step`), timed apart: gspo-lab's intervals run from the
    end of one floor step to the end of the next gspo-lab step (Lightning's own work between steps included)."""

    def __init__(self, step: Callable[[], tuple[float, float]]) -> None:
        self.step = step
        self.lab: list[float] = []
        self.floor: list[tuple[float, float]] = []
        self.resumed: float | None = None

    def on_train_batch_end(self, *args, **kwargs) -> None:
        ended = now()
        if self.resumed is not None:
            self.lab.append(ended - self.resumed)
        self.floor.append(self.step())
        self.resumed = now()


def time_paired(workload: str, steps: int, warmup: int, overrides: list[str], shared: list[str]) -> dict[str, float]:
    """gspo-lab's and the floor's mean seconds per RL step (`mean_interval`), their steps alternated one by one in
    this process so that a change in the machine's speed (this CPU's separate runs spread 20-40%) falls on both
    alike, and the median over the timed pairs of floor / gspo-lab. Time only: both models share the process."""
    between = FloorBetweenSteps(floor_step(workload, steps, shared))
    with tempfile.TemporaryDirectory() as out:
        run, module, _ = build(workload_config(workload, out, steps, overrides))
        run.trainer.callbacks.append(between)
        run.trainer.fit(module)
    lab = between.lab[warmup:]  # the first gspo-lab step has no interval: as mean_interval
    floor = [sum(pair) for pair in between.floor[warmup + 1 :]]
    phases = [statistics.mean(row[key] for row in module.history[warmup + 1 :] if key in row)
              for key in ("time/rollout_s", "time/update_s")]
    print(f"  gspo-lab: rollout {phases[0]:.3f} + updates {phases[1]:.3f} s/step", flush=True)
    floor_means(between.floor, warmup)
    return {"seconds": statistics.mean(lab), "floor_seconds": statistics.mean(floor),
            "pair_ratio": statistics.median(f / g for f, g in zip(floor, lab))}


def time_trl(workload: str, steps: int, warmup: int, seed: int, experts: str | None, shared: list[str],
             peaks: PhasePeaks) -> float:
    """TRL's seconds per RL step; `experts`: the MoE expert kernel (None for a dense model)."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    kernel = [f"model.experts_implementation={experts}"] if experts else []
    with tempfile.TemporaryDirectory() as out:
        cfg = workload_config(workload, out, steps, [*shared, *kernel])
        prompts, group, new_tokens = cfg.rollout.prompts_per_step, cfg.rollout.group_size, cfg.rollout.max_new_tokens
        minibatches = cfg.train.minibatches
        rows = prompts * group // minibatches  # a mini-batch
        micro = cfg.train.micro_batch_size or rows
        if rows % micro:  # TRL's generation batch is micro x accumulation rows: it would sample more than gspo-lab
            raise ValueError(f"train.micro_batch_size={micro} must divide the {rows}-row mini-batch for TRL")
        accumulation = rows // micro
        task = instantiate(cfg.task)
        torch.manual_seed(seed)
        model, tokenizer = instantiate(cfg.model).load(task)
        examples = task.examples("train", prompts * (steps + 1), seed=seed)
        args = GRPOConfig(
            output_dir=out, use_cpu=cfg.trainer.accelerator == "cpu", bf16=cfg.trainer.precision == "bf16-mixed",
            report_to="none", save_strategy="no", logging_steps=10_000,
            seed=seed, max_steps=steps * minibatches, per_device_train_batch_size=micro,
            gradient_accumulation_steps=accumulation, steps_per_generation=minibatches * accumulation,
            num_generations=group, max_completion_length=new_tokens,
            generation_kwargs={"min_new_tokens": new_tokens}, importance_sampling_level="sequence",
            loss_type="grpo", epsilon=cfg.objective.clip_low, epsilon_high=cfg.objective.clip_high, beta=0.0,
            learning_rate=cfg.train.lr, temperature=1.0, top_k=0, top_p=1.0, disable_dropout=True,
            max_grad_norm=cfg.train.grad_clip,
            # GRPOConfig turns it on by default: both sides recompute activations in the backward, or neither
            gradient_checkpointing=cfg.model.gradient_checkpointing,
        )
        clock = TrlClock(minibatches)

        def reward(prompts, completions, answer, **_):  # TRL passes the dataset's other columns by name
            return [task.reward(Example(p, a), c) for p, a, c in zip(prompts, answer, completions)]

        trainer = GRPOTrainer(
            model=model, reward_funcs=reward, args=args, processing_class=tokenizer, callbacks=[clock],
            train_dataset=Dataset.from_list([{"prompt": e.prompt, "answer": e.answer} for e in examples]),
        )
        peaks.reset()
        trainer.train()
    return mean_interval(clock.stamps, warmup)


class RunPeak(PhasePeaks):
    """The peak memory since `reset` (called once, when the RL steps start) and the memory at that moment."""

    def reset(self) -> None:
        super().reset()
        self.start = self.read()  # right after a reset the peak is the current memory


def run_one(side: str, args) -> None:
    """One timed run in this process (a child of main): prints its seconds per step, its peak memory over the
    RL steps and that peak's rise above the memory when they started (model and optimizer built) as JSON."""
    peaks = RunPeak(torch.cuda.is_available())
    # device, precision and the workload's sizes: every run's, gspo-lab's, the floor's and TRL's
    shared = [o for o in args.overrides if o.split("=")[0].split(".")[0] in ("trainer", "model", "rollout", "train")]
    length = [f"rollout.max_new_tokens={args.length}"] if args.length else []
    if side == "paired":  # time only: two models in one process
        paired = time_paired(args.workload, args.steps, args.warmup, args.overrides + length, shared + length)
        print("RESULT " + json.dumps(paired), flush=True)
        return
    if side.startswith("gspo-lab"):  # "gspo-lab padded": train.padding_free=false (--padded)
        padded = ["train.padding_free=false"] if side.endswith("padded") else []
        seconds = time_gspo_lab(args.workload, args.steps, args.warmup, args.overrides + length + padded, peaks)
    elif side == "floor":
        seconds = time_floor(args.workload, args.steps, args.warmup, shared + length, peaks)
    else:  # "TRL" or "TRL <experts kernel>"
        experts = side.split()[1] if " " in side else None
        seconds = time_trl(args.workload, args.steps, args.warmup, args.seed, experts, shared + length, peaks)
    peak = peaks.read()
    print("RESULT " + json.dumps({"seconds": seconds, "peak_mib": peak, "rise_mib": peak - peaks.start}), flush=True)


def child(side: str, length: int | None, seed: int, args) -> dict[str, float]:
    command = [sys.executable, __file__, "--child", side, "--workload", args.workload, "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--seed", str(seed), *(["--length", str(length)] if length else []),
               *args.overrides]
    done = subprocess.run(command, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith(("RESULT ", "  floor", "  gspo-lab"))]
    if done.returncode != 0 or not lines or not lines[-1].startswith("RESULT "):
        raise RuntimeError(f"{side} (length {length}) failed:\n{done.stderr[-3000:]}")
    for line in lines[:-1]:
        print(line, flush=True)
    return json.loads(lines[-1].removeprefix("RESULT "))


def sides_of(workload: str, padded: bool, lab_only: bool = False) -> list[str]:
    """gspo-lab (and with `padded` gspo-lab with train.padding_free=false), its floor and TRL, twice for a MoE model
    (transformers' expert kernel and gspo-lab's); without TRL installed (the `bench` extra) no TRL, and for a
    workload that replays recorded completions (bench_varlen) gspo-lab's runs only, each said on stdout."""
    with tempfile.TemporaryDirectory() as out:
        cfg = workload_config(workload, out, 1)
        moe = is_moe(instantiate(cfg.model).skeleton())
    lab = ["gspo-lab", "gspo-lab padded"] if padded else ["gspo-lab"]
    if lab_only:
        return lab
    if cfg.rollout.backend == "replay":
        print(f"{workload} replays recorded completions (rollout.backend=replay), which TRL's GRPOTrainer cannot (it "
              "always generates; TRL 1.16's GRPOConfig has no padding_free): gspo-lab and its floor (which scores "
              "the recorded completions as the replay backend does) only", flush=True)
        return [*lab, "floor"]
    if importlib.util.find_spec("trl") is None:
        print("TRL is not installed (pip install -e '.[bench]'): gspo-lab and its floor only", flush=True)
        return [*lab, "floor"]
    return [*lab, "floor"] + (["TRL grouped_mm", "TRL index_add"] if moe else ["TRL"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="bench_anchor", help="conf/experiment/<workload>.yaml")
    parser.add_argument("--steps", type=int, default=8, help="RL steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="first step intervals not timed")
    parser.add_argument("--rounds", type=int, default=3, help="alternations of the runs")
    parser.add_argument("--lengths", type=int, nargs="*", default=[None],
                        help="completion lengths (rollout.max_new_tokens) to run at; default the workload's")
    parser.add_argument("--padded", action="store_true",
                        help="also time gspo-lab with train.padding_free=false, alternated with the rest")
    parser.add_argument("--lab-only", action="store_true", help="gspo-lab's runs only: no floor, no TRL")
    parser.add_argument("--paired", action="store_true",
                        help="gspo-lab against its floor only, their steps alternated one by one in one process")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for the gspo-lab side")
    # key=value wherever it stands: after `--lengths 256 1024` argparse would read `trainer=gpu` as a length
    overrides = [a for a in sys.argv[1:] if "=" in a and not a.startswith("-")]
    args = parser.parse_args([a for a in sys.argv[1:] if a not in overrides])
    args.overrides = overrides + args.overrides
    if args.child:
        return run_one(args.child, args)
    if args.paired:
        return paired(args)
    sides = sides_of(args.workload, args.padded, args.lab_only)
    results: dict[tuple[int | None, str], list[dict[str, float]]] = {}
    for round_, length in itertools.product(range(args.rounds), args.lengths):
        for side in sides:
            results.setdefault((length, side), []).append(child(side, length, round_, args))
        print(f"round {round_}, length {length or 'default'}: " + ", ".join(
            f"{side} {results[length, side][-1]['seconds']:.3f} s {results[length, side][-1]['peak_mib']:.0f} MiB"
            for side in sides), flush=True)
    memory = "peak CUDA allocated" if torch.cuda.is_available() else "peak RSS"
    print(f"{args.workload}: medians over {args.rounds} rounds of each run's mean, {torch.get_num_threads()} "
          f"threads; s/step, {memory} over the RL steps (+ its rise above their start) MiB")
    keys = ("seconds", "peak_mib", "rise_mib")
    for length in args.lengths:
        median = {side: {key: statistics.median(r[key] for r in results[length, side]) for key in keys}
                  for side in sides}
        print(f"  length {length or 'default'}: " + ", ".join(
            f"{side} {m['seconds']:.3f} s {m['peak_mib']:.0f} (+{m['rise_mib']:.0f}) MiB"
            for side, m in median.items()))
        lab = median["gspo-lab"]
        if "gspo-lab padded" in median:
            padded = median["gspo-lab padded"]
            ratios = [p["seconds"] / g["seconds"] for g, p in zip(results[length, "gspo-lab"],
                                                                   results[length, "gspo-lab padded"])]
            print(f"    packed (train.padding_free=true) is {padded['seconds'] / lab['seconds']:.2f}x faster than "
                  f"padded (rounds {min(ratios):.2f}-{max(ratios):.2f}x), peak memory {lab['peak_mib']:.0f} against "
                  f"{padded['peak_mib']:.0f} MiB (rise {lab['rise_mib']:.0f} against {padded['rise_mib']:.0f})")
        if "floor" in median:
            print(f"    gspo-lab at {median['floor']['seconds'] / lab['seconds']:.0%} of the floor")
        for trl in (side for side in sides if side.startswith("TRL")):
            print(f"    gspo-lab is {median[trl]['seconds'] / lab['seconds']:.2f}x faster than {trl} "
                  f"(the floor would be {median[trl]['seconds'] / median['floor']['seconds']:.2f}x) and uses "
                  f"{lab['peak_mib'] / median[trl]['peak_mib']:.2f} of its peak memory "
                  f"({lab['rise_mib'] / median[trl]['rise_mib']:.2f} of its rise)")


def paired(args) -> None:
    """`--paired`: per round one process alternating gspo-lab's and the floor's steps (`time_paired`)."""
    for length in args.lengths:
        rounds = [child("paired", length, round_, args) for round_ in range(args.rounds)]
        for round_, r in enumerate(rounds):
            print(f"round {round_}, length {length or 'default'}: gspo-lab {r['seconds']:.3f} s, floor "
                  f"{r['floor_seconds']:.3f} s (means), {r['floor_seconds'] / r['seconds']:.0%} of the floor "
                  f"(pairs' median {r['pair_ratio']:.0%})", flush=True)
        lab, floor = (statistics.median(r[key] for r in rounds) for key in ("seconds", "floor_seconds"))
        ratio = statistics.median(r["floor_seconds"] / r["seconds"] for r in rounds)
        print(f"{args.workload}, length {length or 'default'}: {args.rounds} rounds of {args.steps} alternated steps, "
              f"{torch.get_num_threads()} threads; medians of the rounds' means: gspo-lab {lab:.3f} s/step, floor "
              f"{floor:.3f}; median of the rounds' ratios: gspo-lab at {ratio:.0%} of the floor (of their pair "
              f"medians {statistics.median(r['pair_ratio'] for r in rounds):.0%})")


if __name__ == "__main__":
    main()
