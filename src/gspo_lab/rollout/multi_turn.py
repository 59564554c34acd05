"""Multi-turn rollouts: the model writes, calls tools or acts in an environment, reads the results and goes on.

`MultiTurn.generate` runs the loop over any rollout backend (gspo_lab.rollout.backend), which continues from
token ids:
1. each row's environment is reset in a worker (TRL's `reset(**columns)`; a string it returns extends the
   prompt), the instance of the row's slot reused from the loop's earlier rollouts; every environment and tool
   call is seeded from the row's seed (`environment_seed`); the prompt is rendered with the tools' schemas;
2. the backend generates each active row's turn until its stop token, from the row's prompt and everything so
   far, with the row's seed for that turn (`turn_seeds`), so a row's samples do not depend on the batch, the
   ranks, or how many turns other rows took;
3. the turn's tool calls are parsed (gspo_lab.tools.calls) and run in the workers; each result, cut at
   `max_tool_response_tokens`, is rendered through the chat template's tool role and appended as tokens
   (gspo_lab.tools.template): earlier tokens are never re-tokenised;
4. a row ends at a turn without tool calls, after `max_tool_calls` rounds of calls (TRL's
   max_tool_calling_iterations; the last round's calls are not run), when its tool results would leave no room
   in its length budget (`max_new_tokens`, the model's and the tools' tokens together) for a turn after them:
   then, as TRL does, the results are rolled back and the row ends at its last turn, whole (`rolled_back`, not
   truncated, so rollout.mask_truncated keeps it), or when a turn of its own runs out of budget: then it is
   truncated.

The result is one `Completions` row per prompt whose completion holds every turn, with `turns` marking the
model's tokens (t >= 1 in turn t) apart from the tools' (0): the loss, the ratio, |y|, entropy, KL and the mismatch
metrics see only the model's. The engine's log-probs are 0 on tool tokens. Where the backend records experts (the
hf backend on an MoE), each row's routing trace covers its whole trajectory: it comes from the row's last turn's
call, whose prefill ran every earlier position (r3). `Generated.extra` carries
per row: `tool_calls`, `tool_failures`, `tool_calls/<name>`, `turns` (the model's turns), `lost` (a worker
that held the row's environment died: the row is not trained on) and `environment_reward` (`get_reward()`,
NaN where there is none).
"""

from __future__ import annotations

import itertools
import logging
import math
from dataclasses import replace

import torch  # noqa: F401 - the doctests
from torch import Tensor

from gspo_lab.rollout.completions import Generated
from gspo_lab.rollout.sampling import draw_row_seeds
from gspo_lab.rollout.trajectory import Trajectory, assemble
from gspo_lab.tools import ToolCall, ToolRunner, Toolset, parse_tool_calls
from gspo_lab.tools.runner import (EnvironmentLost, RemoteEnvironment, call_environment, call_tool,
                                   drop_environment, finish_environment, reset_columns, start_environment)
from gspo_lab.tools.template import check_prefix_preserving, prepare_as_trl, tool_suffix_ids

log = logging.getLogger(__name__)
TURN_SEED_STRIDE = 1_000_003  # turn t of row seed s samples from stream s + t * stride (t = 0: the row's own)
ENVIRONMENT_SEED_SALT = 0x5EED_0F_E4_71_2043  # an environment's seeds are not its row's sampling seeds
# a tool result is cut in its worker at this many characters per token it may take (max_tool_response_tokens, else
# the row's budget): more never reaches the model, and a token longer than 64 characters is rare in any vocabulary
RESULT_CHARS_PER_TOKEN = 64


def turn_seeds(row_seeds: Tensor, turn: int) -> Tensor:
    """The seeds of turn `turn` (0-based) of rows seeded `row_seeds` [N]: a function of the row's seed and the
    turn only.

    >>> turn_seeds(torch.tensor([5, 7]), 0).tolist(), turn_seeds(torch.tensor([5]), 2).tolist()
    ([5, 7], [2000011])
    """
    return (row_seeds + turn * TURN_SEED_STRIDE) % (2**63 - 1)


def environment_seed(row_seed: int, turn: int = 0, call: int = 0) -> int:
    """The seed of a row's environment and tool call `call` of its turn `turn` (reset and get_reward: turn 0 and
    the turn after the last): a function of the row's seed (the run's seed, the step and the row) alone.

    >>> environment_seed(5) == environment_seed(5), environment_seed(5) != environment_seed(6)
    (True, True)
    >>> len({environment_seed(5, 1, 0), environment_seed(5, 1, 1), environment_seed(5, 2, 0)})
    3
    """
    return (row_seed ^ ENVIRONMENT_SEED_SALT) + turn * TURN_SEED_STRIDE + call * 7919 & (2**63 - 1)


class MultiTurn:
    """The multi-turn loop for one task's `toolset`, its tools and environments run by `runner`.

    Args:
        max_tool_calls: rounds of tool calls a row may make (rollout.max_tool_calls).
        max_tool_response_tokens: a tool result is cut to this many tokens (rollout.max_tool_response_tokens;
            None: whole).
        chat_template_kwargs: what the prompt format passes to the chat template (prompt.chat_template_kwargs).
    """

    _agents = itertools.count()

    def __init__(self, toolset: Toolset, runner: ToolRunner, max_tool_calls: int,
                 max_tool_response_tokens: int | None, chat_template_kwargs: dict | None = None) -> None:
        self.toolset, self.runner = toolset, runner
        self.max_tool_calls, self.max_tool_response_tokens = max_tool_calls, max_tool_response_tokens
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.schemas = toolset.schemas()
        # row n's environment lives in slot "<class>#<agent>/n" of its worker, reused by this loop's later rollouts
        self.slots = f"{toolset.environment_name}#{next(self._agents)}" if toolset.environment is not None else ""
        self.environments: list[RemoteEnvironment] | None = None  # the last rollout's rows' (reward functions')
        self.first_errors: dict[str, str] = {}  # what failed ("reset", "get_reward", "lost") -> its first message

    def _failed(self, what: str, outcome) -> None:
        """Note an environment's failure; its first occurrence of each kind is logged with its text and traceback
        (the rest are counted: tools/lost_frac, reward/<name>/errors)."""
        if what in self.first_errors:
            return
        name = self.toolset.environment_name
        verb = {"reset": "reset() failed", "get_reward": "get_reward() failed",
                "lost": "was lost with its worker process"}[what]
        message = f"task.environment={name}: {verb} ({outcome.failure}: {outcome.detail})"
        if outcome.traceback:
            message += f"\n{outcome.traceback.rstrip()}"
        self.first_errors[what] = message
        log.warning("%s\nits row is not trained on; further ones are only counted", message)

    @classmethod
    def of(cls, task, rollout, runner: ToolRunner, chat_template_kwargs: dict | None = None) -> MultiTurn | None:
        """The loop for `task`'s tools and environment with the rollout's settings (gspo_lab.config.RolloutConfig);
        None for a single-turn task."""
        if task.toolset is None:
            return None
        return cls(task.toolset, runner, rollout.max_tool_calls or 2**31, rollout.max_tool_response_tokens,
                   chat_template_kwargs)

    @classmethod
    def factory(cls, rollout, runner: ToolRunner, tokenizer, chat_template_kwargs: dict | None = None):
        """`agent_of(task)`: the checked loop of each task with tools for `tokenizer` (None for a single-turn
        task), as the RL step and every evaluation set take it."""

        def agent_of(task) -> MultiTurn | None:
            agent = cls.of(task, rollout, runner, chat_template_kwargs)
            if agent is not None:
                agent.check(tokenizer)
            return agent

        return agent_of

    def check(self, tokenizer) -> None:
        """Refuse a tokenizer without a chat template, or with one that is not prefix-preserving."""
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("task.tools / task.environment need a tokenizer with a chat template (its tool role "
                             "renders the results); the tiny models' tokenizers get one when the task has tools")
        prepare_as_trl(tokenizer, self.chat_template_kwargs)
        check_prefix_preserving(tokenizer, self.chat_template_kwargs)

    def generate(self, backend, tokenizer, render, examples: list, sampling, row_seeds: Tensor | None,
                 batch_size: int | None = None, routing=None) -> Generated:
        """One trajectory per example (repeat examples for groups), row n from the seeds of `row_seeds[n]`,
        `batch_size` rows per `generate` call (None: all); `routing` (gspo_lab.routing.RoutingReplay) records the
        engine's experts where the backend can, stitched into one trace of every row's whole trajectory."""
        if row_seeds is None and not sampling.greedy:
            row_seeds = draw_row_seeds(len(examples))
        seeds = range(len(examples)) if row_seeds is None else row_seeds.tolist()  # greedy: the set is fixed
        rows = [Trajectory([], f"{self.slots}/{n}", seed) for n, seed in enumerate(seeds)]
        observations = self._start(rows, examples)
        prompts: dict[tuple[int, str | None], list[int]] = {}  # a group's rows share a prompt unless reset differs
        for row, example, observation in zip(rows, examples, observations):
            key = (id(example), observation)
            if key not in prompts:
                text = render.text(example, observation=observation, tools=self.schemas)
                prompts[key] = tokenizer(text, add_special_tokens=render.add_special_tokens)["input_ids"]
            row.prompt_ids = list(prompts[key])
        for turn in itertools.count(1):
            active = [n for n, row in enumerate(rows) if not row.done]
            if not active:
                break
            self._turn(backend, tokenizer, sampling, rows, active, turn, row_seeds, batch_size, routing)
            self._run_tools(tokenizer, sampling, rows, [n for n in active if not rows[n].done])
        self._finish(rows)
        if self.toolset.environment is not None:
            self.environments = [RemoteEnvironment(self.runner, n, row.key) for n, row in enumerate(rows)]
        return assemble(tokenizer, rows, self.toolset.names)

    def _start(self, rows: list[Trajectory], examples: list) -> list[str | None]:
        """Each row's environment reset (built where its slot has none) in its worker, from the row's seed; what
        reset returned (a row whose environment failed to start is lost)."""
        if self.toolset.environment is None:
            return [None] * len(rows)
        columns = [reset_columns(e) for e in examples]
        calls = [(n, start_environment, (row.key, self.toolset.environment, row_columns, environment_seed(row.seed)))
                 for n, (row, row_columns) in enumerate(zip(rows, columns))]
        outcomes, _ = self.runner.run(calls)
        observations = []
        for row, outcome in zip(rows, outcomes):
            if outcome.failure is not None:
                row.lost = row.done = True
                self._failed("reset", outcome)
            value = outcome.value
            observations.append(value if isinstance(value, str) else None)
        return observations

    def _turn(self, backend, tokenizer, sampling, rows, active, turn, row_seeds, batch_size, routing) -> None:
        """Generate one turn of each active row, keep the engine's experts where recorded, parse its calls."""
        budgets = [sampling.max_new_tokens - len(rows[n].tokens) for n in active]
        step = replace(sampling, max_new_tokens=max(budgets))
        seeds = None if row_seeds is None else turn_seeds(row_seeds[active], turn - 1)
        size = batch_size or len(active)
        for start in range(0, len(active), size):
            chunk = active[start : start + size]
            prompts = [rows[n].prompt_ids + rows[n].tokens for n in chunk]
            out = backend.generate(tokenizer, prompts, step, None if seeds is None else seeds[start : start + size],
                                   routing)
            done = out.completions
            width = done.prompt_ids.shape[1]  # the call's left-padded prompt columns
            lengths = done.completion_mask.sum(-1).tolist()
            for i, n in enumerate(chunk):
                row, budget = rows[n], budgets[start + i]
                tokens = done.completion_ids[i, : lengths[i]].tolist()[:budget]
                logprobs = None if done.logprobs is None else done.logprobs[i, : len(tokens)].tolist()
                stopped = bool(not done.truncated[i]) and len(tokens) == lengths[i]
                context = prompts[i]  # what the turn was generated from: a reply parser reads it as its prefix
                if out.routing_trace is not None:  # the row's span: its context, then the turn's tokens
                    span = slice(width - len(context), width + len(tokens))
                    row.trace = (out.routing_trace.indices[:, i, span], out.routing_trace.recorded[i, span])
                row.add(tokens, turn, logprobs)
                self._read_turn(tokenizer, row, tokens, stopped, context)

    def _read_turn(self, tokenizer, row: Trajectory, tokens: list[int], stopped: bool, context: list[int]) -> None:
        """The turn's message and calls (`tokens`, its stop token last where `stopped`, after `context`): a response
        template's parser reads the stop token (Llama 3's closes a call with <|eot_id|>), the text is without it;
        the row ends where the turn has none, ran out of budget, or used the last round of calls."""
        text = tokenizer.decode(tokens[:-1] if stopped else tokens, skip_special_tokens=True)
        calls, content = parse_tool_calls(text, tokenizer, tokens, context, self.schemas)
        row.messages.append({"role": "assistant", "content": content, "tool_calls": [c.message() for c in calls
                                                                                     if c.error is None]})
        row.pending = calls
        if not stopped:
            row.truncated = row.done = True
        elif not calls or row.rounds >= self.max_tool_calls:
            row.done = True
        else:
            row.rounds += 1

    def _run_tools(self, tokenizer, sampling, rows: list[Trajectory], waiting: list[int]) -> None:
        """Run the calls of the rows in `waiting`, append their results as tokens."""
        jobs, results = [], {n: [] for n in waiting}
        limit = RESULT_CHARS_PER_TOKEN * (self.max_tool_response_tokens or sampling.max_new_tokens)
        for n in waiting:
            for j, call in enumerate(rows[n].pending):
                rows[n].calls[call.name or "unparsed"] += 1
                job = self._job(n, rows[n], call, environment_seed(rows[n].seed, rows[n].rounds, j), limit)
                if isinstance(job, str):
                    rows[n].failures += 1
                    results[n].append((call.name, job))
                else:
                    results[n].append((call.name, len(jobs)))
                    jobs.append(job)
        outcomes, replaced = self.runner.run(jobs) if jobs else ([], set())
        for n in waiting:
            row = rows[n]
            if self.toolset.environment is not None and self.runner.worker_of(n) in replaced:
                row.lost = row.done = True
                continue
            messages = []
            for name, result in results[n]:
                if not isinstance(result, str):
                    outcome = outcomes[result]
                    if outcome.failure is not None:
                        row.failures += 1
                        if EnvironmentLost.__name__ in outcome.detail:
                            row.lost = row.done = True
                            self._failed("lost", outcome)
                    result = (outcome.value if outcome.failure is None else  # TRL's message: {"error": ...}
                              str({"error": f"{outcome.failure}: {outcome.detail}"}))
                messages.append({"role": "tool", "name": name or "unparsed", "content": self._cut(tokenizer, result)})
            if row.lost:
                continue
            suffix = tool_suffix_ids(tokenizer, messages, self.chat_template_kwargs)
            if len(row.tokens) + len(suffix) >= sampling.max_new_tokens:  # no room left for a turn after them
                row.rolled_back = row.done = True  # TRL's: the results are not appended, the row ends whole
                continue
            row.messages += messages
            row.add(suffix, 0)

    def _job(self, n: int, row: Trajectory, call: ToolCall, seed: int, limit: int):
        """The worker call for one tool call, seeded `seed`, its result cut at `limit` characters in the worker; or
        the error message the model gets instead."""
        if call.error is not None:
            return str({"error": call.error})
        if self.toolset.is_environment_tool(call.name):
            return (n, call_environment, (row.key, call.name, call.arguments, seed, limit))
        fn = self.toolset.function(call.name)
        if fn is None:
            return str({"error": f"no tool named {call.name!r}; the tools are {self.toolset.names}"})
        return (n, call_tool, (fn, call.arguments, seed, limit))

    def _cut(self, tokenizer, result: str) -> str:
        """A tool result cut at max_tool_response_tokens tokens."""
        if self.max_tool_response_tokens is None:
            return result
        ids = tokenizer(result, add_special_tokens=False)["input_ids"]
        return result if len(ids) <= self.max_tool_response_tokens else tokenizer.decode(
            ids[: self.max_tool_response_tokens])

    def _finish(self, rows: list[Trajectory]) -> None:
        """Each environment's reward (`get_reward()`); the instances stay in their slots for the next rollout."""
        if self.toolset.environment is None:
            return
        live = [n for n, row in enumerate(rows) if not row.lost]
        outcomes, _ = self.runner.run([(n, finish_environment, (rows[n].key, environment_seed(rows[n].seed,
                                                                                             rows[n].rounds + 1)))
                                       for n in live])
        for n, outcome in zip(live, outcomes):
            if outcome.failure is None:
                rows[n].reward = math.nan if outcome.value is None else outcome.value
            elif EnvironmentLost.__name__ in outcome.detail or outcome.failure == "timeout":
                rows[n].lost = True
                self._failed("lost", outcome)
            else:  # get_reward() raised: an error of the reward that reads it (environment_reward)
                rows[n].reward_failed = True
                self._failed("get_reward", outcome)

    def preflight(self, example) -> None:
        """Build and reset one environment on `example` (a training row) in a worker, before anything trains: a
        reset() that fails there is refused now, with its error (ValueError), not met as lost rows."""
        if self.toolset.environment is None:
            return
        key = f"{self.slots}/preflight"
        columns = reset_columns(example)
        (outcome,), _ = self.runner.run([(0, start_environment, (key, self.toolset.environment, columns, 0))])
        self.runner.run([(0, drop_environment, (key,))])
        if outcome.failure is not None:
            name = self.toolset.environment_name
            raise ValueError(f"task.environment={name}: reset() on the first training row failed before training "
                             f"({outcome.failure}: {outcome.detail}); the row's columns were {sorted(columns)}"
                             + (f"\n{outcome.traceback.rstrip()}" if outcome.traceback else ""))

    def close(self) -> None:
        self.runner.close()


def generate_rows(backend, tokenizer, render, examples: list, sampling, row_seeds: Tensor | None,
                  batch_size: int | None = None, routing=None, agent: MultiTurn | None = None) -> Generated:
    """One completion per example (repeat examples for groups) from `backend`, in calls of `batch_size` rows:
    single-turn, the rendered prompts, row n from `row_seeds[n]`, the experts `routing` records; multi-turn
    (`agent`), its loop."""
    if agent is not None:
        return agent.generate(backend, tokenizer, render, examples, sampling, row_seeds, batch_size, routing)
    rendered: dict[int, str] = {}  # a group's rows are one example: rendered once
    for example in examples:
        if id(example) not in rendered:
            rendered[id(example)] = render.text(example)
    texts = [rendered[id(example)] for example in examples]
    size = batch_size or len(texts)
    parts = [backend.generate(tokenizer, texts[start : start + size], sampling,
                              None if row_seeds is None else row_seeds[start : start + size], routing)
             for start in range(0, len(texts), size)]
    return parts[0] if len(parts) == 1 else Generated.cat(parts, tokenizer.pad_token_id)
