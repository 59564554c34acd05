"""What a task offers the model to call, with TRL's contract so that tools and environments written for TRL work
unchanged:

- a tool is a plain function, sync or async, whose JSON schema comes from its type hints and Google-style
  docstring (transformers' `get_json_schema`, as `apply_chat_template(tools=...)` takes it);
- an environment is a class built once per rollout row (TRL's `environment_factory`): `reset(**columns)` returns
  None or a string that extends the prompt, an optional `get_reward()` returns the row's reward, and every other
  public method is a tool.

`task.tools: [my_module.my_tool]` and `task.environment: my_module.MyEnv` name them by import path.

>>> toolset = Toolset.of(["gspo_lab.tasks.calculator.calculate"], None)
>>> function = toolset.schemas()[0].get("function")
>>> toolset.names, function.get("parameters").get("required")
(['calculate'], ['expression'])
"""

from __future__ import annotations

import importlib
import inspect
import types
from collections.abc import Callable
from dataclasses import dataclass

from transformers.utils import get_json_schema

ENVIRONMENT_HOOKS = ("reset", "get_reward")  # an environment's methods that are not tools


def imported(path: str | Callable | type, where: str) -> Callable | type:
    """The object at import path "package.module.name" (or the object itself); a ValueError naming `where`."""
    if not isinstance(path, str):
        return path
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as error:
        raise ValueError(f"{where}={path!r}: cannot import {name!r} from {module!r} ({error}); give the import path "
                         "of a function or class of an installed module, e.g. my_package.tools.search") from None


def environment_methods(environment: type) -> list[str]:
    """The names of an environment class's tools: its public methods but reset and get_reward (TRL's rule)."""
    return [name for name, _ in inspect.getmembers(environment, predicate=inspect.isfunction)
            if not name.startswith("_") and name not in ENVIRONMENT_HOOKS]


def method_of(environment: type, name: str) -> Callable:
    """An environment's tool `name` as the model calls it: bound to a stand-in instance (no `self` in its schema),
    or as it is where it is a static method (which has no `self` to drop)."""
    if isinstance(inspect.getattr_static(environment, name), staticmethod):
        return getattr(environment, name)
    return types.MethodType(getattr(environment, name), object())


@dataclass(frozen=True)
class Toolset:
    """The tool functions and the environment class one task offers. `names`: every tool the model may call (the
    functions', then the environment's methods)."""

    tools: tuple[Callable, ...] = ()
    environment: type | None = None

    @classmethod
    def of(cls, tools, environment, where: str = "task") -> Toolset | None:
        """From `task.tools` (import paths or functions) and `task.environment` (an import path or a class); None
        when the task has neither (single-turn). Refuses what TRL's contract does not allow, naming the key."""
        if isinstance(tools, str):  # task.tools=my_module.my_tool: one tool, not a list of its characters
            tools = [tools]
        functions = tuple(imported(path, f"{where}.tools.{i}") for i, path in enumerate(tools or ()))
        for i, fn in enumerate(functions):
            if not callable(fn) or inspect.isclass(fn):
                raise ValueError(f"{where}.tools.{i}={fn!r} must be a function")
        env = None if environment is None else imported(environment, f"{where}.environment")
        if env is not None:
            if not inspect.isclass(env):
                raise ValueError(f"{where}.environment={environment!r} must be a class (TRL's environment_factory: "
                                 "built once per rollout row)")
            if not callable(getattr(env, "reset", None)):
                raise ValueError(f"{where}.environment={environment!r} must define reset() (TRL's contract)")
        toolset = cls(functions, env)
        if env is None and not functions:
            return None
        names = toolset.names
        if len(set(names)) != len(names):
            raise ValueError(f"{where}.tools and {where}.environment name a tool twice: {names}")
        toolset.schemas(where)  # every tool has type hints and a docstring, or the refusal names it and its key
        return toolset

    @property
    def names(self) -> list[str]:
        methods = environment_methods(self.environment) if self.environment is not None else []
        return [fn.__name__ for fn in self.tools] + methods

    def schemas(self, where: str = "task") -> list[dict]:
        """Each tool's JSON schema (transformers' `get_json_schema`): what the chat template lists for the model.
        An environment's methods are read as bound methods, without `self`, and without building an instance. A
        tool without one is refused, named with its key (`where`.tools.<i> or `where`.environment)."""
        methods = environment_methods(self.environment) if self.environment is not None else []
        keyed = [*((fn, f"{where}.tools.{i}") for i, fn in enumerate(self.tools)),
                 *((method_of(self.environment, name), f"{where}.environment") for name in methods)]
        found = []
        for fn, key in keyed:
            try:
                found.append(get_json_schema(fn))
            except Exception as error:  # noqa: BLE001 - transformers raises its own DocstringParsingException
                raise ValueError(f"{key}: tool {fn.__name__!r} has no JSON schema from its signature and docstring "
                                 f"({error}); give every argument a type hint and a Google-style docstring with an "
                                 "Args: section, as transformers' chat templates need") from None
        return found

    def is_environment_tool(self, name: str) -> bool:
        return self.environment is not None and name in environment_methods(self.environment)

    def function(self, name: str) -> Callable | None:
        return next((fn for fn in self.tools if fn.__name__ == name), None)
