"""Train a reward model for `reward=reward_model` from a task's verifier, with TRL's RewardTrainer.

    python scripts/train_reward_model.py --out /tmp/rm                       # the default task and cold start
    python scripts/train_reward_model.py --out /tmp/rm --flip 0.2 --prompts 512 experiment=staleness
    gspo-train reward=reward_model reward.functions.0.path=/tmp/rm          # then train on it

1. The run's starting policy (the cold start of the config the overrides compose, trained or loaded from its
   cache) samples `--group` completions for each of `--prompts` training prompts, at the rollout temperature.
2. The task's checker labels them. Within each prompt, every two completions of different reward make a
   preference pair (the higher one chosen), at most `--pairs-per-prompt` of them.
3. `--holdout` of the prompts are held back. In the rest, `--flip` of the pairs have chosen and rejected swapped:
   the proxy is imperfect by a stated amount, as a reward model learned from human labels is.
4. The reward model starts from the policy's own weights with a fresh one-label head
   (AutoModelForSequenceClassification, as TRL's reward modelling recipe starts from the SFT model) and trains
   with TRL's RewardTrainer (Bradley-Terry loss) on the pairs, as `RewardModel` scores them (`scored_texts`): the
   prompt reward functions get (the data's, not the policy's rendered input) and the completion, through the chat
   template for conversations, no special tokens, no EOS.
5. It is saved with its tokenizer to `--out`, and its pairwise accuracy is reported on the held-out prompts' pairs
   (true labels) and on the training pairs (against their true and their flipped labels), in `--out`/stats.json.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

import torch

from gspo_lab import CONFIG_DIR
from gspo_lab.rewards import RewardModel
from gspo_lab.rewards.reward_model import scored_texts
from gspo_lab.rollout.completions import reward_inputs
from gspo_lab.rollout.backend import Sampling
from gspo_lab.rollout.multi_turn import generate_rows


def sampled_groups(module, prompts: int, group: int, seed: int) -> list[tuple[str | list, list, list[float]]]:
    """(prompt, completions, the checker's rewards) for `prompts` training prompts, `group` each: the prompts and
    completions as reward functions get them (gspo_lab.rollout.completions.reward_inputs), so the model trains on
    the strings RewardModel later scores."""
    examples = module.task.examples("train", prompts, seed=seed)
    grouped = [example for example in examples for _ in range(group)]
    torch.manual_seed(seed)
    sampling = Sampling.of_rollout(module.rollout_cfg, module.render.add_special_tokens)
    module.model.eval()
    with torch.no_grad():
        generated = generate_rows(module.engine, module.tokenizer, module.render, grouped, sampling, None, 256)
    texts = generated.completions.texts
    given, replies, _, _ = reward_inputs(grouped, generated.completions, generated.extra)
    groups = []
    for i, example in enumerate(examples):
        rows = slice(i * group, (i + 1) * group)
        rewards = [float(module.task.reward(example, text)) for text in texts[rows]]
        groups.append((given[i * group], replies[rows], rewards))
    return groups


def preference_pairs(groups, per_prompt: int, rng: random.Random) -> list[dict]:
    """Pairs of completions of one prompt with different rewards: {prompt, chosen, rejected} (chosen: higher)."""
    pairs = []
    for prompt, completions, rewards in groups:
        candidates = [(i, j) for i in range(len(completions)) for j in range(len(completions))
                      if rewards[i] > rewards[j] and completions[i] != completions[j]]
        for i, j in rng.sample(candidates, min(per_prompt, len(candidates))):
            pairs.append({"prompt": prompt, "chosen": completions[i], "rejected": completions[j]})
    return pairs


def accuracy(scorer: RewardModel, pairs: list[dict]) -> float:
    """The share of pairs whose chosen completion the model scores above the rejected one."""
    if not pairs:
        return float("nan")
    chosen = scorer([p["prompt"] for p in pairs], [p["chosen"] for p in pairs])
    rejected = scorer([p["prompt"] for p in pairs], [p["rejected"] for p in pairs])
    return sum(c > r for c, r in zip(chosen, rejected)) / len(pairs)


def tokenized(pairs: list[dict], tokenizer) -> list[dict]:
    """TRL's processed form (chosen_ids, rejected_ids) of the strings RewardModel scores (scored_texts), tokenized
    as it tokenizes them: no special tokens, no EOS."""
    def ids(completions: str) -> list[list[int]]:
        texts = scored_texts(tokenizer, [p["prompt"] for p in pairs], [p[completions] for p in pairs])
        return tokenizer(texts, add_special_tokens=False)["input_ids"]

    return [{"chosen_ids": c, "rejected_ids": r} for c, r in zip(ids("chosen"), ids("rejected"))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="where the reward model is saved")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--group", type=int, default=8, help="completions sampled per prompt")
    parser.add_argument("--pairs-per-prompt", type=int, default=4)
    parser.add_argument("--holdout", type=float, default=0.25, help="share of prompts held back for evaluation")
    parser.add_argument("--flip", type=float, default=0.0, help="share of training pairs with swapped labels")
    parser.add_argument("--epochs", type=float, default=2.0)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of the run whose cold start samples")
    args = parser.parse_args()
    if not 0 <= args.flip < 0.5:
        sys.exit(f"--flip={args.flip} must be in [0, 0.5): at 0.5 the labels carry nothing")
    from datasets import Dataset
    from hydra import compose, initialize_config_dir
    from transformers import AutoModelForSequenceClassification
    from trl import RewardConfig, RewardTrainer

    from gspo_lab.train import build

    with tempfile.TemporaryDirectory(prefix="rm-") as scratch:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            cfg = compose("train", overrides=[*args.overrides, f"paths.output_dir={scratch}/run", f"seed={args.seed}"])
        _, module, _ = build(cfg)
        rng = random.Random(args.seed)
        groups = sampled_groups(module, args.prompts, args.group, args.seed)
        held = int(len(groups) * args.holdout)
        train_pairs = preference_pairs(groups[held:], args.pairs_per_prompt, rng)
        held_pairs = preference_pairs(groups[:held], args.pairs_per_prompt, rng)
        flipped = [dict(p, chosen=p["rejected"], rejected=p["chosen"]) if rng.random() < args.flip else p
                   for p in train_pairs]
        tokenizer = module.tokenizer
        module.model.config.pad_token_id = tokenizer.pad_token_id
        module.model.save_pretrained(f"{scratch}/policy")
        model = AutoModelForSequenceClassification.from_pretrained(f"{scratch}/policy", num_labels=1)
        config = RewardConfig(output_dir=f"{scratch}/trainer", num_train_epochs=args.epochs, learning_rate=args.lr,
                              per_device_train_batch_size=args.batch_size, report_to=[], save_strategy="no",
                              logging_steps=10, seed=args.seed, use_cpu=not torch.cuda.is_available(),
                              max_length=None, bf16=False, gradient_checkpointing=False)
        trainer = RewardTrainer(model=model, args=config, processing_class=tokenizer,
                                train_dataset=Dataset.from_list(tokenized(flipped, tokenizer)))
        trainer.train()
        trainer.save_model(str(args.out))
        tokenizer.save_pretrained(args.out)
    scorer = RewardModel(str(args.out))
    stats = {
        "prompts": len(groups), "held_out_prompts": held, "train_pairs": len(train_pairs),
        "held_out_pairs": len(held_pairs), "flip": args.flip,
        "flipped_pairs": sum(f is not p for f, p in zip(flipped, train_pairs)),
        "held_out_accuracy": accuracy(scorer, held_pairs),
        "train_accuracy_true_labels": accuracy(scorer, train_pairs),
        "train_accuracy_given_labels": accuracy(scorer, flipped),
        "overrides": args.overrides,
    }
    (args.out / "stats.json").write_text(json.dumps(stats, indent=2))
    print(json.dumps(stats, indent=2))


if __name__ == "__main__":
    main()
