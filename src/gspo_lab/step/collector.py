"""The rollout half of an RL step, `RolloutCollector.collect`: this rank's prompts, `group_size` completions each from
the rollout source, rewards (and DAPO's further rounds of prompts), advantages, the mismatch probe's own forward,
the old-policy and reference log-probs: a `Rollout`, the batch the updates train on and the rollout's metrics.
Where the completions come from is the source's (gspo_lab.rollout.sources: synchronous, lagged, overlap); a stale
source marks each completion token with the weight version that wrote it (off_policy/*).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from gspo_lab.config import RolloutConfig
from gspo_lab.objectives import AdvantageEstimator
from gspo_lab.objectives.advantages import scored_advantages
from gspo_lab.rewards import Scores, WeightedRewards
from gspo_lab.rollout import RolloutBatch
from gspo_lab.rollout.completions import Completions, Generated, reward_inputs
from gspo_lab.rollout.multi_turn import MultiTurn
from gspo_lab.rollout.dynamic_sampling import SampledRound, informative_count, merge_rounds
from gspo_lab.rollout.sources import RolloutSource, StepRows, version_metrics
from gspo_lab.step.failures import failure_reasons, stop_without_signal
from gspo_lab.step.metrics import add_round
from gspo_lab.step.policy import PolicyForwards
from gspo_lab.step.probe import MismatchProbe, mismatch_metrics
from gspo_lab.step.ranks import Ranks
from gspo_lab.tasks.base import Example
from gspo_lab.tensors import frac_zero_std


@dataclass
class Extras:
    """What the step adds to the rollout beside the task's reward: the negative control of train.shuffle_rewards,
    the KL penalty's reference log-probs (objective.beta > 0), kl/to_initial, and a verifier's reward/gold beside a
    learned reward (its WeightedRewards, or None)."""

    shuffle_rewards: bool = False
    kl_penalty: bool = False
    kl_to_initial: bool = False
    gold: WeightedRewards | None = None


@dataclass
class Rollout:
    batch: RolloutBatch  # what the updates train on, on the policy's device
    metrics: dict[str, float]  # reward/*, completion/*, rollout/*, mismatch/* where measured, time/*


class RolloutCollector:
    """Collects each RL step's rollout batch, the rows `rows` names, from `source`, scored by `rewards`, with
    advantages from `advantage`, π_old and the reference's log-probs from `policy`; `agent`: the multi-turn loop
    of a task with tools (gspo_lab.rollout.multi_turn), whose counts and environments the scores read, or None."""

    def __init__(self, source: RolloutSource, rows: StepRows, policy: PolicyForwards, probe: MismatchProbe,
                 rewards: WeightedRewards, advantage: AdvantageEstimator, rollout: RolloutConfig, extras: Extras,
                 agent: MultiTurn | None = None) -> None:
        self.source, self.rows, self.policy, self.probe = source, rows, policy, probe
        self.rewards, self.advantage, self.rollout_cfg = rewards, advantage, rollout
        self.extras, self.agent = extras, agent

    def preflight(self) -> None:
        """Build and reset the task's environment on the first training prompt in a tool worker, before anything
        trains (gspo_lab.rollout.multi_turn.MultiTurn.preflight): a ValueError where reset() fails."""
        if self.agent is not None:
            self.agent.preflight(self.rows.first())

    def collect(self, step: int, ranks: Ranks) -> Rollout:
        """This rank's rollout batch for RL step `step`, and its metrics."""
        cfg = self.rollout_cfg
        sampled, metrics = self.sample_round(step, 0, ranks)
        # reward/* and completion/* describe the policy on the step's own prompts, filtered or not
        metrics.update(sample_metrics(sampled.scored_rewards, sampled.completions, cfg.group_size))
        if cfg.filter_zero_std_groups:
            sampled, more = self.resample_zero_std_groups(step, sampled, ranks)
            add_round(metrics, more)
            # the batch trained on (no all-equal groups, so no all-correct ones): names of its own
            trained = sample_metrics(sampled.scored_rewards, sampled.completions, cfg.group_size)
            metrics.update({f"trained/{key}": value for key, value in trained.items()})
        batch = self.batch(sampled, ranks.device)
        if batch.versions is not None:
            metrics.update(version_metrics(batch.versions, batch.policy_mask, step, cfg.max_staleness))
        metrics.update(self.probe.own_forward(batch, step))
        started = time.perf_counter()
        if batch.old_logp is None:
            batch.old_logp, batch.routing_trace = self.policy.old_logprobs(batch, ranks)
            if batch.rollout_logp is not None:  # π_old as the step trains on it (under r3: the engine's experts)
                metrics["mismatch/pi_old_kl"] = mismatch_metrics(batch.old_logp, batch.rollout_logp,
                                                                 batch.policy_mask)["mismatch/kl"]
        metrics["time/old_logprobs_s"] = time.perf_counter() - started
        extras = self.extras
        if extras.kl_penalty or extras.kl_to_initial:
            started = time.perf_counter()
            ref_logp = self.policy.reference_logprobs(batch, ranks)  # [B, C]
            metrics["time/ref_logprobs_s"] = time.perf_counter() - started
            if extras.kl_penalty:
                batch.ref_logp = ref_logp
            if extras.kl_to_initial:
                behave = batch.rollout_logp if batch.rollout_logp is not None else batch.old_logp  # the sampler's
                metrics["kl/to_initial"] = sequence_kl(behave, ref_logp, batch.policy_mask).item()
        metrics["rollout/completions"] = float(len(batch.rewards))  # this rank's; the mean over ranks is logged
        metrics["rollout/width"] = float(batch.input_ids.shape[1])  # padded prompt + completion positions per row
        return Rollout(batch, metrics)

    def batch(self, sampled: SampledRound, device: torch.device) -> RolloutBatch:
        """The scored completions as a RolloutBatch on `device`, with their advantages; π_old is the engine's where
        rollout.logprobs_from_generation, else None until `collect` computes it."""
        cfg = self.rollout_cfg
        completions, rewards, rollout_trace = sampled.completions, sampled.rewards, sampled.rollout_trace
        loss_mask = completions.policy_mask  # the model's tokens: a multi-turn row's tool results are context only
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
        return RolloutBatch(
            input_ids=torch.cat([completions.prompt_ids, completions.completion_ids], 1),
            attention_mask=torch.cat([completions.prompt_mask, completions.completion_mask], 1),
            loss_mask=loss_mask,
            old_logp=completions.logprobs if cfg.logprobs_from_generation else None,
            rewards=rewards,
            advantages=advantages,
            truncated=completions.truncated,
            routing_trace=rollout_trace,
            rollout_logp=completions.logprobs,
            rollout_trace=rollout_trace,
            turns=completions.turns,
            versions=completions.versions,
        ).to(device)

    def sample_round(self, step: int, sampling_round: int, ranks: Ranks) -> tuple[SampledRound, dict[str, float]]:
        """One round of this rank's share of the step's prompts, `group_size` completions each, scored; its
        timings, and the reward functions' metrics (reward/<name>/* of round 0, the running error counts of
        every round)."""
        grouped = self.rows.examples(step, ranks.rank, ranks.world, sampling_round)  # groups contiguous
        generated, metrics = self.source.generated(step, grouped)
        scores = self.score(step, grouped, generated)
        first_errors = self.agent.first_errors if self.agent is not None else {}
        stop_without_signal(failure_reasons(scores, generated, self.rewards.failure_stop_frac, first_errors,
                                            self.rewards.keys), ranks, step, self.rewards.failure_stop_frac)
        metrics.update({k: v for k, v in scores.metrics.items()
                        if sampling_round == 0 or k.endswith(("errors", "timeouts"))})
        rewards, applies, components = scores.total, scores.applies, scores.components
        if self.extras.gold is not None and sampling_round == 0:  # the verifier's reward, which does not train
            gold = self.extras.gold.score(*reward_inputs(grouped, generated.completions, generated.extra)).total
            metrics["reward/gold"] = gold.mean().item()
        if "lost" in generated.extra:  # a tool worker died with the row's environment: the row is not trained on
            applies = applies & (generated.extra["lost"] == 0)
            if sampling_round == 0:
                metrics.update(tool_metrics(generated))
        if self.extras.shuffle_rewards:  # negative control (train.shuffle_rewards): rewards no longer fit completions
            order = torch.randperm(len(rewards))
            rewards, applies, components = rewards[order], applies[order], components[order]
        return SampledRound(grouped, generated.completions, rewards, applies, components,
                            generated.routing_trace), metrics

    def resample_zero_std_groups(self, step: int, first: SampledRound, ranks: Ranks
                                 ) -> tuple[SampledRound, dict[str, float]]:
        """DAPO's dynamic sampling (gspo_lab.rollout.dynamic_sampling): further rounds until the step has
        prompts_per_step groups with differing rewards, or max_sampling_rounds were sampled."""
        cfg = self.rollout_cfg
        rounds, needed, metrics = [first], len(first.rewards) // cfg.group_size, {}

        def short() -> bool:
            return informative_count(rounds, cfg.group_size) < needed and len(rounds) < cfg.max_sampling_rounds

        while ranks.any(short()):  # ranks sample in lockstep
            sampled, more = self.sample_round(step, len(rounds), ranks)
            rounds.append(sampled)
            add_round(metrics, more)
        merged, unfilled = merge_rounds(rounds, cfg.group_size, needed, self.rows.tokenizer.pad_token_id)
        sampled = torch.cat([r.scored_rewards for r in rounds])
        metrics["rollout/sampling_rounds"] = float(len(rounds))
        metrics["rollout/unfilled_groups"] = float(unfilled)
        metrics["rollout/frac_zero_std_sampled"] = frac_zero_std(sampled, cfg.group_size).item()
        return merged, metrics

    def score(self, step: int, examples: list[Example], generated: Generated) -> Scores:
        """The reward functions' scores of this round's completions (gspo_lab.rewards): each function gets the
        examples' prompts, the completions (as assistant messages when the prompts are conversational; a
        multi-turn one's every message), their token ids up to and including the stop token, the reference
        `answer`, every other column, and a multi-turn row's `environment_reward`."""
        group = self.rollout_cfg.group_size
        environments = self.agent.environments if self.agent is not None else None
        return self.rewards.score(*reward_inputs(examples, generated.completions, generated.extra, environments),
                                  where=lambda i: f"RL step {step}, prompt {i // group}, completion {i % group}")


def sample_metrics(rewards: torch.Tensor, completions: Completions, group_size: int) -> dict[str, float]:
    """reward/mean, reward/std, reward/frac_zero_std, completion/len_mean and completion/truncated_frac of sampled
    completions (rewards [N], groups contiguous; NaN where no reward function scored a completion, which the
    reward/* leave out: NaN where none was scored)."""
    scored = rewards[~rewards.isnan()]
    return {
        "reward/mean": scored.mean().item(),
        "reward/std": scored.std(unbiased=False).item(),
        "reward/frac_zero_std": frac_zero_std(rewards, group_size).item(),
        "completion/len_mean": completions.policy_mask.sum(-1).float().mean().item(),  # the model's tokens
        "completion/truncated_frac": completions.truncated.float().mean().item(),
    }


def sequence_kl(behave_logp: torch.Tensor, initial_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """KL(π_behave ‖ π_initial) per sequence, of the policy that sampled the rollout (whose samples reward/mean and
    reward/gold score: the weights k versions back under lagged mode, the engine's), estimated on its own samples
    with k3 per token, Σ_t (e^δ_t − 1 − δ_t), δ_t = log π_initial − log π_behave over each completion's model
    tokens, averaged over the batch: never negative, 0 where the two agree (k1, Σ_t −δ_t, went negative). The KL
    of Gao et al.'s over-optimisation laws (in nats; their d is its square root). behave_logp, initial_logp,
    mask [B, C].

    >>> sequence_kl(torch.tensor([[-1.0, -2.0], [-0.5, 0.0]]), torch.tensor([[-1.5, -2.0], [-1.0, -9.0]]),
    ...             torch.tensor([[1, 1], [1, 0]]))  # δ = -0.5 on one token of each row: e^-0.5 - 1 + 0.5
    tensor(0.1065)
    >>> sequence_kl(torch.tensor([[-2.0]]), torch.tensor([[-1.0]]), torch.tensor([[1]])) > 0  # k1 would be -1
    tensor(True)
    """
    delta = ((initial_logp - behave_logp) * mask).double()  # [B, C], 0 off the model's tokens
    # expm1 keeps δ²/2 where δ is tiny; the clamp takes off what rounding leaves below 0 (k3 >= 0 exactly)
    return ((torch.expm1(delta) - delta).clamp(min=0) * mask).sum(-1).mean().to(behave_logp.dtype)


def tool_metrics(generated: Generated) -> dict[str, float]:
    """A multi-turn round's tool use (gspo_lab.rollout.multi_turn): tools/call_frequency (calls per trajectory),
    tools/failure_frequency (calls that raised, timed out or did not parse, per call; TRL's), tools/<name>/
    call_frequency, turns/mean (the model's turns per trajectory), tokens/tool_fraction (the tools' share of the
    completion tokens), tools/lost_frac (the share of trajectories whose environment's worker died) and
    tools/rolled_back_frac (the share whose last tool results did not fit the budget and were rolled back)."""
    extra, completions = generated.extra, generated.completions
    calls = extra["tool_calls"].sum().item()
    tokens = completions.completion_mask.sum().item()
    metrics = {
        "tools/call_frequency": extra["tool_calls"].mean().item(),
        "tools/failure_frequency": extra["tool_failures"].sum().item() / calls if calls else 0.0,
        "turns/mean": extra["turns"].mean().item(),
        "tokens/tool_fraction": 1.0 - completions.policy_mask.sum().item() / tokens if tokens else 0.0,
        "tools/lost_frac": extra["lost"].mean().item(),
        "tools/rolled_back_frac": extra["rolled_back"].mean().item(),
    }
    for key in extra:
        if key.startswith("tool_calls/"):
            metrics[f"tools/{key.removeprefix('tool_calls/')}/call_frequency"] = extra[key].mean().item()
    return metrics
