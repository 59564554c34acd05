"""rollout.async_mode=overlap's engine: vLLM in a process of its own, on CPU cores of its own, generating while the
trainer trains (gspo_lab.rollout.sources.overlap decides what it generates and when).

The trainer process starts it (`EngineProcess.start`) and stops it with itself (`close`). Two channels join them:

- **control**, two multiprocessing queues of small pickled messages. To the engine: a weight version to receive, a
  rollout to generate (prompt token ids, each row's seed, the sampling settings, the oldest weight version it may
  be generated with), stop. Back: each rollout's sampled token ids and log-probs, the version that generated it,
  and when its generation started and ended (time.monotonic, which both processes share on Linux).
- **weights**, a gloo process group of two made for the purpose (rank 0 the trainer, rank 1 the engine; a TCPStore
  of its own, apart from any group the trainer's strategy or vLLM holds). A version is one broadcast of every
  checkpoint tensor's bytes (gspo_lab.rollout.vllm.weights.checkpoint_weights order, MoE banks split as vLLM's
  loaders take them), which the engine loads through vLLM's in-place reload as the colocated engine does. No
  state dict is pickled. The trainer's broadcast is asynchronous: it copies the weights into a host buffer,
  issues the broadcast and trains on; the engine receives it between two rollouts, never within one.

The engine applies every version that has arrived before it starts a rollout (under rollout.partial also within one:
gspo_lab.rollout.vllm.partial), generates the earliest step's pending
rollout first, and starts one only once it holds a version at least the rollout's `min_version`
(gspo_lab.rollout.sources.overlap sets it from rollout.stale_policy). It
ignores SIGINT and SIGTERM (the trainer stops it after its checkpoint) and exits when the trainer process is
gone. On a GPU the same design would take NCCL for the weights and a device of its own; that is not built
(docs/concepts/staleness.md).
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import queue
import signal
import time
import traceback
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.distributed import ProcessGroupGloo, TCPStore

from gspo_lab.config import RolloutConfig
from gspo_lab.rollout.backend import Sampling
from gspo_lab.rollout.vllm.weights import Layout

POLL_S = 1.0  # seconds between the engine's checks that the trainer process is still there


@dataclass(frozen=True)
class EngineSpec:
    """What the engine process needs to build its engine and join the weight group."""

    folder: str  # the model's config (gspo_lab.rollout.vllm.engine.saved_config)
    dtype: str
    vllm: object  # rollout.vllm (a VLLMConfig)
    cores: tuple[int, ...]
    layout: Layout
    port: int
    parent: int  # the trainer's pid
    timeout_s: float
    agent: bytes | None = None  # a task with tools: the multi-turn loop's parts (gspo_lab.rollout.vllm.agent)


@dataclass(frozen=True)
class Request:
    """One rollout to generate: its id, the RL step it is for, the prompts' token ids, row n's seed, how to sample,
    where to cut, and the oldest weight version it may be generated with."""

    request_id: int
    step: int
    prompt_ids: list[list[int]]
    seeds: list[int]
    sampling: Sampling
    stop: list[int]
    min_version: int
    partial: bool = False  # rollout.partial: new weights interrupt it (gspo_lab.rollout.vllm.partial)
    examples: list | None = None  # a task with tools: the rows' examples, which the engine's multi-turn loop renders


@dataclass(frozen=True)
class Result:
    """A generated rollout: each row's sampled token ids and their log-probs, the weight version that started it
    (the oldest of its tokens'), when (time.monotonic) its generation started and ended, and under rollout.partial
    each token's version."""

    request_id: int
    tokens: list[list[int]]
    logprobs: list[list[float]]
    version: int
    started: float
    ended: float
    versions: list[list[int]] | None = None
    generated: object | None = None  # a task with tools: the loop's Generated (turns, messages, per-row counts)
    first_errors: dict | None = None  # and the first error of each kind its environments raised


class EngineProcess:
    """The trainer's handle on the engine process: start it, push weight versions, submit rollouts, receive them,
    stop it."""

    def __init__(self, model: torch.nn.Module, rollout: RolloutConfig, cores: set[int], agent: bytes | None = None
                 ) -> None:
        self.model, self.rollout, self.cores, self.agent = model, rollout, cores, agent
        self.process = None
        self.store, self.group = None, None  # the gloo group of two that carries the weights, and its TCPStore
        self.layout: Layout | None = None  # where each checkpoint tensor lies in a version's buffer
        self.sending: list[tuple[object, Tensor]] = []  # broadcasts in flight and the buffers they read
        self.folder = None  # the model's config, which the engine builds from

    @property
    def timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.rollout.overlap.timeout_s)

    def start(self) -> None:
        """Start the engine process on its cores and join it in the weight group; returns once vLLM is built."""
        from gspo_lab.rollout.vllm.calls import saved_config
        from gspo_lab.rollout.vllm.weights import checkpoint_weights

        self.folder = saved_config(self.model)
        dtype = self.rollout.vllm.dtype or str(next(self.model.parameters()).dtype).removeprefix("torch.")
        self.layout = Layout.of(list(checkpoint_weights(self.model)))
        store = TCPStore("127.0.0.1", 0, 2, True, self.timeout, wait_for_workers=False)
        spec = EngineSpec(self.folder.name, dtype, self.rollout.vllm, tuple(sorted(self.cores)), self.layout,
                          store.port, os.getpid(), self.rollout.overlap.timeout_s, self.agent)
        context = multiprocessing.get_context("spawn")  # a fresh interpreter: no torch threads or vLLM state shared
        self.requests, self.results = context.Queue(), context.Queue()
        self.process = context.Process(target=serve, args=(spec, self.requests, self.results),
                                       name="gspo-vllm-engine")
        self.process.start()
        self.receive()  # "ready" once vLLM is built, or the engine's error
        self.store, self.group = store, ProcessGroupGloo(store, 0, 2, self.timeout)  # the engine joins after "ready"

    def push(self, version: int) -> None:
        """Send the model's current weights as `version`: copied into a host buffer now, broadcast in the
        background; the engine takes them before its next rollout."""
        from gspo_lab.rollout.vllm.weights import checkpoint_weights

        self.sending = [(work, buffer) for work, buffer in self.sending if not work.is_completed()]
        with torch.no_grad():
            buffer = self.layout.pack(list(checkpoint_weights(self.model)))
        self.requests.put(("weights", version))
        self.sending.append((self.group.broadcast(buffer, 0), buffer))

    def submit(self, request: Request) -> None:
        self.requests.put(("generate", request))

    def receive(self) -> Result | None:
        """The next message from the engine: a `Result`, or None for "ready"; RuntimeError with the engine's
        traceback if it failed, or if it died or sent nothing for rollout.overlap.timeout_s."""
        return awaited(self.process, self.results, self.rollout.overlap.timeout_s,
                       "rollout.async_mode=overlap: the engine process", "rollout.overlap.timeout_s")

    def close(self) -> None:
        """Stop the engine process (after the rollout it is generating) and free the weight group."""
        if self.process is None:
            return
        stopped(self.process, self.requests)
        self.process, self.group, self.store, self.sending = None, None, None, []
        self.folder.cleanup()


def awaited(process, results, timeout_s: float, what: str, key: str):
    """The payload of the next message a served process puts on `results` ((kind, payload) pairs); RuntimeError
    naming `what` with its traceback where it sent ("error", traceback), or where it exited or sent nothing for
    `timeout_s` (the setting `key`)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            kind, payload = results.get(timeout=POLL_S)
            break
        except queue.Empty:
            if not process.is_alive():
                raise RuntimeError(f"{what} exited with code {process.exitcode} without a word") from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} sent nothing for {timeout_s:g} s ({key})") from None
    if kind == "error":
        raise RuntimeError(f"{what} failed:\n{payload}")
    return payload


def stopped(process, requests) -> None:
    """Ask a served process to stop (after what it is doing), and kill it if it has not within a minute. A process
    stopped by a signal (SIGSTOP, a debugger's ^Z) is continued first: else it never reads the request, and close()
    waited the whole minute for it."""
    if process.is_alive():
        try:
            os.kill(process.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        requests.put(("stop", None))
        process.join(timeout=60)
    if process.is_alive():
        process.kill()
        process.join()


def serve(spec: EngineSpec, requests, results) -> None:
    """The engine process's main: build vLLM on `spec.cores`, join the weight group, then apply weight versions and
    generate rollouts as `requests` asks, until "stop" or until the trainer process is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer stops this process after its checkpoint
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        llm = build(spec)
        results.put(("ready", None))
        timeout = datetime.timedelta(seconds=spec.timeout_s)
        group = ProcessGroupGloo(TCPStore("127.0.0.1", spec.port, 2, False, timeout), 1, 2, timeout)
        engine = Engine(spec, llm, group, requests, results)
        try:
            engine.run()
        finally:
            if engine.agent is not None:
                engine.agent.close()
    except BaseException:  # noqa: BLE001 - whatever stops the engine reaches the trainer as its traceback
        results.put(("error", traceback.format_exc()))


def build(spec: EngineSpec):
    """vLLM's engine on the spec's cores, with dummy weights until the first version."""
    os.sched_setaffinity(0, spec.cores)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, spec.cores))
    torch.set_num_threads(len(spec.cores))
    from gspo_lab.rollout.vllm.calls import engine_arguments
    from gspo_lab.rollout.vllm.setup import environment
    from gspo_lab.rollout.vllm.weights import quiet_reloads

    environment()
    from vllm import LLM

    llm = LLM(**engine_arguments(spec.folder, spec.dtype, "cpu", spec.vllm))
    quiet_reloads()
    return llm


class Engine:
    """The engine process's loop: weight versions and rollouts, in the order the rules allow."""

    def __init__(self, spec: EngineSpec, llm, group, requests, results) -> None:
        self.spec, self.llm, self.group, self.requests, self.results = spec, llm, group, requests, results
        self.version = -1  # no weights yet: the first rollout waits for version 0 at least
        self.arrived: list[int] = []  # versions announced and not yet loaded, in order
        self.buffer = torch.empty(spec.layout.nbytes, dtype=torch.uint8)  # each version's bytes, received in turn
        self.pending: list[Request] = []
        self.stopping = False
        self.agent = None  # a task with tools: the multi-turn loop (gspo_lab.rollout.vllm.agent)
        if spec.agent is not None:
            from gspo_lab.rollout.vllm.agent import EngineAgent

            self.agent = EngineAgent(spec.agent)

    def run(self) -> None:
        """Generate the pending rollout of the earliest step (a dropped step's second request goes before the later
        steps') once the version held allows it; otherwise wait for the next message."""
        while not self.stopping:
            self.drain()
            self.apply()
            first = min(self.pending, key=lambda request: (request.step, request.request_id), default=None)
            if first is not None and first.min_version <= self.version:
                self.pending.remove(first)
                self.generate(first)
            elif not self.stopping:
                self.handle(self.next_message())

    def drain(self) -> None:
        """Handle every message already here: the newest weights before the next rollout. A trainer process that
        is gone stops the engine (a partial rollout drains between engine steps and never waits for a message)."""
        if os.getppid() != self.spec.parent:
            self.stopping = True
        while True:
            try:
                self.handle(self.requests.get_nowait())
            except queue.Empty:
                return

    def next_message(self):
        """Wait for the trainer's next message; stop if the trainer process is gone."""
        while True:
            try:
                return self.requests.get(timeout=POLL_S)
            except queue.Empty:
                if os.getppid() != self.spec.parent:
                    return ("stop", None)

    def handle(self, message) -> None:
        kind, payload = message
        if kind == "stop":
            self.stopping = True
        elif kind == "weights":
            self.arrived.append(payload)
        else:
            self.pending.append(payload)

    def apply(self) -> None:
        """Load every version that has arrived, in order (each is one broadcast the trainer issued)."""
        while self.arrived:
            self.load(self.arrived.pop(0))

    def load(self, version: int) -> None:
        """Receive version `version`'s bytes and reload vLLM's weights in place from them."""
        from gspo_lab.rollout.vllm.weights import reload_in_worker

        self.group.broadcast(self.buffer, 0).wait()
        self.llm.collective_rpc(reload_in_worker, args=(iter(self.spec.layout.unpack(self.buffer)),))
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM did not reset its prefix cache after a weight sync")
        self.version = version

    def generate(self, request: Request) -> None:
        from gspo_lab.rollout.vllm.calls import generate_lists

        started, version = time.monotonic(), self.version
        if request.examples is not None:
            generated, errors = self.agent.generate(self.llm, request)
            self.results.put(("rollout", Result(request.request_id, [], [], version, started, time.monotonic(),
                                                generated=generated, first_errors=errors)))
            return
        if request.partial:
            from gspo_lab.rollout.vllm.partial import InterruptedRollout

            tokens, logprobs, versions = InterruptedRollout(self.llm, request).run(self)
        else:
            _, tokens, logprobs = generate_lists(self.llm, request.prompt_ids, request.sampling, request.seeds,
                                                 request.stop)
            versions = None
        if not self.stopping:
            self.results.put(("rollout", Result(request.request_id, tokens, logprobs, version, started,
                                                time.monotonic(), versions)))
