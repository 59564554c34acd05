"""The rollout backend: what samples an RL step's completions and an evaluation's, declared once.

    rollout.backend=hf     transformers' `generate` on the trainer's weights (gspo_lab.rollout.engine; a simulated
                           inference engine through rollout.engine.*)
    rollout.backend=vllm   vLLM in this process (gspo_lab.rollout.vllm.engine; settings under rollout.vllm)
    rollout.backend=replay completions recorded in a file (gspo_lab.rollout.replay; rollout.options.path)

A backend is a class with the methods of `RolloutBackend`, built as `cls(model, rollout)` from the trainer's model
and the `rollout` settings; `BACKENDS` names its class, and its module is imported only when a run names it. One
sampling contract serves training and evaluation: `generate(tokenizer, prompts, Sampling(...), row_seeds)`, one
completion per prompt, returns a `Generated` (gspo_lab.rollout.completions). A backend of your own is one file, a
line in `BACKENDS` and its settings under rollout.options (docs/how-to/extend.md).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
from torch import Tensor

from gspo_lab.config import RolloutConfig
from gspo_lab.rollout.completions import Generated

# rollout.backend -> "module:class"; a module is imported when a run names its backend
BACKENDS = {
    "hf": "gspo_lab.rollout.engine:RolloutEngine",
    "vllm": "gspo_lab.rollout.vllm.engine:VLLMEngine",
    "replay": "gspo_lab.rollout.replay:ReplayBackend",
}


@dataclass(frozen=True)
class Sampling:
    """How `generate` samples: the same for an RL rollout (`of_rollout`) and an evaluation.

    max_new_tokens: the generation budget; a completion without a stop token by then is truncated.
    temperature, top_p: softmax(logits / temperature), nucleus-filtered by top_p (1: none).
    greedy: the most likely token at each step (no row seeds).
    suppress_eos: never stop at a stop token (benchmarks: every completion max_new_tokens long).
    stop_token_ids: tokens that end a completion besides the tokenizer's and the checkpoint's EOS.
    add_special_tokens: false for prompts a chat template rendered, which hold their own special tokens.
    share_prompts: prefill a prompt repeated in the call (a group) once.
    logprobs: return the engine's log-probs of the sampled tokens (an RL rollout's; evaluation needs none).
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    greedy: bool = False
    suppress_eos: bool = False
    stop_token_ids: Sequence[int] = ()
    add_special_tokens: bool = True
    share_prompts: bool = True
    logprobs: bool = True

    @classmethod
    def of_rollout(cls, rollout: RolloutConfig, add_special_tokens: bool) -> Sampling:
        """An RL rollout's sampling, from the `rollout` settings."""
        return cls(rollout.max_new_tokens, rollout.temperature, rollout.top_p, suppress_eos=rollout.suppress_eos,
                   stop_token_ids=tuple(rollout.stop_token_ids), add_special_tokens=add_special_tokens,
                   share_prompts=rollout.share_prompt_prefill)


@dataclass
class RunSettings:
    """What a backend's `check` reads at plan time, before any weights load: the run's validated settings
    (gspo_lab.config; `evaluation` is gspo_lab.evaluation.EvalSettings), the model source (`skeleton()` gives the
    architecture on the meta device), the trainer's device type ("cpu" or "cuda"), whether its strategy shards
    the weights (trainer=fsdp), and trainer.num_nodes."""

    rollout: RolloutConfig
    train: Any
    routing: Any
    evaluation: Any
    model_source: Any
    device: str
    sharded: bool
    nodes: int = 1


class RolloutBackend(Protocol):
    """What samples completions for the RL step (gspo_lab.step.collector) and for evaluation.

    name: its `rollout.backend` value.
    dtype: the dtype it computes in, as evaluation records it (eval/engine_mantissa_bits).

    What it can do, declared on the class and read by the plan (`check_capabilities`) and the step, never inferred
    from its name:
    continues_from_token_ids: `generate` takes token ids and continues from them as they are (a multi-turn rollout:
        task.tools, task.environment).
    samples_synced_weights: it samples from the weights its last `sync` took (a copy of its own: hf's engine under
        rollout.max_staleness > 0, vLLM), not from the trainer's model as it is when it generates. A stale rollout
        (rollout.max_staleness > 0) hands the lagged weights over through `sync` alone, so it needs True (else its
        rows would be the current weights' while counted k versions old).
    returns_logprobs: its log-probs are those of the engine that sampled (`rollout_logp`: mismatch/*, TIS/MIS, and
        what rollout.rescore replaces), not the trainer's recomputed.
    returns_experts: `generate` returns the experts the engine routed each prompt and completion token to (a
        routing trace), which routing.replay=r3 replays.
    serves_evaluation: evaluation generates through it under eval.engine=rollout (vLLM: its samples are the
        engine's); otherwise evaluation runs transformers on the trainer's model.
    runs_apart: it can generate in a process of its own while the trainer trains (rollout.async_mode=overlap).
    A backend that can score tokens it did not sample is also a `Scorer` (rollout.rescore).
    """

    name: ClassVar[str]
    continues_from_token_ids: ClassVar[bool]
    samples_synced_weights: ClassVar[bool]
    returns_logprobs: ClassVar[bool]
    returns_experts: ClassVar[bool]
    serves_evaluation: ClassVar[bool]
    runs_apart: ClassVar[bool]

    def __init__(self, model: torch.nn.Module, rollout: RolloutConfig) -> None: ...

    @classmethod
    def check(cls, run: RunSettings) -> None:
        """Refuse, at plan time, what this backend cannot run: a ValueError naming the key, the value and the
        rule."""

    @classmethod
    def exact_logprobs(cls, rollout: RolloutConfig) -> bool:
        """Whether its log-probs are the trainer forward's own, exactly (hf with rollout.engine at its defaults): then
        π_old is taken from them unless rollout.logprobs_from_generation says otherwise."""

    @property
    def dtype(self) -> str: ...

    def sync(self) -> None:
        """Take the trainer's current weights (before every rollout, after every update)."""

    def generate(self, tokenizer, prompts: list[str] | list[list[int]], sampling: Sampling,
                 row_seeds: Tensor | None = None, routing=None) -> Generated:
        """One completion per prompt (a text, or token ids taken as they are: a multi-turn rollout continues from
        what was generated, never re-tokenised), row n sampled from the stream seeded by `row_seeds[n]` ([N]
        int64; None: greedy, or drawn here), with the engine's log-probs of the sampled tokens; `routing` (a
        gspo_lab.routing.RoutingReplay, or None) records the experts where the backend `returns_experts`."""

    def close(self) -> None:
        """Stop what the backend runs beside the trainer (vLLM's engine); nothing for an ordinary module."""


@runtime_checkable
class Scorer(Protocol):
    """A backend that scores tokens it did not sample (rollout.rescore, gspo_lab.rollout.rescore)."""

    @classmethod
    def check_scoring(cls, rollout: RolloutConfig) -> None:
        """Refuse, at plan time, a rollout it cannot score (vLLM: a temperature other than 1)."""

    def score(self, tokenizer, completions, temperature: float) -> Tensor:
        """The log-probs [N, C] of the completion tokens (a gspo_lab.rollout.completions.Completions) under its
        current weights, 0 on padding."""


def backend_class(name: str, key: str = "rollout.backend") -> type[RolloutBackend]:
    """The class `BACKENDS` names for rollout.backend=`name`, or a class of your own package named as
    "package.module:Class"; its module imported now. ValueError for another name."""
    if name not in BACKENDS and ":" not in name:
        raise ValueError(f"{key}={name!r} is invalid: must be one of {list(BACKENDS)}, or a class of your own as "
                         "'package.module:Class'")
    module, _, cls = BACKENDS.get(name, name).partition(":")
    try:
        return getattr(importlib.import_module(module), cls)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"{key}={name!r}: cannot import {cls} from {module} ({error})") from None


def check_capabilities(backend: type, run: RunSettings, multi_turn: bool) -> None:
    """Refuse what the run asks of `backend` (a class) that it does not declare it can do; `multi_turn`: the task
    has tools or an environment. ValueError naming the key, the value and the rule."""
    rollout = run.rollout
    named = f"rollout.backend={rollout.backend}"
    wants = [
        (multi_turn, "continues_from_token_ids", "task.tools / task.environment",
         "a multi-turn rollout continues each row from its token ids after a tool result"),
        (rollout.partial, "continues_from_token_ids", "rollout.partial=true",
         "a partial rollout continues each row from its token ids under the next weight version"),
        (rollout.max_staleness > 0, "samples_synced_weights", f"rollout.max_staleness={rollout.max_staleness}",
         "a stale rollout hands the lagged weights to the backend through its sync(), so it must sample the weights "
         "of its last sync, not the trainer's model as it is when it generates (else its rows would be the current "
         "weights' while counted as stale)"),
        (rollout.async_mode == "overlap", "runs_apart", "rollout.async_mode=overlap",
         "overlap generates in a process of its own while the trainer trains"),
        (run.routing.replay == "r3", "returns_experts", "routing.replay=r3",
         "r3 replays the experts the engine chose for each token, so the backend must return them"),
        (rollout.rescore is not None, "returns_logprobs", f"rollout.rescore={rollout.rescore}",
         "rescoring replaces the generating engine's log-probs"),
    ]
    for asked, capability, setting, rule in wants:
        if asked and not getattr(backend, capability, False):
            raise ValueError(f"{setting} with {named}: {rule}, and {backend.__name__} does not declare "
                             f"{capability} = True (docs/concepts/rollout-engine.md, the table of what runs; "
                             "docs/how-to/extend.md)")
    if rollout.rescore is not None:
        registered = rollout.rescore in BACKENDS or ":" in rollout.rescore
        scorer = backend_class(rollout.rescore, "rollout.rescore") if registered else None
        if scorer is None or not issubclass(scorer, Scorer):
            raise ValueError(f"rollout.rescore={rollout.rescore!r} is invalid: must be null or a backend that scores "
                             f"tokens it did not sample (a Scorer: one of {scorers()})")
        scorer.check_scoring(rollout)


def scorers() -> list[str]:
    """The rollout.backend names whose class is a `Scorer` (each module imported, none of them imports its engine)."""
    return [name for name in BACKENDS if issubclass(backend_class(name), Scorer)]


def build_backend(model: torch.nn.Module, rollout: RolloutConfig) -> RolloutBackend:
    """The backend rollout.backend names, generating with `model`'s weights."""
    return backend_class(rollout.backend)(model, rollout)
