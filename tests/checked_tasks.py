"""Tasks whose checkers misbehave, importable by grading workers (a class defined in a test module run by pytest
is importable too, but these are shared)."""

import time

from gspo_lab.tasks import Arithmetic


class HangingArithmetic(Arithmetic):
    """Arithmetic whose checker never returns, as sympy on `\\boxed{7^{7^{7^{7}}}}` once did."""

    checker_may_hang = True

    def is_correct(self, example, completion):
        time.sleep(3600)
        return False


class GradedApart(Arithmetic):
    """Arithmetic whose checker says it can hang, so it grades in a killable worker (and returns at once there)."""

    checker_may_hang = True


class ExtractionRefused(Arithmetic):
    """Arithmetic whose answer extraction raises: shows where evaluation extracts answers."""

    def answer_of(self, completion, example=None):
        raise AssertionError("answer_of was called")
