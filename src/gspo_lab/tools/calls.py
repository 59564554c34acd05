"""The tool calls in what the model wrote, in its chat template's format.

A tokenizer that declares how its replies parse (transformers' `response_template`, which TRL's
`add_response_schema` sets for Qwen3, Qwen3.5, Llama 3, GLM-4.5, GPT-OSS and others) is parsed by
`tokenizer.parse_response`. Otherwise the calls are the Hermes / Qwen format that most templates use,
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`. (The tiny models' tool template writes the pythonic
format and declares its parser: gspo_lab.tools.template.) A reply the declared parser cannot read is one failed
call.

A call that does not parse (not JSON, no name, arguments that are not an object) is kept as a `ToolCall` with its
`error`: the model is told what was wrong, and it counts as a failed call.

>>> calls, content = parse_tool_calls('Let me see. <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>')
>>> calls[0].name, calls[0].arguments, calls[0].error, content
('add', {'a': 1}, None, 'Let me see.')
>>> parse_tool_calls('<tool_call>{"name": add}</tool_call>')[0][0].error[:24]
'the call is not JSON: Ex'
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

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
    calls = []
    for found in HERMES.finditer(text):
        try:
            calls.append(call_of(json.loads(found.group(1))))
        except json.JSONDecodeError as error:
            calls.append(ToolCall("", error=f"the call is not JSON: {error}"))
    return calls, HERMES.sub("", text).strip()
