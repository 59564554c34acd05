"""Tool results as tokens through the chat template (gspo_lab.tools.template): the suffix after a turn's stop
token, the prefix check, and demonstrations."""

import pytest

from gspo_lab.models.tokenizer import ALPHABET, char_tokenizer
from gspo_lab.tools.template import (
    check_prefix_preserving,
    demonstration_ids,
    tool_suffix_ids,
    with_tool_template,
)

# ChatML with Qwen2.5's tool rendering: a tool result is a user turn wrapped in <tool_response>
QWEN_TOOLS = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'tool' -%}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' -%}{{ '<|im_start|>assistant\\n' }}{{ m.content }}"
    "{%- for c in m.tool_calls or [] -%}{{ '<tool_call>\\n' + (c.function | tojson) + '\\n</tool_call>' }}"
    "{%- endfor -%}{{ '<|im_end|>\\n' }}"
    "{%- else -%}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
# the same, but an assistant turn before the last user message loses its <think> block, as Qwen3's does
QWEN3_STRIPPING = QWEN_TOOLS.replace(
    "{%- elif m.role == 'assistant' -%}{{ '<|im_start|>assistant\\n' }}{{ m.content }}",
    "{%- elif m.role == 'assistant' -%}{{ '<|im_start|>assistant\\n' }}"
    "{%- if loop.index0 < last_user -%}{{ m.content.split('</think>')[-1].lstrip() }}"
    "{%- else -%}{{ m.content }}{%- endif -%}",
).replace("{%- for m in messages -%}",
          "{%- set ns = namespace(last=0) -%}{%- for m in messages -%}{%- if m.role == 'user' -%}"
          "{%- set ns.last = loop.index0 -%}{%- endif -%}{%- endfor -%}{%- set last_user = ns.last -%}"
          "{%- for m in messages -%}", 1)


def chatml(template: str):
    tok = char_tokenizer(ALPHABET + "\n")
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"], "eos_token": "<|im_end|>"})
    tok.chat_template = template
    return tok


def test_qwen_suffix_starts_after_the_stop_token_and_ends_with_the_generation_prompt():
    tok = chatml(QWEN_TOOLS)
    suffix = tok.decode(tool_suffix_ids(tok, [{"role": "tool", "name": "f", "content": "42"}]))
    # the newline the template writes after <|im_end|> is not the model's: it stopped at <|im_end|>
    assert suffix == "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


def test_two_results_render_together():
    tok = with_tool_template(char_tokenizer())
    ids = tool_suffix_ids(tok, [{"role": "tool", "name": "f", "content": "1"}, {"role": "tool", "name": "g",
                                                                                 "content": "2"}])
    assert tok.decode(ids) == "<tool_response>1</tool_response><tool_response>2</tool_response>"
    assert all(t >= len(char_tokenizer()) for t in tok("<tool_response>", add_special_tokens=False)["input_ids"])


def test_prefix_preserving_templates_pass_and_a_think_stripping_one_is_refused():
    check_prefix_preserving(chatml(QWEN_TOOLS))
    check_prefix_preserving(with_tool_template(char_tokenizer()))
    with pytest.raises(ValueError, match="not prefix-preserving.*<think>.*get_training_chat_template"):
        check_prefix_preserving(chatml(QWEN3_STRIPPING))


def test_demonstration_tokens_are_what_a_rollout_holds_with_the_tools_masked():
    tok = chatml(QWEN_TOOLS)
    call = {"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}
    messages = [{"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "name": "f", "content": "2"}, {"role": "assistant", "content": "2"}]
    ids, mask = demonstration_ids(tok, messages)
    prompt = tok.apply_chat_template([{"role": "user", "content": "q"}], add_generation_prompt=True,
                                     return_dict=False)
    whole = tok.apply_chat_template([{"role": "user", "content": "q"}, *messages], return_dict=False)
    # the template's rendering of the whole conversation, but for the newline after the last stop token
    assert prompt + ids == whole[:-1]
    model = tok.decode([t for t, m in zip(ids, mask) if m])
    tools = tok.decode([t for t, m in zip(ids, mask) if not m])
    assert model == '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call><|im_end|>2<|im_end|>'
    assert tools == "\n<|im_start|>user\n<tool_response>\n2\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


def test_the_tiny_template_writes_pythonic_calls_that_are_read_back_after_a_save(tmp_path):
    from transformers import AutoTokenizer

    from gspo_lab.tools import parse_tool_calls

    tok = with_tool_template(char_tokenizer())
    written = [{"type": "function", "function": {"name": "guess", "arguments": {"number": 12}}},
               {"type": "function", "function": {"name": "calculate", "arguments": {"expression": "12*34"}}}]
    ids = demonstration_ids(tok, [{"role": "assistant", "content": "so", "tool_calls": written}])[0]
    text = tok.decode(ids[:-1], skip_special_tokens=True)
    assert tok.decode(ids) == 'so<tool_call>[guess(number=12),calculate(expression="12*34")]</tool_call><eos>'
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)  # what gspo-eval and a resumed run parse with
    calls, content = parse_tool_calls(text, loaded)
    assert [c.message() for c in calls] == written and content == "so"  # 12 read back as an int
    calls, _ = parse_tool_calls("<tool_call>[guess(12)]</tool_call><tool_call>[guess(number=3)]</tool_call>", loaded)
    assert "keyword arguments only" in calls[0].error and calls[1].arguments == {"number": 3}  # region by region
    assert parse_tool_calls("<tool_call>[guess(number=int('3'))]</tool_call>", loaded)[0][0].error  # literals only
    assert parse_tool_calls("", loaded) == ([], "")  # the stop token at once

