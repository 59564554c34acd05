#!/usr/bin/env bash
# GSPO's clip range against the learning rate on two tasks (README.md here): the default task (3-digit addition,
# tiny MoE, 100 RL steps) and the bring-your-own workload (experiments/bring_your_own, 60 RL steps), each GSPO with
# clip_scale 1, 10, 100 and GRPO with 0.5, 1, 2, at lr 1e-5, 3e-5, 1e-4, 3e-4, seeds 0-4: 240 runs.
#   bash experiments/clip_lr/run.sh OUT [extra overrides]   # OUT/{byo,default}/{gspo,grpo}, OUT/byo/data
set -euo pipefail
out=${1:?usage: run.sh OUT [overrides]}; shift
here=$(dirname "$0")
grpo=(algorithm=grpo clip_scale=0.5,1.0,2.0)
python scripts/make_chat_example.py "$out/byo/data" --problems 4000 --hidden 64 --layers 2
BYO_DATA=$out/byo/data source "$here/../bring_your_own/overrides.sh"
gspo-train -m experiment=clip_lr "${byo[@]}" train.steps=60 hydra.sweep.dir="$out/byo/gspo" "$@"
gspo-train -m experiment=clip_lr "${byo[@]}" train.steps=60 "${grpo[@]}" hydra.sweep.dir="$out/byo/grpo" "$@"
gspo-train -m experiment=clip_lr hydra.sweep.dir="$out/default/gspo" "$@"
gspo-train -m experiment=clip_lr "${grpo[@]}" hydra.sweep.dir="$out/default/grpo" "$@"
