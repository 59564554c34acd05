"""Reasoning-gym tasks: procedural generators with their own verifiers (`pip install reasoning-gym`).

`task=reasoning_gym task.dataset=word_sorting task.config.min_words=8` picks a dataset by name and passes its
own settings through `task.config`. One dataset object is built once with a fixed seed and a virtual size of
`DATASET_SIZE` items; reasoning-gym generates item `i` on demand from `Random(seed + i)`, so `sample(rng)`
is an index drawn from `rng` and costs one item's generation (tens of microseconds). The held-out split is the
hash split of `Task` over the prompt text. The reward is the dataset's own `score_answer`, partial credit kept:

>>> task = ReasoningGym(dataset="word_sorting", config={"min_words": 3, "max_words": 3})
>>> example = task.sample(random.Random(0))
>>> example.answer
'Congress, never, unfailing'
>>> # sorted: 1; one word of three in place: 1/3; the right words, none in place: 0.2; one word, in place: 1/3
>>> [round(task.reward(example, words), 3) for words in ("Congress, never, unfailing",
...     "Congress, unfailing, never", "unfailing, Congress, never", "Congress")]
[1.0, 0.333, 0.2, 0.333]
"""

from __future__ import annotations

import dataclasses
import importlib
import random

from gspo_lab.tasks.base import Example, Task

DATASET_SIZE = 2**40  # virtual: items are generated from their index, none is stored
DATASET_SEED = 0
RESERVED = ("seed", "size")  # the task owns these: sampling draws indices of one fixed-seed dataset


def registry() -> dict:
    """reasoning-gym's datasets by name; imported on first use (0.7 s: it registers all of them), so other
    tasks never pay for it."""
    return importlib.import_module("reasoning_gym").factory.DATASETS


def _settings(dataset: str) -> list[str]:
    return [f.name for f in dataclasses.fields(registry()[dataset][1]) if f.name not in RESERVED]


def _create(dataset: str, config: dict):
    """The dataset, or the error reasoning-gym raised building it (a bad setting: TypeError, AssertionError
    or ValueError, depending on the dataset)."""
    try:
        create = importlib.import_module("reasoning_gym").create_dataset
        return create(dataset, seed=DATASET_SEED, size=DATASET_SIZE, **config), None
    except (TypeError, AssertionError, ValueError) as error:
        return None, error


def build_dataset(dataset: str, config: dict):
    """The reasoning-gym dataset, or ValueError naming the key, the value and the valid choices or rule."""
    if dataset not in registry():
        choices = sorted(registry())
        raise ValueError(f"task.dataset={dataset!r} is not a reasoning-gym dataset; choose one of {choices}")
    for key, value in config.items():
        if key not in _settings(dataset):
            raise ValueError(f"task.config.{key}={value!r} is not a setting of reasoning-gym's {dataset}; its settings "
                             f"are {_settings(dataset)}" + (" (the task owns seed and size)" if key in RESERVED else ""))
    built, error = _create(dataset, config)
    if built is not None:
        return built
    for key, value in config.items():  # name the setting that fails alone, if one does
        if _create(dataset, {key: value})[1] is not None:
            raise ValueError(f"task.config.{key}={value!r} is rejected by reasoning-gym's {dataset}: {error}")
    given = ", ".join(f"task.config.{k}={v!r}" for k, v in config.items())
    raise ValueError(f"{given}: rejected together by reasoning-gym's {dataset}: {error}")


class ReasoningGym(Task):
    """One reasoning-gym dataset as a task; the reward is its `score_answer` of the stripped completion.

    Args:
        dataset: a reasoning-gym dataset name (`registry()`).
        config: the dataset's own settings (its config dataclass's fields, seed and size excepted).
        Other arguments: see `Task`. With `format_weight` > 0 a non-empty completion scores at least that.
    """

    name = "reasoning_gym"

    def __init__(self, dataset: str = "word_sorting", config: dict | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.dataset_name, self.config = dataset, dict(config or {})
        self.dataset = build_dataset(dataset, self.config)

    def sample(self, rng: random.Random) -> Example:
        entry = self.dataset[rng.randrange(DATASET_SIZE)]
        return Example(prompt=entry["question"], answer=entry["answer"], meta={"entry": entry})

    def demonstration(self, example: Example) -> str:
        return example.answer

    def score(self, example: Example, completion: str) -> float:
        """The dataset's verifier; a verifier that raises on model output scores 0."""
        try:
            return float(self.dataset.score_answer(completion.strip(), example.meta["entry"]))
        except Exception:  # noqa: BLE001 - model output must never crash a run
            return 0.0

    def is_correct(self, example: Example, completion: str) -> bool:
        return self.score(example, completion) >= 1.0

    def is_well_formed(self, example: Example, completion: str) -> bool:
        return bool(completion.strip())

    def reward(self, example: Example, completion: str) -> float:
        """`score_answer`'s float (partial credit kept), raised to `format_weight` for a non-empty completion."""
        floor = self.format_weight if self.format_weight and self.is_well_formed(example, completion) else 0.0
        return max(self.score(example, completion), floor)
