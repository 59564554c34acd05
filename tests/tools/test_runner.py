"""Tools and environments in killable workers (gspo_lab.tools.runner): raising, timing out and dying cost a call or
the rows of one worker, never the run; an environment keeps its state across calls in its worker."""

import functools
import os
import time
from pathlib import Path

import pytest

from gspo_lab.tools import ToolRunner, Toolset
from gspo_lab.tools.runner import call_environment, call_tool, finish_environment, start_environment
from tests.tools.trl_style import (CounterEnv, NoArguments, RandomStart, ResetFails, Resets, Shouter, add, explode,
                                   flood, held_environments, multiply, spawn_and_stall, stall, write_file)


def test_sync_and_async_tools_and_a_raising_one():
    runner = ToolRunner(2, 10.0)
    try:
        outcomes, replaced = runner.run([(0, call_tool, (multiply, {"a": 6, "b": 7})),
                                         (1, call_tool, (add, {"a": 1, "b": 2})),
                                         (2, call_tool, (explode, {"reason": "x"}))])
    finally:
        runner.close()
    assert [o.value for o in outcomes[:2]] == ["42", "3"]
    assert outcomes[2].failure == "error" and "boom: x" in outcomes[2].detail
    assert replaced == set()


def test_a_timeout_kills_its_worker_only():
    runner = ToolRunner(2, 1.0)
    try:
        outcomes, replaced = runner.run([(0, call_tool, (stall, {"seconds": 30})),
                                         (1, call_tool, (multiply, {"a": 2, "b": 3}))])
        again, _ = runner.run([(0, call_tool, (multiply, {"a": 3, "b": 3}))])
    finally:
        runner.close()
    assert outcomes[0].failure == "timeout" and outcomes[1].value == "6"
    assert replaced == {runner.worker_of(0)}
    assert again[0].value == "9"  # a fresh worker took its place


def test_an_environment_lives_in_its_worker_and_dies_with_it():
    runner = ToolRunner(2, 10.0)
    try:
        started, _ = runner.run([(n, start_environment, (f"k{n}", CounterEnv, {"start": n})) for n in range(2)])
        stepped, _ = runner.run([(0, call_environment, ("k0", "increment", {"step": 3})),
                                 (1, call_environment, ("k1", "increment", {"step": 1}))])
        crashed, replaced = runner.run([(1, call_environment, ("k1", "crash", {}))])
        rewards, _ = runner.run([(0, finish_environment, ("k0",)), (1, finish_environment, ("k1",))])
    finally:
        runner.close()
    assert [o.value for o in started] == [" (the counter is at 0)", " (the counter is at 1)"]
    assert [o.value for o in stepped] == ["3", "2"]
    assert crashed[0].failure == "error" and replaced == {runner.worker_of(1)}
    assert rewards[0].value == 1.0
    assert rewards[1].failure == "error" and "EnvironmentLost" in rewards[1].detail


def test_a_seeded_reset_draws_the_same_numbers_in_any_worker_after_any_rows():
    """random.randint in reset (TRL's IncrementEnv example): the draw is the seed's, whichever worker runs it and
    whatever ran there before; other seeds draw other numbers."""
    runner = ToolRunner(2, 10.0)
    try:
        first, _ = runner.run([(n, start_environment, (f"s/{n}", RandomStart, {}, seed))
                               for n, seed in enumerate([7, 8, 9])])
        again, _ = runner.run([(n, start_environment, (f"s/{n}", RandomStart, {}, seed))
                               for n, seed in enumerate([9, 7, 8])])  # each seed now in another worker
        rewards, _ = runner.run([(0, finish_environment, ("s/0", 3)), (1, finish_environment, ("s/1", 3))])
    finally:
        runner.close()
    assert [o.value for o in again] == [first[2].value, first[0].value, first[1].value]
    assert len({o.value for o in first}) == 3
    starts = [int(o.value.split()[-1][:-1]) for o in again]  # " (the counter is at 123)"
    # get_reward's draw is seed 3's in both workers: the rewards differ by their counters alone
    assert rewards[0].value - rewards[1].value == pytest.approx((starts[0] - starts[1]) / 1000, abs=1e-12)


def test_a_slot_keeps_its_instance_across_resets_and_closes_it_when_its_worker_stops(tmp_path):
    """TRL builds its environments once and resets them: the second rollout resets the same instance; close() runs
    for each instance when the runner closes (a functools.partial is the factory: Hydra's _partial_: true)."""
    factory = functools.partial(Resets, str(tmp_path))
    runner = ToolRunner(2, 10.0)
    try:
        firsts, _ = runner.run([(n, start_environment, (f"r/{n}", factory, {}, n)) for n in range(3)])
        seconds, _ = runner.run([(n, start_environment, (f"r/{n}", factory, {}, n)) for n in range(3)])
        assert not list(tmp_path.iterdir())  # nothing closed while the run goes on
    finally:
        runner.close()
    assert [o.value for o in firsts] == ["1"] * 3 and [o.value for o in seconds] == ["2"] * 3
    assert sorted(path.read_text() for path in tmp_path.iterdir()) == ["2"] * 3


def test_an_async_tools_background_task_lives_across_calls():
    """asyncio.run per call closed the loop that reset's reader task ran on: the tool then waited for ever."""
    runner = ToolRunner(1, 5.0)
    try:
        started, _ = runner.run([(0, start_environment, ("a/0", Shouter, {}, 0))])
        replies, _ = runner.run([(0, call_environment, ("a/0", "shout", {"text": "hi"}, 1)),
                                 (0, call_environment, ("a/0", "shout", {"text": "again"}, 2))])
    finally:
        runner.close()
    assert started[0].failure is None, started[0].detail
    assert [(o.failure, o.value) for o in replies] == [(None, "HI"), (None, "AGAIN")]


def test_a_lambda_or_a_function_builds_the_environment():
    """TRL's environment_factory takes any callable: a lambda goes to the worker by value, a function by its import
    path; the tools are the methods of what it builds."""
    assert Toolset.of([], functools.partial(Resets, "/nonexistent")).environment_class is Resets  # none built
    by_lambda = Toolset.of([], lambda: CounterEnv())
    by_path = Toolset.of([], "tests.tools.trl_style.make_counter")
    assert by_lambda.environment_class is by_path.environment_class is CounterEnv
    assert by_lambda.names == by_path.names == ["crash", "increment"]
    runner = ToolRunner(1, 10.0)
    try:
        started, _ = runner.run([(0, start_environment, ("l/0", by_lambda.environment, {"start": 2}, 0)),
                                 (0, start_environment, ("p/0", by_path.environment, {"start": 1}, 0))])
        stepped, _ = runner.run([(0, call_environment, ("l/0", "increment", {"step": 1}, 0))])
    finally:
        runner.close()
    assert [o.value for o in started] == [" (the counter is at 2)", " (the counter is at 1)"]
    assert stepped[0].value == "3"


def sleeping(marker: str) -> list[int]:
    """The pids of the processes running `sleep <marker>`."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and (proc / "cmdline").read_bytes().split(b"\0")[:2] == [b"sleep",
                                                                                             marker.encode()]:
                found.append(int(proc.name))
        except OSError:
            pass
    return found


def test_a_timed_out_tools_own_processes_die_with_its_worker():
    """A timed-out tool's child (`sleep 777`) outlived the worker that was killed: the worker's process group is
    killed now."""
    marker = f"{os.getpid()}.777"  # this test's own sleep
    runner = ToolRunner(1, 2.0)
    try:
        outcomes, replaced = runner.run([(0, call_tool, (spawn_and_stall, {"seconds": marker}, 0))])
    finally:
        runner.close()
    assert outcomes[0].failure == "timeout" and replaced == {0}
    deadline = time.monotonic() + 10  # the kill is sent; give a loaded machine time to carry it out
    while sleeping(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sleeping(marker) == []


def test_a_result_is_cut_in_the_worker_before_it_crosses():
    """A result was pickled back whole (2 million characters: seconds); the loop's limit cuts it in the worker."""
    runner = ToolRunner(1, 10.0)
    try:
        outcomes, _ = runner.run([(0, call_tool, (flood, {"chars": 2_000_000}, 0, 640)),
                                  (0, call_tool, (flood, {"chars": 5}, 0, 640))])
    finally:
        runner.close()
    assert [o.value for o in outcomes] == ["x" * 640, "x" * 5]


def test_failing_resets_leave_no_instances_behind():
    """After three rollouts with a failing reset a worker held 12 instances: an instance whose reset raised is
    dropped, and the rows of later rollouts reuse their slots."""
    runner = ToolRunner(1, 10.0)
    try:
        for _ in range(3):
            outcomes, _ = runner.run([(0, start_environment, (f"f/{n}", ResetFails, {}, n)) for n in range(4)])
            assert all(o.failure == "error" for o in outcomes)
        (failed,), _ = runner.run([(0, call_tool, (held_environments, {}))])
        for _ in range(3):
            runner.run([(0, start_environment, (f"c/{n}", CounterEnv, {}, n)) for n in range(4)])
        (kept,), _ = runner.run([(0, call_tool, (held_environments, {}))])
    finally:
        runner.close()
    assert (failed.value, kept.value) == ("0", "4")


def test_a_tool_may_write_files(tmp_path):
    """The docs said tool workers may not write files, and a write_file tool did: the guard covers checkers grading
    model output, not tools, and the docs now say so."""
    runner = ToolRunner(1, 10.0)
    try:
        (outcome,), _ = runner.run([(0, call_tool, (write_file, {"path": str(tmp_path / "out.txt"), "text": "hi"}))])
    finally:
        runner.close()
    assert outcome.value == "written" and (tmp_path / "out.txt").read_text() == "hi"


def test_a_reset_without_arguments_gets_none():
    """`def reset(self)` (TRL's echo_env_factory.py) raised TypeError on the row's columns."""
    runner = ToolRunner(1, 10.0)
    try:
        (started,), _ = runner.run([(0, start_environment, ("n/0", NoArguments, {"prompt": "p", "answer": "a"}))])
        (echoed,), _ = runner.run([(0, call_environment, ("n/0", "step", {"message": "hi"}))])
    finally:
        runner.close()
    assert (started.failure, started.value, echoed.value) == (None, None, "hi")
