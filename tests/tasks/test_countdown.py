from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gspo_lab.tasks import Countdown, Example
from gspo_lab.tasks.countdown import ParseError, parse_expression, solutions

EXAMPLE = Example("nums 4 7 9 target 19:", "4*7-9", {"numbers": (4, 7, 9), "target": 19})


def test_many_correct_answers_score_one():
    task = Countdown()
    for answer in ("4*7-9", "(4*7)-9", "7*4-9", " 4 * 7 - 9 ", "(7*4)-(9)"):
        assert task.reward(EXAMPLE, answer) == 1.0, answer


@pytest.mark.parametrize(
    "completion",
    ["", "19", "4*7-9+4-4", "4+7+9", "9**9**9", "٤*٧-٩", "9/(7-7)", "(4+7+9", "4+7+9)", "4+-7", "eval('19')",
     "99999999999999999999*4", "4" * 70, "((((((((((4))))))))))+7+9+x"],
)
def test_wrong_malformed_and_adversarial_completions_score_zero(completion):
    assert Countdown().reward(EXAMPLE, completion) == 0.0


def test_format_reward_for_valid_but_wrong_expressions():
    task = Countdown(format_weight=0.2)
    assert task.reward(EXAMPLE, "4+7") == 0.2  # a valid expression over the numbers, value 11
    assert task.reward(EXAMPLE, "4+4") == 0.0  # 4 used twice is not well-formed
    assert task.reward(EXAMPLE, "4*7-9") == 1.0


def test_parser_evaluates_exactly_with_precedence():
    assert parse_expression("2+3*4") == (Fraction(14), [2, 3, 4])
    assert parse_expression("(2+3)*4") == (Fraction(20), [2, 3, 4])
    assert parse_expression("7/2") == (Fraction(7, 2), [7, 2])
    with pytest.raises(ParseError, match="division by zero"):
        parse_expression("1/(2-2)")


def test_demonstrations_are_correct_and_splits_disjoint():
    task = Countdown()
    train = task.examples("train", 300, seed=0)
    assert all(task.reward(e, task.demonstration(e)) == 1.0 for e in train)
    assert not {e.prompt for e in train} & {e.prompt for e in task.eval_examples()}


@settings(max_examples=40, deadline=None)
@given(numbers=st.lists(st.integers(1, 12), min_size=2, max_size=3))
def test_every_solution_found_by_search_verifies(numbers):
    task = Countdown()
    for value, expr in solutions(tuple(sorted(numbers))).items():
        if value.denominator == 1 and value > 0:
            example = Example("", expr, {"numbers": tuple(numbers), "target": int(value)})
            assert task.reward(example, expr) == 1.0, expr


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet="0123456789+-*/() x.\t٤", max_size=80))
def test_reward_never_raises(text):
    assert Countdown(format_weight=0.1).reward(EXAMPLE, text) in (0.0, 0.1, 1.0)
