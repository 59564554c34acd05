"""Tools and environments inside overlap's pipeline: the multi-turn loop (gspo_lab.rollout.multi_turn) runs in the
engine process (gspo_lab.rollout.vllm.process), beside the engine, while the trainer trains.

The trainer sends the loop's parts once, in the engine's spec (`AgentSpec`, by value: cloudpickle carries a tool or
an environment factory defined in a script), and each rollout's examples. The engine process builds its own tool
workers (a `ToolRunner` of rollout.tool_workers killable processes, on the engine's cores) and runs the loop over
`Served`, its vLLM as a backend that continues from token ids. Everything the loop gives the trainer comes back in
the result: the completions with their turns and messages, the per-row counts (tool calls, failures, lost rows,
each environment's `get_reward()`), and the first error of each kind. Row seeds hold across turns as in the
trainer's own loop (`turn_seeds`, `environment_seed`), and every token of a rollout is the version that generated
it. A reward function that reads `environments` (the rows' instances, in the engine's workers) is refused under
overlap (gspo_lab.plan.check_multi_turn).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from gspo_lab.rollout.backend import Sampling
from gspo_lab.rollout.completions import Generated, from_token_lists


@dataclass
class AgentSpec:
    """What the engine process builds its multi-turn loop from."""

    toolset: object  # the task's gspo_lab.tools.Toolset
    max_tool_calls: int
    max_tool_response_tokens: int | None
    chat_template_kwargs: dict
    tool_workers: int
    tool_timeout_s: float
    tokenizer: object
    render: object  # the bound PromptFormat

    def dumps(self) -> bytes:
        import cloudpickle

        return cloudpickle.dumps(self)


class Served:
    """The engine process's vLLM as a rollout backend for the multi-turn loop: prompts as token ids, cut at `stop`
    (the trainer's stop ids, sent with each request)."""

    def __init__(self, llm, stop: list[int]) -> None:
        self.llm, self.stop = llm, stop

    def generate(self, tokenizer, prompts: list[list[int]], sampling: Sampling, row_seeds: Tensor | None = None,
                 routing=None) -> Generated:
        from gspo_lab.rollout.vllm.calls import generate_lists

        encoded = [list(ids) for ids in prompts]
        seeds = [None] * len(encoded) if sampling.greedy else row_seeds.tolist()
        _, tokens, logprobs = generate_lists(self.llm, encoded, sampling, seeds, self.stop)
        return Generated(from_token_lists(tokenizer, encoded, tokens, logprobs, self.stop))


class EngineAgent:
    """The multi-turn loop in the engine process, its tool workers started on the first rollout."""

    def __init__(self, spec: bytes) -> None:
        import cloudpickle

        self.spec: AgentSpec = cloudpickle.loads(spec)
        self.loop = None

    def generate(self, llm, request) -> tuple[Generated, dict[str, str]]:
        """The request's rollout (its examples, row n from seed n), and the first error of each kind so far."""
        from gspo_lab.rollout.multi_turn import MultiTurn
        from gspo_lab.tools import ToolRunner

        spec = self.spec
        if self.loop is None:
            self.loop = MultiTurn(spec.toolset, ToolRunner(spec.tool_workers, spec.tool_timeout_s),
                                  spec.max_tool_calls, spec.max_tool_response_tokens, spec.chat_template_kwargs)
            self.loop.check(spec.tokenizer)
        generated = self.loop.generate(Served(llm, request.stop), spec.tokenizer, spec.render, request.examples,
                                       request.sampling, torch.tensor(request.seeds, dtype=torch.int64))
        return generated, dict(self.loop.first_errors)

    def close(self) -> None:
        if self.loop is not None:
            self.loop.close()
