"""The end-of-run summary: reward and held-out accuracy before and after, clip fraction, time, and every
evaluation set's metrics at the last evaluation."""

from __future__ import annotations

import math

from gspo_lab.report.run import is_set_metric, series


MANTISSA_BITS = {"float64": 52, "float32": 23, "float16": 10, "bfloat16": 7}  # explicit bits: names each dtype


def eval_engine_columns(on_vllm: bool, dtype: str) -> dict[str, float]:
    """metrics.csv's record of what generated an evaluation: eval/engine_vllm, 1 for vLLM's engine and 0 for
    transformers on the trainer's weights, and eval/engine_mantissa_bits, the mantissa bits of the dtype it
    computed in (MANTISSA_BITS).

    >>> eval_engine_columns(True, "bfloat16")
    {'eval/engine_vllm': 1.0, 'eval/engine_mantissa_bits': 7.0}
    """
    return {"eval/engine_vllm": float(on_vllm), "eval/engine_mantissa_bits": float(MANTISSA_BITS[dtype])}


def eval_engine(history: list[dict[str, float]]) -> str | None:
    """What generated the run's last evaluation, as "vllm bfloat16" or "transformers float32" (summary.json's
    eval/engine); None where no row records it.

    >>> eval_engine([{"eval/engine_vllm": 0.0, "eval/engine_mantissa_bits": 23.0}, {"loss/total": 1.0}])
    'transformers float32'
    """
    rows = [row for row in history if "eval/engine_vllm" in row]
    if not rows:
        return None
    names = {bits: name for name, bits in MANTISSA_BITS.items()}
    return (f"{'vllm' if rows[-1]['eval/engine_vllm'] else 'transformers'} "
            f"{names[int(rows[-1]['eval/engine_mantissa_bits'])]}")


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def summarise(history: list[dict[str, float]], seconds: float, algorithm: str | None, run_dir: str,
              window: int = 10) -> dict:
    """Figures of one run from its logged rows; `window` RL steps average the reward at each end."""
    _, rewards = series(history, "reward/mean")
    _, accuracies = series(history, "eval/accuracy")
    _, clip = series(history, "clip/frac")
    return {
        "algorithm": algorithm,
        "steps": len(rewards),
        "reward/mean_first": _mean(rewards[:window]),
        "reward/mean_last": _mean(rewards[-window:]),
        "eval/accuracy_before": accuracies[0] if accuracies else math.nan,
        "eval/accuracy_after": accuracies[-1] if accuracies else math.nan,
        "clip/frac_mean": _mean(clip),
        "seconds": round(seconds, 1),
        "run_dir": run_dir,
        "eval/final": final_evaluation(history),
        "eval/engine": eval_engine(history),
    }


def final_evaluation(history: list[dict[str, float]]) -> dict[str, float]:
    """Each eval/<set>/<metric> at the last evaluation that logged it.

    >>> final_evaluation([{"eval/heldout/greedy": 0.2}, {"loss/total": 1.0}, {"eval/heldout/greedy": 0.5}])
    {'eval/heldout/greedy': 0.5}
    """
    final = {}
    for row in history:
        final.update({k: v for k, v in row.items() if is_set_metric(k)})
    return final


def format_summary(summary: dict) -> str:
    return "\n".join([
        f"gspo-train finished: {summary['algorithm']}, {summary['steps']} RL steps in {summary['seconds']} s",
        f"  reward (sampled, mean of first/last 10 steps): {summary['reward/mean_first']:.3f} -> "
        f"{summary['reward/mean_last']:.3f}",
        f"  held-out accuracy (greedy): {summary['eval/accuracy_before']:.3f} -> {summary['eval/accuracy_after']:.3f}",
        f"  clip/frac (mean over steps): {summary['clip/frac_mean']:.4f}",
        *evaluation_lines(summary.get("eval/final", {})),
        f"  outputs: {summary['run_dir']}",
    ])


def evaluation_lines(final: dict[str, float]) -> list[str]:
    """One line per evaluation set with its last evaluation's metrics, when there is more to say than the
    heldout set's greedy accuracy (printed above)."""
    by_set: dict[str, list[str]] = {}
    for key, value in final.items():
        _, name, metric = key.split("/", 2)
        if metric != "length":
            by_set.setdefault(name, []).append(f"{metric} {value:.3f}")
    if set(by_set) <= {"heldout"} and all(item.startswith("greedy ") for item in by_set.get("heldout", [])):
        return []  # the default evaluation: the accuracy line says it all
    return [f"  eval {name} (last evaluation): " + ", ".join(items) for name, items in by_set.items()]
