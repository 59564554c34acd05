"""gspo_lab.grading.scan: what a checker runs is read from its code, through the functions of its package it calls,
and a method that merely shares a risky name (`re.compile`) is not a risk."""

import ast
import re
import subprocess

import pytest

from gspo_lab.grading.scan import risky_call


def lenient(answer):
    return eval(answer) == 1


def pattern(answer):
    return re.compile(r"\d+").fullmatch(answer) is not None


def literal(answer):
    return ast.literal_eval(answer) == [1]


def through_a_helper(answer):
    return pattern(answer) and lenient(answer)


def in_a_comprehension(answers):
    return [exec(answer) for answer in answers]


def shell(answer):
    return subprocess.run(["test", answer]).returncode == 0


def imported_shell(answer):
    import os

    return os.system(answer) == 0


class Evaluating:
    def parse(self, answer):
        return eval(answer)


class Delegating(Evaluating):
    def parse(self, answer):
        return super().parse(answer.strip())


@pytest.mark.parametrize("checker, owner, reached", [
    (pattern, None, None),
    (literal, None, None),
    (through_a_helper, None, "eval in lenient"),
    (in_a_comprehension, None, "exec in in_a_comprehension.<locals>.<listcomp>"),
    (shell, None, "subprocess in shell"),
    (imported_shell, None, "system in imported_shell"),
    (Delegating.parse, Delegating, "eval in Evaluating.parse"),
])
def test_what_a_checker_reaches(checker, owner, reached):
    assert risky_call(checker, owner) == reached
