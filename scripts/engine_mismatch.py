"""Trainer-vs-engine mismatch under each rollout-engine dose: a few RL steps per setting from the same cold
start, medians of mismatch/*, routing/rollout_disagreement* and (under r3) routing/override_frac.

    python scripts/engine_mismatch.py model=small_moe                  # docs/concepts/rollout-engine.md's figures
    python scripts/engine_mismatch.py model=small_moe task=rg_word_sorting model.tokenizer=task_bpe sft.steps=500 \
        sft.eval_every=500 sft.eval_size=32 sft.batch_size=32 sft.max_new_tokens=80 sft.target_accuracy=1.0 \
        rollout.max_new_tokens=80                                      # long answers
    python scripts/engine_mismatch.py --steps 3 sft.enabled=false      # a random-init tiny MoE, seconds
    .venv-vllm/bin/python scripts/engine_mismatch.py model=small_moe --doses default bf16 vllm vllm_bf16
                                                                       # the real engine (vLLM) beside the simulated

The vLLM doses (rollout.backend=vllm, fp32 or bf16 weights) need vLLM (make test-vllm builds .venv-vllm); without
it they are skipped, and said so.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

from hydra import compose, initialize_config_dir

from gspo_lab import CONFIG_DIR
from gspo_lab.rollout.vllm import setup as vllm_setup
from gspo_lab.train import build

DOSES = {
    "default": [],
    "fp16": ["rollout.engine.precision=fp16"],
    "bf16": ["rollout.engine.precision=bf16"],
    "router_noise=0.05": ["rollout.engine.router_noise=0.05"],
    "weight_bits=8": ["rollout.engine.weight_bits=8"],
    "router_noise=0.05 + r3": ["rollout.engine.router_noise=0.05", "routing.replay=r3"],
    "vllm": ["rollout.backend=vllm"],
    "vllm_bf16": ["rollout.backend=vllm", "rollout.vllm.dtype=bfloat16"],
}
KEYS = ("mismatch/kl", "mismatch/extreme_frac", "mismatch/seq_log_ratio_abs", "routing/rollout_disagreement",
        "routing/rollout_disagreement_tokens", "routing/override_frac", "time/engine_sync_s", "completion/len_mean")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5, help="RL steps per setting")
    parser.add_argument("--doses", nargs="+", choices=list(DOSES), default=list(DOSES), help="the settings to run")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides shared by every setting")
    args = parser.parse_args()
    for name in args.doses:
        dose = DOSES[name]
        if "rollout.backend=vllm" in dose and not vllm_setup.available():
            print(f"{name:24s} skipped: {vllm_setup.INSTALL}", flush=True)
            continue
        with tempfile.TemporaryDirectory() as out, initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
            cfg = compose("train", overrides=[f"train.steps={args.steps}", "train.eval_every=0", f"paths.output_dir={out}",
                                              "callbacks.progress.refresh_rate=0", "logger=[]", *args.overrides, *dose])
            run, module, _ = build(cfg)
            run.trainer.fit(module)
        medians = {k: statistics.median(r[k] for r in module.history if k in r) for k in KEYS if k in module.history[0]}
        print(f"{name:24s} " + "  ".join(f"{k.split('/', 1)[1]} {v:.3g}" for k, v in medians.items()), flush=True)


if __name__ == "__main__":
    main()
