"""Held-out accuracy: greedy (and optionally sampled) completions on a task's fixed evaluation set."""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from gspo_lab.prompts import Renderer
from gspo_lab.rollout.generation import generate
from gspo_lab.tasks.base import Example, Task


def accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    examples: list[Example],
    max_new_tokens: int,
    batch_size: int = 256,
    temperature: float | None = None,
    render: Renderer | None = None,
    stop_token_ids: Sequence[int] = (),
) -> float:
    """Fraction of `examples` the task's checker accepts; greedy unless a sampling temperature is given. Prompts
    are formatted by `render` (gspo_lab.prompts; default: the prompt text as it is)."""
    if not examples:
        raise ValueError(f"{type(task).__name__}: no evaluation examples to score")
    correct = 0
    for start in range(0, len(examples), batch_size):
        chunk = examples[start : start + batch_size]
        completions = generate(
            model,
            tokenizer,
            render.texts(chunk) if render is not None else [e.prompt for e in chunk],
            max_new_tokens,
            temperature=temperature or 1.0,
            greedy=temperature is None,
            stop_token_ids=stop_token_ids,
            add_special_tokens=render is None or render.add_special_tokens,
        )
        correct += sum(task.is_correct(e, text) for e, text in zip(chunk, completions.texts))
    return correct / len(examples)
