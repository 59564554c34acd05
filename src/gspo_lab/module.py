"""The LightningModule that runs every algorithm: rollout -> reward -> advantages -> objective -> updates.

One RL step is one `training_step`:
1. this rank's share of the step's prompts, `group_size` completions each (transformers `generate`) from the
   rollout engine (the trainer's model itself by default; `rollout.engine.*` makes it differ);
2. rewards from the reward functions (gspo_lab.rewards; the task's checker by default), with
   `rollout.filter_zero_std_groups` further rounds of prompts replacing groups whose rewards are all equal
   (gspo_lab.rollout.dynamic_sampling); group-relative advantages;
3. old-policy log-probs from the engine's own logits (default), or from a no-grad trainer forward; with
   `objective.beta > 0`, the frozen reference policy's log-probs from one more no-grad forward;
4. `train.minibatches` shuffled mini-batches, one optimizer step each, with gradient clipping; the trainer's own
   log-probs and experts before any update against the engine's (mismatch/*, routing/rollout_disagreement*) are
   those of the first mini-batch's forwards (without replay, when it holds routing.diagnostics_rows rows) or of a
   no-grad forward of the diagnostic rows in step 2, and the routing change of those rows after the updates
   closes the step;
5. metrics reduced across ranks and written once, with `step` = the RL step.
Steps 1-3 are the rollout half (gspo_lab.rollout.collection.RolloutCollection, mixed in); this file holds the
Lightning plumbing and the updates. The algorithm only chooses the objective (and the routing replay mode).
Randomness is re-seeded from (seed, step, rank) at the start of every step, so a run resumed from a checkpoint,
or another algorithm on the same seed, draws the same prompts and (while the weights agree) the same samples.
"""

from __future__ import annotations

import copy
import logging
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import lightning as L
import torch
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.strategies import ParallelStrategy
from torch.distributed import ReduceOp
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from gspo_lab.config import RolloutConfig, RoutingConfig, TrainConfig
from gspo_lab.eval_sets import EvalPlan, SetSpec, evaluation_sampler
from gspo_lab.evaluation import HELDOUT, EvalSettings, write_jsonl
from gspo_lab.models.lm_head import fp32_lm_head
from gspo_lab.models.lora import LoraPolicy
from gspo_lab.objectives import AdvantageEstimator, NonFiniteLossError, Objective
from gspo_lab.objectives import micro_batches
from gspo_lab.objectives.entropy import EntropyCoefficient
from gspo_lab.prompts import PromptFormat
from gspo_lab.rewards import RewardFunction, TaskReward, WeightedRewards
from gspo_lab.rollout import PromptSchedule, RolloutBatch, StepTicks, token_logprobs
from gspo_lab.rollout.collection import RolloutCollection
from gspo_lab.rollout.engine import build_engine
from gspo_lab.rollout.generation import distinct_prompts
from gspo_lab.routing import RoutingReplay
from gspo_lab.routing.trace import RoutingTrace
from gspo_lab.seeding import RL_SAMPLING, stream_seed
from gspo_lab.sharding import is_sharded, shard
from gspo_lab.tasks.base import Task
from gspo_lab.tensors import masked_mean

log = logging.getLogger(__name__)


class TooManySkippedUpdates(RuntimeError):
    """Raised after `train.max_consecutive_skips` updates in a row were skipped for NaN/Inf."""


class RLModule(RolloutCollection, L.LightningModule):
    """Group-based policy optimisation of a causal LM, with manual optimisation.

    Args:
        model, tokenizer: the policy (a transformers causal LM) and its tokenizer.
        task: prompts and the reward function.
        objective: an `Objective` (GSPO, GSPOToken, GRPO, or one composed in conf/objective/*.yaml).
        advantage: rewards [B] -> advantages [B], an `AdvantageEstimator` (the `advantage` config group).
        optimizer: a partial taking the parameters, e.g. `functools.partial(torch.optim.AdamW, lr=3e-5)`.
        rollout, train, routing: validated settings (gspo_lab.config).
        seed: the run's seed.
        lora: the PEFT wrapper when `model` trains through LoRA adapters (gspo_lab.models.lora), else None.
        rewards: the reward functions (gspo_lab.rewards, the `reward` config group); by default the task's own
            checker, graded in this process.
        prompt: how an example becomes model input (gspo_lab.prompts, the `prompt` config group); by default
            the prompt text as it is, or in the tokenizer's chat template when it has one.
        evaluation: the evaluation sets and how they decode (gspo_lab.eval_sets, the `eval` config group); by
            default greedy accuracy on the task's held-out split (`heldout`).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        task: Task,
        objective: Objective,
        advantage: AdvantageEstimator,
        optimizer: Callable,
        rollout: RolloutConfig,
        train: TrainConfig,
        routing: RoutingConfig,
        seed: int,
        lora: LoraPolicy | None = None,
        rewards: WeightedRewards | None = None,
        prompt: PromptFormat | None = None,
        evaluation: EvalPlan | None = None,
    ) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.model, self.tokenizer, self.task = model, tokenizer, task
        self.model.train()  # what Lightning expects at the start of fit; RL itself runs in eval mode (on_train_start)
        if train.lm_head_fp32:  # before the reference and an engine copy are made: they keep it
            fp32_lm_head(model)
        self.objective, self.advantage, self.optimizer_factory = objective, advantage, optimizer
        # the KL penalty's reference: the starting policy (the cold start, or the initial model), frozen; under
        # LoRA the same model with its adapters disabled
        self.lora = lora
        self.kl_penalty = getattr(objective, "beta", 0.0) > 0
        self.reference = frozen_copy(model) if self.kl_penalty and lora is None else None
        self.rollout_cfg, self.train_cfg, self.seed = rollout, train, seed
        self.routing = RoutingReplay(model, routing.replay, diagnostics_rows=routing.diagnostics_rows)
        self.diagnostics_every = routing.diagnostics_every
        self.engine = build_engine(model, rollout)  # hf: the trainer's model itself unless configured
        self.prompts = PromptSchedule(task, rollout.prompts_per_step, seed)
        self.render = (prompt or PromptFormat()).bind(tokenizer)
        self.evaluation = evaluation or EvalPlan(EvalSettings(), [SetSpec(HELDOUT, task, prompt or PromptFormat(),
                                                                          None, None)])
        self.evaluator = self.evaluation.evaluator(tokenizer, rollout.max_new_tokens, rollout.stop_token_ids, seed)
        self.rl_step = 0  # RL steps completed; saved in checkpoints
        self.history: list[dict[str, float]] = []  # every logged row (rank 0's view), saved in checkpoints
        self.consecutive_skips = 0
        # the entropy bonus's coefficient (objective.entropy_coef; adaptive with objective.entropy_target); saved
        self.entropy_control = EntropyCoefficient.of(objective)
        self.rewards = rewards or WeightedRewards([RewardFunction(TaskReward(task))], on_error=train.on_reward_error)

    # ---- Lightning plumbing -------------------------------------------------------------------------------

    def configure_model(self) -> None:
        """trainer=fsdp (Lightning's ModelParallelStrategy) gives the module a [nodes, devices] device mesh:
        shard the policy with FSDP2 within a node and replicate it across nodes. Other strategies give no mesh
        and leave the model as it is. Every rank still trains on its own share of the prompts."""
        if self.device_mesh is not None:  # LoRA and an engine copy are refused with fsdp by the plan (train.check_model)
            shard(self.model, self.device_mesh)
            if self.reference is not None:
                shard(self.reference, self.device_mesh)

    def on_train_start(self) -> None:
        """Eval mode for the whole run: generation, old and new log-probs are then one deterministic function
        (no dropout, attention dropout or router jitter), so an on-policy ratio is 1. Gradient checkpointing still
        applies (gspo_lab.models.builders.checkpoint_blocks). The KL reference runs in the same mode."""
        self.model.eval()
        if self.reference is not None:
            self.reference.eval()

    def configure_optimizers(self):
        trained = [p for p in self.model.parameters() if p.requires_grad]  # LoRA: the adapters (PEFT keeps them fp32)
        half = {str(p.dtype).removeprefix("torch.") for p in trained} & {"bfloat16", "float16"}
        if half:
            log.warning(
                "the trained weights are %s (model.dtype): an optimizer step smaller than half the spacing of that "
                "format at a weight (|w|/256 to |w|/128 in bfloat16) leaves it unchanged, so at small learning rates "
                "most weights never move (the anchor model in bfloat16 at train.lr=3e-5: 27%% of its weights changed "
                "in 8 updates, 97%% in float32). Keep model.dtype=float32 with trainer.precision=bf16-mixed, or "
                "train LoRA adapters (model.lora.enabled=true).", ", ".join(sorted(half)))
        return self.optimizer_factory(trained)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(StepTicks(self.train_cfg.steps), batch_size=None)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        bad = [name for name, p in self.model.named_parameters() if not torch.isfinite(local(p)).all()]
        if is_sharded(self.model):  # each rank holds its own shards: a bad one anywhere stops every rank
            anywhere = self.trainer.strategy.reduce_boolean_decision(bool(bad), all=False)  # every rank calls it
            bad = bad or (["another rank's shard"] if anywhere else [])
        if bad:
            raise FloatingPointError(f"refusing to write a checkpoint with non-finite weights in {bad[:5]}")
        checkpoint["rl_step"] = self.rl_step
        checkpoint["history"] = self.history
        checkpoint["consecutive_skips"] = self.consecutive_skips
        checkpoint["entropy_control"] = self.entropy_control.state_dict()
        checkpoint["rewards"] = self.reward_counts_of_all_ranks()  # running counts of reward errors and timeouts
        if self.lora is not None:  # the adapters only: the base weights come from the model source on resume
            self.lora.save_checkpoint(checkpoint, prefix="model.")

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        if self.lora is not None:
            self.lora.check_checkpoint(checkpoint, prefix="model.")
            self.strict_loading = False  # checked above: exactly the adapters, for this base
        self.rl_step = checkpoint["rl_step"]
        self.history = [row for row in checkpoint["history"] if row["step"] < self.rl_step]
        self.consecutive_skips = checkpoint["consecutive_skips"]
        if "entropy_control" in checkpoint:  # absent from checkpoints written before entropy control
            self.entropy_control.load_state_dict(checkpoint["entropy_control"])
        counts = checkpoint if self.global_rank == 0 else {}  # all ranks' together: rank 0 carries them on
        if "rewards" in counts:
            self.rewards.load_state_dict(counts["rewards"])
        elif counts.get("reward_errors"):  # a checkpoint written before the reward group: one total, one function
            self.rewards.errors[self.rewards.functions[0].name] = counts["reward_errors"]

    def reward_counts_of_all_ranks(self) -> dict[str, dict[str, int]]:
        """The reward functions' running error and timeout counts (`WeightedRewards.state_dict`) summed over the
        ranks, each of which counts its own completions, as they are logged; collective: every rank saves."""
        state = self.rewards.state_dict()
        if self.trainer.world_size == 1:
            return state
        summed = across_ranks({f"reward/{name}/{kind}": float(n) for kind, counts in state.items()
                               for name, n in counts.items()}, self.trainer.strategy, self.device)
        return {kind: {name: int(summed[f"reward/{name}/{kind}"]) for name in counts} for kind, counts in state.items()}

    def teardown(self, stage: str) -> None:
        self.close()

    def close(self) -> None:
        """Stop what runs beside the model: the grading pools' worker processes and the rollout engine (vLLM's);
        the module's teardown on success, gspo_lab.train when fit raises."""
        if self.rewards.runner is not None:
            self.rewards.runner.close()
        self.evaluation.close()
        self.engine.close()

    # ---- one RL step --------------------------------------------------------------------------------------

    def training_step(self, tick: int, tick_idx: int) -> None:
        if self.rl_step >= self.train_cfg.steps:  # resumed from the final checkpoint: nothing left
            self.trainer.should_stop = True
            return
        step = self.rl_step
        torch.manual_seed(stream_seed(self.seed, RL_SAMPLING, step, self.global_rank))
        metrics: dict[str, float] = {}
        evaluating = self.train_cfg.eval_every > 0
        if evaluating and step % self.train_cfg.eval_every == 0:
            metrics.update(self.evaluate(step))
        started = time.perf_counter()
        batch = self.collect_rollout(step, metrics)
        rolled = time.perf_counter()
        metrics.update(self.update(batch))
        updated = time.perf_counter()
        tokens = float(batch.attention_mask[:, -batch.completion_len :].sum())
        metrics.update(self.rollout_metrics(batch))
        metrics.update({
            "time/rollout_s": rolled - started,
            "time/update_s": updated - rolled,
            "throughput/tokens_per_s": tokens / (updated - started),
            "lr": self.optimizers().param_groups[0]["lr"],
        })
        self.rl_step += 1
        self.log_step(step, metrics)
        if self.rl_step == self.train_cfg.steps:
            final = self.evaluate(self.rl_step) if evaluating else {}
            if self.trainer.world_size > 1 and not is_sharded(self.model):  # replicas (DDP) must agree
                final["params/rank_spread"] = self.rank_spread()
            if final:
                self.log_step(self.rl_step, final)
            self.trainer.should_stop = True

    def update(self, batch: RolloutBatch) -> dict[str, float]:
        optimizer = self.optimizers()
        collected: list[dict[str, float]] = []
        skipped = 0
        diagnostics: dict[str, float] = {}
        for index, rows in enumerate(torch.randperm(len(batch.rewards)).chunk(self.train_cfg.minibatches)):
            minibatch = batch.rows(rows.to(self.device))
            # without replay the first mini-batch's forwards are the trainer's own before any update: the engine
            # mismatch and the routing before the updates are measured on them, not by a forward of their own
            before = FirstForwards() if index == 0 and self.measured_in_update(batch) else None
            metrics = self.accumulate(minibatch, before)
            if before is not None:
                started = time.perf_counter()
                diagnostics.update(before.measured(self, minibatch))
                diagnostics["time/mismatch_s"] = time.perf_counter() - started
            if metrics is None:
                optimizer.zero_grad()  # a micro-batch before the non-finite one may have left gradients
                skipped += self.skip_update("non-finite loss")
                continue
            grad_norm = self.grad_norm()
            if not torch.isfinite(grad_norm):  # identical on every rank: gradients are all-reduced
                optimizer.zero_grad()
                skipped += self.skip_update(f"gradient norm {grad_norm.item()}")
                continue
            self.consecutive_skips = 0
            if self.clips(grad_norm):  # by the norm just computed: Lightning's clip_gradients refuses fused
                # optimizers under any mixed precision, bf16's too (no grad scaler there; Lightning issue #21435)
                torch.nn.utils.clip_grads_with_norm_(self.model.parameters(), self.train_cfg.grad_clip, grad_norm)
            optimizer.step()
            optimizer.zero_grad()
            if self.entropy_control.enabled:  # the coefficient for the next update (adaptive), as TRL logs it
                self.entropy_control.update(self.loss_tokens_entropy(metrics))
                metrics["entropy/coef"] = self.entropy_control.coef
            collected.append({**metrics, "grad_norm": grad_norm.item()})
        metrics = combine(collected)
        metrics["train/skipped_updates"] = float(skipped)
        metrics.update(diagnostics)
        metrics.update(self.routing.diagnostics(self.shared_logprobs, measure=self.diagnosing(self.rl_step)))
        return metrics

    # ---- pieces -------------------------------------------------------------------------------------------

    def accumulate(self, minibatch: RolloutBatch, before: FirstForwards | None = None) -> dict[str, float] | None:
        """The mini-batch's gradient, accumulated over micro-batches of train.micro_batch_size rows, each loss
        weighted by its share D_m / D of the aggregation's count (gspo_lab.objectives.micro_batches), and its
        metrics; None when a loss was non-finite (on every rank). Under DDP only the last micro-batch's backward
        all-reduces (`gradient_sync`). `before` gathers the forwards' log-probs and experts."""
        count = len(minibatch.rewards)
        slices = micro_batches.micro_slices(count, self.train_cfg.micro_batch_size)
        split = len(slices) > 1
        total = micro_batches.denominator(self.objective, minibatch.loss_mask).clamp(min=1) if split else None
        tokens = minibatch.loss_mask.sum().clamp(min=1) if split else None  # the entropy bonus's count
        keys, collected = None, []
        for index, rows in enumerate(slices):
            micro = minibatch.rows(torch.arange(count, device=self.device)[rows]) if split else minibatch
            share = micro_batches.denominator(self.objective, micro.loss_mask) / total if split else None
            token_share = micro.loss_mask.sum() / tokens if split else None
            with self.gradient_sync(last=index == len(slices) - 1):
                out, entropy = self.forward_backward(micro, share, before, token_share)
            if out is None:
                return None
            mask = micro.loss_mask
            keys = keys or [*out.metrics, "entropy"]
            metrics = {**out.metrics, "entropy": masked_mean(entropy, mask.to(entropy.dtype))}
            counts = [mask.sum(), mask.bool().any(-1).sum(), torch.ones(()) if share is None else share]
            collected.append(torch.stack([v.detach().double().to(self.device) for v in
                                          [*(metrics[k] for k in keys), *counts]]))  # [K + 3]
        host = torch.stack(collected).cpu().tolist()  # one copy to the host per mini-batch, not one per metric
        parts = [(dict(zip(keys, row[:-3])), *row[-3:]) for row in host]
        return micro_batches.combine(self.objective, parts)

    def gradient_sync(self, last: bool):
        """Around a micro-batch's backward: under DDP, no all-reduce but in a mini-batch's last micro-batch (Lightning's
        `block_backward_sync`, DDP's `no_sync`), whose all-reduce then carries the sum accumulated locally; one per
        optimizer step instead of one per micro-batch. FSDP reduce-scatters every micro-batch: deferring that would
        hold the whole model's unsharded gradients on every rank (`set_requires_gradient_sync`)."""
        strategy = self.trainer.strategy
        if last or not isinstance(strategy, ParallelStrategy):
            return nullcontext()
        return strategy.block_backward_sync()

    def forward_backward(self, minibatch: RolloutBatch, share: torch.Tensor | None = None,
                         before: FirstForwards | None = None, token_share: torch.Tensor | None = None):
        """Objective and gradient of one (micro-)batch, its loss weighted by `share` (None: 1) and its entropy bonus by
        `token_share` (micro_batches.weighted_loss); (None, None) on every rank when any rank's loss is non-finite.
        Backward runs inside the replay context, so recomputed forwards replay too. `before` (no replay) keeps the
        forward's log-probs and experts (recorded in the forward only)."""
        coef = self.entropy_control.applied if self.entropy_control.enabled else None
        with self.routing.training(minibatch):
            with self.routing.recording() if before is not None else nullcontext() as trace:
                logp, entropy = self.logprobs(minibatch, share_prompts=self.replay_allows_sharing(minibatch),
                                              entropy_grad=bool(coef))  # the bonus's gradient, only where it acts
            if before is not None:
                before.logp.append(logp.detach())
                before.traces.append(trace)
            try:
                entropy_inputs = {"entropy": entropy, "entropy_coef": coef} if self.objective_needs_entropy else {}
                out = self.objective(logp, minibatch.old_logp, minibatch.advantages, minibatch.loss_mask,
                                     ref_logp=minibatch.ref_logp, rollout_logp=minibatch.rollout_logp,
                                     **entropy_inputs)
            except NonFiniteLossError as error:
                log.warning("RL step %d: %s", self.rl_step, error)
                out = None
            if self.trainer.strategy.reduce_boolean_decision(out is None, all=False):  # any rank -> all skip
                return None, None
            self.manual_backward(out.loss if share is None else micro_batches.weighted_loss(out, share, token_share))
        return out, entropy.detach()

    def logprobs(self, batch: RolloutBatch, model: torch.nn.Module | None = None,
                 share_prompts: bool = False, entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs and entropy of the batch's completion tokens under `model` (default: the policy);
        `share_prompts` (train.share_prompt_forward, never with routing hooks or FSDP): each prompt runs once;
        `entropy_grad`: the entropy with its gradient (the entropy bonus)."""
        share = share_prompts and self.train_cfg.share_prompt_forward and not is_sharded(self.model)
        return token_logprobs(
            self.model if model is None else model, batch.input_ids, batch.attention_mask, batch.completion_len,
            self.rollout_cfg.temperature, self.train_cfg.logprob_chunk_rows, share_prompts=share,
            chunk_tokens=self.train_cfg.logprob_chunk_tokens, entropy_grad=entropy_grad,
        )

    @property
    def objective_needs_entropy(self) -> bool:
        """Whether the objective takes the entropy (its bonus or top-entropy mask; a user's objective may not)."""
        return getattr(self.objective, "needs_entropy", False)

    def loss_tokens_entropy(self, metrics: dict[str, float]) -> float:
        """The mean entropy over the tokens the policy loss kept in this mini-batch, over all ranks (each rank's
        sum and count reduced, as TRL's controller): what the adaptive coefficient steers (`EntropyCoefficient`)."""
        mean = metrics.get("entropy/kept_mean", metrics["entropy"])
        count = metrics["mask/valid_tokens"] * metrics.get("entropy/kept_frac", 1.0)
        if self.trainer.world_size == 1:
            return mean
        totals = self.trainer.strategy.reduce(torch.tensor([mean * count, count], device=self.device,
                                                           dtype=torch.float64), reduce_op="sum")
        return (totals[0] / totals[1].clamp(min=1)).item()

    def replay_allows_sharing(self, minibatch: RolloutBatch) -> bool:
        """Whether a training forward may run each distinct prompt once: always without replay; under replay when
        the rows of each prompt replay the same experts on its columns (so do traces that shared forwards and
        prefills recorded, the defaults), for a shared prompt can only replay one row's experts."""
        if not self.routing.replays_in_training:
            return True
        _, inverse, first = distinct_prompts(minibatch.input_ids, minibatch.attention_mask, minibatch.completion_len)
        prompt, same = slice(0, minibatch.input_ids.shape[1] - minibatch.completion_len), first[inverse].cpu()
        trace = minibatch.routing_trace
        return (torch.equal(trace.indices[:, :, prompt], trace.indices[:, same, prompt])
                and torch.equal(trace.recorded[:, prompt], trace.recorded[same, prompt]))

    def shared_logprobs(self, batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """`logprobs` of the policy with each prompt run once, for forwards that only record routing."""
        return self.logprobs(batch, share_prompts=True)

    def diagnosing(self, step: int) -> bool:
        """Whether RL step `step` runs the forwards that serve only the diagnostics (routing.diagnostics_every)."""
        return step % self.diagnostics_every == 0

    def grad_norm(self) -> torch.Tensor:
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        if not grads:
            return torch.zeros((), device=self.device)
        norm = torch.nn.utils.get_total_norm(grads)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm  # FSDP: the norm over all shards

    def clips(self, grad_norm: torch.Tensor) -> bool:
        """Whether train.grad_clip scales the gradients: torch's clip_grads_with_norm_ multiplies them by
        min(1, grad_clip / (norm + 1e-6)), so by exactly 1 (a pass over every gradient that changes nothing) unless
        this holds. The host already waited for the norm (the finiteness check above)."""
        clip = self.train_cfg.grad_clip
        return clip > 0 and bool(clip / (grad_norm + 1e-6) < 1)

    def skip_update(self, reason: str) -> int:
        """Count a skipped update; too many in a row stop the run with a clear message."""
        self.consecutive_skips += 1
        log.warning("RL step %d: update skipped (%s)", self.rl_step, reason)
        if self.consecutive_skips >= self.train_cfg.max_consecutive_skips:
            checkpoint = Path(self.trainer.default_root_dir) / "checkpoints" / "last.ckpt"
            self.trainer.save_checkpoint(checkpoint)  # the weights are the last good ones: skips change nothing
            raise TooManySkippedUpdates(
                f"{self.consecutive_skips} consecutive updates were skipped for NaN/Inf loss or gradients "
                f"(train.max_consecutive_skips={self.train_cfg.max_consecutive_skips}); stopped at RL step "
                f"{self.rl_step} with checkpoint {checkpoint}. Lower train.lr or set objective.log_ratio_clamp, "
                "then resume with ckpt_path=last."
            )
        return 1

    def rank_spread(self) -> float:
        """Largest difference of any parameter tensor's sum between ranks (0 when DDP keeps them identical)."""
        sums = torch.stack([p.detach().double().sum() for p in self.model.parameters()])  # [n_tensors]
        gathered = self.all_gather(sums)  # [world, n_tensors]
        return (gathered - gathered[0]).abs().max().item()

    def evaluate(self, step: int) -> dict[str, float]:
        """Every evaluation set's metrics (gspo_lab.evaluation; each rank scores its share of the prompts) and
        eval/accuracy, the heldout set's greedy accuracy. Sampling draws from the evaluation's own seeds, and the
        training's random state is restored after it. Rank 0 keeps its prompts among the first `eval.samples` of each
        set in samples/step_<step>.jsonl (and a wandb Table)."""
        cuda = [self.device] if self.device.type == "cuda" else []
        sampler, generated_by = evaluation_sampler(self.engine, self.model, self.evaluator.settings.engine)
        with torch.random.fork_rng(devices=cuda):
            metrics, rows = self.evaluator.run(
                self.model, self.tokenizer, self.global_rank, self.trainer.world_size,
                reduce_sum=lambda t: self.trainer.strategy.reduce(t.to(self.device), reduce_op="sum").cpu(),
                keep=self.evaluator.settings.samples, sampler=sampler)
        metrics.update(generated_by)
        if rows and self.global_rank == 0:
            self.write_samples(step, rows)
        return metrics

    def write_samples(self, step: int, rows: list[dict]) -> None:
        """samples/step_<step>.jsonl in the run dir, and one wandb Table per set when the wandb logger is on."""
        folder = Path(self.trainer.default_root_dir) / "samples"
        folder.mkdir(parents=True, exist_ok=True)
        write_jsonl(folder / f"step_{step}.jsonl", rows)
        for logger in self.loggers:
            if isinstance(logger, WandbLogger):
                columns = ["set", "index", "prompt", "reference", "mode", "sample", "completion", "answer", "correct"]
                for name in dict.fromkeys(row["set"] for row in rows):
                    data = [[row[c] for c in columns] for row in rows if row["set"] == name]
                    logger.log_table(key=f"samples/{name}", columns=columns, data=data, step=step)

    def log_step(self, step: int, metrics: dict[str, float]) -> None:
        """Reduce across ranks, write one row to every logger, and show the headline on the progress bar."""
        metrics = self.reduce_across_ranks(metrics)
        self.history.append({"step": step, **metrics})
        for logger in self.loggers:
            logger.log_metrics(metrics, step=step)
        shown = {"reward": "reward/mean", "clip": "clip/frac", "acc": "eval/accuracy"}
        for name, key in shown.items():
            if key in metrics:
                self.log(name, metrics[key], prog_bar=True, logger=False, on_step=True, on_epoch=False)

    def reduce_across_ranks(self, metrics: dict[str, float]) -> dict[str, float]:
        if self.trainer.world_size == 1:
            return metrics
        return across_ranks(metrics, self.trainer.strategy, self.device)


@dataclass
class FirstForwards:
    """The log-probs [b, C] and experts of the first mini-batch's micro-batches, in order: the trainer's own (no
    replay) before any update, which the engine mismatch and the routing diagnostics measure."""

    logp: list[torch.Tensor] = field(default_factory=list)
    traces: list[RoutingTrace | None] = field(default_factory=list)

    def measured(self, module: RLModule, minibatch: RolloutBatch) -> dict[str, float]:
        """mismatch/* and routing/rollout_disagreement* on the rows forwarded (all of the mini-batch's, unless a
        non-finite loss stopped it early)."""
        logp = torch.cat(self.logp)  # [b, C]
        rows = minibatch.rows(torch.arange(len(logp), device=logp.device))
        trace = None if self.traces[0] is None else RoutingTrace.cat(self.traces)
        return module.mismatch_measured(rows, logp, trace)


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` that never trains: no gradients, and the optimizer never sees it (it only gets
    `self.model`'s parameters). It is saved in checkpoints, so a resumed run keeps the same reference."""
    reference = copy.deepcopy(model)
    reference.requires_grad_(False)
    return reference


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of an FSDP parameter, or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def across_ranks(metrics: dict[str, float], strategy, device: torch.device) -> dict[str, float]:
    """Every rank's `metrics` (the same keys on each) reduced to one row by the Lightning `strategy`, each key as
    `reduction` says; collective: every rank calls it."""
    keys = sorted(metrics)
    values = torch.tensor([metrics[k] for k in keys], device=device, dtype=torch.float64)  # [K]
    reduced = {
        "mean": strategy.reduce(values.clone(), reduce_op="mean"),
        "sum": strategy.reduce(values.clone(), reduce_op="sum"),
        "max": strategy.reduce(values.clone(), reduce_op=ReduceOp.MAX),
        "min": strategy.reduce(values.clone(), reduce_op=ReduceOp.MIN),
    }
    return {k: reduced[reduction(k)][i].item() for i, k in enumerate(keys)}


def reduction(key: str) -> str:
    """How a metric combines across mini-batches and ranks: */max by max, */min by min, the reward functions'
    error and timeout counts (reward/errors, reward/<name>/timeouts, ...; only in rollout metrics, so only across
    ranks) by sum, for each rank counts its own completions; else mean."""
    if key.endswith(("/max", "/min")):
        return key.rsplit("/", 1)[1]
    return "sum" if key.startswith("reward/") and key.endswith(("/errors", "/timeouts")) else "mean"


def combine(rows: list[dict[str, float]]) -> dict[str, float]:
    """Per-mini-batch metrics -> one value each (see `reduction`)."""
    if not rows:
        return {}
    combined = {}
    for key in rows[0]:
        values = [row[key] for row in rows]
        kind = reduction(key)
        combined[key] = max(values) if kind == "max" else min(values) if kind == "min" else sum(values) / len(values)
    return combined
