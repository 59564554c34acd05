"""Held-out evaluation as papers report it: greedy accuracy, and n samples per prompt scored as mean@n, pass@k and
maj@k (gspo_lab.eval_metrics), on one or more evaluation sets, with the completions kept to read.

An evaluation set is a data source with its prompt format and, optionally, its reward functions (the `eval`
config group, `EvalSettings`); `heldout`, the run's own task's held-out split in the run's prompt format, is the
default. A completion is correct when the set's task's checker accepts it (`Task.is_correct`, the same one that
scores eval/accuracy); reward functions, when a set names them, are scored and reported beside it, per function.
A checker that can hang (`Task.checker_may_hang`: math-verify on model output, a reasoning-gym verifier that evals
the completion) runs in killable grading workers (gspo_lab.grading.pool; eval.grading_workers, eval.grading_timeout_s),
so no completion can stop an evaluation or run in its process.

Metric names mirror verl's validation (mean@n, maj@k) and lighteval's / lm-eval's pass@k, under eval/<set>/:
greedy, mean@<n>, pass@<k>, maj@<k>, length (mean completion tokens of the samples, else of greedy),
grading_failures (how many checks timed out or raised, each counted wrong), and reward/<function>/{greedy,mean@<n>}
where a set names reward functions; the time each set took is
time/eval/<set>_s, the whole evaluation's time/eval_s. Sample j of prompt i of a set draws from its own stream,
seeded by (the run's seed, the set's name, j, i: `stream_seed`), so every evaluation of a run samples each prompt
with the same seeds whatever eval.batch_size and the number of ranks, eval.n = 8 extends eval.n = 4's samples, and
the training's random state is left as it was.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from gspo_lab.config import RolloutConfig
from gspo_lab.eval_metrics import maj_at_k, pass_at_k
from gspo_lab.grading import GradingPool
from gspo_lab.prompts import Renderer
from gspo_lab.rewards import WeightedRewards
from gspo_lab.rollout.backend import RolloutBackend, Sampling
from gspo_lab.rollout.completions import reward_inputs
from gspo_lab.rollout.engine import RolloutEngine
from gspo_lab.rollout.multi_turn import MultiTurn, generate_rows
from gspo_lab.rollout.trajectory import trajectories
from gspo_lab.seeding import stream_seed
from gspo_lab.tasks.base import Example, Task
from gspo_lab.tasks.checks import Checker, grade

EVAL_SAMPLING = "eval_sampling"
HELDOUT = "heldout"
TOTALS = ("grading_failures",)  # metrics that are counts summed over ranks, not means over prompts
log = logging.getLogger(__name__)


@dataclass
class EvalSettings:
    """How each evaluation decodes (the `eval` config group; its sets are built by gspo_lab.eval_sets).

    Args:
        n: samples per prompt for mean@n, pass@k and maj@k; 0 samples none (greedy only).
        k: the k of pass@k and maj@k, each <= n.
        greedy: also decode greedily (eval/<set>/greedy; on the heldout set, eval/accuracy).
        temperature, top_p: the samples' sampling (no top-k, as in training).
        max_new_tokens: the generation budget; null: rollout.max_new_tokens.
        batch_size: completions per `generate` call (n samples of batch_size // n prompts when sampling).
        samples: prompts per set whose completions an evaluation during training keeps (samples/step_<k>.jsonl,
            a wandb Table); 0 keeps none.
        grading_workers: worker processes that check the completions of sets whose checker can hang
            (`Task.checker_may_hang`: math-verify; reasoning-gym's sympy and eval verifiers); 0 checks them in this
            process.
        grading_timeout_s: the longest one check may take in a worker; beyond it, the completion counts as wrong
            (eval/<set>/grading_failures).
        engine: what generates: "rollout", the run's backend (vLLM's engine for rollout.backend=vllm; transformers
            on the trainer's weights for hf, never a simulated engine copy), or "trainer", transformers on the
            trainer's weights whatever the backend (eval/engine_vllm and eval/engine_mantissa_bits record which).
    """

    n: int = 0
    k: list[int] = field(default_factory=lambda: [1])
    greedy: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int | None = None
    batch_size: int = 256
    samples: int = 4
    grading_workers: int = 1
    grading_timeout_s: float = 10.0
    engine: str = "rollout"

    def __post_init__(self) -> None:
        def whole(key: str, value, minimum: int) -> None:
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= minimum):
                raise ValueError(f"eval.{key}={value!r} is invalid: must be an integer >= {minimum}")

        whole("n", self.n, 0)
        whole("batch_size", self.batch_size, 1)
        whole("samples", self.samples, 0)
        whole("grading_workers", self.grading_workers, 0)
        if not (isinstance(self.grading_timeout_s, (int, float)) and self.grading_timeout_s > 0):
            raise ValueError(f"eval.grading_timeout_s={self.grading_timeout_s!r} is invalid: must be a number > 0")
        if self.max_new_tokens is not None:
            whole("max_new_tokens", self.max_new_tokens, 1)
        self.k = list(self.k or [])
        for k in self.k:
            whole("k", k, 1)
        if self.n and any(k > self.n for k in self.k):
            raise ValueError(f"eval.k={self.k} is invalid: every k must be <= eval.n={self.n} (pass@k and maj@k "
                             "choose k of the n samples)")
        if not (self.greedy or self.n):
            raise ValueError("eval.greedy=false with eval.n=0 is invalid: an evaluation would decode nothing; set "
                             "eval.n >= 1 or keep eval.greedy=true (or train.eval_every=0 for no evaluation)")
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"eval.temperature={self.temperature!r} is invalid: must be a finite number > 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"eval.top_p={self.top_p!r} is invalid: must satisfy 0 < top_p <= 1")
        if self.engine not in ("rollout", "trainer"):
            raise ValueError(f"eval.engine={self.engine!r} is invalid: must be rollout (the run's backend) or trainer")


@dataclass
class EvalSet:
    """One evaluation set: its task (examples and checker), how prompts are rendered, its reward functions
    (None: correctness only) and the grading pool its checker runs in (None: this process)."""

    name: str
    task: Task
    examples: list[Example]
    render: Renderer
    rewards: WeightedRewards | None = None
    grader: GradingPool | None = None
    agent: MultiTurn | None = None  # the multi-turn loop of a task with tools (gspo_lab.rollout.multi_turn)
    checker: Checker = field(init=False)

    def __post_init__(self) -> None:
        self.checker = Checker(self.task)


@dataclass
class Decoded:
    """The completions of one set's prompts in one mode, with what each was scored."""

    texts: list[str]
    lengths: list[int]
    correct: list[bool]
    answers: list[str | None]
    rewards: dict[str, list[float]]  # function -> reward of each completion (NaN where it did not apply)
    failures: list[bool] = field(default_factory=list)  # the completion's check timed out or raised
    trajectories: list[str | None] = field(default_factory=list)  # multi-turn: each turn, tool results marked

    def first(self, count: int) -> Decoded:
        """The first `count` completions (a rank's own, without the padding of its share)."""
        return Decoded(self.texts[:count], self.lengths[:count], self.correct[:count], self.answers[:count],
                       {name: values[:count] for name, values in self.rewards.items()}, self.failures[:count],
                       self.trajectories[:count])


class Evaluator:
    """Evaluates a model on every set: metrics (summed on this rank, reduced by `reduce_sum`, then divided) and
    the rows of the samples table.

    Args:
        sets: the evaluation sets.
        settings: how to decode (`EvalSettings`).
        max_new_tokens: the budget when settings leave it unset (rollout.max_new_tokens).
        stop_token_ids: rollout.stop_token_ids.
        seed: the run's seed; with the set's name, the prompt and the sample's index, it seeds each sample.
    """

    def __init__(self, sets: list[EvalSet], settings: EvalSettings, max_new_tokens: int,
                 stop_token_ids: Sequence[int], seed: int) -> None:
        self.sets, self.settings, self.seed = sets, settings, seed
        self.max_new_tokens = settings.max_new_tokens or max_new_tokens
        self.stop_token_ids = list(stop_token_ids)

    def run(self, model, tokenizer, rank: int = 0, world: int = 1,
            reduce_sum: Callable[[torch.Tensor], torch.Tensor] = lambda t: t, keep: int | None = None,
            progress: Callable[[int], None] | None = None,
            backend: RolloutBackend | None = None) -> tuple[dict[str, float], list[dict[str, Any]]]:
        """Metrics of every set (and eval/accuracy, the heldout set's greedy accuracy) and the sample rows of the
        first `keep` prompts of each (all: None) on this rank.
        Every rank scores the prompts rank, rank + world, ...; with several ranks each share is padded (with a
        repeat of a prompt, left out of every count and row) to the largest share, so every rank makes the same
        generate calls, as a sharded model's collectives need, and reduces the same keys. `progress(n)` is told
        of each n completions. `backend` generates (gspo_lab.rollout.backend; eval_sets.evaluation_backend picks
        it); default: transformers' `generate` on `model` (the hf backend on the model itself)."""
        backend = backend or RolloutEngine(model, RolloutConfig())
        metrics: dict[str, float] = {}
        rows: list[dict[str, Any]] = []
        started = time.perf_counter()
        for eval_set in self.sets:
            began = time.perf_counter()
            indices = list(range(rank, len(eval_set.examples), world))
            examples = [eval_set.examples[i] for i in indices]
            share = -(-len(eval_set.examples) // world)  # the largest rank's share
            padded = examples + [eval_set.examples[0]] * (share - len(examples)) if world > 1 else examples
            numbers = indices + [0] * (len(padded) - len(examples))  # each padded prompt's index in the set
            n = self.settings.n
            greedy = self._decode(backend, tokenizer, eval_set, padded, numbers, 1, True, progress) \
                if self.settings.greedy else None
            sampled = self._decode(backend, tokenizer, eval_set, padded, numbers, n, False, progress) if n else None
            greedy = greedy.first(len(examples)) if greedy is not None else None
            sampled = sampled.first(len(examples) * n) if sampled is not None else None
            sums = self._sums(eval_set, greedy, sampled, len(examples))
            keys = sorted(sums)
            totals = reduce_sum(torch.tensor([sums[key] for key in keys], dtype=torch.float64))
            values = dict(zip(keys, totals.tolist()))
            for key in keys:
                if key in TOTALS:
                    metrics[f"eval/{eval_set.name}/{key}"] = values[key]
                elif not key.endswith("#"):
                    count = values[f"{key}#"] if f"{key}#" in values else values["prompts#"]
                    metrics[f"eval/{eval_set.name}/{key}"] = values[key] / count if count else math.nan
            metrics[f"time/eval/{eval_set.name}_s"] = time.perf_counter() - began
            kept = [j for j, i in enumerate(indices) if keep is None or i < keep]
            rows += self._rows(eval_set, indices, examples, kept, greedy, sampled)
        if f"eval/{HELDOUT}/greedy" in metrics:  # the column every run has logged since the start
            metrics["eval/accuracy"] = metrics[f"eval/{HELDOUT}/greedy"]
        metrics["time/eval_s"] = time.perf_counter() - started
        return metrics, rows

    def _decode(self, backend: RolloutBackend, tokenizer, eval_set: EvalSet, examples: list[Example],
                numbers: list[int], n: int,
                greedy: bool, progress) -> Decoded:
        """n completions of each example (one when `greedy`), batch_size completions per `generate` call; sample j
        of the set's prompt i (`numbers`: each example's i) is seeded from (seed, set, j, i)."""
        per_batch = max(1, self.settings.batch_size // n)
        decoded = Decoded([], [], [], [], {})
        for start in range(0, len(examples), per_batch):
            chunk = [e for e in examples[start : start + per_batch] for _ in range(n)]
            seeds = None if greedy else torch.tensor(
                [stream_seed(self.seed, f"{EVAL_SAMPLING}/{eval_set.name}/{j}", i)
                 for i in numbers[start : start + per_batch] for j in range(n)], dtype=torch.int64)
            sampling = Sampling(self.max_new_tokens, self.settings.temperature, self.settings.top_p, greedy=greedy,
                                stop_token_ids=tuple(self.stop_token_ids), share_prompts=n > 1, logprobs=False,
                                add_special_tokens=eval_set.render.add_special_tokens)
            generated = generate_rows(backend, tokenizer, eval_set.render, chunk, sampling, seeds,
                                      agent=eval_set.agent)
            out = generated.completions
            decoded.texts += out.texts
            decoded.lengths += out.policy_mask.sum(-1).tolist()  # the model's tokens
            decoded.trajectories += trajectories(tokenizer, out)
            # answers are extracted only for maj@k, which sampling with some k reports
            graded = grade(eval_set.checker, chunk, out.texts, not greedy and bool(self.settings.k), eval_set.grader)
            decoded.correct, decoded.answers = decoded.correct + graded.correct, decoded.answers + graded.answers
            decoded.failures += graded.failed
            if any(graded.failed):
                log.warning("eval set %s: %d of %d checks failed and count as wrong (eval/%s/grading_failures); the "
                            "first: %s", eval_set.name, sum(graded.failed), len(chunk), eval_set.name, graded.detail)
            if eval_set.rewards is not None:
                environments = eval_set.agent.environments if eval_set.agent is not None else None
                scores = eval_set.rewards.score(*reward_inputs(chunk, out, generated.extra, environments),
                                                where=lambda i: f"eval set {eval_set.name}, completion {i}")
                for name, values in scores.per_function.items():
                    decoded.rewards.setdefault(name, []).extend(values.tolist())
            if progress is not None:
                progress(len(chunk))
        return decoded

    def _sums(self, eval_set: EvalSet, greedy: Decoded | None, sampled: Decoded | None, prompts: int
              ) -> dict[str, float]:
        """Per-prompt metrics summed over this rank's prompts; a key ending in '#' counts the entries of the key
        before it (where not every prompt contributes), 'prompts#' the prompts."""
        sums: dict[str, float] = {"prompts#": float(prompts), "grading_failures": 0.0}
        for decoded in (greedy, sampled):
            sums["grading_failures"] += float(sum(decoded.failures)) if decoded is not None else 0.0
        rewarded = eval_set.rewards is not None
        if greedy is not None:
            sums["greedy"] = float(sum(greedy.correct))
            sums["length"] = float(sum(greedy.lengths))
        if sampled is not None:
            n = self.settings.n
            sums[f"mean@{n}"] = 0.0
            for k in self.settings.k:
                sums[f"pass@{k}"] = sums[f"maj@{k}"] = 0.0
            for p in range(prompts):
                correct, answers = sampled.correct[p * n : (p + 1) * n], sampled.answers[p * n : (p + 1) * n]
                sums[f"mean@{n}"] += sum(correct) / n
                for k in self.settings.k:
                    sums[f"pass@{k}"] += pass_at_k(n, sum(correct), k)
                    # maj@k: the majority answer among the first k samples, correct if a sample giving it is
                    sums[f"maj@{k}"] += maj_at_k(answers, {a for a, c in zip(answers[:k], correct) if c}, k)
            sums["length"] = float(sum(sampled.lengths)) / n
        for decoded, suffix in ((greedy, "greedy"), (sampled, f"mean@{self.settings.n}")):
            if decoded is None or not rewarded:
                continue
            for name in (f.name for f in eval_set.rewards.functions):  # every key on every rank, prompts or none
                applied = [v for v in decoded.rewards.get(name, []) if not math.isnan(v)]
                sums[f"reward/{name}/{suffix}"] = float(sum(applied))
                sums[f"reward/{name}/{suffix}#"] = float(len(applied))
        return sums

    def _rows(self, eval_set: EvalSet, indices: list[int], examples: list[Example], kept: list[int],
              greedy: Decoded | None, sampled: Decoded | None) -> list[dict[str, Any]]:
        """One row per kept completion: set, prompt index, prompt, reference answer, mode, sample number,
        completion, extracted answer, correct, rewards."""
        rows = []
        for mode, decoded, n in (("greedy", greedy, 1), ("sample", sampled, self.settings.n)):
            if decoded is None:
                continue
            for j in kept:
                for s in range(n):
                    c = j * n + s
                    rows.append({
                        "set": eval_set.name, "index": indices[j], "prompt": examples[j].prompt,
                        "reference": examples[j].answer, "mode": mode, "sample": s,
                        "completion": decoded.texts[c], "tokens": decoded.lengths[c], "answer": decoded.answers[c],
                        "correct": decoded.correct[c],
                        "rewards": {name: values[c] for name, values in decoded.rewards.items()},
                        **({"trajectory": decoded.trajectories[c]} if decoded.trajectories[c] is not None else {}),
                    })
        return rows


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    """Sample rows as JSON lines (samples/step_<k>.jsonl of a run, gspo-eval's samples.jsonl)."""
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


