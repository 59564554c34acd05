"""What a task offers the model to call, with TRL's contract so that tools and environments written for TRL work
unchanged:

- a tool is a plain function, sync or async, whose JSON schema comes from its type hints and Google-style
  docstring (transformers' `get_json_schema`, as `apply_chat_template(tools=...)` takes it);
- an environment comes from any callable that builds one (TRL's `environment_factory`): a class, a function, a
  functools.partial (Hydra's `_partial_: true`), a lambda; `reset(**columns)` returns None or a string that extends
  the prompt, an optional `get_reward()` returns the row's reward, an optional `close()` runs at the end, and every
  other public method is a tool. A factory that is neither a class nor a partial of one is called once here, as TRL
  does, to learn its instances' class (its methods are the tools), and that instance closed.

`task.tools: [my_module.my_tool]` and `task.environment: my_module.MyEnv` (or `my_module.make_env`) name them by
import path.

>>> toolset = Toolset.of(["gspo_lab.tasks.calculator.calculate"], None)
>>> function = toolset.schemas()[0].get("function")
>>> toolset.names, function.get("parameters").get("required")
(['calculate'], ['expression'])
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import inspect
import types
from collections.abc import Callable
from dataclasses import dataclass, field

from transformers.utils import get_json_schema

from gspo_lab.tools.runner import portable

# an environment's methods that are not tools: TRL's two, and close(), which the workers call when they stop
ENVIRONMENT_HOOKS = ("reset", "get_reward", "close")


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
    """The names of an environment class's tools: its public methods but reset and get_reward (TRL's rule) and
    close (called at the end, never by the model)."""
    return [name for name, _ in inspect.getmembers(environment, predicate=inspect.isfunction)
            if not name.startswith("_") and name not in ENVIRONMENT_HOOKS]


def method_of(environment: type, name: str) -> Callable:
    """An environment's tool `name` as the model calls it: bound to a stand-in instance (no `self` in its schema),
    or as it is where it is a static method (which has no `self` to drop)."""
    if isinstance(inspect.getattr_static(environment, name), staticmethod):
        return getattr(environment, name)
    return types.MethodType(getattr(environment, name), object())


def environment_class(factory: Callable, where: str) -> type:
    """The class of the environments `factory` builds: the factory itself where it is a class, or the class a
    functools.partial binds, else the class of one instance built here (and closed); refused, naming `where`, where
    it is not callable or builds something without reset()."""
    if inspect.isclass(factory):
        found = factory
    elif isinstance(factory, functools.partial) and inspect.isclass(factory.func):  # Hydra's _partial_: no instance
        found = factory.func
    elif callable(factory):
        try:
            instance = factory()
        except Exception as error:  # noqa: BLE001 - a user's factory may raise anything
            raise ValueError(f"{where}={factory!r}: calling it to build an environment raised {error!r}") from None
        found = type(instance)
        close = getattr(instance, "close", None)
        if callable(close):
            result = close()
            if inspect.isawaitable(result):
                asyncio.run(result)
    else:
        raise ValueError(f"{where}={factory!r} must be a class or a callable that builds an environment (TRL's "
                         "environment_factory)")
    if not callable(getattr(found, "reset", None)):
        raise ValueError(f"{where}={factory!r} builds {found.__name__} objects, which have no reset() (TRL's "
                         "contract)")
    return found


@dataclass(frozen=True)
class Toolset:
    """The tool functions and the environment class one task offers. `names`: every tool the model may call (the
    functions', then the environment's methods)."""

    tools: tuple[Callable, ...] = ()
    environment: Callable | None = None  # the factory: what builds an instance in a worker
    environment_class: type | None = field(default=None, compare=False)  # the class of what it builds

    def __post_init__(self) -> None:
        if self.environment is not None and self.environment_class is None:
            object.__setattr__(self, "environment_class", environment_class(self.environment, "task.environment"))

    @property
    def environment_name(self) -> str:
        """The environment as messages and metric names call it: its class's name."""
        return getattr(self.environment_class, "__name__", repr(self.environment_class))

    @classmethod
    def of(cls, tools, environment, where: str = "task") -> Toolset | None:
        """From `task.tools` (import paths or functions) and `task.environment` (an import path or a factory); None
        when the task has neither (single-turn). Refuses what TRL's contract does not allow, naming the key."""
        if isinstance(tools, str):  # task.tools=my_module.my_tool: one tool, not a list of its characters
            tools = [tools]
        functions = tuple(imported(path, f"{where}.tools.{i}") for i, path in enumerate(tools or ()))
        for i, fn in enumerate(functions):
            if not callable(fn) or inspect.isclass(fn):
                raise ValueError(f"{where}.tools.{i}={fn!r} must be a function")
        env = None if environment is None else imported(environment, f"{where}.environment")
        toolset = cls(functions, None if env is None else portable(env),
                      None if env is None else environment_class(env, f"{where}.environment"))
        if env is None and not functions:
            return None
        names = toolset.names
        if len(set(names)) != len(names):
            raise ValueError(f"{where}.tools and {where}.environment name a tool twice: {names}")
        toolset.schemas(where)  # every tool has type hints and a docstring, or the refusal names it and its key
        return toolset

    @property
    def names(self) -> list[str]:
        methods = environment_methods(self.environment_class) if self.environment is not None else []
        return [fn.__name__ for fn in self.tools] + methods

    def schemas(self, where: str = "task") -> list[dict]:
        """Each tool's JSON schema (transformers' `get_json_schema`): what the chat template lists for the model.
        An environment's methods are read as bound methods, without `self`, and without building an instance. A
        tool without one is refused, named with its key (`where`.tools.<i> or `where`.environment)."""
        methods = environment_methods(self.environment_class) if self.environment is not None else []
        keyed = [*((fn, f"{where}.tools.{i}") for i, fn in enumerate(self.tools)),
                 *((method_of(self.environment_class, name), f"{where}.environment") for name in methods)]
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
        return self.environment is not None and name in environment_methods(self.environment_class)

    def function(self, name: str) -> Callable | None:
        return next((fn for fn in self.tools if fn.__name__ == name), None)
