"""Calls run in worker processes that can be killed: a timeout holds even for a verifier that never returns.

math-verify's own timeout is `signal.alarm` (main thread only), and it cannot interrupt sympy stuck in C code
(Math-Verify issue #65); a thread cannot be stopped at all. So each call runs in one of `num_workers` worker
processes (fresh Python interpreters on a socket); a call still running `timeout_s` after it started is a
timeout, and its worker is killed and replaced (as verl grades in a spawn ProcessPoolExecutor with
`result(timeout=...)`, but per call: a pool's future cannot be cancelled once it runs). A worker that dies (a
segfault in C code) makes its call an error. Reward functions (gspo_lab.rewards) and evaluation's checkers
(gspo_lab.evaluation) both grade here.

Functions and their arguments cross to the workers by plain pickle (tensors included: their bytes, not shared
memory): a function must be importable by its module path (a function defined in a script run as `__main__` is
not; put it in a module). Each function crosses once per worker, however many calls name it (a task's checker
carries the task's data), and the pool holds on to it while it lives. What cannot be pickled, either way, is an
"error" outcome of its call.

>>> pool = GradingPool(num_workers=1, timeout_s=10.0)
>>> [outcome.value for outcome in pool([(len, ("abc",), {}), (abs, (-2,), {})])]
[3, 2]
>>> pool.close()
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import weakref
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Callable

from gspo_lab.grading import guard

log = logging.getLogger(__name__)
STARTUP_TIMEOUT_S = 300  # a worker's imports before its first call
STDERR_TAIL = 2000  # characters of a dead worker's stderr its error quotes
TRACEBACK_TAIL = 4000  # characters of a raised call's traceback its outcome keeps
LIVENESS_S = 0.5  # how often a wait looks whether the worker process still lives


@dataclass(frozen=True)
class Outcome:
    """One call's result: `value` (what the function returned), or why there is none ("error" or "timeout")."""

    value: Any = None
    failure: str | None = None  # None, "error" or "timeout"
    detail: str = ""  # the exception's repr
    traceback: str = ""  # where it was raised (the end of it: TRACEBACK_TAIL characters)


def call_inline(fn: Callable, args: tuple, kwargs: dict) -> Outcome:
    """Run one call in this process; any exception, BaseExceptions such as math-verify's timeout included (but
    not KeyboardInterrupt or SystemExit), is an "error" outcome."""
    try:
        return Outcome(fn(*args, **kwargs))
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as error:  # noqa: BLE001 - a user's function may raise anything
        return Outcome(failure="error", detail=repr(error), traceback=traceback.format_exc()[-TRACEBACK_TAIL:])


def serve(fd: int) -> None:
    """A worker process: over the socket `fd`, say it is ready, then take each function `(key, fn)` (answered
    "loaded") and answer each call `(key, None, args, kwargs)` with `(True, Outcome)`, until it receives None or
    the parent goes away; a message it cannot unpickle is answered `(False, Outcome)`."""
    connection, functions = Connection(fd), {}
    guard.install()  # a task's checker on model output may not write files or start processes here
    connection.send_bytes(pickle.dumps("ready"))
    while True:
        try:
            message = connection.recv_bytes()
        except (EOFError, OSError):  # the parent is gone
            return
        try:
            call = pickle.loads(message)
        except Exception as error:  # noqa: BLE001 - e.g. a function not importable here
            connection.send_bytes(pickle.dumps((False, Outcome(failure="error", detail=f"could not be loaded in "
                                                                                        f"the worker: {error!r}"))))
            continue
        if call is None:
            return
        if len(call) == 2:  # (key, fn): a function loaded before its first call, its imports outside any timeout
            functions[call[0]] = call[1]
            connection.send_bytes(pickle.dumps("loaded"))
            continue
        key, fn, args, kwargs = call
        functions.setdefault(key, fn)
        outcome = call_inline(functions[key], args, kwargs)
        try:
            reply = pickle.dumps((True, outcome))
        except Exception as error:  # noqa: BLE001 - a result that cannot be pickled
            reply = pickle.dumps((True, Outcome(failure="error", detail=f"its result could not be sent back from "
                                                                        f"the worker: {error!r}")))
        connection.send_bytes(reply)


class Worker:
    """A fresh Python process (not multiprocessing's spawn: under a joblib/loky launcher its start method does
    not exist in the child, and spawn re-imports the parent's __main__) that imports what the parent can: its
    sys.path is the parent's. Its stderr goes to a file, quoted when it dies."""

    def __init__(self) -> None:
        parent, child = socket.socketpair()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        code = f"from gspo_lab.grading.pool import serve; serve({child.fileno()})"
        self.stderr = tempfile.TemporaryFile()
        # a process group of its own, so a kill takes what a tool started too (a `sleep 777` outlived it)
        self.process = subprocess.Popen([sys.executable, "-c", code], pass_fds=[child.fileno()], env=env,
                                        stdin=subprocess.DEVNULL, stderr=self.stderr, start_new_session=True)
        child.close()
        self.connection = Connection(parent.detach())
        self.known: set[int] = set()  # keys of the functions this worker holds
        self.job: int | None = None  # the index of the call it runs
        self.started = 0.0
        # a call's timeout counts from its start, not from the worker's imports (torch, sympy: seconds)
        if not (self.answers_within(STARTUP_TIMEOUT_S) and self.receive() == "ready"):
            try:  # a worker that closed its socket is ending: its exit code says more than the socket
                self.process.wait(timeout=10 * LIVENESS_S)
            except subprocess.TimeoutExpired:
                pass
            why = self.death() if self.process.poll() is not None else f"not ready within {STARTUP_TIMEOUT_S} s"
            self.kill()
            raise RuntimeError(f"a grading worker process did not start: {why}")

    def answers_within(self, seconds: float) -> bool:
        """Whether the worker sends something (or its socket closes) within `seconds`; False at once when the
        process has ended, even while another process forked from this one still holds its socket open."""
        deadline = time.monotonic() + seconds
        while not self.connection.poll(min(LIVENESS_S, max(0.0, deadline - time.monotonic()))):
            if self.process.poll() is not None or time.monotonic() >= deadline:
                return False
        return True

    def receive(self) -> Any:
        """The next message, or None where the worker is gone."""
        try:
            return pickle.loads(self.connection.recv_bytes())
        except (EOFError, OSError):
            return None

    def death(self) -> str:
        """Why the worker ended: its exit code and the end of its stderr."""
        code = self.process.wait()
        self.stderr.seek(0)
        tail = self.stderr.read().decode(errors="replace")[-STDERR_TAIL:].strip()
        return f"the worker process exited with code {code}" + (f"; its stderr ends:\n{tail}" if tail else "")

    def kill(self) -> None:
        """Kill the worker and every process of its group (what its calls started and left running)."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            self.process.kill()
        self.process.wait()
        self.connection.close()
        self.stderr.close()


def _close(workers: list[Worker]) -> None:
    for worker in workers:
        try:
            worker.connection.send_bytes(pickle.dumps(None))
        except OSError:
            pass
        try:
            worker.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        worker.kill()
    workers.clear()


class GradingPool:
    """Runs calls `(fn, args, kwargs)` in `num_workers` worker processes, each call at most `timeout_s` seconds
    from its start; returns one Outcome per call, in order. Workers start on first use and live until `close()`,
    or until the pool is garbage-collected or the interpreter exits."""

    def __init__(self, num_workers: int, timeout_s: float) -> None:
        if not (isinstance(num_workers, int) and num_workers >= 1):
            raise ValueError(f"num_workers={num_workers!r} must be an integer >= 1 for a grading pool")
        if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            raise ValueError(f"timeout_s={timeout_s!r} must be a number > 0")
        self.num_workers, self.timeout_s = num_workers, timeout_s
        self.workers: list[Worker] = []
        self.functions: dict[int, Callable] = {}  # key -> function: held, so a key is never another's id
        self.replaced = 0  # workers replaced since the pool began (what they held is gone: gspo_lab.tools.runner)
        self._finalizer = weakref.finalize(self, _close, self.workers)

    def __call__(self, calls: list[tuple[Callable, tuple, dict]]) -> list[Outcome]:
        if not self.workers:
            self.workers.extend(Worker() for _ in range(self.num_workers))
        outcomes: list[Outcome | None] = [None] * len(calls)
        queue = deque(range(len(calls)))
        while queue or any(w.job is not None for w in self.workers):
            for k in range(len(self.workers)):
                while self.workers[k].job is None and queue:
                    self._send(k, queue.popleft(), calls, outcomes)
            busy = [w for w in self.workers if w.job is not None]
            if not busy:
                continue
            deadline = min(w.started for w in busy) + self.timeout_s
            left = max(0.0, deadline - time.monotonic())
            ready = wait([w.connection for w in busy], timeout=min(LIVENESS_S, left))
            for k, worker in enumerate(self.workers):
                if worker.job is not None:
                    self._collect(k, worker, worker.connection in ready, calls, outcomes)
        return outcomes  # type: ignore[return-value]

    def _send(self, k: int, job: int, calls: list, outcomes: list) -> None:
        """Send call `job` to worker k with its function where the worker lacks it; a call that cannot be pickled
        is an error outcome at once, and the worker stays free; a worker found dead is replaced."""
        worker = self.workers[k]
        fn, args, kwargs = calls[job]
        key = id(fn)
        if key not in worker.known and not self._load(k, key, fn, job, outcomes):
            return
        worker = self.workers[k]
        try:
            message = pickle.dumps((key, None, args, kwargs))
        except Exception as error:  # noqa: BLE001 - pickling raises many types
            outcomes[job] = Outcome(failure="error", detail=f"could not be sent to a grading worker: {error!r}")
            return
        try:
            worker.connection.send_bytes(message)
        except OSError:  # it died since its last call
            outcomes[job] = Outcome(failure="error", detail=worker.death())
            worker.kill()
            self._replace(k)
            return
        worker.job, worker.started = job, time.monotonic()

    def _load(self, k: int, key: int, fn: Callable, job: int, outcomes: list) -> bool:
        """Give worker k the function `fn` before its first call, and wait (up to STARTUP_TIMEOUT_S) while
        unpickling it imports its modules (math-verify, sympy, torch: seconds, more on a loaded machine), so a
        call's timeout times the call alone. False, with call `job`'s error outcome set, where it cannot be sent or
        loaded; a worker that died meanwhile is replaced."""
        worker = self.workers[k]
        try:
            message = pickle.dumps((key, fn))
        except Exception as error:  # noqa: BLE001 - pickling raises many types
            outcomes[job] = Outcome(failure="error", detail=f"could not be sent to a grading worker: {error!r}")
            return False
        self.functions[key] = fn  # held, so its id is never another function's key
        try:
            worker.connection.send_bytes(message)
            reply = worker.receive() if worker.answers_within(STARTUP_TIMEOUT_S) else None
        except OSError:
            reply = None
        if reply == "loaded":
            worker.known.add(key)
            return True
        if reply is not None:  # (False, Outcome): it could not be loaded there; the worker goes on
            outcomes[job] = reply[1]
            return False
        dead = worker.process.poll() is not None
        outcomes[job] = Outcome(failure="error", detail=worker.death() if dead else
                                f"its function was not loaded within {STARTUP_TIMEOUT_S} s")
        worker.kill()
        self._replace(k)
        return False

    def _collect(self, k: int, worker: Worker, ready: bool, calls: list, outcomes: list) -> None:
        """Take worker k's answer when `ready`, or its timeout; a worker that died or timed out is replaced."""
        if ready:
            reply = worker.receive()
            if reply is not None:
                known, outcomes[worker.job] = reply
                if known:
                    worker.known.add(id(calls[worker.job][0]))
                worker.job = None
                return
            outcomes[worker.job] = Outcome(failure="error", detail=worker.death())  # it died mid-call
        elif worker.process.poll() is not None and not worker.connection.poll(0):
            # it died, and its socket stays open in a process forked from this one meanwhile: no EOF comes
            outcomes[worker.job] = Outcome(failure="error", detail=worker.death())
        elif time.monotonic() - worker.started >= self.timeout_s:
            outcomes[worker.job] = Outcome(failure="timeout", detail=f"still running after {self.timeout_s} s")
        else:
            return
        worker.kill()
        self._replace(k)

    def _replace(self, k: int) -> None:
        """A new worker in place of worker k (dead, or killed at a timeout); counted in `replaced`."""
        self.workers[k] = Worker()
        self.replaced += 1

    def close(self) -> None:
        """Stop the workers (a later call starts new ones)."""
        _close(self.workers)

    def __getstate__(self):  # a module holding the pool is deep-copied or pickled: the workers stay here
        return {"num_workers": self.num_workers, "timeout_s": self.timeout_s}

    def __setstate__(self, state) -> None:
        self.__init__(state["num_workers"], state["timeout_s"])
