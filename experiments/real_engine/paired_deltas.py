"""The study README's paired differences: per seed, setting minus setting in final held-out accuracy, as logged
(summary.json under runs/) and as evaluated in float32 (fp32_eval.csv), with 95% percentile-bootstrap intervals
of the mean (9,999 resamples, seed 0).

    python experiments/real_engine/paired_deltas.py
"""
import json, glob, yaml, sys
import numpy as np
from scipy.stats import bootstrap
from pathlib import Path
root = Path(__file__).parent / "runs"
acc = {}
for d in root.glob("*/*"):
    if not (d / "summary.json").exists(): continue
    o = yaml.safe_load(open(d / ".hydra/overrides.yaml"))
    seed = int([x for x in o if x.startswith("seed=")][0].split("=")[1])
    key = " ".join(sorted(x for x in o if not x.startswith(("seed=", "experiment=", "callbacks"))))
    acc[(key, seed)] = json.load(open(d / "summary.json"))["eval/accuracy_after"]
fp32 = {}
if (Path(__file__).parent / "fp32_eval.csv").exists():
    for line in open(Path(__file__).parent / "fp32_eval.csv"):
        s, n, ov, a = line.strip().split(",")
        o = ov.split()
        seed = int([x for x in o if x.startswith("seed=")][0].split("=")[1])
        key = " ".join(sorted(x for x in o if not x.startswith(("seed=", "experiment=", "callbacks"))))
        fp32[(key, seed)] = float(a)
def paired(a, b, table):
    d = np.array([table[(a, s)] - table[(b, s)] for s in range(5)])
    ci = bootstrap((d,), np.mean, n_resamples=9999, method="percentile", random_state=0).confidence_interval
    return f"{d.mean():+.3f} [{ci.low:+.3f}, {ci.high:+.3f}] per seed {', '.join(f'{x:+.3f}' for x in d)}"
L = "rollout.logprobs_from_generation="
for alg in ("gspo", "grpo"):
    T, F = f"algorithm={alg} {L}True", f"algorithm={alg} {L}False"
    tis = f"algorithm={alg} objective.rollout_correction=tis_token {L}False"
    sim = f"algorithm={alg} rollout.backend=hf rollout.engine.precision=bf16 {L}True"
    for name, table in (("bf16 eval (logged)", acc), ("fp32 eval", fp32)):
        if not table or (T, 4) not in table: continue
        print(alg, name, "engine-F:", paired(T, F, table))
        print(alg, name, "tis-F:   ", paired(tis, F, table))
    print(alg, "sim lfg=T minus real lfg=T (logged evals; sim fp32, real bf16):", paired(sim, T, acc))
    if fp32 and (T, 4) in fp32:
        print(alg, "sim lfg=T (fp32) minus real lfg=T (fp32):", paired(sim, T, {**acc, **fp32}))
