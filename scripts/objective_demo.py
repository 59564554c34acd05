"""Trains a tabular toy policy with GSPO, GSPO-token and GRPO on random tensors, to watch the objectives work.

Each of 8 prompts owns a [T, V] table of logits; a completion is T tokens sampled from it; the reward is the
fraction of tokens equal to 0. Per step: sample groups, score, group-relative advantages, old log-probs, then
4 mini-batch updates through the objective, exactly the shape of an RL step.

    python scripts/objective_demo.py --steps 30
"""

from __future__ import annotations

import argparse

import torch

from gspo_lab.objectives import GRPO, GSPO, GroupAdvantage, GSPOToken


def run(objective, steps: int, seed: int, prompts=8, group_size=8, length=6, vocab=4, minibatches=4):
    torch.manual_seed(seed)
    logits = torch.zeros(prompts, length, vocab, requires_grad=True)
    optimizer = torch.optim.Adam([logits], lr=0.05)
    advantage = GroupAdvantage()
    for step in range(steps):
        with torch.no_grad():
            table = logits.repeat_interleave(group_size, 0)  # [B, T, V]
            tokens = torch.distributions.Categorical(logits=table).sample()  # [B, T]
            rewards = (tokens == 0).float().mean(-1)  # [B]
            adv = advantage(rewards, group_size)
            old_logp = table.log_softmax(-1).gather(-1, tokens[..., None]).squeeze(-1)  # [B, T]
        clip = []
        for rows in torch.randperm(tokens.shape[0]).chunk(minibatches):
            logp = logits.repeat_interleave(group_size, 0)[rows].log_softmax(-1)
            logp = logp.gather(-1, tokens[rows, :, None]).squeeze(-1)
            out = objective(logp, old_logp[rows], adv[rows], torch.ones_like(logp))
            optimizer.zero_grad()
            out.loss.backward()
            optimizer.step()
            clip.append(out.metrics["clip/frac"].item())
        if step % 10 == 0 or step == steps - 1:
            print(f"  step {step:3d}  reward {rewards.mean():.3f}  clip/frac {sum(clip) / len(clip):.3f}")
    return rewards.mean().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for objective in (GSPO(clip_low=0.03, clip_high=0.04), GSPOToken(clip_low=0.03, clip_high=0.04), GRPO()):
        print(objective)
        final = run(objective, args.steps, args.seed)
        print(f"  final reward {final:.3f} (random policy: 0.25)")


if __name__ == "__main__":
    main()
