"""The cold-start SFT stage: imitate task demonstrations until held-out accuracy reaches a target.

The paper starts RL from a supervised model; at toy scale this stage leaves the policy partly competent
(between about 20% and 60% held-out accuracy) so that RL has room to improve it. Loss is on completion
tokens and EOS only. Evaluation runs every `eval_every` steps; training stops at the first evaluation at
or above `target_accuracy`, or after `steps`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import lightning as L
import torch
from torch.utils.data import DataLoader, IterableDataset
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from gspo_lab.config import RolloutConfig
from gspo_lab.grading import GradingPool
from gspo_lab.prompts import PromptFormat, Renderer
from gspo_lab.rollout.backend import Sampling
from gspo_lab.rollout.engine import RolloutEngine
from gspo_lab.rollout.generation import generate
from gspo_lab.rollout.multi_turn import MultiTurn
from gspo_lab.tasks.checks import Checker, grade
from gspo_lab.seeding import SFT_DEMONSTRATIONS, stream_seed
from gspo_lab.tasks.base import Example, Task
from gspo_lab.tools import ToolRunner
from gspo_lab.tools.template import demonstration_ids

log = logging.getLogger(__name__)


@dataclass
class SFTConfig:
    """Settings of the cold start; every field enters the cache key.

    Args:
        enabled: true, false, or "auto" (the default): on for models built from config, off for a pretrained
            checkpoint (model=hf), which starts RL as it is unless the user asks for the cold start.
        steps: the most optimizer steps.
        batch_size: demonstrations per step.
        lr: AdamW learning rate after warm-up; warmup_steps: linear warm-up length.
        eval_every: steps between held-out evaluations; eval_size: held-out prompts each time.
        target_accuracy: stop at the first evaluation at or above this.
        max_new_tokens: greedy completion budget of the evaluation.
        seed: the cold start's seed (model initialisation and demonstrations); the config sets it to the run's
            `seed`, and a fixed value lets RL runs of several seeds start from one cold start.
    """

    enabled: bool | str = "auto"
    steps: int = 1000
    batch_size: int = 128
    lr: float = 1e-3
    warmup_steps: int = 20
    weight_decay: float = 0.0
    eval_every: int = 25
    eval_size: int = 200
    target_accuracy: float = 0.2
    max_new_tokens: int = 8
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.enabled, bool) or self.enabled == "auto"):
            raise ValueError(f"sft.enabled={self.enabled!r} is invalid: must be true, false or auto")
        for key in ("steps", "batch_size", "eval_every", "eval_size", "max_new_tokens"):
            if not getattr(self, key) >= 1:
                raise ValueError(f"sft.{key}={getattr(self, key)!r} must be >= 1")
        if not self.lr > 0:
            raise ValueError(f"sft.lr={self.lr!r} must be > 0")
        if not self.warmup_steps >= 0:
            raise ValueError(f"sft.warmup_steps={self.warmup_steps!r} must be >= 0")
        if not self.weight_decay >= 0:
            raise ValueError(f"sft.weight_decay={self.weight_decay!r} must be >= 0 (AdamW's decoupled decay)")
        if not 0 < self.target_accuracy <= 1:
            raise ValueError(f"sft.target_accuracy={self.target_accuracy!r} must satisfy 0 < target <= 1")

    def runs_on(self, model_source) -> bool:
        """Whether the cold start runs before RL: as set, or under "auto" only for a model built from config
        (a source whose `pretrained` is false)."""
        return not model_source.pretrained if self.enabled == "auto" else self.enabled


class Demonstrations(IterableDataset):
    """An endless stream of right-padded batches: prompt + demonstration + EOS, labels on the completion."""

    def __init__(self, task: Task, tokenizer, batch_size: int, seed: int, render: Renderer | None = None) -> None:
        self.task, self.tokenizer, self.batch_size, self.seed = task, tokenizer, batch_size, seed
        self.render = render  # the prompt format (gspo_lab.prompts); None: the prompt text as it is
        self.tools = task.toolset.schemas() if task.toolset is not None else None  # what the chat template lists
        self.chat_template_kwargs = render.format.chat_template_kwargs if render is not None else {}

    def __iter__(self):
        step = 0
        while True:
            yield self.batch(self.examples(step))
            step += 1

    def examples(self, step: int):
        """The demonstrations of SFT step `step`, from the cold start's own seed stream."""
        return self.task.examples("train", self.batch_size, seed=stream_seed(self.seed, SFT_DEMONSTRATIONS, step))

    def batch(self, examples) -> dict[str, torch.Tensor]:
        tok = self.tokenizer
        rows, labels = [], []
        for example in examples:
            if self.render is None:
                prompt = tok(example.prompt)["input_ids"]
            else:
                text = self.render.text(example, tools=self.tools)
                prompt = tok(text, add_special_tokens=self.render.add_special_tokens)["input_ids"]
            demonstration = self.task.demonstration(example)
            if isinstance(demonstration, str):
                completion = tok(demonstration, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
                mine = [1] * len(completion)
            else:  # multi-turn: the model's turns, and the tools' results (context, out of the loss)
                completion, mine = demonstration_ids(tok, demonstration, self.chat_template_kwargs)
            rows.append(prompt + completion)
            # loss on the model's completion tokens (and EOS) only
            labels.append([-100] * len(prompt) + [t if m else -100 for t, m in zip(completion, mine)])
        width = max(len(r) for r in rows)
        pad = [width - len(r) for r in rows]
        return {
            "input_ids": torch.tensor([r + [tok.pad_token_id] * p for r, p in zip(rows, pad)]),
            "attention_mask": torch.tensor([[1] * len(r) + [0] * p for r, p in zip(rows, pad)]),
            "labels": torch.tensor([lab + [-100] * p for lab, p in zip(labels, pad)]),
        }


def accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    checker: Checker,
    examples: list[Example],
    max_new_tokens: int,
    batch_size: int = 256,
    temperature: float | None = None,
    render: Renderer | None = None,
    stop_token_ids: Sequence[int] = (),
    grader: GradingPool | None = None,
    agent: MultiTurn | None = None,
) -> float:
    """Fraction of `examples` a task's `checker` accepts; greedy unless a sampling temperature is given. Prompts
    are formatted by `render` (gspo_lab.prompts; default: the prompt text as it is); the checker runs in `grader`'s
    killable workers when given (a check that times out counts as wrong), else in this process. Pass the same
    checker to every evaluation: a grading pool sends each checker, and so the task's data, to each worker once.
    A task with tools runs `agent`'s multi-turn loop (gspo_lab.rollout.multi_turn) on `model`."""
    if not examples:
        raise ValueError(f"{type(checker.task).__name__}: no evaluation examples to score")
    correct = 0
    for start in range(0, len(examples), batch_size):
        chunk = examples[start : start + batch_size]
        if agent is not None:
            rendered = render or PromptFormat().bind(tokenizer)
            sampling = Sampling(max_new_tokens, temperature or 1.0, greedy=temperature is None,
                                stop_token_ids=tuple(stop_token_ids), add_special_tokens=rendered.add_special_tokens,
                                share_prompts=False, logprobs=False)
            completions = agent.generate(RolloutEngine(model, RolloutConfig()), tokenizer, rendered, chunk, sampling,
                                         None).completions
        else:
            completions = generate(model, tokenizer,
                                   render.texts(chunk) if render is not None else [e.prompt for e in chunk],
                                   max_new_tokens, temperature=temperature or 1.0, greedy=temperature is None,
                                   stop_token_ids=stop_token_ids,
                                   add_special_tokens=render is None or render.add_special_tokens)
        correct += sum(grade(checker, chunk, completions.texts, False, grader).correct)
    return correct / len(examples)


GRADING_TIMEOUT_S = 10.0  # one held-out check in the worker, as eval.grading_timeout_s's default


class SFTModule(L.LightningModule):
    """Next-token cross-entropy on demonstrations, with held-out greedy accuracy and early stopping."""

    def __init__(self, model, tokenizer, task: Task, config: SFTConfig, seed: int,
                 render: Renderer | None = None, rollout: RolloutConfig | None = None) -> None:
        super().__init__()
        self.model, self.tokenizer, self.task, self.config, self.seed = model, tokenizer, task, config, seed
        self.render = render
        self.eval_set = task.eval_examples()[: config.eval_size]
        self.history: list[tuple[int, float]] = []  # (step, held-out accuracy)
        # a checker that can hang (math-verify, eval of the completion) checks in a killable worker, which it
        # crosses to once for every evaluation; the caller closes the worker
        self.checker = Checker(task)
        self.grader = GradingPool(1, GRADING_TIMEOUT_S) if task.checker_may_hang else None
        # a task with tools evaluates through the multi-turn loop, its tools in a worker of their own
        self.tool_runner = ToolRunner(1, GRADING_TIMEOUT_S) if task.toolset is not None else None
        self.agent = None
        if self.tool_runner is not None:
            kwargs = render.format.chat_template_kwargs if render is not None else {}
            # the run's limits on tool calls (rollout.max_tool_calls, max_tool_response_tokens), as RL evaluates
            self.agent = MultiTurn.factory(rollout or RolloutConfig(), self.tool_runner, tokenizer, kwargs)(task)

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch, use_cache=False).loss  # no KV cache to build (and none under checkpointing)
        self.log("sft/loss", loss, prog_bar=True)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        step = self.trainer.global_step
        if step % self.config.eval_every == 0 or step >= self.config.steps:
            self.evaluate(step)

    def evaluate(self, step: int) -> float:
        acc = accuracy(self.model, self.tokenizer, self.checker, self.eval_set, self.config.max_new_tokens,
                       render=self.render, grader=self.grader, agent=self.agent)
        self.history.append((step, acc))
        self.log("sft/eval_accuracy", acc, prog_bar=True)
        log.info("sft step %d: held-out accuracy %.3f", step, acc)
        if acc >= self.config.target_accuracy:
            self.trainer.should_stop = True
        return acc

    def configure_optimizers(self):
        cfg = self.config
        optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        warmup = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: min(1.0, (step + 1) / cfg.warmup_steps) if cfg.warmup_steps else 1.0
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}

    def train_dataloader(self):
        data = Demonstrations(self.task, self.tokenizer, self.config.batch_size, self.seed, self.render)
        return DataLoader(data, batch_size=None)
