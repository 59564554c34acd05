#!/usr/bin/env bash
# The bring-your-own path end to end on this CPU: a tiny chat model saved with save_pretrained (ChatML, a two-id
# EOS list), GSM8K-format word problems in a local jsonl read through datasets, math-verify as the reward in
# worker processes, one cold start on the worked answers shared by 5 RL seeds (sft.seed=0), then GSPO.
#   bash experiments/bring_your_own/run.sh OUT [extra overrides]    # OUT/model, OUT/runs/seed=*, report
set -euo pipefail
out=${1:?usage: run.sh OUT [overrides]}; shift
python scripts/make_chat_example.py "$out" --problems 4000 --hidden 64 --layers 2
gspo-train -m model=hf model.path="$out/model" \
    task=hf task.path="$out/word_problems.jsonl" task.prompt_column=question "task.answer_pattern='#### (.+)'" \
    task.solution_column=answer task.eval_size=200 \
    sft.enabled=true sft.seed=0 sft.steps=300 sft.eval_every=50 sft.eval_size=100 sft.batch_size=64 \
    sft.max_new_tokens=16 sft.lr=3e-3 sft.target_accuracy=0.6 \
    reward=math_verify reward.functions.0.latex_only=false rollout.max_new_tokens=16 \
    train.steps=100 train.eval_every=20 train.lr=1e-4 threads=1 paths.cache_dir="$out/cache" \
    seed=0,1,2,3,4 hydra/launcher=joblib hydra.launcher.n_jobs=2 hydra.sweep.dir="$out/runs" "$@"
gspo-report "$out/runs"
