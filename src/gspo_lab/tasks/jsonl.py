"""A user's data set: one `{"prompt": ..., "answer": ...}` object per line, matched exactly or numerically.

Every line is checked when the task is built; a bad line fails with the file, the line number and what is
wrong. Without `eval_path`, the held-out split is the hash split of `Task` over the file's prompts.

>>> task = JsonlTask.from_records([{"prompt": f"{i}+{i}=", "answer": f"{2 * i}.0"} for i in range(20)], match="numeric")
>>> example = task.records[2]
>>> task.reward(example, "4"), task.reward(example, "4.00"), task.reward(example, "four"), task.reward(example, "1e999")
(1.0, 1.0, 0.0, 0.0)
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gspo_lab.tasks.base import SPLITS, Example, Task

MATCHES = ("exact", "numeric")


def read_jsonl(path: str | Path) -> list[Example]:
    """Parse and check every line of `path`; blank lines are skipped."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"task.path={str(path)!r}: no such file")
    records = [_check(record, where) for where, record in json_lines(path)]
    if not records:
        raise ValueError(f"{path}: no records (expected one JSON object per line)")
    return records


def json_lines(path: Path) -> Iterator[tuple[str, Any]]:
    """Each non-blank line of the JSONL file `path`, parsed, with where it stands ("<path>:<line>"); ValueError
    naming that place for a line that is not JSON."""
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                yield f"{path}:{number}", json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number}: not valid JSON ({error.msg})") from None


def _check(record, where: str) -> Example:
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object with 'prompt' and 'answer', got {type(record).__name__}")
    for key in ("prompt", "answer"):
        if key not in record:
            raise ValueError(f"{where}: missing key {key!r}")
        if not isinstance(record[key], (str, int, float)) or isinstance(record[key], bool):
            raise ValueError(f"{where}: {key!r} must be a string or a number, got {type(record[key]).__name__}")
    if not str(record["prompt"]):
        raise ValueError(f"{where}: 'prompt' is empty")
    return Example(prompt=str(record["prompt"]), answer=str(record["answer"]).strip())


def _number(text: str) -> float | None:
    try:
        value = float(text.strip())
    except ValueError:
        return None
    return value if math.isfinite(value) else None


class JsonlTask(Task):
    """Prompts and answers read from JSON lines.

    Args:
        path: the JSONL file.
        eval_path: an optional separate held-out file; without it the hash split applies.
        match: "exact" (stripped strings equal) or "numeric" (values within `tolerance`).
        tolerance: absolute tolerance of numeric matching.
        Other arguments: see `Task`.
    """

    name = "jsonl"

    def __init__(self, path=None, eval_path=None, match="exact", tolerance=1e-6, records=None, **kwargs):
        super().__init__(**kwargs)
        if match not in MATCHES:
            raise ValueError(f"task.match={match!r} must be one of {MATCHES}")
        if records is None and path is None:
            raise ValueError("task.path is not set: task=jsonl needs task.path=/path/to/data.jsonl")
        self.match, self.tolerance = match, tolerance
        self.records = records if records is not None else read_jsonl(path)
        self.eval_records = read_jsonl(eval_path) if eval_path is not None else None
        if self.eval_records is None:
            self._check_split(path or "the records given")

    def _check_split(self, source) -> None:
        """The hash split must leave at least one record on each side, else evaluation would divide by zero."""
        held_out = len(self.pool("eval"))
        if held_out == 0 or held_out == len(self.records):
            raise ValueError(
                f"task.eval_fraction={self.eval_fraction!r} holds out {held_out} of the {len(self.records)} records of "
                f"{source}; both the training and the held-out split need at least one record: add records, "
                "change task.eval_fraction, or give a held-out file with task.eval_path"
            )

    @classmethod
    def from_records(cls, records: list[dict], **kwargs) -> JsonlTask:
        return cls(records=[_check(r, f"record {i}") for i, r in enumerate(records)], **kwargs)

    @property
    def records(self) -> list[Example]:
        """The training data (with the hash split, all of it); assigning a new list re-splits it."""
        return self._records

    @records.setter
    def records(self, records: list[Example]) -> None:
        self._records, self._hash_split = records, None

    def pool(self, split: str) -> list[Example]:
        """The examples of `split`: the held-out file's, or the hash split of the records, computed once per record
        list rather than at every RL step (1.79M hashes a step on DAPO-Math-17k's hub copy)."""
        if self.eval_records is not None:
            return self.eval_records if split == "eval" else self.records
        if self._hash_split is None:
            self._hash_split = {name: [] for name in SPLITS}
            for record in self.records:
                self._hash_split[self.split_of(record.prompt)].append(record)
        return self._hash_split[split]

    def sample(self, rng: random.Random) -> Example:
        return rng.choice(self.records)

    def examples(self, split: str, n: int, seed: int) -> list[Example]:
        pool = self.pool(split) if split in ("train", "eval") else super().examples(split, n, seed)
        if len(pool) < n:
            raise ValueError(f"task=jsonl: asked for {n} {split!r} examples but the data holds {len(pool)}")
        return random.Random(f"{self.name}/{split}/{seed}").sample(pool, n)

    def eval_examples(self) -> list[Example]:
        pool = self.pool("eval")
        return self.examples("eval", min(self.eval_size, len(pool)), self.eval_seed) if pool else []

    def demonstration(self, example: Example) -> str:
        return example.answer

    def answer_of(self, completion: str, example: Example | None = None) -> str | None:
        if self.match == "exact":
            return super().answer_of(completion, example)
        number = _number(completion)
        return None if number is None else repr(number)

    def is_correct(self, example: Example, completion: str) -> bool:
        if self.match == "exact":
            return completion.strip() == example.answer
        got, want = _number(completion), _number(example.answer)
        return got is not None and want is not None and abs(got - want) <= self.tolerance

    def is_well_formed(self, example: Example, completion: str) -> bool:
        return bool(completion.strip()) if self.match == "exact" else _number(completion) is not None
