"""Grading below tasks and rewards: reading answers out of model output and math checks
(gspo_lab.grading.answers), calls run in killable worker processes (gspo_lab.grading.pool), a task's checker
on many completions there (gspo_lab.tasks.checks uses them), and whether a checker must run there, read from its code
(gspo_lab.grading.scan)."""

from gspo_lab.grading.pool import GradingPool, Outcome, call_inline

__all__ = ["GradingPool", "Outcome", "call_inline"]
