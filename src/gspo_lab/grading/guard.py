"""While a task's checker grades model output in a grading worker, the worker refuses what a checker never needs:
writing, moving or deleting files, starting processes, opening connections. reasoning-gym's string_insertion,
spiral_matrix, binary_matrix and n_queens `eval()` the completion, and a policy under RL writes what its reward
pays for; a checker that tried any of these is a counted grading failure (`GuardRefusal`), even where the checker
itself swallowed the refusal (reasoning-gym scores an expression that raised 0).

The refusal is an audit hook (PEP 578), installed in the grading workers only (`install`, by
gspo_lab.grading.pool's `serve`) and active inside `guarded()` only, so a user's reward function that logs to a
file, run in the same pool, is not touched. Audit hooks are not a sandbox (Python's documentation says so): code
that means harm can get around them, and the worker runs with the user's rights. The timeout and the separate
process remain the protection against a checker that hangs or crashes.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

# audit events of side effects (https://docs.python.org/3/library/audit_events.html); "open" only when it writes
REFUSED = ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.symlink", "os.link", "os.truncate", "os.chmod",
           "os.chown", "os.utime", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
           "os.kill", "os.killpg", "os.putenv", "os.unsetenv", "subprocess.Popen", "shutil.rmtree", "shutil.move",
           "shutil.copyfile", "socket.connect", "socket.bind", "socket.sendto", "ctypes.dlopen", "pty.spawn")
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
_state = threading.local()


class GuardRefusal(RuntimeError):
    """A checker grading model output tried a side effect; the message names the first."""


def writes(mode, flags) -> bool:
    """Whether an "open" audit event opens for writing (`mode` a string from `open`, or None from `os.open`).

    >>> writes("r", 0), writes("ab", 0), writes(None, os.O_WRONLY | os.O_CREAT)
    (False, True, True)
    """
    if isinstance(mode, str):
        return any(c in mode for c in "wax+")
    return bool((flags or 0) & WRITE_FLAGS)


def _refuse(event: str, args: tuple) -> None:
    if not getattr(_state, "active", False):
        return
    if event == "open" and writes(*args[1:3]) or event in REFUSED:
        target = f" {args[0]!r}" if args and isinstance(args[0], (str, bytes, os.PathLike)) else ""
        _state.refused = _state.refused or f"{event}{target}"
        raise GuardRefusal(refusal(_state.refused))


def install() -> None:
    """Install the audit hook in this process (a grading worker); it acts inside `guarded()` only."""
    sys.addaudithook(_refuse)


@contextmanager
def guarded() -> Iterator[None]:
    """Around a checker's call on model output: in a grading worker, a side effect is refused, and a call that
    tried one raises GuardRefusal when it returns (whatever the checker did with the refusal). Elsewhere, nothing."""
    _state.active, _state.refused = True, None
    try:
        yield
    finally:
        _state.active = False
    if _state.refused:
        raise GuardRefusal(refusal(_state.refused))


def refusal(what: str) -> str:
    return f"the checker tried {what} while grading model output, and was refused (gspo_lab.grading.guard)"
