"""Tool calls parsed from what the model wrote (gspo_lab.tools.calls)."""

from gspo_lab.tools import parse_tool_calls


def test_several_calls_in_one_turn_in_order_with_the_content_apart():
    text = ('First <tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call> then'
            '<tool_call>\n{"name": "b", "arguments": "{\\"y\\": [2]}"}\n</tool_call>')
    calls, content = parse_tool_calls(text)
    assert [(c.name, c.arguments, c.error) for c in calls] == [("a", {"x": 1}, None), ("b", {"y": [2]}, None)]
    assert content == "First  then"


def test_llama3_parameters_key_and_transformers_function_form():
    calls, _ = parse_tool_calls('<tool_call>{"name": "a", "parameters": {"x": 1}}</tool_call>'
                                '<tool_call>{"type": "function", "function": {"name": "b", "arguments": {}}}'
                                '</tool_call>')
    assert [(c.name, c.arguments) for c in calls] == [("a", {"x": 1}), ("b", {})]


def test_malformed_calls_are_kept_with_their_error():
    calls, _ = parse_tool_calls('<tool_call>{"arguments": {}}</tool_call><tool_call>{"name": "a", "arguments": 3}'
                                '</tool_call><tool_call>not json</tool_call>')
    assert [c.name for c in calls] == ["", "a", ""]
    assert "needs a \"name\"" in calls[0].error
    assert "must be an object" in calls[1].error
    assert calls[2].error.startswith("the call is not JSON")


def test_text_without_calls_has_none():
    assert parse_tool_calls("4776") == ([], "4776")
