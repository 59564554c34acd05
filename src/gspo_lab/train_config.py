"""The optimisation side of an RL run: what `train:` in the Hydra config builds (re-exported by gspo_lab.config,
whose other settings it sits beside). Its `__post_init__` names the key, the value and the rule of a bad value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gspo_lab.engine_settings import positive_int, require

if TYPE_CHECKING:
    from gspo_lab.config import RolloutConfig


@dataclass
class TrainConfig:
    """The optimisation side of an RL run.

    Args:
        steps: RL steps (each: one rollout, then `minibatches` optimizer steps).
        minibatches: optimizer steps per rollout batch; the first is on-policy, the rest off-policy.
        micro_batch_size: rows per forward and backward, gradients accumulated to the mini-batch (one optimizer
            step per mini-batch as without); null runs each mini-batch whole. The update does not depend on it
            (gspo_lab.objectives.micro_batches), only the memory and the float rounding. The no-grad old-policy
            and reference forwards take this many rows at a time too (null: the rank's whole batch).
        micro_batch_tokens: micro-batches by a token budget instead (verl's ppo_max_token_len_per_gpu): each
            mini-batch's rows, in its order, into micro-batches of at most this many real tokens (prompt and
            completion, padding not counted; a longer row is a micro-batch of its own), every rank running as many
            as the rank that needs most (gspo_lab.step.budget). Exact as micro_batch_size is; null: off. The
            no-grad forwards take the same budget.
        padding_free: the policy's, old policy's and reference's forwards (and the hf engine's scoring) run on each
            row's real tokens only, rows packed end to end with attention kept within each row
            (gspo_lab.rollout.packing): the same log-probs to float rounding without computing a pad token. An
            architecture whose rows would see each other (linear attention, gpt-oss) stays padded, with a warning.
        pack_min_saving: a forward packs only where its bins hold at least this share fewer tokens than the padded
            batch, else it runs padded (0: always packs): where nearly every row is as long as the longest, the
            bins' indexing and mask cost more than they save (bench_anchor's fixed-length answers: 0.91x padded).
        lr: learning rate, read by the optimizer config.
        grad_clip: max gradient norm; 0 disables clipping.
        shuffle_rewards: negative control: shuffle rewards across the rollout batch before advantages.
        eval_every: RL steps between held-out evaluations (also at step 0 and after the last step); 0 never
            evaluates (benchmarks).
        ckpt_every: RL steps between checkpoints (last.ckpt is always kept).
        logprob_chunk_rows: rows per chunk of the log-prob computation (bounds its memory).
        logprob_chunk_tokens: (row, token) positions per chunk of the log-prob computation at most: the largest
            [*, V] tensor it holds, whatever the completion length (a chunk of r rows spans this // r columns).
        share_prompt_forward: training and reference forwards run each distinct prompt once and its group's
            completions on its keys and values (gspo_lab.rollout.logprobs.shared_prompt_hidden): the same
            maths to float rounding, less work; under routing replay only where a prompt's rows recorded the same
            experts; not under FSDP or activation checkpointing.
        max_consecutive_skips: stop the run after this many updates in a row skipped for NaN/Inf.
        lm_head_fp32: the policy's LM head computes in float32 outside autocast wherever the trainer's model
            runs (generation on the hf backend, log-probs, reference, evaluation; gspo_lab.models.lm_head), TRL's
            cast_lm_head_to_fp32; it matters under trainer.precision=bf16-mixed, where autocast would run the head
            in bfloat16. A vLLM engine computes its head in rollout.vllm.dtype (a warning says so).
        on_reward_error: "zero" scores a completion whose reward function raised 0 (reported and counted
            in reward/errors); "raise" stops the run.
        failure_stop_frac: a round in which one reward function failed (raised or timed out) on at least this
            share of the completions, or this share of the rows lost their environment, stops the run before its
            update, with the first error and a checkpoint (gspo_lab.step.failures); 1.0: where no signal is left.
        kl_to_initial: log kl/to_initial every step, KL(π_behave ‖ π_initial): of the policy that sampled the
            rollout from the initial one (the cold start), k3 on its samples (one no-grad forward of a frozen copy
            of the initial policy, which objective.beta > 0 has anyway);
            null: where a reward function is learned (a reward model), whose over-optimisation is read against it.
    """

    steps: int = 200
    minibatches: int = 4
    micro_batch_size: int | None = None
    micro_batch_tokens: int | None = None
    padding_free: bool = True
    pack_min_saving: float = 0.1
    lr: float = 3e-5
    grad_clip: float = 1.0
    shuffle_rewards: bool = False
    eval_every: int = 25
    ckpt_every: int = 50
    logprob_chunk_rows: int = 32
    logprob_chunk_tokens: int = 8192
    share_prompt_forward: bool = True
    max_consecutive_skips: int = 5
    lm_head_fp32: bool = False
    on_reward_error: str = "zero"
    failure_stop_frac: float = 1.0
    kl_to_initial: bool | None = None

    def __post_init__(self) -> None:
        require(self.on_reward_error in ("zero", "raise"), "train.on_reward_error", self.on_reward_error,
                "must be one of ['zero', 'raise']")
        require(isinstance(self.failure_stop_frac, (int, float)) and 0 < self.failure_stop_frac <= 1,
                "train.failure_stop_frac", self.failure_stop_frac, "must be a share in (0, 1]")
        require(self.kl_to_initial in (None, True, False), "train.kl_to_initial", self.kl_to_initial,
                "must be null, true or false")
        for key in ("steps", "minibatches", "ckpt_every", "logprob_chunk_rows", "logprob_chunk_tokens",
                    "max_consecutive_skips"):
            positive_int(f"train.{key}", getattr(self, key))
        positive_int("train.eval_every", self.eval_every, minimum=0)
        if self.micro_batch_size is not None:
            positive_int("train.micro_batch_size", self.micro_batch_size)
        if self.micro_batch_tokens is not None:
            positive_int("train.micro_batch_tokens", self.micro_batch_tokens)
            require(self.micro_batch_size is None, "train.micro_batch_tokens", self.micro_batch_tokens,
                    f"cannot be set with train.micro_batch_size={self.micro_batch_size}: choose rows or tokens")
        require(isinstance(self.padding_free, bool), "train.padding_free", self.padding_free, "must be true or false")
        require(isinstance(self.pack_min_saving, (int, float)) and 0 <= self.pack_min_saving < 1,
                "train.pack_min_saving", self.pack_min_saving, "must be a share in [0, 1)")
        require(isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0, "train.lr", self.lr,
                "must be a finite number > 0")
        require(isinstance(self.grad_clip, (int, float)) and self.grad_clip >= 0, "train.grad_clip", self.grad_clip,
                "must be >= 0 (0 disables clipping)")

    def check_against(self, rollout: RolloutConfig, world_size: int = 1) -> None:
        """Rules that involve both configs: mini-batches and ranks must divide the rollout batch."""
        require(rollout.batch_size % self.minibatches == 0, "train.minibatches", self.minibatches,
                f"must divide the rollout batch prompts_per_step x group_size = {rollout.batch_size}")
        require(rollout.prompts_per_step % world_size == 0, "rollout.prompts_per_step", rollout.prompts_per_step,
                f"must be divisible by the number of processes ({world_size}) so each rank holds whole groups")
        per_rank = rollout.batch_size // world_size
        require(per_rank % self.minibatches == 0, "train.minibatches", self.minibatches,
                f"must divide each rank's rollout batch ({per_rank})")
