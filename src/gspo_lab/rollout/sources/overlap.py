"""rollout.async_mode=overlap: a vLLM engine in a process of its own (gspo_lab.rollout.vllm.process) generates the
next steps' rollouts while the trainer trains, at most rollout.max_staleness = k weight versions old.

At the start of RL step t the trainer holds weight version t. `OverlapSource.generated(t, examples)`:

1. pushes version t to the engine (a host copy, broadcast in the background);
2. keeps the engine `queue_size` rollouts ahead: it submits the rollouts of steps up to t + queue_size that are not
   yet submitted (queue_size: rollout.overlap.queue_size, by default k), each step's prompts from the prompt
   schedule and each row's seed from (seed, step), so a rollout does not depend on when it was asked for;
3. waits for step t's rollout (time/wait_s) and returns it with the version that generated it.

The engine applies every version that has arrived before it starts a rollout. rollout.stale_policy decides what
keeps a rollout within k versions:
- **wait** (the default; prime-rl's async level, AReaL's max_head_offpolicyness): the rollout of step s is never
  started with a version older than s - k; the engine waits for the trainer's weights. Nothing is dropped, and
  queue_size is at most k.
- **drop** (TRL AsyncGRPO's filter): the engine generates with whatever version it holds, up to queue_size ahead;
  a rollout more than k versions old when its step comes is dropped (off_policy/dropped counts its rows) and its
  prompts are generated again from version t, which the trainer waits for. Here a step's rows share one version
  (the engine generates a rollout whole), so drop throws away whole rollouts; in a pipeline that streams rows and
  changes weights between them, the rows in flight longest, the long ones, are the ones dropped: a bias against
  long completions (tinker-cookbook PR #822).

With one engine generating in order and the trainer pushing a version at the start of every step, the rollout of
step t under wait is min(t, k) versions old unless the engine fell behind (then it is fresher): the versions of
async_mode=lagged, reached by timing rather than by construction.

Stopping: the rollouts in flight are not checkpointed. A run stopped at SIGTERM (gspo_lab.callbacks.GracefulStop)
checkpoints after its step and closes the engine; resumed at step t, it generates steps t, t+1, ... again from the
checkpoint's weights, with the same prompts and seeds. Nothing is lost; those rows are fresher than they would have
been.
"""

from __future__ import annotations

import logging
import os
import time

import torch

from gspo_lab.config import RolloutConfig
from gspo_lab.rollout.backend import Sampling
from gspo_lab.rollout.completions import Generated, from_token_lists, stop_ids
from gspo_lab.rollout.multi_turn import MultiTurn
from gspo_lab.rollout.sources.base import StepRows
from gspo_lab.rollout.vllm.agent import AgentSpec
from gspo_lab.rollout.vllm.process import EngineProcess, Request, Result
from gspo_lab.tasks.base import Example

log = logging.getLogger(__name__)

OVERLAP_ROWS = "overlap_rows"  # the stream of each step's row seeds under overlap (gspo_lab.seeding)


def split_cores(engine_cores: list[int] | None, available: set[int] | None = None) -> tuple[set[int], set[int]]:
    """The engine process's cores and the trainer's, from rollout.overlap.engine_cores (null: the last of the cores
    this process may use, `available`); ValueError where the engine would get none or the trainer none.

    >>> split_cores(None, {0, 1})
    ({1}, {0})
    >>> split_cores([0], {0, 1, 2, 3})
    ({0}, {1, 2, 3})
    """
    available = set(os.sched_getaffinity(0)) if available is None else available
    engine = set(engine_cores) if engine_cores is not None else {max(available)}
    if not engine <= available or engine == available:
        raise ValueError(f"rollout.overlap.engine_cores={engine_cores!r} is invalid: the engine's cores {sorted(engine)} "
                         f"must be some, not all, of the cores this process may use, {sorted(available)} (the trainer "
                         "keeps the others)")
    return engine, available - engine


def overlap_share(busy: list[tuple[float, float]], waits: list[tuple[float, float]], since: float, now: float
                  ) -> float:
    """The share of [since, now] in which the engine generated (`busy` intervals) while the trainer did not wait
    (`waits`, within the window, disjoint).

    >>> overlap_share(busy=[(0.0, 4.0), (5.0, 9.0)], waits=[(8.0, 9.0)], since=2.0, now=10.0)  # (2 + 4 - 1) / 8
    0.625
    """
    overlap = 0.0
    for start, end in busy:
        overlap += max(0.0, min(end, now) - max(start, since))
        overlap -= sum(max(0.0, min(end, w1) - max(start, w0)) for w0, w1 in waits)
    return min(max(overlap / (now - since), 0.0), 1.0) if now > since else 0.0


def pin_process(cores: set[int]) -> None:
    """Every thread of this process on `cores` (sched_setaffinity sets one thread's; torch's thread pool already
    runs)."""
    for thread in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(thread), cores)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass


class OverlapSource:
    """The trainer's side of overlap: which rollouts the engine process generates, and each step's from it."""

    in_process = False  # the engine process holds stale weights and works for the RL step

    def __init__(self, model: torch.nn.Module, rollout: RolloutConfig, rows: StepRows, seed: int,
                 agent: MultiTurn | None = None) -> None:
        self.model, self.rollout, self.rows, self.seed, self.k = model, rollout, rows, seed, rollout.max_staleness
        self.queue_size = rollout.overlap.queue_size or self.k
        self.engine_cores, self.trainer_cores = split_cores(rollout.overlap.engine_cores)
        self.agent = agent  # a task with tools: the trainer's loop, whose first errors the engine's loop reports
        spec = None
        if agent is not None:  # the loop runs in the engine process (gspo_lab.rollout.vllm.agent)
            spec = AgentSpec(agent.toolset, agent.max_tool_calls, agent.max_tool_response_tokens,
                             agent.chat_template_kwargs, rollout.tool_workers, rollout.tool_timeout_s,
                             rows.tokenizer, rows.render).dumps()
        self.engine = EngineProcess(model, rollout, self.engine_cores, spec)
        self.started = False
        self.submitted: dict[int, Request] = {}  # step -> its latest request, until taken
        self.arrived: dict[int, Result] = {}  # request id -> its rollout, not yet taken
        self.busy: list[tuple[float, float]] = []  # the engine's generation intervals not yet accounted
        self.last_taken: float | None = None  # when the trainer last took a rollout (time.monotonic)
        self.waits: list[tuple[float, float]] = []  # when the trainer waited since then
        self.next_id = 0
        self.restore: tuple[set[int], int] | None = None  # the trainer's cores and threads before start

    def start(self) -> None:
        """Pin the trainer to its cores and start the engine process on the others."""
        self.restore = (set(os.sched_getaffinity(0)), torch.get_num_threads())
        pin_process(self.trainer_cores)
        torch.set_num_threads(len(self.trainer_cores))
        self.engine.start()
        self.started = True
        log.info("rollout.async_mode=overlap: engine process %d on cores %s, the trainer on %s",
                 self.engine.process.pid, sorted(self.engine_cores), sorted(self.trainer_cores))

    def close(self) -> None:
        self.engine.close()
        if self.restore is not None:
            pin_process(self.restore[0])
            torch.set_num_threads(self.restore[1])
            self.restore = None
        self.started = False

    def generated(self, step: int, examples: list[Example]) -> tuple[Generated, dict[str, float]]:
        """Step `step`'s completions of `examples` (the step's rows from `rows`, which the engine took ahead of the
        step), each token marked with the weight version that generated it, and off_policy/* and time/* metrics."""
        pushed = time.perf_counter()
        if not self.started:
            self.start()
        self.engine.push(step)
        for ahead in range(step, step + self.queue_size + 1):
            if ahead not in self.submitted:
                self.submit(ahead, self.min_version(ahead))
        metrics = {"time/engine_sync_s": time.perf_counter() - pushed}
        (request, result), dropped = self.take(step), 0
        if step - result.version > self.k:  # only under drop: regenerate from the current version
            dropped = len(request.seeds)
            self.submit(step, min_version=step)
            request, result = self.take(step)
        metrics.update(self.timing(result))
        metrics["off_policy/dropped"] = float(dropped)
        return self.completions(request, result), metrics

    def min_version(self, step: int) -> int:
        """The oldest version step `step`'s rollout may be generated with: step - k under wait, any under drop."""
        return max(step - self.k, 0) if self.rollout.stale_policy == "wait" else 0

    def submit(self, step: int, min_version: int) -> None:
        """Ask the engine for step `step`'s rollout, generated with version `min_version` or a later one."""
        examples = self.rows.examples(step)
        seeds = StepRows.stream_seeds(self.seed, OVERLAP_ROWS, step, len(examples))
        sampling = Sampling.of_rollout(self.rollout, self.rows.render.add_special_tokens)
        stop = [] if sampling.suppress_eos else stop_ids(self.rows.tokenizer, self.model, sampling.stop_token_ids)
        if self.agent is not None:  # the engine's multi-turn loop renders the prompts with the tools' schemas
            self.submitted[step] = Request(self.next_id, step, [], seeds.tolist(), sampling, stop, min_version,
                                           examples=examples)
        else:
            self.submitted[step] = Request(self.next_id, step, self.rows.token_ids(examples), seeds.tolist(),
                                           sampling, stop, min_version, self.rollout.partial)
        self.engine.submit(self.submitted[step])
        self.next_id += 1

    def take(self, step: int) -> tuple[Request, Result]:
        """Step `step`'s latest request and its rollout, waited for (the wait recorded); the rollouts of later steps
        that arrive meanwhile are kept for their steps."""
        request = self.submitted.pop(step)
        started = time.monotonic()
        while request.request_id not in self.arrived:
            result = self.engine.receive()
            self.arrived[result.request_id] = result
            self.busy.append((result.started, result.ended))
        self.waits.append((started, time.monotonic()))
        return request, self.arrived.pop(request.request_id)

    def timing(self, result: Result) -> dict[str, float]:
        """time/wait_s (the trainer waiting for this step's rollout), time/generate_s (the engine generating it) and
        off_policy/overlap_frac: the share of the time since the trainer last took a rollout in which the engine
        generated (rollouts received since) while the trainer did not wait for it: trained, scored, logged (0 at
        the first step)."""
        now = time.monotonic()
        waited = sum(end - start for start, end in self.waits)
        frac = 0.0 if self.last_taken is None else overlap_share(self.busy, self.waits, self.last_taken, now)
        self.last_taken, self.waits, self.busy = now, [], []
        return {"time/wait_s": waited, "time/generate_s": result.ended - result.started,
                "off_policy/overlap_frac": frac}

    def completions(self, request: Request, result: Result) -> Generated:
        """The result's rows as completions, each token marked with the version that generated it."""
        if result.generated is not None:  # the engine's multi-turn loop: one version per rollout
            generated = result.generated
            generated.completions.versions = torch.full_like(generated.completions.completion_ids, result.version)
            for kind, message in (result.first_errors or {}).items():
                self.agent.first_errors.setdefault(kind, message)
            return generated
        completions = from_token_lists(self.rows.tokenizer, request.prompt_ids, result.tokens, result.logprobs,
                                       request.stop)
        completions.versions = torch.full_like(completions.completion_ids, result.version)
        for row, versions in enumerate(result.versions or []):  # rollout.partial: several versions per row
            kept = int(completions.completion_mask[row].sum())  # the tokens up to the first stop token
            completions.versions[row, :kept] = torch.tensor(versions[:kept], dtype=torch.long)
        return Generated(completions)

    def state_dict(self) -> dict:
        return {}  # the rollouts in flight are generated again on resume (see the module docstring)

    def load_state_dict(self, state: dict) -> None:
        pass
