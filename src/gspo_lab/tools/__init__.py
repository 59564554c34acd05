"""Tools and environments for multi-turn rollouts, with TRL's contract (`GRPOTrainer(tools=, environment_factory=)`).

    toolset.py    what a task offers the model: tool functions and an environment class (task.tools,
                  task.environment), their JSON schemas for the chat template
    calls.py      the tool calls in what the model wrote (the chat template's format)
    template.py   tool results as tokens through the chat template's tool role; the prefix check; the tiny
                  models' tool template
    runner.py     tool calls and environments in killable worker processes
"""

from gspo_lab.tools.calls import ToolCall, parse_tool_calls
from gspo_lab.tools.runner import ToolRunner
from gspo_lab.tools.toolset import Toolset

__all__ = ["ToolCall", "ToolRunner", "Toolset", "parse_tool_calls"]
