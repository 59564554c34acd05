"""Rollout: generation into documented tensors; no loss logic here."""

from gspo_lab.rollout.generation import Completions, generate, position_ids

__all__ = ["Completions", "generate", "position_ids"]
