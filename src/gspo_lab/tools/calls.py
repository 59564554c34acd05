"""The tool calls in what the model wrote, in its chat template's format.

- A tokenizer that declares how its replies parse (transformers' `response_template`, which TRL's
  `add_response_schema` sets for Qwen3, Qwen3.5, Llama 3, GLM-4.5, GPT-OSS and others) is parsed by
  `tokenizer.parse_response`. A reply that parser cannot read is one failed call.
- The tiny models' tool template (gspo_lab.tools.template) writes the pythonic format, `<tool_call>[f(x=1),
  g(y="a")]</tool_call>`, read here with Python's `ast`: keyword arguments whose values are literals. (transformers
  reads it as `python-call-list` from 5.24 on; the vLLM environment's 5.19 cannot, so the parser is ours.)
- Otherwise the calls are the Hermes / Qwen format that most templates use,
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

A call that does not parse (not JSON or not a call, no name, arguments that are not an object) is kept as a
`ToolCall` with its `error`: the model is told what was wrong, and it counts as a failed call.

>>> calls, content = parse_tool_calls('Let me see. <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>')
>>> calls[0].name, calls[0].arguments, calls[0].error, content
('add', {'a': 1}, None, 'Let me see.')
>>> parse_tool_calls('<tool_call>{"name": add}</tool_call>')[0][0].error[:24]
'the call is not JSON: Ex'
>>> [(c.name, c.arguments) for c in pythonic_calls('[add(a=1, b=-2), echo(text="hi")]')]
[('add', {'a': 1, 'b': -2}), ('echo', {'text': 'hi'})]
>>> pythonic_calls('[add(1)]')[0].error
'the call did not parse: add takes keyword arguments only, such as f(x=1)'
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field
from typing import Any

from gspo_lab.tools.template import TINY_TOOL_TEMPLATE

HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str  # "" when the call did not parse
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # why the call did not parse; None for a well-formed call

    def message(self) -> dict:
        """The call as an assistant message's `tool_calls` entry (transformers' chat template format)."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def call_of(payload: Any) -> ToolCall:
    """A ToolCall from one parsed call: {"name": ..., "arguments": {...}} (or "parameters", Llama 3's key), or
    transformers' {"type": "function", "function": {...}}."""
    if isinstance(payload, dict) and isinstance(payload.get("function"), dict):
        payload = payload["function"]
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str) or not payload["name"]:
        return ToolCall("", error=f"a tool call needs a \"name\"; got {json.dumps(payload)[:200]}")
    arguments = payload.get("arguments", payload.get("parameters", {}))
    if isinstance(arguments, str):  # some templates write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return ToolCall(payload["name"], error=f"the arguments of {payload['name']!r} must be an object; got "
                                               f"{json.dumps(arguments)[:200]}")
    return ToolCall(payload["name"], arguments)


def _literal(source: str, node: ast.expr) -> Any:
    """A keyword argument's value: JSON as the template writes it (`tojson`: true, null, "a\\u00e9"), else a
    Python literal (True, 'a')."""
    segment = ast.get_source_segment(source, node) or ""
    try:
        return json.loads(segment)
    except json.JSONDecodeError:
        return ast.literal_eval(node)


def pythonic_calls(written: str) -> list[ToolCall]:
    """The calls in one pythonic region, `[f(x=1), g(y="a")]`; a region that is not such a list is one failed
    call, a call in it that is not well formed one failed call.

    >>> [c.arguments for c in pythonic_calls('[f(a=true, b=null, c=[1, "x"]), f(d=False)]')]
    [{'a': True, 'b': None, 'c': [1, 'x']}, {'d': False}]
    """
    source = written.strip()
    try:
        tree = ast.parse(source, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError) as error:
        return [ToolCall("", error=f"the call did not parse: {type(error).__name__}: {error}")]
    if not isinstance(tree, ast.List):
        return [ToolCall("", error="the call did not parse: write a list of calls, such as [f(x=1)]")]
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
            calls.append(ToolCall("", error="the call did not parse: each item is a call, such as f(x=1)"))
        elif node.args or any(keyword.arg is None for keyword in node.keywords):
            calls.append(ToolCall("", error=f"the call did not parse: {node.func.id} takes keyword arguments "
                                            "only, such as f(x=1)"))
        else:
            try:
                calls.append(ToolCall(node.func.id, {k.arg: _literal(source, k.value) for k in node.keywords}))
            except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError) as error:
                calls.append(ToolCall("", error=f"the call did not parse: {node.func.id}: {error}"))
    return calls


def parse_tool_calls(text: str, tokenizer=None, ids: list[int] | None = None, prefix: list[int] | None = None,
                     tools: list[dict] | None = None) -> tuple[list[ToolCall], str]:
    """The calls in one turn the model wrote and its content without them. `text`: the turn decoded (without its
    stop token); with a tokenizer that has a `response_template`, its parser reads the turn's token `ids` after
    the context `prefix`, arguments typed by the `tools`' schemas."""
    if tokenizer is not None and getattr(tokenizer, "response_template", None) is not None and ids is not None:
        if not ids:  # an empty reply (the stop token at once); parse_response would read [] as an empty batch
            return [], ""
        try:
            parsed = tokenizer.parse_response(ids, prefix=prefix or [], tools=tools)
        except (ValueError, TypeError, KeyError) as error:
            return [ToolCall("", error=f"the reply did not parse: {error}")], text
        calls = [call_of(call) for call in parsed.get("tool_calls") or []]
        return calls, str(parsed.get("content") or "")
    pythonic = getattr(tokenizer, "chat_template", None) == TINY_TOOL_TEMPLATE
    calls = []
    for found in HERMES.finditer(text):
        if pythonic:
            calls += pythonic_calls(found.group(1))
            continue
        try:
            calls.append(call_of(json.loads(found.group(1))))
        except json.JSONDecodeError as error:
            calls.append(ToolCall("", error=f"the call is not JSON: {error}"))
    return calls, HERMES.sub("", text).strip()
