"""The rollout half of an RL step (RLModule mixes it in): this rank's prompts, `group_size` completions each from
the rollout engine, rewards (and DAPO's further rounds of prompts), advantages, the engine-trainer mismatch, the
old-policy and reference log-probs, and the rollout's metrics. The update half stays in gspo_lab.module.
"""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext

import torch

from gspo_lab.objectives import micro_batches
from gspo_lab.objectives.advantages import scored_advantages
from gspo_lab.rewards import Scores
from gspo_lab.rollout.batch import RolloutBatch
from gspo_lab.rollout.dynamic_sampling import SampledRound, informative_count, merge_rounds
from gspo_lab.rollout.engine import mismatch_metrics
from gspo_lab.rollout.generation import Completions, draw_row_seeds
from gspo_lab.routing.trace import RoutingTrace
from gspo_lab.tasks.base import Example
from gspo_lab.tensors import frac_zero_std

log = logging.getLogger(__name__)


class RolloutCollection:
    """Methods of RLModule (gspo_lab.module) that produce its rollout batch; they use the module's model, engine,
    routing, prompt schedule, task, settings and trainer."""

    def collect_rollout(self, step: int, metrics: dict[str, float]) -> RolloutBatch:
        """This rank's rollout batch; adds the rollout's timings to `metrics`, and the engine-trainer mismatch where
        a forward of its own measures it (else the update measures it on the first mini-batch's forwards)."""
        cfg = self.rollout_cfg
        sampled = self.sample_round(step, 0, metrics)
        # reward/* and completion/* describe the policy on the step's own prompts, filtered or not
        metrics.update(sample_metrics(sampled.scored_rewards, sampled.completions, cfg.group_size))
        if cfg.filter_zero_std_groups:
            sampled = self.resample_zero_std_groups(step, sampled, metrics)
            # the batch trained on (no all-equal groups, so no all-correct ones): names of its own
            trained = sample_metrics(sampled.scored_rewards, sampled.completions, cfg.group_size)
            metrics.update({f"trained/{key}": value for key, value in trained.items()})
        completions, rewards, rollout_trace = sampled.completions, sampled.rewards, sampled.rollout_trace
        loss_mask = completions.completion_mask
        if cfg.mask_truncated:
            loss_mask = loss_mask * (~completions.truncated)[:, None]
        # what an estimator may need beside the totals, on their device (the host: scores are computed there, the
        # completions may be on the GPU); built only where it names them (`inputs`): the token counts' copy to the
        # host waits for the GPU
        available = {"components": lambda: sampled.components, "weights": lambda: self.rewards.weights,
                     "token_counts": lambda: loss_mask.sum(-1).to(rewards.device)}
        inputs = {name: available[name]() for name in getattr(self.advantage, "inputs", ())}
        # a completion no reward function applied to (all None) reaches the estimator as NaN: it takes no part in the
        # other completions' baselines and statistics, nor in the update (advantage 0)
        advantages = scored_advantages(self.advantage, rewards, sampled.applies, cfg.group_size, **inputs)
        input_ids = torch.cat([completions.prompt_ids, completions.completion_ids], 1)
        batch = RolloutBatch(
            input_ids=input_ids,
            attention_mask=torch.cat([completions.prompt_mask, completions.completion_mask], 1),
            loss_mask=loss_mask,
            old_logp=completions.logprobs if cfg.logprobs_from_generation else None,
            rewards=rewards,
            advantages=advantages,
            truncated=completions.truncated,
            routing_trace=rollout_trace,
            rollout_logp=completions.logprobs,
            rollout_trace=rollout_trace,
        ).to(self.device)
        # a forward of its own, on diagnostic steps, unless the first mini-batch's own forwards measure it (update)
        if not self.measured_in_update(batch) and self.diagnosing(step):
            started = time.perf_counter()
            metrics.update(self.mismatch(batch))
            metrics["time/mismatch_s"] = time.perf_counter() - started
        started = time.perf_counter()
        if batch.old_logp is None:
            batch.old_logp, batch.routing_trace = self.old_logprobs(batch)
        metrics["time/old_logprobs_s"] = time.perf_counter() - started
        if self.kl_penalty:
            started = time.perf_counter()
            # the reference routes with its own routers: no replay context is open here
            with torch.no_grad(), self.lora.disabled() if self.lora is not None else nullcontext():
                batch.ref_logp = torch.cat([self.logprobs(part, self.reference, share_prompts=True)[0]
                                            for part in self.forward_parts(batch)])
            metrics["time/ref_logprobs_s"] = time.perf_counter() - started
        return batch

    def forward_parts(self, batch: RolloutBatch) -> list[RolloutBatch]:
        """The batch as its no-grad forwards take it: train.micro_batch_size rows at a time, as training's forwards
        (else the rank's whole batch at once, which a long-generation recipe cannot hold: 512 rows x 4,608 tokens
        of a 1.5B model's MLP activations are about 127 GB)."""
        slices = micro_batches.micro_slices(batch.input_ids.shape[0], self.train_cfg.micro_batch_size)
        return [batch] if len(slices) == 1 else [batch.rows(torch.arange(s.start, s.stop)) for s in slices]

    def old_logprobs(self, batch: RolloutBatch) -> tuple[torch.Tensor, RoutingTrace | None]:
        """π_old of the batch's completion tokens [B, C] and the old policy's routing trace, in no-grad forwards
        of `forward_parts`; r3 replays the engine's experts there, off and r2 record them."""
        logps, traces = [], []
        for part in self.forward_parts(batch):
            with torch.no_grad(), self.routing.old_policy(part) as trace:
                share = self.routing.mode != "r3" or self.replay_allows_sharing(part)
                logps.append(self.logprobs(part, share_prompts=share)[0])
            traces.append(trace)
        if len(logps) == 1:
            return logps[0], traces[0]
        return torch.cat(logps), None if traces[0] is None else RoutingTrace.cat(traces)

    def sample_round(self, step: int, sampling_round: int, metrics: dict[str, float]) -> SampledRound:
        """One round of this rank's share of the step's prompts, `group_size` completions each, scored."""
        cfg = self.rollout_cfg
        examples = self.prompts.for_step(step, self.global_rank, self.trainer.world_size, sampling_round)
        grouped = [example for example in examples for _ in range(cfg.group_size)]  # groups contiguous
        texts = self.render.texts(examples)  # model input, once per prompt
        completions, trace = self.sample([text for text in texts for _ in range(cfg.group_size)], metrics)
        scores = self.score(step, grouped, completions)
        # reward/<name>/* of the step's own prompts (round 0, as reward/*); the running error counts of every round
        metrics.update({k: v for k, v in scores.metrics.items()
                        if sampling_round == 0 or k.endswith(("errors", "timeouts"))})
        rewards, applies, components = scores.total, scores.applies, scores.components
        if self.train_cfg.shuffle_rewards:  # negative control: rewards no longer belong to their completions
            order = torch.randperm(len(rewards))
            rewards, applies, components = rewards[order], applies[order], components[order]
        return SampledRound(grouped, completions, rewards, applies, components, trace)

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
        sampled = torch.cat([r.scored_rewards for r in rounds])
        metrics["rollout/sampling_rounds"] = float(len(rounds))
        metrics["rollout/unfilled_groups"] = float(unfilled)
        metrics["rollout/frac_zero_std_sampled"] = frac_zero_std(sampled, cfg.group_size).item()
        return merged

    def sample(self, prompts: list[str], metrics: dict[str, float]) -> tuple[Completions, RoutingTrace | None]:
        """Completions from the rollout engine, its weights first refreshed from the trainer's current ones, in
        `generate` calls of rollout.generation_batch_size rows; the engine's own log-probs of the sampled tokens
        are always kept, and its experts when routing records them. Each row samples from its own stream, its seed
        drawn here for all rows at once, so the samples do not depend on the batch size (unless the engine draws
        router noise, which it does per call). Timings add up over a step's rounds."""
        cfg = self.rollout_cfg
        started = time.perf_counter()
        self.engine.sync()
        synced = time.perf_counter()
        seeds = draw_row_seeds(len(prompts))  # [N]
        size = cfg.generation_batch_size or len(prompts)
        parts, traces = [], []
        for start in range(0, len(prompts), size):
            part, trace = self.engine.generate(self.tokenizer, prompts[start : start + size], cfg,
                                               seeds[start : start + size], self.render.add_special_tokens, self.routing)
            parts.append(part)
            traces.append(trace)
        completions, trace = one_batch(parts, traces, self.tokenizer.pad_token_id)
        metrics["time/engine_sync_s"] = metrics.get("time/engine_sync_s", 0.0) + synced - started
        metrics["time/generate_s"] = metrics.get("time/generate_s", 0.0) + time.perf_counter() - synced
        return completions, trace

    def mismatch(self, batch: RolloutBatch) -> dict[str, float]:
        """mismatch/* and routing/rollout_disagreement*: the trainer's own log-probs and experts (no replay,
        no grad) against the engine's, on the diagnostic rows of the batch, before any update: a forward of
        their own, for routing replay's training forwards replay the engine's experts."""
        rows = self.routing.diagnostic_rows(batch)
        train_logp, metrics = self.routing.before_update(rows, self.shared_logprobs)
        return {**metrics, **engine_mismatch(rows, train_logp)}

    def measured_in_update(self, batch: RolloutBatch) -> bool:
        """Whether the first mini-batch's forwards (torch.chunk's first: ceil(B / minibatches) rows) measure the
        mismatch and the routing before the updates, instead of a forward of their own."""
        first = -(-len(batch.rewards) // self.train_cfg.minibatches)
        return self.routing.measures_in_training(first, len(batch.rewards))

    def mismatch_measured(self, rows: RolloutBatch, train_logp: torch.Tensor, trace) -> dict[str, float]:
        """The same metrics from the trainer's log-probs `train_logp` [B, C] and experts `trace` on `rows`, taken
        by forwards that ran before any update anyway (the first mini-batch's, without replay)."""
        return {**self.routing.measured_before(rows, trace), **engine_mismatch(rows, train_logp)}

    def score(self, step: int, examples: list[Example], completions: Completions) -> Scores:
        """The reward functions' scores of this round's completions (gspo_lab.rewards): each function gets the
        examples' prompts, the completions (as assistant messages when the prompts are conversational), their
        token ids up to and including the stop token, the reference `answer` and every other column."""
        group = self.rollout_cfg.group_size
        return self.rewards.score(*reward_inputs(examples, completions),
                                  where=lambda i: f"RL step {step}, prompt {i // group}, completion {i % group}")

    def rollout_metrics(self, batch: RolloutBatch) -> dict[str, float]:
        return {
            "rollout/completions": float(len(batch.rewards)),  # this rank's; the mean over ranks is logged
            "rollout/width": float(batch.input_ids.shape[1]),  # padded prompt + completion positions per row
        }


def engine_mismatch(rows: RolloutBatch, train_logp: torch.Tensor) -> dict[str, float]:
    """mismatch/* of the trainer's log-probs [B, C] of `rows` against the engine's (`mismatch_metrics`)."""
    return mismatch_metrics(train_logp, rows.rollout_logp, rows.attention_mask[:, -rows.completion_len :])


def one_batch(parts: list[Completions], traces: list[RoutingTrace | None], pad_id: int
              ) -> tuple[Completions, RoutingTrace | None]:
    """The completions of several `generate` calls as one batch, re-padded to the widest prompt (left) and
    completion (right), their routing traces with them (None where routing records nothing)."""
    if len(parts) == 1:
        return parts[0], traces[0]
    prompt_len = max(part.prompt_ids.shape[1] for part in parts)
    completion_len = max(part.completion_ids.shape[1] for part in parts)
    completions = Completions.cat([part.padded(prompt_len, completion_len, pad_id) for part in parts])
    if traces[0] is None:
        return completions, None
    return completions, RoutingTrace.cat([t.realigned(prompt_len, prompt_len + completion_len) for t in traces])


def reward_inputs(examples: list[Example], completions: Completions) -> tuple[list, list, list[list[int]], dict]:
    """What reward functions get for these completions of `examples` (one example per completion): the prompts,
    the completions (as assistant messages when the prompts are conversational), their token ids up to and
    including the stop token, and the columns (the reference `answer` and every other column of the data)."""
    conversational = bool(examples) and isinstance(examples[0].prompt, list)
    texts = completions.texts
    replies = [[{"role": "assistant", "content": text}] for text in texts] if conversational else texts
    # one copy to the host for the whole round (a GPU sync per row otherwise)
    lengths = completions.completion_mask.sum(-1).tolist()
    ids = [row[:n] for row, n in zip(completions.completion_ids.tolist(), lengths)]  # right-padded rows
    columns = {"answer": [e.answer for e in examples]}
    for key in examples[0].meta if examples else ():
        columns[key] = [e.meta.get(key) for e in examples]
    return [e.prompt for e in examples], replies, ids, columns


def sample_metrics(rewards: torch.Tensor, completions: Completions, group_size: int) -> dict[str, float]:
    """reward/mean, reward/std, reward/frac_zero_std, completion/len_mean and completion/truncated_frac of sampled
    completions (rewards [N], groups contiguous; NaN where no reward function scored a completion, which the
    reward/* leave out: NaN where none was scored)."""
    scored = rewards[~rewards.isnan()]
    return {
        "reward/mean": scored.mean().item(),
        "reward/std": scored.std(unbiased=False).item(),
        "reward/frac_zero_std": frac_zero_std(rewards, group_size).item(),
        "completion/len_mean": completions.completion_mask.sum(-1).float().mean().item(),
        "completion/truncated_frac": completions.truncated.float().mean().item(),
    }
