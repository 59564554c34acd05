#!/usr/bin/env bash
# The bring-your-own path end to end on this CPU: a tiny chat model saved with save_pretrained (ChatML, a two-id
# EOS list), GSM8K-format word problems in a local jsonl read through datasets, math-verify as the reward in
# worker processes, one cold start on the worked answers shared by 5 RL seeds (sft.seed=0), then GSPO.
#   bash experiments/bring_your_own/run.sh OUT [extra overrides]    # OUT/model, OUT/runs/seed=*, report
set -euo pipefail
out=${1:?usage: run.sh OUT [overrides]}; shift
python scripts/make_chat_example.py "$out" --problems 4000 --hidden 64 --layers 2
BYO_DATA=$out source "$(dirname "$0")/overrides.sh"
gspo-train -m "${byo[@]}" train.steps=100 train.lr=1e-4 \
    seed=0,1,2,3,4 hydra/launcher=joblib hydra.launcher.n_jobs=2 hydra.sweep.dir="$out/runs" "$@"
gspo-report "$out/runs"
