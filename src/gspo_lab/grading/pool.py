"""Reward functions graded in worker processes that can be killed: a timeout holds even for a verifier that
never returns.

math-verify's own timeout is `signal.alarm` (main thread only), and it cannot interrupt sympy stuck in C code
(Math-Verify issue #65); a thread cannot be stopped at all. So each call runs in one of `num_workers` worker
processes (fresh Python interpreters on a socket); a call still running `timeout_s` after it started is a
timeout, and its worker is killed and replaced (as verl grades in a spawn ProcessPoolExecutor with
`result(timeout=...)`, but per call: a pool's future cannot be cancelled once it runs). A worker that dies (a segfault in C code) makes its call an error.

Functions and their arguments cross to the workers by pickle: a function must be importable by its module
path (a function defined in a script run as `__main__` is not; put it in a module).

>>> pool = GradingPool(num_workers=1, timeout_s=10.0)
>>> [outcome.value for outcome in pool([(len, ("abc",), {}), (abs, (-2,), {})])]
[3, 2]
>>> pool.close()
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from collections import deque
from multiprocessing.connection import Connection, wait
from typing import Callable

from gspo_lab.rewards.base import Outcome, call_inline

log = logging.getLogger(__name__)
STARTUP_TIMEOUT_S = 300  # a worker's imports before its first call


def serve(fd: int) -> None:
    """A worker process: over the socket `fd`, say it is ready, then run each call it receives and send back its
    Outcome, until it receives None."""
    connection = Connection(fd)
    connection.send("ready")
    while True:
        call = connection.recv()
        if call is None:
            return
        connection.send(call_inline(*call))


class Worker:
    """A fresh Python process (not multiprocessing's spawn: under a joblib/loky launcher its start method does
    not exist in the child, and spawn re-imports the parent's __main__) that imports what the parent can: its
    sys.path is the parent's."""

    def __init__(self) -> None:
        parent, child = socket.socketpair()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        code = f"from gspo_lab.rewards.pool import serve; serve({child.fileno()})"
        self.process = subprocess.Popen([sys.executable, "-c", code], pass_fds=[child.fileno()], env=env,
                                        stdin=subprocess.DEVNULL)
        child.close()
        self.connection = Connection(parent.detach())
        self.job: int | None = None  # the index of the call it runs
        self.started = 0.0
        # a call's timeout counts from its start, not from the worker's imports (torch, sympy: seconds)
        if not self.connection.poll(STARTUP_TIMEOUT_S) or self.connection.recv() != "ready":
            self.kill()
            raise RuntimeError(f"a reward worker process did not start within {STARTUP_TIMEOUT_S} s")

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        self.connection.close()


class GradingPool:
    """Runs calls `(fn, args, kwargs)` in `num_workers` worker processes, each call at most `timeout_s` seconds
    from its start; returns one Outcome per call, in order. Workers start on first use and live until `close()`."""

    def __init__(self, num_workers: int, timeout_s: float) -> None:
        if not num_workers >= 1:
            raise ValueError(f"reward.num_workers={num_workers!r} must be >= 1 for a grading pool")
        if not timeout_s > 0:
            raise ValueError(f"reward.timeout_s={timeout_s!r} must be > 0")
        self.num_workers, self.timeout_s = num_workers, timeout_s
        self.workers: list[Worker] = []

    def __call__(self, calls: list[tuple[Callable, tuple, dict]]) -> list[Outcome]:
        if not self.workers:
            self.workers = [Worker() for _ in range(self.num_workers)]
        outcomes: list[Outcome | None] = [None] * len(calls)
        queue = deque(range(len(calls)))
        while queue or any(w.job is not None for w in self.workers):
            for worker in self.workers:
                if worker.job is None and queue:
                    worker.job, worker.started = queue.popleft(), time.monotonic()
                    worker.connection.send(calls[worker.job])
            busy = [w for w in self.workers if w.job is not None]
            deadline = min(w.started for w in busy) + self.timeout_s
            ready = wait([w.connection for w in busy], timeout=max(0.0, deadline - time.monotonic()))
            for k, worker in enumerate(self.workers):
                if worker.job is None:
                    continue
                if worker.connection in ready:
                    try:
                        outcomes[worker.job] = worker.connection.recv()
                        worker.job = None
                        continue
                    except (EOFError, OSError):  # the worker died mid-call
                        died = f"the worker process died (exit code {worker.process.poll()})"
                        outcomes[worker.job] = Outcome(failure="error", detail=died)
                elif time.monotonic() - worker.started >= self.timeout_s:
                    outcomes[worker.job] = Outcome(failure="timeout", detail=f"still running after {self.timeout_s} s")
                else:
                    continue
                worker.kill()
                self.workers[k] = Worker()
        return outcomes  # type: ignore[return-value]

    def close(self) -> None:
        for worker in self.workers:
            try:
                worker.connection.send(None)
            except OSError:
                pass
            try:
                worker.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                worker.kill()
        self.workers = []

    def __getstate__(self):  # a module holding the pool is deep-copied or pickled: the workers stay here
        return {"num_workers": self.num_workers, "timeout_s": self.timeout_s}

    def __setstate__(self, state) -> None:
        self.__init__(state["num_workers"], state["timeout_s"])
