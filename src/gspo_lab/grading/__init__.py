"""Grading below tasks and rewards: reading answers out of model output and math checks
(gspo_lab.grading.answers), calls run in killable worker processes (gspo_lab.grading.pool), and a task's checker
on many completions there (gspo_lab.grading.checks)."""

from gspo_lab.grading.pool import GradingPool, Outcome, call_inline

__all__ = ["GradingPool", "Outcome", "call_inline"]
