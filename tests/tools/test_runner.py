"""Tools and environments in killable workers (gspo_lab.tools.runner): raising, timing out and dying cost a call or
the rows of one worker, never the run; an environment keeps its state across calls in its worker."""

from gspo_lab.tools import ToolRunner
from gspo_lab.tools.runner import call_environment, call_tool, finish_environment, start_environment
from tests.tools.trl_style import CounterEnv, add, explode, multiply, stall


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
