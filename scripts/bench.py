"""Seconds per RL step of a named workload, split into generation / old log-probs / updates, with tokens per
second, peak memory and model-FLOPs utilisation against this machine's matmul rate (measured in the same
run, same threads, same dtype).

    python scripts/bench.py                       # the anchor workload (conf/experiment/bench_anchor.yaml)
    python scripts/bench.py --workload bench_anchor --steps 20 model.config.num_hidden_layers=8
    python scripts/bench.py --workload bench_gpu trainer=gpu      # on a GPU node: a 334M-parameter MoE in bf16
    python scripts/bench.py objective.beta=0.04   # the KL penalty's reference policy: its forward and memory
    python scripts/bench.py objective.beta=0.04 model.lora.enabled=true   # LoRA: the reference is the base itself

Model FLOPs per RL step count the matmuls of the active parameters (experts weighted by top-k / experts):
2 N per token for each forward (generation, the old log-probs' forward unless they come from generation, the
routing diagnostics' rows) and 6 N per token for each training forward+backward, over the padded [B, width]
tokens; attention score FLOPs are left out.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import tempfile
import time

import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from gspo_lab import CONFIG_DIR
from gspo_lab.models.lora import apply_lora
from gspo_lab.report.run import step_rows
from gspo_lab.train import train


def matmul_rate(dtype: torch.dtype, device: str, size: int = 1024, seconds: float = 1.0) -> float:
    """Sustained FLOP/s of square matmuls, the yardstick of MFU."""
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
        active = active_parameters(model)
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
        train(cfg)
        rows = step_rows(out, skip=2)
    median = {k: statistics.median(r[k] for r in rows) for k in
              ("time/generate_s", "time/old_logprobs_s", "time/update_s", "time/rollout_s", "rollout/width",
               "rollout/completions", "throughput/tokens_per_s")}
    step = median["time/rollout_s"] + median["time/update_s"]
    tokens = median["rollout/completions"] * median["rollout/width"]
    diagnosed = cfg.routing.diagnostics_rows or median["rollout/completions"]
    diagnostics_share = min(1.0, diagnosed / median["rollout/completions"])  # its forward covers these rows
    old_forward = 0 if cfg.rollout.logprobs_from_generation else 2  # no second forward when generation gives them
    flops = (2 + old_forward + 2 * diagnostics_share + 6) * active * tokens  # generation, old, diagnostics, training
    rate = matmul_rate(dtype, device)
    peak = torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else resource.getrusage(
        resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"workload {args.workload}: {len(rows)} timed RL steps, {int(median['rollout/completions'])} completions x "
          f"{int(median['rollout/width'])} positions, {active / 1e6:.2f}M active parameters, {torch.get_num_threads()} threads")
    print(f"  seconds per RL step   {step:.4f}")
    print(f"    generation          {median['time/generate_s']:.4f}")
    print(f"    old log-probs       {median['time/old_logprobs_s']:.4f}")
    mismatch_s = statistics.median(r["time/mismatch_s"] for r in rows)  # the trainer-vs-engine forward
    print(f"    mismatch forward    {mismatch_s:.4f} (diagnostic rows, part of the rollout)")
    if cfg.objective.beta > 0:  # a frozen copy of the policy, one no-grad forward per rollout batch
        reference_s = statistics.median(r["time/ref_logprobs_s"] for r in rows)
        weights = "none: the model with adapters disabled" if source.lora.enabled else f"{parameter_mib:.1f} MiB"
        print(f"    reference log-probs {reference_s:.4f} (part of the rollout; its own weights: {weights})")
    print(f"    updates (+diagnostics) {median['time/update_s']:.4f}")
    print(f"  completion tokens/s   {median['throughput/tokens_per_s']:.0f}")
    print(f"  parameters            {parameter_mib:.1f} MiB; trained {sum(p.numel() for p in trainable) / 1e6:.2f}M, "
          f"their gradients and AdamW moments {trained_mib:.1f} MiB")
    print(f"  peak memory           {peak:.0f} MiB ({'CUDA allocated' if device == 'cuda' else 'process RSS'})")
    print(f"  matmul rate           {rate / 1e9:.1f} GFLOP/s ({dtype}, {device})")
    print(f"  model FLOPs per step  {flops / 1e9:.2f} GFLOP -> MFU {100 * flops / step / rate:.2f}%")


if __name__ == "__main__":
    main()
