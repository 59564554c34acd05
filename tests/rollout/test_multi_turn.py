"""The multi-turn loop (gspo_lab.rollout.multi_turn) over a scripted backend, whose turns are fixed, so the loop's
bookkeeping is checked exactly: tokens, turns, masks, stops, budgets, failures, environments and seeds."""

import json

import pytest
import torch

from gspo_lab.models.tokenizer import char_tokenizer
from gspo_lab.prompts import PromptFormat
from gspo_lab.rollout.backend import Sampling
from gspo_lab.rollout.multi_turn import MultiTurn, turn_seeds
from gspo_lab.rollout.trajectory import trajectories
from gspo_lab.tasks.base import Example
from gspo_lab.tools import ToolRunner, Toolset
from gspo_lab.tools.template import with_tool_template
from tests.rollout.scripted import ScriptedBackend

TOOLS = ["tests.tools.trl_style.multiply", "tests.tools.trl_style.explode", "tests.tools.trl_style.stall"]


def fn(name: str, **arguments) -> str:
    """One call in the tiny template's pythonic format."""
    return name + "(" + ",".join(f"{key}={json.dumps(value)}" for key, value in arguments.items()) + ")"


def calls(*written: str) -> str:
    """A turn's calls, in the tiny template's one <tool_call> region."""
    return "<tool_call>[" + ",".join(written) + "]</tool_call>"


def call(name: str, **arguments) -> str:
    return calls(fn(name, **arguments))


@pytest.fixture(scope="module")
def tok():
    return with_tool_template(char_tokenizer())


@pytest.fixture
def runner():
    runner = ToolRunner(2, 2.0)
    yield runner
    runner.close()


def loop(runner, tools=TOOLS, environment=None, max_tool_calls=2**31, cut=None) -> MultiTurn:
    return MultiTurn(Toolset.of(tools, environment), runner, max_tool_calls, cut)


def run(agent, tok, script, examples, budget=200, seeds=None, batch_size=None):
    backend = ScriptedBackend(script)
    render = PromptFormat().bind(tok)
    seeds = torch.arange(len(examples)) + 100 if seeds is None else seeds
    out = agent.generate(backend, tok, render, examples, Sampling(budget), seeds, batch_size)
    return out, backend


def multiply_then_answer(text: str) -> str:
    return call("multiply", a=6, b=7) if "<tool_response>" not in text else "42"


def test_a_call_then_an_answer_token_in_token_out(tok, runner):
    out, backend = run(loop(runner), tok, multiply_then_answer, [Example("q1", "42")])
    c = out.completions
    ids = c.completion_ids[0, : int(c.completion_mask[0].sum())].tolist()
    first = tok(call("multiply", a=6, b=7), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    result = tok("<tool_response>42</tool_response>", add_special_tokens=False)["input_ids"]
    answer = tok("42", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert ids == first + result + answer  # exactly what was generated, with the tool's tokens between
    turns = c.turns[0, : len(ids)].tolist()
    assert turns == [1] * len(first) + [0] * len(result) + [2] * len(answer)
    assert c.policy_mask[0].sum() == len(first) + len(answer)
    assert c.logprobs[0, len(first) : len(first) + len(result)].eq(0).all()  # the engine's cover the model's only
    assert c.logprobs[0, : len(first)].eq(-0.5).all()
    assert c.texts == ["42"] and not c.truncated[0]
    assert out.extra["tool_calls"].tolist() == [1.0] and out.extra["turns"].tolist() == [2.0]
    assert out.extra["tool_calls/multiply"].tolist() == [1.0] and out.extra["tool_failures"].tolist() == [0.0]
    # the second turn continued from the token ids of the first, never re-tokenised text
    assert backend.calls[1]["texts"][0].endswith("</tool_response>")
    assert [m["role"] for m in c.messages[0]] == ["assistant", "tool", "assistant"]
    assert trajectories(tok, c)[0] == (call("multiply", a=6, b=7) + "<eos>⟦tool: <tool_response>42</tool_response>⟧"
                                       "42<eos>")


def test_failures_return_an_error_to_the_model_and_are_counted(tok, runner):
    def script(text):
        if "<tool_response>" not in text:
            return calls(fn("explode", reason="r"), fn("nope"), fn("stall", seconds=30), fn("multiply", a=2, b=3))
        # a region that does not parse is one failed call
        return "<tool_call>[bad(</tool_call>" if text.count("</tool_response>") == 4 else "done"

    out, _ = run(loop(runner), tok, script, [Example("q", "x")], budget=1000)
    responses = [m["content"] for m in out.completions.messages[0] if m["role"] == "tool"]
    assert "boom: r" in responses[0] and "no tool named 'nope'" in responses[1]
    assert "timeout" in responses[2] and responses[3] == "6" and "did not parse" in responses[4]
    assert out.extra["tool_calls"].tolist() == [5.0] and out.extra["tool_failures"].tolist() == [4.0]
    assert out.completions.texts == ["done"]


def test_max_tool_calls_ends_a_row_without_running_its_last_calls(tok, runner):
    def forever(text):
        return call("multiply", a=text.count("</tool_response>"), b=1)

    out, _ = run(loop(runner, max_tool_calls=2), tok, forever, [Example("q", "x")])
    assert out.extra["turns"].tolist() == [3.0] and out.extra["tool_calls"].tolist() == [2.0]
    assert not out.completions.truncated[0]  # it ended, it was not cut


def test_the_length_budget_truncates_and_counts_the_tools_tokens(tok, runner):
    def forever(text):
        return call("multiply", a=1, b=1) if text.count("</tool_response>") < 2 else "9" * 200

    out, _ = run(loop(runner), tok, forever, [Example("q", "x")], budget=100)
    c = out.completions
    assert c.truncated[0] and int(c.completion_mask[0].sum()) == 100
    assert out.extra["tool_calls"].tolist() == [2.0]  # both rounds' results counted in the budget


def test_results_that_do_not_fit_are_rolled_back_and_the_row_kept_whole(tok, runner):
    """TRL rolls back a tool result that leaves no room and keeps the row; it was marked truncated here, so
    rollout.mask_truncated dropped rows that TRL trains on."""
    def script(text):
        return call("multiply", a=123456789, b=987654321) if "<tool_response>" not in text else "ok"

    first = tok(call("multiply", a=123456789, b=987654321), add_special_tokens=False)["input_ids"]
    budget = len(first) + 1 + 20  # the call and its stop token fit; the 18-digit result's region does not
    out, _ = run(loop(runner), tok, script, [Example("q", "x")], budget=budget)
    c = out.completions
    assert not c.truncated[0] and out.extra["rolled_back"].tolist() == [1.0]
    assert c.completion_ids[0, : int(c.completion_mask[0].sum())].tolist() == first + [tok.eos_token_id]
    assert [m["role"] for m in c.messages[0]] == ["assistant"]  # no tool message: the result was not appended
    assert out.extra["tool_calls"].tolist() == [1.0]


def test_a_result_is_cut_at_max_tool_response_tokens(tok, runner):
    def script(text):
        return call("multiply", a=123456, b=1000) if "<tool_response>" not in text else "ok"

    out, _ = run(loop(runner, cut=4), tok, script, [Example("q", "x")])
    assert [m["content"] for m in out.completions.messages[0] if m["role"] == "tool"] == ["1234"]


def test_each_row_samples_from_its_own_seeds_whatever_the_batch_and_the_other_rows(tok, runner):
    def script(text):  # row "a" calls twice, row "b" answers at once
        rounds = text.count("</tool_response>")
        return call("multiply", a=1, b=2) if text.startswith("<bos>a") and rounds < 2 else "end"

    examples = [Example("a", "x"), Example("b", "y"), Example("a", "x")]
    seeds = torch.tensor([11, 22, 33])
    seen = {}
    for batch_size in (None, 1):
        _, backend = run(loop(runner), tok, script, examples, seeds=seeds, batch_size=batch_size)
        per_turn = [(t, s) for c in backend.calls for t, s in zip(c["texts"], c["seeds"])]
        seen[batch_size] = sorted(per_turn)
    assert seen[None] == seen[1]
    # rows "a" took three turns, each from the stream of its seed for that turn; "b" one, from its own seed
    expected = [turn_seeds(torch.tensor([seed]), turn).item() for seed in (11, 33) for turn in range(3)] + [22]
    assert sorted(s for _, s in seen[None]) == sorted(expected)


def test_a_trl_environment_extends_the_prompt_keeps_state_and_rewards(tok, runner):
    def script(text):
        rounds = text.count("</tool_response>")
        return call("increment", step=1) if rounds < 3 else "3"

    examples = [Example("count", "3", {"start": 0}), Example("count", "3", {"start": 1})]
    out, backend = run(loop(runner, tools=[], environment="tests.tools.trl_style.CounterEnv"), tok, script,
                       examples)
    assert backend.calls[0]["texts"][0] == "<bos>count (the counter is at 0)"
    results = [[m["content"] for m in row if m["role"] == "tool"] for row in out.completions.messages]
    assert results == [["1", "2", "3"], ["2", "3", "4"]]
    assert out.extra["environment_reward"].tolist() == [1.0, 0.0]
    assert out.extra["lost"].tolist() == [0.0, 0.0]


def test_a_dying_worker_costs_its_rows_only(tok, runner):
    def script(text):
        if "<tool_response>" in text:
            return "end"
        return call("crash") if "at 1)" in text else call("increment", step=2)

    examples = [Example("c", "3", {"start": 0}), Example("c", "3", {"start": 1})]  # rows 0, 1: workers 0, 1
    out, _ = run(loop(runner, tools=[], environment="tests.tools.trl_style.CounterEnv"), tok, script, examples)
    assert out.extra["lost"].tolist() == [0.0, 1.0]
    assert out.completions.texts[0] == "end"
    assert torch.isnan(out.extra["environment_reward"][1]) and out.extra["environment_reward"][0] == 0.0


def test_a_reward_function_that_takes_environments_reads_its_rows_instances(tok, runner):
    """TRL's `reward_func(environments, **kwargs)` (echo.py) was refused: the instances live in the workers. Each row
    now hands its reward functions a handle that reads its own instance there, attributes and methods alike."""
    from gspo_lab.rewards import build_rewards
    from gspo_lab.rollout.completions import reward_inputs
    from gspo_lab.tasks.calculator import Calculator

    def script(text):
        return call("increment", step=int(text[text.index("at ") + 3])) if "<tool_response>" not in text else "ok"

    agent = loop(runner, tools=[], environment="tests.tools.trl_style.CounterEnv")
    examples = [Example("q", "x", {"start": 0}), Example("q", "y", {"start": 1})]
    out, _ = run(agent, tok, script, examples)  # row 0 counts 0 -> 0, row 1 counts 1 -> 2
    task = Calculator(tools=[], environment="tests.tools.trl_style.CounterEnv")
    rewards = build_rewards({"functions": [
        {"_target_": "tests.tools.trl_style.counter_reward"},
        {"_target_": "tests.tools.trl_style.counter_reward_by_method"}], "num_workers": 0}, task)
    scores = rewards.score(*reward_inputs(examples, out.completions, out.extra, agent.environments))
    assert scores.per_function["counter_reward"].tolist() == pytest.approx([0.0, 2 / 3], rel=2**-23)  # float32
    assert scores.per_function["counter_reward_by_method"].tolist() == [0.0, 0.0]  # CounterEnv pays at 3 only
    with pytest.raises(ValueError, match=r"reward.functions.0 takes `environments`.*reward.num_workers=1"):
        build_rewards({"functions": [{"_target_": "tests.tools.trl_style.counter_reward"}], "num_workers": 1}, task)
