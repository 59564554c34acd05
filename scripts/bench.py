"""Seconds per RL step of a named workload, split into generation / old log-probs / updates, with tokens per
second, peak memory and model-FLOPs utilisation against this machine's matmul rate (measured in the same
run, same threads, same dtype).

    python scripts/bench.py                       # the anchor workload (conf/experiment/bench_anchor.yaml)
    python scripts/bench.py --workload bench_anchor --steps 20 model.config.num_hidden_layers=8
    python scripts/bench.py --workload bench_gpu trainer=gpu      # on a GPU node: a 334M-parameter MoE in bf16
    python scripts/bench.py objective.beta=0.04   # the KL penalty's reference policy: its forward and memory
    python scripts/bench.py objective.beta=0.04 model.lora.enabled=true   # LoRA: the reference is the base itself

Peak memory is measured per phase of each timed step (the rollout: generation, old and reference log-probs,
rewards, mismatch diagnostics; the updates: training forwards and backwards, optimizer steps, routing
diagnostics): on CPU the process's peak resident set, reset at the start of each phase (Linux's
/proc/self/clear_refs, then VmHWM); on a GPU torch.cuda's peak allocated memory, reset likewise. The medians over
timed steps are printed.

Model FLOPs per RL step count the matmuls of the active parameters (experts weighted by top-k / experts):
2 N per token for each forward (generation, the old log-probs' forward unless they come from generation, the
routing diagnostics' rows) and 6 N per token for each training forward+backward, over the padded [B, width]
tokens; attention score FLOPs are left out.
"""

from __future__ import annotations

import argparse
import functools
import math
import re
import resource
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from gspo_lab import CONFIG_DIR
from gspo_lab.models.lora import apply_lora
from gspo_lab.step.collector import RolloutCollector
from gspo_lab.step.updater import Updater
from gspo_lab.report.run import step_rows
from gspo_lab.routing import is_moe
from gspo_lab.train import train


def matmul_rate(dtype: torch.dtype, device: str, size: int | None = None, seconds: float = 1.0) -> float:
    """Sustained FLOP/s of square matmuls, the yardstick of MFU: 1,024 on CPU, 8,192 on a GPU (at 1,024 an H100
    measured 90-105 TFLOP/s in bf16 on 2026-11-25, a tenth of the 989 NVIDIA lists for dense bf16: too small)."""
    size = size or (8192 if device == "cuda" else 1024)
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    for _ in range(3):
        a @ b
    count, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        a @ b
        count += 1
    if device == "cuda":
        torch.cuda.synchronize()
    return 2 * size**3 * count / (time.perf_counter() - started)


class PhasePeaks:
    """Peak memory of each call of the RL step's methods it wraps, in MiB: CUDA allocated on a GPU, else the
    process's peak RSS, reset before each call (Linux; elsewhere the peak since start, said in the output)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.peaks: dict[str, list[float]] = defaultdict(list)
        self.rises: dict[str, list[float]] = defaultdict(list)  # the peak above the memory at the phase's start
        self.resettable = cuda or Path("/proc/self/clear_refs").exists()

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        elif self.resettable:
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS

    def read(self) -> float:
        if self.cuda:
            return torch.cuda.max_memory_allocated() / 2**20
        status = Path("/proc/self/status")
        if status.exists():
            return int(re.search(r"VmHWM:\s+(\d+)", status.read_text()).group(1)) / 1024
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    def wrap(self, phase: str, method):
        @functools.wraps(method)
        def measured(module, *args, **kwargs):
            self.reset()
            start = self.read()  # right after a reset the peak is the current memory
            try:
                return method(module, *args, **kwargs)
            finally:
                self.peaks[phase].append(self.read())
                self.rises[phase].append(self.peaks[phase][-1] - start)
        return measured


def active_parameters(model: torch.nn.Module) -> float:
    """Parameters a token passes through: embeddings out, experts weighted by top-k / number of experts."""
    config = model.config
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    top_k = getattr(config, "num_experts_per_tok", None)
    total = 0.0
    for name, parameter in model.named_parameters():
        if "embed_tokens" in name:
            continue
        share = top_k / experts if experts and ".experts." in name else 1.0
        total += parameter.numel() * share
    return total


def nan_median(values) -> float:
    """The median of the values that are not NaN (a metric logged on some steps only); NaN if none is."""
    kept = [v for v in values if not math.isnan(v)]
    return statistics.median(kept) if kept else math.nan


def old_forward_units(cfg) -> int:
    """Model FLOPs of the old log-probs per (active parameter x token): a no-grad forward, unless from generation."""
    return 0 if cfg.rollout.logprobs_from_generation else 2


def diagnostic_units(cfg, moe: bool, completions: float) -> float:
    """Model FLOPs of the diagnostics' own forwards per (active parameter x token), averaged over
    routing.diagnostics_every steps: the forward before the updates where the first mini-batch's forwards do not
    measure it (under replay, or a first mini-batch smaller than routing.diagnostics_rows), and for an MoE the
    routing forward after them, each over diagnostics_rows of the batch's rows."""
    rows = min(cfg.routing.diagnostics_rows or completions, completions)
    first = math.ceil(completions / cfg.train.minibatches)  # torch.chunk's first mini-batch
    own_before = (moe and cfg.routing.replay != "off") or first < rows
    return 2 * rows / completions * (int(own_before) + int(moe)) / cfg.routing.diagnostics_every


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="bench_anchor", help="an experiment in conf/experiment")
    parser.add_argument("--steps", type=int, default=20, help="RL steps; the first two are warm-up, not timed")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as out, initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("train", overrides=[f"experiment={args.workload}", f"train.steps={args.steps}",
                                          f"paths.output_dir={out}", "callbacks.progress.refresh_rate=0",
                                          *args.overrides])
        source = instantiate(cfg.model)
        model, _ = source.load(instantiate(cfg.task))  # task_bpe trains on the task
        active, moe = active_parameters(model), is_moe(model)
        parameter_mib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
        if source.lora.enabled:
            model = apply_lora(model, source.lora).model
        trainable = [p for p in model.parameters() if p.requires_grad]
        # gradients and AdamW's two moments, one copy each per trained parameter
        trained_mib = 3 * sum(p.numel() * p.element_size() for p in trainable) / 2**20
        dtype, device = next(model.parameters()).dtype, "cuda" if cfg.trainer.accelerator == "gpu" else "cpu"
        del model
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        phases = PhasePeaks(device == "cuda")
        wrapped = {"rollout": (RolloutCollector, "collect"), "updates": (Updater, "update")}
        originals = {phase: getattr(part, name) for phase, (part, name) in wrapped.items()}
        for phase, (part, name) in wrapped.items():
            setattr(part, name, phases.wrap(phase, originals[phase]))
        try:
            train(cfg)
        finally:
            for phase, (part, name) in wrapped.items():
                setattr(part, name, originals[phase])
        rows = step_rows(out, skip=2)
    median = {k: nan_median(r.get(k, math.nan) for r in rows) for k in
              ("time/generate_s", "time/old_logprobs_s", "time/update_s", "time/rollout_s", "rollout/width",
               "rollout/completions", "throughput/tokens_per_s")}
    step = median["time/rollout_s"] + median["time/update_s"]
    tokens = median["rollout/completions"] * median["rollout/width"]
    flops = (2 + old_forward_units(cfg) + diagnostic_units(cfg, moe, median["rollout/completions"]) + 6) \
        * active * tokens  # generation, old log-probs, diagnostics, training
    rate = matmul_rate(dtype, device)
    # the phases' peaks (resetting the peak also resets what getrusage reports), and the peak since the last phase
    peak = max([phases.read(), *(p for peaks in phases.peaks.values() for p in peaks)])
    print(f"workload {args.workload}: {len(rows)} timed RL steps, {int(median['rollout/completions'])} completions x "
          f"{int(median['rollout/width'])} positions, {active / 1e6:.2f}M active parameters, {torch.get_num_threads()} threads")
    print(f"  seconds per RL step   {step:.4f}")
    print(f"    generation          {median['time/generate_s']:.4f}")
    print(f"    old log-probs       {median['time/old_logprobs_s']:.4f}")
    mismatch_s = nan_median(r.get("time/mismatch_s", math.nan) for r in rows)
    print(f"    mismatch            {mismatch_s:.4f} (a forward of its own, part of the rollout, under replay or when the "
          "first mini-batch is smaller than routing.diagnostics_rows; else measured inside the updates)")
    if cfg.objective.beta > 0:  # a frozen copy of the policy, one no-grad forward per rollout batch
        reference_s = statistics.median(r["time/ref_logprobs_s"] for r in rows)
        weights = "none: the model with adapters disabled" if source.lora.enabled else f"{parameter_mib:.1f} MiB"
        print(f"    reference log-probs {reference_s:.4f} (part of the rollout; its own weights: {weights})")
    print(f"    updates (+diagnostics) {median['time/update_s']:.4f}")
    print(f"  completion tokens/s   {median['throughput/tokens_per_s']:.0f}")
    print(f"  parameters            {parameter_mib:.1f} MiB; trained {sum(p.numel() for p in trainable) / 1e6:.2f}M, "
          f"their gradients and AdamW moments {trained_mib:.1f} MiB")
    kind = "CUDA allocated" if device == "cuda" else "process RSS"
    print(f"  peak memory           {peak:.0f} MiB ({kind}, the largest phase peak or after the last phase)")
    since = "" if phases.resettable else ", not resettable here: peak since start"
    for phase in wrapped:
        timed = phases.peaks[phase][2:] or phases.peaks[phase]  # the warm-up steps left out, as for the times
        rise = phases.rises[phase][2:] or phases.rises[phase]
        print(f"    {phase:<20}{statistics.median(timed):.0f} MiB, {statistics.median(rise):.0f} MiB above its start "
              f"(medians over steps{since})")
    print(f"  matmul rate           {rate / 1e9:.1f} GFLOP/s ({dtype}, {device})")
    print(f"  model FLOPs per step  {flops / 1e9:.2f} GFLOP -> MFU {100 * flops / step / rate:.2f}%")


if __name__ == "__main__":
    main()
