"""The LightningModule that runs every algorithm: one RL step is one `training_step`, which reads top to bottom:
seed, evaluate when due, collect a rollout, run the updates, log.

The step's parts are named objects (gspo_lab.step), built here from the same settings:
    RolloutCollector  this rank's share of the step's prompts, `group_size` completions each from the rollout backend
                      (gspo_lab.rollout.backend: the trainer's model itself by default), rewards, DAPO's further
                      rounds, advantages, old-policy and reference log-probs, and the rollout's metrics
    Updater           `train.minibatches` shuffled mini-batches, one optimizer step each, with gradient clipping and
                      skips; it owns the entropy coefficient and the skip counter
    PolicyForwards    the policy's forwards: log-probs, shared-prompt forwards, old and reference
    MismatchProbe     the trainer's own log-probs and experts before any update against the engine's (mismatch/*,
                      routing/rollout_disagreement*), and the routing change after the updates
This file holds the Lightning plumbing: checkpoints, evaluation, logging (metrics reduced across ranks and written
once, with `step` = the RL step). The algorithm only chooses the objective (and the routing replay mode).
Randomness is re-seeded from (seed, step, rank) at the start of every step, so a run resumed from a checkpoint,
or another algorithm on the same seed, draws the same prompts and (while the weights agree) the same samples.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import lightning as L
import torch
from torch.utils.data import DataLoader

from gspo_lab.config import RolloutConfig, RoutingConfig, TrainConfig
from gspo_lab.eval_sets import EvalPlan, SetSpec, evaluation_backend, write_samples
from gspo_lab.evaluation import HELDOUT, EvalSettings
from gspo_lab.models.lm_head import fp32_lm_head
from gspo_lab.models.lora import LoraPolicy
from gspo_lab.objectives import AdvantageEstimator, Objective
from gspo_lab.prompts import PromptFormat
from gspo_lab.rewards import RewardFunction, TaskReward, WeightedRewards, gold_reward
from gspo_lab.rewards.base import is_batched
from gspo_lab.rollout import PromptSchedule, StepTicks
from gspo_lab.rollout.backend import Sampling, build_backend
from gspo_lab.rollout.multi_turn import MultiTurn
from gspo_lab.rollout.rescore import build_rescorer
from gspo_lab.rollout.sources import InProcess, StepRows, build_source
from gspo_lab.routing import RoutingReplay
from gspo_lab.seeding import RL_SAMPLING, stream_seed
from gspo_lab.sharding import is_sharded, refuse_non_finite, shard
from gspo_lab.step.collector import Extras, RolloutCollector
from gspo_lab.step.failures import NoSignal, RunStopped
from gspo_lab.step.metrics import across_ranks, rank_spread, reward_counts_across_ranks
from gspo_lab.step.policy import PolicyForwards, frozen_copy
from gspo_lab.step.probe import MismatchProbe
from gspo_lab.step.ranks import Ranks
from gspo_lab.step.updater import TooManySkippedUpdates, Updater, warn_half_precision_weights
from gspo_lab.tasks.base import Task
from gspo_lab.tools import ToolRunner

__all__ = ["NoSignal", "RLModule", "RunStopped", "TooManySkippedUpdates"]


class RLModule(L.LightningModule):
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
        self.optimizer_factory = optimizer
        # the KL penalty's reference: the starting policy (the cold start, or the initial model), frozen; under
        # LoRA the same model with its adapters disabled
        self.lora = lora
        kl_penalty = getattr(objective, "beta", 0.0) > 0
        self.rewards = rewards or WeightedRewards([RewardFunction(TaskReward(task))], None, train.on_reward_error,
                                                  train.failure_stop_frac)
        learned = any(is_batched(f.fn) for f in self.rewards.functions)  # a reward model: over-optimisation to watch
        kl_to_initial = learned if train.kl_to_initial is None else train.kl_to_initial
        self.reference = frozen_copy(model) if (kl_penalty or kl_to_initial) and lora is None else None
        self.rollout_cfg, self.train_cfg, self.seed = rollout, train, seed
        self.routing = RoutingReplay(model, routing.replay, diagnostics_rows=routing.diagnostics_rows)
        self.engine = build_backend(model, rollout)  # hf: the trainer's model itself unless configured
        self.render = (prompt or PromptFormat()).bind(tokenizer)
        rows = StepRows(PromptSchedule(task, rollout.prompts_per_step, seed), self.render, tokenizer,
                        rollout.group_size)
        # tools and environments of a multi-turn task run in these workers (started on first use)
        self.tool_runner = ToolRunner(rollout.tool_workers, rollout.tool_timeout_s)
        agent_of = MultiTurn.factory(rollout, self.tool_runner, tokenizer, self.render.format.chat_template_kwargs)
        agent = agent_of(task)
        # where the rollouts come from (gspo_lab.rollout.sources): the engine synced to the trainer's weights, to
        # weights that lag them (async_mode=lagged), or an engine process generating ahead (overlap);
        # rollout.rescore's second engine scores the samples beside the engine
        rescorer = build_rescorer(model, rollout, self.engine)
        for engine in (self.engine, getattr(rescorer, "engine", None)):  # the hf and replay backends' scoring
            if hasattr(engine, "padding_free"):
                engine.padding_free = train.padding_free  # packed or padded as training's forwards
        in_process = InProcess(self.engine, rows, Sampling.of_rollout(rollout, self.render.add_special_tokens),
                               rollout.generation_batch_size, self.routing, agent, rescorer)
        self.source = build_source(model, rollout, in_process, rows, seed)
        self.evaluation = evaluation or EvalPlan(EvalSettings(), [SetSpec(HELDOUT, task, prompt or PromptFormat(),
                                                                          None, None)])
        self.evaluator = self.evaluation.evaluator(tokenizer, rollout.max_new_tokens, rollout.stop_token_ids, seed,
                                                   agent_of)
        self.rl_step = 0  # RL steps completed; saved in checkpoints
        self.history: list[dict[str, float]] = []  # every logged row (rank 0's view), saved in checkpoints
        # the step's parts (gspo_lab.step)
        self.policy = PolicyForwards(model, self.reference, lora, self.routing, rollout, train)
        self.probe = MismatchProbe(self.routing, self.policy, train.minibatches, routing.diagnostics_every)
        extras = Extras(train.shuffle_rewards, kl_penalty, kl_to_initial,
                        gold_reward(task, self.rewards) if learned else None)
        self.collector = RolloutCollector(self.source, rows, self.policy, self.probe, self.rewards, advantage,
                                          rollout, extras, agent)
        self.updater = Updater(model, objective, self.policy, self.routing, self.probe, train,
                               backward=self.manual_backward, save_last=self.save_last_checkpoint)

    @property
    def objective(self) -> Objective:
        """The objective the updates optimise (the updater's: replace it there)."""
        return self.updater.objective

    # ---- Lightning plumbing -------------------------------------------------------------------------------

    def configure_model(self) -> None:
        """trainer=fsdp (Lightning's ModelParallelStrategy) gives the module a [nodes, devices] device mesh:
        shard the policy with FSDP2 within a node and replicate it across nodes. Other strategies give no mesh
        and leave the model as it is. Every rank still trains on its own share of the prompts."""
        if self.device_mesh is not None:  # LoRA and an engine copy are refused with fsdp at plan time
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
        warn_half_precision_weights(trained)
        return self.optimizer_factory(trained)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(StepTicks(self.train_cfg.steps), batch_size=None)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        refuse_non_finite(self.model, getattr(self._trainer, "strategy", None))  # the strategy: sharded only
        checkpoint["rl_step"] = self.rl_step
        checkpoint["history"] = self.history
        checkpoint.update(self.updater.state_dict())  # consecutive_skips, entropy_control
        checkpoint.update(self.source.state_dict())  # lagged: the weight versions a resumed run still generates from
        # running counts of reward errors and timeouts, all ranks' (collective: every rank saves)
        checkpoint["rewards"] = reward_counts_across_ranks(self.rewards, self.trainer.strategy,
                                                           self.trainer.world_size, self.device)
        if self.lora is not None:  # the adapters only: the base weights come from the model source on resume
            self.lora.save_checkpoint(checkpoint, prefix="model.")

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        if self.lora is not None:
            self.lora.check_checkpoint(checkpoint, prefix="model.")
            self.strict_loading = False  # checked above: exactly the adapters, for this base
        self.rl_step = checkpoint["rl_step"]
        self.history = [row for row in checkpoint["history"] if row["step"] < self.rl_step]
        self.updater.load_state_dict(checkpoint)
        self.source.load_state_dict(checkpoint)
        counts = checkpoint if self.global_rank == 0 else {}  # all ranks' together: rank 0 carries them on
        if "rewards" in counts:
            self.rewards.load_state_dict(counts["rewards"])
        elif counts.get("reward_errors"):  # a checkpoint written before the reward group: one total, one function
            self.rewards.errors[self.rewards.functions[0].name] = counts["reward_errors"]

    def teardown(self, stage: str) -> None:
        self.close()

    def close(self) -> None:
        """Stop what runs beside the model: the grading pools' worker processes, a judge's engine and the rollout
        engine (vLLM's); the module's teardown on success, gspo_lab.train when fit raises."""
        self.rewards.close()
        self.evaluation.close()
        self.engine.close()
        self.source.close()  # rollout.rescore's engine, the overlap engine process
        self.tool_runner.close()

    # ---- one RL step --------------------------------------------------------------------------------------

    def training_step(self, tick: int, tick_idx: int) -> None:
        if self.rl_step >= self.train_cfg.steps:  # resumed from the final checkpoint: nothing left
            self.trainer.should_stop = True
            return
        step, ranks = self.rl_step, self.ranks()
        torch.manual_seed(stream_seed(self.seed, RL_SAMPLING, step, self.global_rank))
        evaluating = self.train_cfg.eval_every > 0
        metrics = self.evaluate(step) if evaluating and step % self.train_cfg.eval_every == 0 else {}
        started = time.perf_counter()
        try:
            rollout = self.collector.collect(step, ranks)
        except NoSignal as error:  # nothing trained this step: the weights are those before it
            raise NoSignal(f"{error}\nCheckpoint of the weights before this step: {self.save_last_checkpoint()}; "
                           "resume with ckpt_path=last once the failure is fixed.") from None
        rolled = time.perf_counter()
        metrics.update(rollout.metrics)
        metrics.update(self.updater.update(rollout.batch, self.optimizers(), ranks, step))
        metrics.update(self.probe.after_updates(step))
        updated = time.perf_counter()
        tokens = float(rollout.batch.attention_mask[:, -rollout.batch.completion_len :].sum())
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
                final["params/rank_spread"] = rank_spread(self.model, self.all_gather)
            if final:
                self.log_step(self.rl_step, final)
            self.trainer.should_stop = True

    def ranks(self) -> Ranks:
        """This rank and the world, as the step's parts take them."""
        return Ranks(self.global_rank, self.trainer.world_size, self.device, self.trainer.strategy)

    def save_last_checkpoint(self) -> Path:
        """<run dir>/checkpoints/last.ckpt, written now (the updater's, when too many updates in a row were
        skipped: the weights are then the last good ones)."""
        checkpoint = Path(self.trainer.default_root_dir) / "checkpoints" / "last.ckpt"
        self.trainer.save_checkpoint(checkpoint)
        return checkpoint

    def evaluate(self, step: int) -> dict[str, float]:
        """Every evaluation set's metrics (gspo_lab.evaluation; each rank scores its share of the prompts) and
        eval/accuracy, the heldout set's greedy accuracy. Sampling draws from the evaluation's own seeds, and the
        training's random state is restored after it. Rank 0 keeps its prompts among the first `eval.samples` of each
        set in samples/step_<step>.jsonl (and a wandb Table)."""
        cuda = [self.device] if self.device.type == "cuda" else []
        # under async_mode=overlap the engine process holds stale weights and works for the RL step: evaluation runs
        # transformers on the trainer's weights (eval/engine_vllm 0)
        engine = self.engine if self.source.in_process else None
        backend, generated_by = evaluation_backend(engine, self.model, self.evaluator.settings.engine)
        with torch.random.fork_rng(devices=cuda):
            metrics, rows = self.evaluator.run(
                self.model, self.tokenizer, self.global_rank, self.trainer.world_size,
                reduce_sum=lambda t: self.trainer.strategy.reduce(t.to(self.device), reduce_op="sum").cpu(),
                keep=self.evaluator.settings.samples, backend=backend)
        metrics.update(generated_by)
        if rows and self.global_rank == 0:
            write_samples(Path(self.trainer.default_root_dir) / "samples", step, rows, self.loggers)
        return metrics

    def log_step(self, step: int, metrics: dict[str, float]) -> None:
        """Reduce across ranks, write one row to every logger, and show the headline on the progress bar."""
        if self.trainer.world_size > 1:
            metrics = across_ranks(metrics, self.trainer.strategy, self.device)
        self.history.append({"step": step, **metrics})
        for logger in self.loggers:
            logger.log_metrics(metrics, step=step)
        shown = {"reward": "reward/mean", "clip": "clip/frac", "acc": "eval/accuracy"}
        for name, key in shown.items():
            if key in metrics:
                self.log(name, metrics[key], prog_bar=True, logger=False, on_step=True, on_epoch=False)

