# The bring-your-own workload's overrides (the README's example, without train.steps, train.lr and seed), for
# scripts that `source` this file with BYO_DATA set to make_chat_example.py's output folder.
byo=(model=hf model.path="$BYO_DATA/model"
     task=hf task.path="$BYO_DATA/word_problems.jsonl" task.prompt_column=question "task.answer_pattern='#### (.+)'"
     task.solution_column=answer task.eval_size=200
     sft.enabled=true sft.seed=0 sft.steps=300 sft.eval_every=50 sft.eval_size=100 sft.batch_size=64
     sft.max_new_tokens=16 sft.lr=3e-3 sft.target_accuracy=0.6
     reward=math_verify reward.functions.0.latex_only=false rollout.max_new_tokens=16
     train.eval_every=20 threads=1 paths.cache_dir="$BYO_DATA/cache")
