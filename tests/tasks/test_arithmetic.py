import pytest

from gspo_lab.tasks import Arithmetic, Example


def test_prompts_answers_and_difficulty():
    task = Arithmetic(digits=2, ops=["+", "-", "*"])
    for example in task.examples("train", 200, seed=0):
        a, op, b = example.prompt[:2], example.prompt[2], example.prompt[3:5]
        assert example.prompt.endswith("=") and 10 <= int(a) <= 99 and 10 <= int(b) <= 99
        assert int(example.answer) == {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]


def test_rewards_on_correct_wrong_malformed_and_adversarial():
    task = Arithmetic(format_weight=0.1)
    example = Example("999+1=", "1000")
    assert task.reward(example, "1000") == 1.0
    assert task.reward(example, "1001") == 0.1  # well-formed, wrong: the format reward
    for bad in ("", "10 00", "1e3", "9**9**9", "1000=", "(1000", "\x00", "1" * 1000, "١٠٠٠"):
        assert task.reward(example, bad) == 0.0, bad


def test_splits_are_disjoint_and_fixed_by_seed():
    task = Arithmetic()
    train = {e.prompt for e in task.examples("train", 2000, seed=0)}
    held_out = {e.prompt for e in task.eval_examples()}
    assert len(held_out) == 400 and not train & held_out
    assert [e.prompt for e in task.examples("train", 50, seed=3)] == [e.prompt for e in task.examples("train", 50, seed=3)]
    assert task.examples("train", 50, seed=3) != task.examples("train", 50, seed=4)


@pytest.mark.parametrize(
    "kwargs, message",
    [({"digits": 0}, r"task\.digits=0"), ({"ops": ["^"]}, r"task\.ops=\['\^'\]"), ({"eval_fraction": 1.5}, "eval_fraction")],
)
def test_bad_settings_name_key_and_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Arithmetic(**kwargs)


def test_too_small_prompt_space_fails_clearly():
    with pytest.raises(ValueError, match="prompt space is too small"):
        Arithmetic(digits=1).examples("eval", 500, seed=0)
