"""Rollout: generation into documented tensors, log-probs, and the prompt schedule; no loss logic here."""

from gspo_lab.rollout.batch import RolloutBatch
from gspo_lab.rollout.completions import Completions, Generated
from gspo_lab.rollout.generation import generate, position_ids
from gspo_lab.rollout.logprobs import token_logprobs
from gspo_lab.rollout.prompts import PromptSchedule, StepTicks

__all__ = ["Completions", "Generated", "PromptSchedule", "RolloutBatch", "StepTicks", "generate", "position_ids",
           "token_logprobs"]
