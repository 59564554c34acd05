#!/usr/bin/env bash
# clip_lr's follow-up on the bring-your-own workload from a low cold start (README.md here, "Follow-up"): 50 SFT
# steps instead of 300 (the user's report started near 0.07), lr 1e-4, 60 RL steps, GSPO with clip_scale 1, 10, 100
# and GRPO at its paper range, seeds 0-4: 20 runs.
#   bash experiments/clip_lr/low_start.sh OUT [extra overrides]   # OUT/low_start/{gspo,grpo}; data as run.sh's
set -euo pipefail
out=${1:?usage: low_start.sh OUT [overrides]}; shift
here=$(dirname "$0")
test -d "$out/byo/data/model" || python scripts/make_chat_example.py "$out/byo/data" --problems 4000 --hidden 64 \
    --layers 2
BYO_DATA=$out/byo/data source "$here/../bring_your_own/overrides.sh"
low=(sft.steps=50 train.steps=60 train.lr=1e-4)
gspo-train -m experiment=clip_lr "${byo[@]}" "${low[@]}" hydra.sweep.dir="$out/low_start/gspo" "$@"
gspo-train -m experiment=clip_lr "${byo[@]}" "${low[@]}" algorithm=grpo clip_scale=1.0 \
    hydra.sweep.dir="$out/low_start/grpo" "$@"
