"""Qwen3's real chat template (TRL ships a copy, trl/chat_templates/qwen3.jinja) on a character tokenizer with
Qwen3's special tokens: refused as not prefix-preserving (it strips earlier <think> blocks), accepted once replaced
by TRL's training template, and its replies parsed by transformers' parser (the response template TRL's
add_response_schema sets)."""

from pathlib import Path

import pytest

from gspo_lab.models.tokenizer import ALPHABET, char_tokenizer
from gspo_lab.tools import parse_tool_calls
from gspo_lab.tools.template import check_prefix_preserving, tool_suffix_ids

trl = pytest.importorskip("trl")
from trl.chat_template_utils import add_response_schema, get_training_chat_template  # noqa: E402


@pytest.fixture
def qwen3():
    tok = char_tokenizer(ALPHABET + "\n")
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"], "eos_token": "<|im_end|>"})
    tok.add_tokens(["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"])
    tok.chat_template = (Path(trl.__file__).parent / "chat_templates" / "qwen3.jinja").read_text()
    return tok


def test_qwen3_is_refused_and_its_training_template_accepted(qwen3):
    with pytest.raises(ValueError, match="not prefix-preserving"):
        check_prefix_preserving(qwen3)
    qwen3.chat_template = get_training_chat_template(qwen3)
    check_prefix_preserving(qwen3)
    suffix = qwen3.decode(tool_suffix_ids(qwen3, [{"role": "tool", "name": "f", "content": "42"}]))
    assert suffix == "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


def test_a_tokenizer_with_a_response_template_is_parsed_by_it(qwen3):
    add_response_schema(qwen3)
    assert qwen3.response_template is not None
    text = ('<think>\nthree times four\n</think>\n\n'
            '<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n</tool_call>')
    ids = qwen3(text, add_special_tokens=False)["input_ids"]
    prompt = qwen3.apply_chat_template([{"role": "user", "content": "q"}], add_generation_prompt=True,
                                       return_dict=False)
    calls, _ = parse_tool_calls(text, qwen3, ids, prompt)
    assert [(c.name, c.arguments, c.error) for c in calls] == [("multiply", {"a": 3, "b": 4}, None)]


def test_the_context_check_measures_prompts_with_their_tools_schemas(qwen3):
    """A prompt measured at 38 tokens was 1,025 with its tools' schemas rendered, and rollout/width passed the
    model's positions with only transformers' warning: the check now renders the prompts as the rollout does."""
    from types import SimpleNamespace

    from gspo_lab.models.builders import ContextTooLong, check_context
    from gspo_lab.prompts import PromptFormat
    from gspo_lab.tasks.calculator import Calculator

    tokenizer = qwen3  # its template lists the tools' schemas in the system message
    task = Calculator(tools=["gspo_lab.tasks.calculator.calculate", "tests.tools.trl_style.multiply"],
                      environment="tests.tools.trl_style.CounterEnv", eval_size=8)
    render = PromptFormat().bind(tokenizer)
    def longest(tools) -> int:
        return max(len(tokenizer(render.text(e, tools=tools), add_special_tokens=render.add_special_tokens)
                       ["input_ids"]) for e in task.eval_examples())

    bare, listed = longest(None), longest(task.toolset.schemas())
    assert listed > bare + 100  # the schemas are most of the prompt
    model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=listed + 50))
    check_context(model, tokenizer, task, {"rollout.max_new_tokens": 50}, render)  # fits to the token
    with pytest.raises(ContextTooLong, match=rf"rollout.max_new_tokens=51 does not fit: .* is {listed} tokens"):
        check_context(model, tokenizer, task, {"rollout.max_new_tokens": 51}, render)


def scripted_run(tokenizer, script):
    """One row of a multi-turn rollout over a scripted backend, with TRL's multiply tool, after the loop's check."""
    import torch

    from gspo_lab.prompts import PromptFormat
    from gspo_lab.rollout.backend import Sampling
    from gspo_lab.rollout.multi_turn import MultiTurn
    from gspo_lab.tasks.base import Example
    from gspo_lab.tools import ToolRunner, Toolset
    from tests.rollout.scripted import ScriptedBackend

    runner = ToolRunner(1, 10.0)
    try:
        agent = MultiTurn(Toolset.of(["tests.tools.trl_style.multiply"], None), runner, 4, None)
        agent.check(tokenizer)
        return agent.generate(ScriptedBackend(script), tokenizer, PromptFormat().bind(tokenizer), [Example("q", "42")],
                              Sampling(400), torch.tensor([1]))
    finally:
        runner.close()


def test_llama_3_2_json_calls_are_read_through_trls_response_template():
    """Llama 3.2 writes a call as bare JSON and its tokenizer has no response schema: 0 calls parsed. The loop now
    sets TRL's response template (add_response_schema), whose parser closes a call on <|eot_id|>, so the turn's
    stop token reaches it."""
    tok = char_tokenizer(ALPHABET + "\n")
    tok.add_tokens(["\n\n"])  # the template's header ends in two newlines, which the character vocabulary lacks
    tok.add_special_tokens({"additional_special_tokens": ["<|begin_of_text|>", "<|start_header_id|>",
                                                         "<|end_header_id|>", "<|eot_id|>", "<|python_tag|>",
                                                         "<|eom_id|>"], "eos_token": "<|eot_id|>"})
    tok.chat_template = (Path(trl.__file__).parent / "chat_templates" / "llama3_2.jinja").read_text()

    def script(text):
        answered = "<|start_header_id|>ipython<|end_header_id|>" in text  # the tool result's turn
        return "42" if answered else '{"name": "multiply", "parameters": {"a": 6, "b": 7}}'

    out = scripted_run(tok, script)
    assert tok.response_template is not None
    assert out.extra["tool_calls"].tolist() == [1.0] and out.extra["tool_failures"].tolist() == [0.0]
    assert [m.get("content") for m in out.completions.messages[0] if m["role"] == "tool"] == ["42"]


def test_qwen3s_shipped_template_runs_with_trls_training_template(qwen3):
    """Qwen3's shipped template is not prefix-preserving; TRL swaps in its training template, and so does the loop
    now, after setting the response template from the shipped one: a Hermes call is parsed and run."""
    shipped = qwen3.chat_template

    def script(text):
        return ('<tool_call>\n{"name": "multiply", "arguments": {"a": 6, "b": 7}}\n</tool_call>'
                if "<tool_response>" not in text else "42")

    out = scripted_run(qwen3, script)
    assert qwen3.chat_template == get_training_chat_template_of(shipped) and qwen3.response_template is not None
    assert out.extra["tool_calls"].tolist() == [1.0] and out.extra["tool_failures"].tolist() == [0.0]


def get_training_chat_template_of(template: str) -> str:
    tok = char_tokenizer(ALPHABET + "\n")
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"], "eos_token": "<|im_end|>"})
    tok.add_tokens(["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"])
    tok.chat_template = template
    return get_training_chat_template(tok)
