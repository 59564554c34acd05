"""What a checker can run, read from its bytecode: whether it, or a function of its own package that it calls, runs
text as Python (`eval`, `exec`, `compile`, `__import__`), starts a process (subprocess, `os.system`, `os.popen`) or
enters sympy (whose `parse_expr` evals its input and whose simplification can run without end). Such a checker
grades in killable grading workers (gspo_lab.grading.pool), never in the trainer: `eval` of the completion
`9**9**9**9` never returns, and of `__import__('os').remove(...)` does what it says.

The walk follows the names each function loads (its globals and builtins; attributes of its owner's classes,
`self.x`, and of the modules and package classes it holds or imports) into every function and class of the same
top-level package, not into other libraries beyond the names above. It errs towards a worker: `x.system` counts
in a module that imports os, whatever `x` is. A name computed at run time (`getattr(obj, name)`) is not followed.
`ast.literal_eval` is not a risk: it reads literals only, and refuses `9**9**9**9` rather than computing it.

>>> def exact(answer, reference): return answer.strip() == reference
>>> def lenient(answer, reference): return exact(str(eval(answer)), reference)
>>> risky_call(exact), risky_call(lenient)
(None, 'eval in lenient')
"""

from __future__ import annotations

import builtins
import dis
import inspect
import os
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

RUNS_TEXT = (builtins.eval, builtins.exec, builtins.compile, builtins.__import__, os.system, os.popen)
RISKY_PACKAGES = ("sympy", "subprocess")
GLOBAL_LOADS = ("LOAD_GLOBAL", "LOAD_NAME")
ATTRIBUTE_LOADS = ("LOAD_ATTR", "LOAD_METHOD", "LOAD_SUPER_ATTR")  # LOAD_METHOD to 3.11, LOAD_SUPER_ATTR from 3.12


def risky_call(fn: Callable, owner: type | None = None) -> str | None:
    """What `fn` reaches that runs text as Python, starts a process or enters sympy, and in which function (e.g.
    'eval in StringInsertionDataset.score_answer'), or None. `owner`: the class whose attributes `self.x` names
    (a subclass's override wins)."""
    return _walk(fn, owner, _package(fn), set())


def _package(value: Any) -> str:
    module = value.__name__ if isinstance(value, types.ModuleType) else getattr(value, "__module__", None)
    return module.partition(".")[0] if isinstance(module, str) else ""


def _functions(value: Any) -> Iterator[types.FunctionType]:
    """The Python functions behind `value`: itself, a method's, a property's accessors, or a class's members."""
    if isinstance(value, type):
        for member in vars(value).values():
            yield from _functions(member) if not isinstance(member, type) else ()
    elif isinstance(value, property):
        yield from (f for f in (value.fget, value.fset) if f is not None)
    else:
        value = getattr(value, "__func__", value)  # a bound, static or class method's function
        value = inspect.unwrap(value) if isinstance(value, types.FunctionType) else value  # under its decorators
        if isinstance(value, types.FunctionType):
            yield value


def _walk(fn: Callable, owner: type | None, package: str, seen: set) -> str | None:
    for function in _functions(fn):
        if function.__code__ in seen:
            continue
        seen.add(function.__code__)
        scope = function.__globals__
        # what `x.name` can be read from: the owner's classes (self.name, super().name), the modules and package
        # classes the function's module holds, and the modules the function imports
        holders = [*(owner.__mro__ if owner else ()), *(v for v in scope.values() if isinstance(v, types.ModuleType)
                                                        or (isinstance(v, type) and _package(v) == package))]
        for code, instruction in _instructions(function.__code__):
            where = f" in {getattr(code, 'co_qualname', code.co_name)}"
            if instruction.opname == "IMPORT_NAME":
                if str(instruction.argval).partition(".")[0] in RISKY_PACKAGES:
                    return f"import {instruction.argval}{where}"
                holders.append(sys.modules.get(instruction.argval))
            for value in _loaded(instruction, scope, holders):
                found = _risk(value, instruction.argval)
                if found:
                    return found + where
                if _package(value) == package and not isinstance(value, types.ModuleType):
                    found = _walk(value, owner, package, seen)
                    if found:
                        return found
    return None


def _instructions(code: types.CodeType) -> Iterator[tuple[types.CodeType, dis.Instruction]]:
    """Every instruction of `code` and of the code nested in it (comprehensions, lambdas, inner functions)."""
    for instruction in dis.get_instructions(code):
        yield code, instruction
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            yield from _instructions(constant)


def _loaded(instruction: dis.Instruction, scope: dict, holders: list) -> list:
    """What the name an instruction loads can be: a global or builtin, or that attribute of any holder."""
    name = instruction.argval
    if instruction.opname in GLOBAL_LOADS:
        return [scope[name] if name in scope else getattr(builtins, name, None)]
    if instruction.opname in ATTRIBUTE_LOADS:  # builtins aside: `re.compile` is not `compile`
        return [inspect.getattr_static(holder, name, None) for holder in holders
                if holder is not None and holder is not builtins]
    return []


def _risk(value: Any, name: str) -> str | None:
    if value is None:
        return None
    if any(value is runner for runner in RUNS_TEXT):
        return name
    package = _package(getattr(value, "__func__", value))
    if package not in RISKY_PACKAGES:
        return None
    return name if name == package else f"{name} ({package})"
