"""A failure that leaves a step with no signal stops the run (train.failure_stop_frac; gspo_lab.step.failures): a
reward function or a reward model that fails on every completion, an environment whose reset() fails (refused at
start, or stopping the run when every row of a round lost it), and a get_reward() that raises, counted as the
reward's errors. The stop names the function or class with its key, quotes the first error and its traceback,
and leaves a checkpoint of the weights before the step; one flaky call is only counted."""

import subprocess
import sys

import pytest
import torch

from gspo_lab.grading.pool import call_inline
from gspo_lab.rewards import RewardFunction, WeightedRewards
from gspo_lab.step.failures import NoSignal
from gspo_lab.train import ConfigError, build, plan
from tests.rewards.user_rewards import always_raises, flaky

ENVIRONMENT = ["model.config.max_position_embeddings=320", "rollout.tool_workers=1"]  # room for the chat template


def test_a_raising_call_keeps_its_traceback():
    outcome = call_inline(always_raises, (["p"], ["c"]), {})
    assert outcome.failure == "error" and outcome.detail == "TimeoutError('the reward service did not answer')"
    assert "in always_raises" in outcome.traceback and outcome.traceback.rstrip().endswith(
        "TimeoutError: the reward service did not answer")


def test_a_round_records_each_functions_failures_and_the_first_ones_text():
    """flaky raises on completions holding a 7: 2 of the 3 here; the first one's message names its completion."""
    rewards = WeightedRewards([RewardFunction(flaky, 1.0), RewardFunction(always_raises, 0.5)])
    scores = rewards.score(["1+6=", "2+5=", "1+1="], ["7", "17", "2"], [[1], [2], [3]], {"answer": ["7", "7", "2"]},
                           where=lambda i: f"completion {i}")
    assert {name: f.count for name, f in scores.failures.items()} == {"flaky": 2, "always_raises": 3}
    assert scores.failures["flaky"].first.startswith("reward function flaky raised KeyError('bug in the reward "
                                                     "function') (completion 0); prompt '1+6=', completion '7'\n")
    assert "Traceback" in scores.failures["always_raises"].first
    assert rewards.keys == {"flaky": "reward.functions.0", "always_raises": "reward.functions.1"}
    assert scores.total.tolist() == [0.0, 0.0, 1.0]


@pytest.mark.parametrize("function, error", [
    ("tests.rewards.user_rewards.always_raises", "TimeoutError: the reward service did not answer"),
    ("tests.rewards.user_rewards.BrokenRewardModel", "ValueError: Cannot use chat template functions"),
], ids=["function", "reward-model"])
def test_a_reward_that_fails_on_every_completion_stops_the_run_before_the_update(function, error, compose,
                                                                                  rl_overrides, tmp_path):
    """Before: every completion scored 0 for the failing function, reward/mean 0 on every step, and the run
    ended with exit code 0."""
    functions = f"reward.functions=[{{_target_:gspo_lab.rewards.TaskReward}},{{_target_:{function}}}]"
    run, module, _ = build(compose(rl_overrides + [functions]))
    before = {k: v.clone() for k, v in module.model.state_dict().items()}
    with pytest.raises(NoSignal) as stopped:
        run.trainer.fit(module)
    message = str(stopped.value)
    assert "RL step 0: too many failures to train on (train.failure_stop_frac=1.0)" in message
    assert "(reward.functions.1) failed on 16 of 16 completions" in message
    assert error in message and "Traceback (most recent call last)" in message  # the first error, whole
    assert module.history == []  # no step was logged: the stop came before its update
    checkpoint = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)
    assert checkpoint["rl_step"] == 0 and str(tmp_path / "run" / "checkpoints" / "last.ckpt") in message
    for key, value in before.items():  # no optimizer step ran
        assert torch.equal(module.model.state_dict()[key], value), key


def test_a_reward_that_fails_on_part_of_the_completions_is_counted_and_the_run_goes_on(compose, rl_overrides):
    functions = "reward.functions=[{_target_:gspo_lab.rewards.TaskReward},{_target_:tests.rewards.user_rewards.flaky}]"
    run, module, _ = build(compose(rl_overrides + [functions, "train.steps=1"]))
    torch.manual_seed(0)
    run.trainer.fit(module)
    errors = module.history[0]["reward/flaky/errors"]
    assert 0 < errors < 16, errors  # some completions held a 7, not all: counted, trained on


def test_failure_stop_frac_stops_at_a_share_below_all(compose, rl_overrides):
    """With train.failure_stop_frac=0.01 any failure in a round stops the run (TRL's raise, through this rule)."""
    functions = "reward.functions=[{_target_:gspo_lab.rewards.TaskReward},{_target_:tests.rewards.user_rewards.flaky}]"
    run, module, _ = build(compose(rl_overrides + [functions, "train.failure_stop_frac=0.01"]))
    torch.manual_seed(0)
    with pytest.raises(NoSignal, match=r"reward function flaky \(reward.functions.1\) failed on \d+ of 16"):
        run.trainer.fit(module)


@pytest.mark.parametrize("value", [0, 1.5, -0.2, "all"])
def test_failure_stop_frac_must_be_a_share(value, compose, rl_overrides):
    with pytest.raises(ConfigError, match=rf"train.failure_stop_frac={value!r}.*must be a share in \(0, 1\]"):
        plan(compose(rl_overrides + [f"train.failure_stop_frac={value}"]))


def test_an_environment_whose_reset_fails_is_refused_before_training(compose, rl_overrides):
    """Before: exit code 0 after '0 RL steps', tools/lost_frac 1.0, and the exception's text nowhere."""
    cfg = compose(rl_overrides + ENVIRONMENT + ["task.environment=tests.tools.trl_style.ResetFails"])
    with pytest.raises(ConfigError) as refused:
        build(cfg)
    message = str(refused.value)
    assert message.startswith("task.environment=ResetFails: reset() on the first training row failed before "
                              "training (error: ConnectionError('the environment server refused the connection'))")
    assert "in reset" in message and "Traceback" in message


def test_the_cli_refuses_a_failing_reset_with_its_message(fast_rl, tmp_path):
    result = subprocess.run([sys.executable, "-m", "gspo_lab.train", *fast_rl, *ENVIRONMENT,
                             "task.environment=tests.tools.trl_style.ResetFails", f"paths.output_dir={tmp_path}"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "invalid configuration: task.environment=ResetFails: reset() on the first training row" in result.stderr
    assert "ConnectionError: the environment server refused the connection" in result.stderr


def test_rows_that_all_lose_their_environment_stop_the_run_with_the_first_error(compose, rl_overrides, caplog):
    """The check before training passes (the first reset works); every later reset fails, so step 0 has no row
    (no evaluation, whose own loop would meet the failures first)."""
    cfg = compose(rl_overrides + ENVIRONMENT + ["task.environment=tests.tools.trl_style.ResetFailsAfterFirst",
                                                 "train.eval_every=0"])
    run, module, _ = build(cfg)
    with pytest.raises(NoSignal) as stopped:
        run.trainer.fit(module)
    message = str(stopped.value)
    assert "16 of 16 rows lost their environment (task.environment)" in message
    assert "task.environment=ResetFailsAfterFirst: reset() failed (error: ConnectionError('reset number 2 lost its " \
           "server'))" in message
    # the first occurrence logged with its text, the rest (15 rows) counted: once per loop (a cold start trained in
    # this test evaluates through a loop of its own)
    assert 1 <= caplog.text.count("reset() failed") <= 2


ENVIRONMENT_REWARD = "reward.functions=[{_target_:gspo_lab.rewards.environment_reward}]"


def test_a_get_reward_that_raises_on_every_row_stops_the_run(compose, rl_overrides):
    """Before: reward NaN (the rows were taken as unscored) and reward/environment_reward/errors 0."""
    cfg = compose(rl_overrides + ENVIRONMENT + ["task.environment=tests.tools.trl_style.RewardFails",
                                                 ENVIRONMENT_REWARD])
    run, module, _ = build(cfg)
    with pytest.raises(NoSignal) as stopped:
        run.trainer.fit(module)
    message = str(stopped.value)
    assert "reward function environment_reward (reward.functions.0) failed on 16 of 16 completions" in message
    assert "get_reward() raised" in message


def test_a_get_reward_that_raises_on_some_rows_counts_errors(compose, rl_overrides, caplog):
    cfg = compose(rl_overrides + ENVIRONMENT + ["task.environment=tests.tools.trl_style.OddRewardFails",
                                                 ENVIRONMENT_REWARD, "train.steps=1"])
    run, module, _ = build(cfg)
    run.trainer.fit(module)
    errors, mean = module.history[0]["reward/environment_reward/errors"], module.history[0]["reward/mean"]
    assert 0 < errors < 16 and mean == mean, (errors, mean)
    # once per loop (training, its evaluation, a cold start's evaluation), not once per failed row
    assert 1 <= caplog.text.count("get_reward() failed (error: ZeroDivisionError('scoring answer") <= 3 < errors
