"""The rollout half of an RL step (RLModule mixes it in): this rank's prompts, `group_size` completions each from
the rollout engine, rewards (and DAPO's further rounds of prompts), advantages, the engine-trainer mismatch, the
old-policy and reference log-probs, and the rollout's metrics. The update half stays in gspo_lab.module.
"""

from __future__ import annotations

import logging
import math
import time
from contextlib import nullcontext

import torch

from gspo_lab.objectives import frac_zero_std
from gspo_lab.rollout.batch import RolloutBatch
from gspo_lab.rollout.dynamic_sampling import SampledRound, informative_count, merge_rounds
from gspo_lab.rollout.engine import mismatch_metrics
from gspo_lab.rollout.generation import Completions, generate
from gspo_lab.tasks.base import Example

log = logging.getLogger(__name__)


class RolloutCollection:
    """Methods of RLModule (gspo_lab.module) that produce its rollout batch; they use the module's model, engine,
    routing, prompt schedule, task, settings and trainer."""

    def collect_rollout(self, step: int, metrics: dict[str, float]) -> RolloutBatch:
        """This rank's rollout batch; adds the rollout's timings and the engine-trainer mismatch to `metrics`."""
        cfg = self.rollout_cfg
        sampled = self.sample_round(step, 0, metrics)
        # reward/* and completion/* describe the policy on the step's own prompts, filtered or not
        metrics.update(sample_metrics(sampled.rewards, sampled.completions, cfg.group_size))
        if cfg.filter_zero_std_groups:
            sampled = self.resample_zero_std_groups(step, sampled, metrics)
            # the batch trained on (no all-equal groups, so no all-correct ones): names of its own
            trained = sample_metrics(sampled.rewards, sampled.completions, cfg.group_size)
            metrics.update({f"trained/{key}": value for key, value in trained.items()})
        completions, rewards, rollout_trace = sampled.completions, sampled.rewards, sampled.rollout_trace
        loss_mask = completions.completion_mask
        if cfg.mask_truncated:
            loss_mask = loss_mask * (~completions.truncated)[:, None]
        input_ids = torch.cat([completions.prompt_ids, completions.completion_ids], 1)
        batch = RolloutBatch(
            input_ids=input_ids,
            attention_mask=torch.cat([completions.prompt_mask, completions.completion_mask], 1),
            loss_mask=loss_mask,
            old_logp=completions.logprobs if cfg.logprobs_from_generation else None,
            rewards=rewards,
            advantages=self.advantage(rewards, cfg.group_size),
            truncated=completions.truncated,
            routing_trace=rollout_trace,
            rollout_logp=completions.logprobs,
            rollout_trace=rollout_trace,
        ).to(self.device)
        started = time.perf_counter()
        metrics.update(self.mismatch(batch))
        metrics["time/mismatch_s"] = time.perf_counter() - started
        started = time.perf_counter()
        if batch.old_logp is None:
            with torch.no_grad(), self.routing.old_policy(batch) as trace:  # r3 replays here, off and r2 record
                share = self.routing.mode != "r3" or self.replay_allows_sharing(batch)
                batch.old_logp, _ = self.logprobs(batch, share_prompts=share)
            batch.routing_trace = trace
        metrics["time/old_logprobs_s"] = time.perf_counter() - started
        if self.kl_penalty:
            started = time.perf_counter()
            # the reference routes with its own routers: no replay context is open here
            with torch.no_grad(), self.lora.disabled() if self.lora is not None else nullcontext():
                batch.ref_logp, _ = self.logprobs(batch, self.reference, share_prompts=True)
            metrics["time/ref_logprobs_s"] = time.perf_counter() - started
        return batch

    def sample_round(self, step: int, sampling_round: int, metrics: dict[str, float]) -> SampledRound:
        """One round of this rank's share of the step's prompts, `group_size` completions each, scored."""
        cfg = self.rollout_cfg
        examples = self.prompts.for_step(step, self.global_rank, self.trainer.world_size, sampling_round)
        grouped = [example for example in examples for _ in range(cfg.group_size)]  # groups contiguous
        completions = self.sample([e.prompt for e in grouped], metrics)
        rewards = torch.tensor([
            self.score(example, text, f"RL step {step}, prompt {row // cfg.group_size}, completion {row % cfg.group_size}")
            for row, (example, text) in enumerate(zip(grouped, completions.texts))
        ])
        if self.train_cfg.shuffle_rewards:  # negative control: rewards no longer belong to their completions
            rewards = rewards[torch.randperm(len(rewards))]
        prompt_len = completions.prompt_ids.shape[1]
        trace = self.routing.generation_trace(prompt_len, prompt_len + completions.completion_ids.shape[1])
        return SampledRound(grouped, completions, rewards, trace)

    def resample_zero_std_groups(self, step: int, first: SampledRound, metrics: dict[str, float]) -> SampledRound:
        """DAPO's dynamic sampling (gspo_lab.rollout.dynamic_sampling): further rounds until the step has
        prompts_per_step groups with differing rewards, or max_sampling_rounds were sampled."""
        cfg = self.rollout_cfg
        rounds, needed = [first], len(first.rewards) // cfg.group_size

        def short() -> bool:
            return informative_count(rounds, cfg.group_size) < needed and len(rounds) < cfg.max_sampling_rounds

        while self.trainer.strategy.reduce_boolean_decision(short(), all=False):  # ranks sample in lockstep
            rounds.append(self.sample_round(step, len(rounds), metrics))
        merged, unfilled = merge_rounds(rounds, cfg.group_size, needed, self.tokenizer.pad_token_id)
        sampled = torch.cat([r.rewards for r in rounds])
        metrics["rollout/sampling_rounds"] = float(len(rounds))
        metrics["rollout/unfilled_groups"] = float(unfilled)
        metrics["rollout/frac_zero_std_sampled"] = frac_zero_std(sampled, cfg.group_size).item()
        return merged

    def sample(self, prompts: list[str], metrics: dict[str, float]) -> Completions:
        """Completions from the rollout engine, its weights first refreshed from the trainer's current ones;
        the engine's own log-probs of the sampled tokens are always kept. Timings add up over a step's rounds."""
        cfg = self.rollout_cfg
        started = time.perf_counter()
        self.engine.sync()
        synced = time.perf_counter()
        with self.engine.generating(), self.routing.generation(self.engine.model):
            completions = generate(
                self.engine.model, self.tokenizer, prompts, cfg.max_new_tokens, temperature=cfg.temperature,
                top_p=cfg.top_p, suppress_eos=cfg.suppress_eos, return_logprobs=True,
                share_prompts=cfg.share_prompt_prefill,
            )
        metrics["time/engine_sync_s"] = metrics.get("time/engine_sync_s", 0.0) + synced - started
        metrics["time/generate_s"] = metrics.get("time/generate_s", 0.0) + time.perf_counter() - synced
        return completions

    def mismatch(self, batch: RolloutBatch) -> dict[str, float]:
        """mismatch/* and routing/rollout_disagreement*: the trainer's own log-probs and experts (no replay,
        no grad) against the engine's, on the diagnostic rows of the batch, before any update."""
        rows = self.routing.diagnostic_rows(batch)
        train_logp, metrics = self.routing.before_update(rows, self.shared_logprobs)
        completion_mask = rows.attention_mask[:, -rows.completion_len :]
        return {**metrics, **mismatch_metrics(train_logp, rows.rollout_logp, completion_mask)}

    def score(self, example: Example, completion: str, where: str) -> float:
        """The task's reward. A reward function that raises, or returns NaN or ±inf (which would reach the
        advantages and end several steps later in skipped updates), is a reward error: reported with `where` (the
        step, the prompt's index in this rank's share, the completion's in its group), counted in reward/errors
        and scored 0, or, with train.on_reward_error=raise, stops the run."""
        try:
            reward = float(self.task.reward(example, completion))
            if not math.isfinite(reward):
                raise ValueError(f"the reward function returned {reward}")
            return reward
        except Exception as error:  # noqa: BLE001 - a user's reward function may raise anything
            if self.train_cfg.on_reward_error == "raise":
                raise RuntimeError(f"reward error ({where}): {error!r}; prompt {example.prompt!r}, completion "
                                   f"{completion!r}") from error
            self.reward_errors += 1
            log.warning("reward error (%s): %r on prompt %r, completion %r; scored 0 (train.on_reward_error=zero)",
                        where, error, example.prompt, completion)
            return 0.0

    def rollout_metrics(self, batch: RolloutBatch) -> dict[str, float]:
        return {
            "rollout/completions": float(len(batch.rewards)),  # this rank's; the mean over ranks is logged
            "rollout/width": float(batch.input_ids.shape[1]),  # padded prompt + completion positions per row
            "reward/errors": float(self.reward_errors),
        }


def sample_metrics(rewards: torch.Tensor, completions: Completions, group_size: int) -> dict[str, float]:
    """reward/mean, reward/std, reward/frac_zero_std, completion/len_mean and completion/truncated_frac of sampled
    completions (rewards [N], groups contiguous)."""
    return {
        "reward/mean": rewards.mean().item(),
        "reward/std": rewards.std(unbiased=False).item(),
        "reward/frac_zero_std": frac_zero_std(rewards, group_size).item(),
        "completion/len_mean": completions.completion_mask.sum(-1).float().mean().item(),
        "completion/truncated_frac": completions.truncated.float().mean().item(),
    }
