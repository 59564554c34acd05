"""The reward axis: TRL's contract, weights and None, names, refusals, and grading that survives bad verifiers."""

import functools
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from gspo_lab import CONFIG_DIR
from gspo_lab.grading.answers import math_answer

from gspo_lab.rewards import (
    GradingPool,
    RewardContractError,
    RewardFunction,
    WeightedRewards,
    build_rewards,
    math_accuracy,
    reward_name,
    think_format,
)
from gspo_lab.tasks import Arithmetic, HFDataset
from tests.rewards import slow_import, user_rewards

PROMPTS = ["1+1=", "2+5=", "3+3="]
TEXTS = ["2", "so 7", "six 6"]
IDS = [[5], [6, 7, 8, 9], [1, 2, 3, 4, 5]]
COLUMNS = {"answer": ["2", "7", "6"]}


def target(name: str) -> str:
    return f"tests.rewards.user_rewards.{name}"


def test_the_total_is_the_weighted_sum_of_the_functions_that_apply_and_none_applies_nowhere():
    rewards = build_rewards({"functions": [{"_target_": target("ends_with_answer"), "weight": 1.0},
                                           {"_target_": target("short"), "weight": -2.0, "max_chars": 1}]}, task=None)
    scores = rewards.score(PROMPTS, TEXTS, IDS, COLUMNS)
    # ends_with_answer: 1, 1, 1; short (<= 1 char): 0.5, None, None -> 1 - 2 * 0.5 = 0, 1, 1
    assert scores.total.tolist() == [0.0, 1.0, 1.0] and scores.applies.all()
    assert torch.equal(scores.per_function["short"].isnan(), torch.tensor([False, True, True]))
    assert scores.metrics["reward/short/mean"] == 0.5 and scores.metrics["reward/ends_with_answer/std"] == 0.0
    alone = build_rewards({"functions": [{"_target_": target("short"), "max_chars": 1}]}, task=None)
    assert alone.score(PROMPTS, TEXTS, IDS, COLUMNS).applies.tolist() == [True, False, False]


def test_every_column_but_the_prompt_reaches_the_function_one_entry_per_completion():
    seen = {}

    def spy(prompts, completions, completion_ids, **columns):
        seen.setdefault("calls", []).append((prompts, completions, completion_ids, columns))
        return [0.0] * len(completions)

    WeightedRewards([RewardFunction(spy)]).score(PROMPTS, TEXTS, IDS, {**COLUMNS, "level": [1, 2, 3]})
    assert seen["calls"][1] == (["2+5="], ["so 7"], [[6, 7, 8, 9]], {"answer": ["7"], "level": [2]})


def test_names_follow_trl_a_function_a_partial_a_callable_class_or_a_given_name():
    assert reward_name(user_rewards.short) == "short"
    assert reward_name(functools.partial(user_rewards.short, max_chars=2)) == "short"
    assert reward_name(user_rewards.LengthPenalty()) == "LengthPenalty"
    built = build_rewards({"functions": [{"_target_": target("LengthPenalty"), "per_char": 0.5},
                                         {"_target_": target("short"), "name": "brevity"}]}, task=None)
    assert [f.name for f in built.functions] == ["LengthPenalty", "brevity"]
    assert built.score(PROMPTS, TEXTS, IDS, COLUMNS).per_function["LengthPenalty"].tolist() == [-0.5, -2.0, -2.5]
    with pytest.raises(ValueError, match="two functions are named 'short'"):
        build_rewards({"functions": [{"_target_": target("short")}, {"_target_": target("short")}]}, task=None)


def test_a_function_without_kwargs_or_a_bad_target_is_refused_at_start_up_by_name():
    with pytest.raises(ValueError, match=r"reward\.functions\.1 \(no_kwargs\) must accept \*\*kwargs"):
        build_rewards({"functions": [{"_target_": target("short")}, {"_target_": target("no_kwargs")}]}, task=None)
    with pytest.raises(ValueError, match=r"reward\.functions\.0._target_='tests.rewards.user_rewards.missing' cannot"):
        build_rewards({"functions": [{"_target_": target("missing")}]}, task=None)
    with pytest.raises(ValueError, match="reward.functions=\\[\\] must be a non-empty list"):
        build_rewards({"functions": []}, task=None)


@pytest.mark.parametrize("name, message", [
    ("wrong_length", r"reward function wrong_length returned list of length 2 for 1 completion \(completion 0\)"),
    ("non_finite", r"reward function non_finite returned nan \(completion 0\); a reward must be a finite number"),
])
def test_a_reward_that_breaks_the_contract_stops_the_run_naming_the_function(name, message):
    rewards = build_rewards({"functions": [{"_target_": target(name)}]}, task=None)
    with pytest.raises(RewardContractError, match=message):
        rewards.score(PROMPTS, TEXTS, IDS, COLUMNS, where=lambda i: f"completion {i}")


def test_a_function_that_raises_scores_zero_there_is_counted_and_logged_once(caplog):
    rewards = build_rewards({"functions": [{"_target_": target("flaky"), "weight": 2.0}]}, task=None)
    scores = rewards.score(PROMPTS * 2, TEXTS * 2, IDS * 2, {"answer": COLUMNS["answer"] * 2})
    assert scores.total.tolist() == [2.0, 0.0, 2.0] * 2  # "so 7" raises: 0 for that completion only
    assert scores.metrics["reward/flaky/errors"] == 2 and scores.metrics["reward/errors"] == 2
    assert caplog.text.count("reward function flaky raised KeyError('bug in the reward function')") == 1
    with pytest.raises(RuntimeError, match=r"flaky raised KeyError.*\(train.on_reward_error=raise\)"):
        WeightedRewards(rewards.functions, on_error="raise").score(PROMPTS, TEXTS, IDS, COLUMNS)


def test_a_verifier_that_never_returns_times_out_in_its_worker_and_grading_goes_on():
    pool = GradingPool(num_workers=2, timeout_s=1.0)
    rewards = WeightedRewards([RewardFunction(user_rewards.sleepy), RewardFunction(user_rewards.flaky),
                               RewardFunction(user_rewards.ends_with_answer)], runner=pool)
    try:
        started = time.monotonic()
        scores = rewards.score(PROMPTS, TEXTS, IDS, COLUMNS)
        first = time.monotonic() - started
        # sleepy hangs on "so 7" and is killed; flaky raises there; ends_with_answer gives 1 everywhere
        assert scores.per_function["sleepy"].tolist() == [0.0, 0.0, 0.0]
        assert scores.per_function["flaky"].tolist() == [1.0, 0.0, 1.0]
        assert scores.total.tolist() == [2.0, 1.0, 2.0]
        assert scores.metrics["reward/sleepy/timeouts"] == 1 and scores.metrics["reward/flaky/errors"] == 1
        assert scores.metrics["reward/timeouts"] == 1 and scores.metrics["reward/errors"] == 1
        assert first < 60  # not the hour the verifier sleeps
        again = rewards.score(PROMPTS, TEXTS, IDS, COLUMNS)  # the killed worker was replaced
        assert again.total.tolist() == [2.0, 1.0, 2.0] and again.metrics["reward/sleepy/timeouts"] == 2
    finally:
        pool.close()


def test_the_counts_are_saved_and_restored():
    rewards = WeightedRewards([RewardFunction(user_rewards.flaky)])
    rewards.score(PROMPTS, TEXTS, IDS, COLUMNS)
    restored = WeightedRewards([RewardFunction(user_rewards.flaky)])
    restored.load_state_dict(rewards.state_dict())
    assert restored.score(PROMPTS, TEXTS, IDS, COLUMNS).metrics["reward/flaky/errors"] == 2


def test_a_torch_module_reward_keeps_its_weights_out_of_the_reward_state():
    """A reward function that is a torch module has a state_dict, of weights: the run's reward counts do not carry
    them (a judge's counts are kept; tests/rewards/test_judge.py)."""
    class Scorer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(()))

        def forward(self, prompts, completions, **kwargs):
            return [float(self.scale) * len(c) for c in completions]

    rewards = WeightedRewards([RewardFunction(Scorer(), name="scorer")])
    assert rewards.score(PROMPTS, TEXTS, IDS, COLUMNS).total.tolist() == [float(len(t)) for t in TEXTS]
    state = rewards.state_dict()
    assert state["functions"] == {} and state["errors"] == {"scorer": 0}
    rewards.load_state_dict({**state, "functions": {"scorer": {"scale": torch.zeros(())}}})
    assert float(rewards.functions[0].fn.scale) == 1.0


def test_the_tasks_checker_is_a_reward_function_named_after_the_task():
    rewards = build_rewards({"functions": [{"_target_": "gspo_lab.rewards.TaskReward"}]},
                            task=Arithmetic(format_weight=0.5))
    scores = rewards.score(["1+1=", "1+1=", "1+1="], ["2", "3", "two"], [[1]] * 3, {"answer": ["2"] * 3})
    assert rewards.functions[0].name == "arithmetic" and scores.total.tolist() == [1.0, 0.5, 0.0]


@pytest.mark.parametrize("completion, gold, reward", [
    (r"so $\boxed{\frac{1}{2}}$", "0.5", 1.0),
    (r"The answer is $0.5$.", r"\frac{1}{2}", 1.0),
    (r"$\boxed{\frac{1}{3}}$", "0.5", 0.0),
    (r"it is $\boxed{5\text{ cm}}$", "5", 1.0),
    (r"first $\boxed{3}$ then $\boxed{4}$", "3", 0.0),  # the last boxed answer counts
    (r"first $\boxed{3}$ then $\boxed{4}$", "4", 1.0),
    ("the answer is 42", "42", 0.0),  # LaTeX only, as TRL: no anchor-less plain number
    (r"$\boxed{2}$", "no number here", None),  # the gold does not parse: the function does not apply
])
def test_math_accuracy_on_answers_in_real_formats(completion, gold, reward):
    assert math_accuracy(None, [completion], answer=[gold]) == [reward]


def test_math_accuracy_reads_plain_answers_when_not_latex_only():
    assert math_accuracy(None, ["4 + 38 = 42. The answer is 42"], answer=["42"], latex_only=False) == [1.0]
    assert math_accuracy(None, ["the answer is 41"], answer=["42"], latex_only=False) == [0.0]


def grade_in_a_joblib_worker(texts):
    pool = GradingPool(num_workers=1, timeout_s=30.0)
    try:
        return WeightedRewards([RewardFunction(user_rewards.ends_with_answer)], runner=pool).score(
            PROMPTS, texts, IDS, COLUMNS).total.tolist()
    finally:
        pool.close()


def test_grading_workers_start_inside_a_joblib_launcher_job():
    """hydra/launcher=joblib runs jobs in loky processes, whose start method a multiprocessing child cannot set
    ('cannot find context for loky'): every job of a joblib sweep with reward workers failed."""
    from joblib import Parallel, delayed

    results = Parallel(n_jobs=2, backend="loky")(delayed(grade_in_a_joblib_worker)(TEXTS) for _ in range(2))
    assert results == [[1.0, 1.0, 1.0]] * 2


@pytest.mark.parametrize("prompt, completion, settings, reward", [
    ("Q: 1+1?", "<think>\nadd them\n</think>\n2", {}, 1.0),  # the block opened, closed, then answered
    ("Q: 1+1?", "add them\n</think>\n2", {}, 0.0),  # the block never opened
    # the prompt (as the data holds it, e.g. a rendered DeepSeek-R1 prompt) already opened the block
    ("<｜User｜>1+1?<｜Assistant｜><think>\n", "add them\n</think>\n2", {}, 1.0),
    ("<｜User｜>1+1?<｜Assistant｜><think>\n", "add them\n</think>\n", {}, 0.0),  # closed, but no answer
    ("<｜User｜>1+1?<｜Assistant｜><think>\n", "<think>add them</think>\n2", {}, 0.0),  # a second, nested block
    # the chat template opens it (prefilled=true), out of sight of the data's prompt
    ([{"role": "user", "content": "1+1?"}], [{"role": "assistant", "content": "add them</think> 2"}],
     {"prefilled": True}, 1.0),
    ("Q: 1+1?", "add them, no close 2", {"prefilled": True}, 0.0),
])
def test_think_format_scores_a_completion_that_starts_inside_a_block_the_prompt_opened(prompt, completion,
                                                                                       settings, reward):
    assert think_format([prompt], [completion], **settings) == [reward]


def test_a_function_needing_a_column_the_data_lacks_is_refused_at_start_up_naming_it():
    """TRL's accuracy_reward(completions, solution, **kwargs) on data without a solution column raised TypeError
    on every call, each scored 0: a run that trained on all-zero rewards."""
    with pytest.raises(ValueError, match=r"reward\.functions\.0 \(needs_solution\) needs the parameter 'solution'"
                                         r", which no call passes: the data's columns are answer"):
        build_rewards({"functions": [{"_target_": target("needs_solution")}]}, task=Arithmetic())
    with_solution = HFDataset(rows=[{"prompt": f"{i}+1=", "answer": str(i + 1), "solution": "s"} for i in range(30)])
    assert build_rewards({"functions": [{"_target_": target("needs_solution")}]}, task=with_solution).functions


def test_a_misspelled_setting_and_a_column_replacing_a_setting_are_refused():
    with pytest.raises(ValueError, match=r"reward\.functions\.0.latex_onyl is not a parameter of "
                                         r"gspo_lab.rewards.math_accuracy \(its parameters: .*latex_only\)"):
        build_rewards({"functions": [{"_target_": "gspo_lab.rewards.math_accuracy", "latex_onyl": False}]}, task=None)
    with pytest.raises(ValueError, match=r"reward\.functions\.0.per_chars is not a parameter"):
        build_rewards({"functions": [{"_target_": target("LengthPenalty"), "per_chars": 0.5}]}, task=None)
    # a column of the data reaches every call as a keyword, which replaces a partial's bound keyword
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1), "max_length": 3} for i in range(30)]
    overlong = {"_target_": "gspo_lab.rewards.soft_overlong_punishment", "max_length": 8, "cache_length": 2}
    with pytest.raises(ValueError, match=r"reward\.functions\.0.max_length=8: the data has a column 'max_length'"):
        build_rewards({"functions": [overlong]}, task=HFDataset(rows=rows))


def test_the_task_reward_grades_in_a_worker_where_its_checker_can_hang():
    """reward=task: null workers grade arithmetic's string match here, and math-verify (task=hf) in a worker."""
    group = OmegaConf.load(Path(CONFIG_DIR) / "reward" / "task.yaml")
    assert build_rewards(group, task=Arithmetic()).runner is None
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(30)]
    for match, pooled in (("math_verify", True), ("numeric", False), ("exact", False)):
        rewards = build_rewards(group, task=HFDataset(rows=rows, match=match))
        assert isinstance(rewards.runner, GradingPool) == pooled and (rewards.runner is None or rewards.runner.num_workers == 1)
    assert build_rewards({"functions": [{"_target_": "gspo_lab.rewards.math_accuracy"}], "num_workers": None},
                         task=None).runner is not None


def test_a_tensor_reward_crosses_from_a_worker_and_each_function_crosses_once(tmp_path):
    """Workers once sent tensors through shared memory (AuthenticationError: digest sent was rejected), and a
    TaskReward, with its whole dataset, once per completion."""
    copies = tmp_path / "copies.txt"
    counted = user_rewards.CountsItsCopies(str(copies), payload_size=1_000_000)
    pool = GradingPool(num_workers=1, timeout_s=30.0)
    rewards = WeightedRewards([RewardFunction(user_rewards.as_tensor), RewardFunction(counted)], runner=pool)
    try:
        for _ in range(2):
            scores = rewards.score(PROMPTS, TEXTS, IDS, COLUMNS)
            assert scores.per_function["as_tensor"].tolist() == [1.0, 4.0, 5.0]  # len("2"), len("so 7"), ...
        assert scores.per_function["CountsItsCopies"].tolist() == [1.0] * 3
        assert copies.read_text() == "copy\n"  # 6 calls, one copy
    finally:
        pool.close()


def test_a_calls_timeout_does_not_count_its_functions_imports(monkeypatch):
    """A worker imports a function's modules when it first receives it; under a 1 s timeout, a module that takes
    3 s to import timed out the first call (math_verify's first grade did on a loaded machine: CI's test of the
    reward options). The function is loaded before the call's clock starts."""
    monkeypatch.setenv("SLOW_IMPORT_S", "3")
    pool = GradingPool(num_workers=1, timeout_s=1.0)
    try:
        outcomes = pool([(slow_import.length, ("abc",), {}), (slow_import.length, ("de",), {})])
        assert [o.value for o in outcomes] == [3, 2]
    finally:
        pool.close()


def test_a_call_that_cannot_be_pickled_is_an_error_and_the_next_call_runs():
    pool = GradingPool(num_workers=1, timeout_s=30.0)
    try:
        lost = pool([(len, (lambda: 0,), {})])[0]  # a lambda cannot cross
        assert lost.failure == "error" and "could not be sent to a grading worker" in lost.detail
        assert [o.value for o in pool([(len, ("abcd",), {}), (abs, (-3,), {})])] == [4, 3]
        unloadable = pool([(user_rewards.short, ([],), {"max_chars": ModuleNotFoundHere()})])[0]
        assert unloadable.failure == "error" and "could not be loaded in the worker" in unloadable.detail
        assert pool([(len, ("ab",), {})])[0].value == 2
    finally:
        pool.close()


class ModuleNotFoundHere:
    """Pickles by reference to a module the worker cannot import."""

    def __reduce__(self):
        return (__import__, ("a_module_that_does_not_exist",))


def test_a_worker_that_cannot_start_says_why(tmp_path, monkeypatch):
    broken = tmp_path / "python"
    broken.write_text("#!/bin/sh\necho 'ImportError: no module named gspo_lab' >&2\nexit 3\n")
    broken.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(broken))
    with pytest.raises(RuntimeError, match=r"did not start: the worker process exited with code 3; its stderr ends:"
                                           r"\nImportError: no module named gspo_lab"):
        GradingPool(num_workers=1, timeout_s=5.0)([(len, ("a",), {})])


def test_math_answer_of_a_tower_of_powers_returns():
    r"""`\boxed{7^{7^{7^{7}}}}` (a "last digit of" answer): float() of it never returned, outside every timeout."""
    pool = GradingPool(num_workers=1, timeout_s=60.0)
    try:
        outcome = pool([(math_answer, (r"so $\boxed{7^{7^{7^{7}}}}$",), {"latex_only": False})])[0]
    finally:
        pool.close()
    assert outcome.failure is None and outcome.value == "7**(7**(7**7))"


def test_grading_sits_below_tasks_and_rewards():
    """answer extraction and math checks have one home that imports neither; tasks do not import rewards."""
    code = ("import sys, gspo_lab.grading.answers, gspo_lab.grading.pool; print(sorted(m for m in sys.modules if "
            "m.startswith(('gspo_lab.tasks', 'gspo_lab.rewards')))); import gspo_lab.tasks.hf; "
            "print(sorted(m for m in sys.modules if m.startswith('gspo_lab.rewards')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == ["[]", "[]"]


def test_an_environments_get_reward_is_a_reward_unless_the_list_names_it():
    """TRL adds an environment's get_reward() as a reward by itself; here it was silently unused unless
    reward=environment was given. An explicit environment_reward entry, of any weight, replaces the added one."""
    from gspo_lab.tasks import GuessNumberTask

    task = GuessNumberTask()
    added = build_rewards({"functions": [{"_target_": "gspo_lab.rewards.TaskReward"}]}, task=task)
    assert [(f.name, f.weight) for f in added.functions] == [("guess_number", 1.0), ("GuessNumber", 1.0)]
    examples = task.eval_examples()[:2]
    scored = added.score([e.prompt for e in examples], ["8", "3"], [[1], [2]],
                         {"answer": [e.answer for e in examples], "environment_reward": [0.5, 0.25]})
    assert scored.per_function["GuessNumber"].tolist() == [0.5, 0.25]  # TRL names it after the class
    named = build_rewards({"functions": [{"_target_": "gspo_lab.rewards.TaskReward"},
                                         {"_target_": "gspo_lab.rewards.environment_reward", "weight": 0.0}]},
                          task=task)
    assert [(f.name, f.weight) for f in named.functions] == [("guess_number", 1.0), ("environment_reward", 0.0)]
    plain = build_rewards({"functions": [{"_target_": "gspo_lab.rewards.TaskReward"}]}, task=Arithmetic())
    assert [f.name for f in plain.functions] == ["arithmetic"]  # no environment, nothing added
