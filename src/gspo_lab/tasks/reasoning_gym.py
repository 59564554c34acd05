"""Reasoning-gym tasks: procedural generators with their own verifiers (`pip install reasoning-gym`).

`task=reasoning_gym task.dataset=word_sorting task.config.min_words=8` picks a dataset by name and passes its
own settings through `task.config`. One dataset object is built once with a fixed seed and a virtual size of
`task.dataset_size` items; reasoning-gym generates item `i` on demand from `Random(seed + i)` in most
datasets, so `sample(rng)` is an index drawn from `rng` and costs one item's generation (tens of microseconds).
A few datasets precompute every item at construction (acre, list_functions, gsm_symbolic) or cap the size
(word_ladder: 20000): give those a smaller `task.dataset_size`. The held-out split is the
hash split of `Task` over the prompt text. The reward is the dataset's own `score_answer`, partial credit kept:

>>> task = ReasoningGym(dataset="word_sorting", config={"min_words": 3, "max_words": 3})
>>> example = task.sample(random.Random(0))
>>> example.answer
'Indies, cities, stepped'
>>> # sorted: 1; one word of three in place: 1/3; the right words, none in place: 0.2; one word, in place: 1/3
>>> [round(task.reward(example, words), 3) for words in ("Indies, cities, stepped",
...     "Indies, stepped, cities", "stepped, Indies, cities", "Indies")]
[1.0, 0.333, 0.2, 0.333]
"""

from __future__ import annotations

import dataclasses
import importlib
import random

from omegaconf import DictConfig, OmegaConf

from gspo_lab.grading.scan import risky_call
from gspo_lab.tasks.base import Example, Task

DATASET_SEED = 0
RESERVED = ("seed", "size")  # the task owns these: sampling draws indices of one fixed-seed dataset


def registry() -> dict:
    """reasoning-gym's datasets by name; imported on first use (0.7 s: it registers all of them), so other
    tasks never pay for it."""
    return importlib.import_module("reasoning_gym").factory.DATASETS


def _settings(dataset: str) -> list[str]:
    return [f.name for f in dataclasses.fields(registry()[dataset][1]) if f.name not in RESERVED]


def _create(dataset: str, config: dict, size: int):
    """The dataset, or the error reasoning-gym raised building it (for a bad setting an AssertionError,
    TypeError or ValueError, depending on the dataset)."""
    try:
        create = importlib.import_module("reasoning_gym").create_dataset
        return create(dataset, seed=DATASET_SEED, size=size, **config), None
    except Exception as error:  # noqa: BLE001 - whatever a dataset raises on bad settings becomes one line
        return None, error


def build_dataset(dataset: str, config: dict, size: int):
    """The reasoning-gym dataset, or ValueError naming the key, the value and the valid choices or rule."""
    if dataset not in registry():
        choices = sorted(registry())
        raise ValueError(f"task.dataset={dataset!r} is not a reasoning-gym dataset; choose one of {choices}")
    for key, value in config.items():
        if key not in _settings(dataset):
            raise ValueError(f"task.config.{key}={value!r} is not a setting of reasoning-gym's {dataset}; its settings "
                             f"are {_settings(dataset)}" + (" (the seed is the task's; the size is task.dataset_size)"
                                                             if key in RESERVED else ""))
    if not size >= 1:
        raise ValueError(f"task.dataset_size={size!r} must be >= 1")
    built, error = _create(dataset, config, size)
    if built is not None:
        return built
    for key, value in config.items():  # name the setting that fails alone, if one does
        if _create(dataset, {key: value}, size)[1] is not None:
            raise ValueError(f"task.config.{key}={value!r} is rejected by reasoning-gym's {dataset}: {error}")
    given = ", ".join([f"task.config.{k}={v!r}" for k, v in config.items()] + [f"task.dataset_size={size!r}"])
    raise ValueError(f"{given}: rejected together by reasoning-gym's {dataset}: {error}")


class ReasoningGym(Task):
    """One reasoning-gym dataset as a task; the reward is its `score_answer` of the stripped completion.

    Args:
        dataset: a reasoning-gym dataset name (`registry()`).
        config: the dataset's own settings (its config dataclass's fields, seed and size excepted).
        dataset_size: the dataset's virtual size; `sample` draws item indices below it.
        Other arguments: see `Task`. With `format_weight` > 0 a non-empty completion scores at least that.
    """

    name = "reasoning_gym"

    def __init__(self, dataset="word_sorting", config=None, dataset_size=1_000_000, **kwargs) -> None:
        super().__init__(**kwargs)
        # Hydra passes a DictConfig; reasoning-gym's checks expect plain lists and dicts
        config = OmegaConf.to_container(config, resolve=True) if isinstance(config, DictConfig) else config
        self.dataset_name, self.config, self.dataset_size = dataset, dict(config or {}), dataset_size
        self.dataset = build_dataset(dataset, self.config, dataset_size)

    def sample(self, rng: random.Random) -> Example:
        entry = self.dataset[rng.randrange(self.dataset_size)]
        return Example(prompt=entry["question"], answer=entry["answer"], meta={"entry": entry})

    @property
    def checker_may_hang(self) -> bool:
        """Whether the dataset's verifier, read from its code (`risky_call`), runs text as Python (string_insertion,
        spiral_matrix, binary_matrix and n_queens `eval` the completion), starts a process or uses sympy (the
        integration, countdown and 24 datasets): on model output it can run without end or do what the text says,
        so it grades in killable workers. The rest (sorting, reversal, ...) are string and number checks."""
        dataset = type(self.dataset)
        return risky_call(dataset.score_answer, dataset) is not None

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
