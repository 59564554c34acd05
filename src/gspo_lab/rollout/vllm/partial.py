"""rollout.partial under async_mode=overlap: a rollout that new weights interrupt. The engine process
(gspo_lab.rollout.vllm.process) drives vLLM's `LLMEngine` one step at a time and looks for the trainer's messages
between steps. When a weight version has arrived, it:

1. aborts the unfinished rows, keeping every token each has delivered and its log-prob;
2. loads the new weights (all the versions that arrived, in order);
3. continues each row from its prompt and its own tokens, for what is left of its budget, from its row seed for
   that segment (gspo_lab.rollout.multi_turn.turn_seeds, as a multi-turn row's turns take theirs).

Each token records the version that generated it. A token is trained once, at its position: the rows continue from
what they delivered. The engine core may have computed a few tokens past the last delivered one when the abort
reaches it; those are discarded, and generated again under the new weights. A row's versions never go back, and
its first token's is the version the rollout started with, so under stale_policy=wait (a rollout of step s starts
with version s − k or later) no token is more than k versions old when step s trains. Under drop, a rollout whose
first tokens grew too old is dropped whole and generated again (gspo_lab.rollout.sources.overlap), as without
partial rollouts: slime keeps such tokens and AReaL bounds them the way wait does here.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Protocol

import torch

from gspo_lab.rollout.multi_turn import turn_seeds


class Holder(Protocol):
    """The engine process's side that the interruption asks: the messages waiting, and the weights to apply."""

    version: int
    arrived: list[int]
    stopping: bool

    def drain(self) -> None: ...

    def apply(self) -> None: ...


class InterruptedRollout:
    """One request's rows, generated step by step and continued under each new version."""

    def __init__(self, llm, request) -> None:
        self.engine, self.request = llm.llm_engine, request
        rows = len(request.prompt_ids)
        self.tokens: list[list[int]] = [[] for _ in range(rows)]
        self.logprobs: list[list[float]] = [[] for _ in range(rows)]
        self.versions: list[list[int]] = [[] for _ in range(rows)]
        self.segment = 0

    def run(self, holder: Holder) -> tuple[list[list[int]], list[list[float]], list[list[int]]]:
        """Each row's tokens, their log-probs and versions; interrupted (and continued) wherever `holder` receives
        weights while rows are unfinished. Returns early, incomplete, where the holder is stopping."""
        live = self.add(list(range(len(self.tokens))), holder.version)
        while live:
            for output in self.engine.step():
                row = live.get(output.request_id)
                if row is None:
                    continue
                self.take(row, output, holder.version)
                if output.finished:
                    del live[output.request_id]
            if live and not self.engine.has_unfinished_requests():
                raise RuntimeError(f"vLLM holds none of the rows it was given ({sorted(live)}): their outputs never "
                                   "came back under the ids they were added with")
            holder.drain()
            if live and (holder.arrived or holder.stopping):
                self.engine.abort_request(list(live))
                while self.engine.has_unfinished_requests():  # let the aborts land before the weights load
                    self.engine.step()
                if holder.stopping:
                    break
                holder.apply()
                self.segment += 1
                live = self.add(sorted(live.values()), holder.version)
        return self.tokens, self.logprobs, self.versions

    def add(self, rows: list[int], version: int) -> dict[str, int]:
        """Queue `rows`, each from its prompt and its tokens so far, for the rest of its budget; request id ->
        row."""
        from vllm.sampling_params import RequestOutputKind

        from gspo_lab.rollout.vllm.calls import sampling_params

        request, live = self.request, {}
        seeds = turn_seeds(torch.tensor([request.seeds[row] for row in rows]), self.segment).tolist()
        for row, seed in zip(rows, seeds):
            left = request.sampling.max_new_tokens - len(self.tokens[row])
            if left <= 0 or (self.tokens[row] and self.tokens[row][-1] in request.stop):
                continue
            params, = sampling_params(replace(request.sampling, max_new_tokens=left), [seed], request.stop)
            params.output_kind = RequestOutputKind.DELTA  # each step's new tokens alone
            name = f"{request.request_id}-{row}-{self.segment}"
            prompt = {"prompt_token_ids": request.prompt_ids[row] + self.tokens[row]}
            self.engine.add_request(name, prompt, params)
            live[name] = row  # outputs and aborts name a request by this id (vLLM adds a suffix to its own)
        return live

    def take(self, row: int, output, version: int) -> None:
        """A step's new tokens of `row` and their log-probs, written by `version`."""
        sample = output.outputs[0]
        new = list(sample.token_ids)
        self.tokens[row] += new
        self.versions[row] += [version] * len(new)
        if sample.logprobs is not None:
            self.logprobs[row] += [step[token].logprob for step, token in zip(sample.logprobs, new)]
