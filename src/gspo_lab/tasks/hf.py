"""A dataset loaded with `datasets.load_dataset` (task=hf): a hub id when online, or local json/jsonl/parquet/csv.

Columns map onto an example: `prompt_column` (text, or a list of chat messages) is the prompt, `answer_column`
the reference answer (optionally cut out by `answer_pattern`, e.g. GSM8K's `#### (.+)`), every other column is
kept and reaches the reward functions as a keyword. The held-out set is a named split (`eval_split`) or, without
one, the hash split of `Task` over the prompts. The task's own checker (reward=task, and eval/accuracy) compares
the completion with the reference by `match`: math_verify (the default), numeric (last number) or exact.

    task=hf task.path=openai/gsm8k task.name=main task.prompt_column=question "task.answer_pattern='#### (.+)'"
    task=hf task.path=/data/gsm8k.parquet task.prompt_column=question "task.answer_pattern='#### (.+)'"
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from gspo_lab.grading.answers import last_number, math_answer, math_equal
from gspo_lab.tasks.base import Example, Task
from gspo_lab.tasks.jsonl import JsonlTask

log = logging.getLogger(__name__)
MATCHES = ("math_verify", "numeric", "exact")
BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def column(row: dict, name: str):
    """A row's column; a dotted name reaches into nested columns (DAPO-Math-17k's `reward_model.ground_truth`).

    >>> column({"reward_model": {"ground_truth": "34", "style": "rule"}}, "reward_model.ground_truth")
    '34'
    """
    value = row
    for part in name.split("."):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(name)
        value = value[part]
    return value


def load_split(path: str, name: str | None, data_files: Any, split: str, revision: str | None) -> list[dict]:
    """The rows of one split. A local file is read with the builder its suffix names (no hub needed); anything
    else goes to `datasets.load_dataset` as given (a hub id, a local dataset folder, a builder with data_files)."""
    from datasets import load_dataset  # imported here: tasks that do not load data need not pay for it

    if isinstance(data_files, (DictConfig, ListConfig)):  # from Hydra: datasets takes plain dicts and lists
        data_files = OmegaConf.to_container(data_files)
    builder, files = path, data_files
    local = Path(path).expanduser()
    if local.is_file():
        if local.suffix not in BUILDERS:
            raise ValueError(f"task.path={path!r}: a local file must end in one of {sorted(BUILDERS)}")
        builder, files = BUILDERS[local.suffix], str(local)
    try:
        dataset = load_dataset(builder, name, data_files=files, split=split, revision=revision)
    except Exception as error:  # noqa: BLE001 - datasets raises many types; the message names the source
        raise ValueError(f"task.path={path!r} (name={name!r}, data_files={data_files!r}, split={split!r}) could not be "
                         f"loaded: {type(error).__name__}: {error}") from None
    return [dict(row) for row in dataset]


def prompt_key(prompt: str | list) -> str:
    """A prompt as one string, what the hash split hashes: text as it is, chat messages as sorted-key JSON."""
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)


def first_of_each_prompt(examples: list[Example]) -> list[Example]:
    """The first example of each distinct prompt, in order.

    >>> [e.answer for e in first_of_each_prompt([Example("1+1?", "2"), Example("2+2?", "4"), Example("1+1?", "2")])]
    ['2', '4']
    """
    seen, kept = set(), []
    for example in examples:
        key = prompt_key(example.prompt)
        if key not in seen:
            seen.add(key)
            kept.append(example)
    return kept


class HFDataset(JsonlTask):
    """Examples from a `datasets` split; the held-out set from `eval_split` or the hash split.

    Args:
        path, name, data_files, split, revision: `datasets.load_dataset`'s arguments (a local file path alone
            is enough: its suffix picks the builder).
        eval_split: the held-out split's name (e.g. "test"); null holds out a hash share of `split`.
        prompt_column: the prompt, text or a list of {role, content} messages.
        answer_column: the reference answer; `answer_pattern` (a regex) keeps its first group, e.g. "#### (.+)".
            Dotted names reach into nested columns (`reward_model.ground_truth`).
        solution_column: what the cold start imitates (`sft.enabled=true`), e.g. GSM8K's worked `answer`;
            null imitates the reference answer.
        match: the task's checker: math_verify, numeric or exact.
        max_prompt_tokens: prompts longer than this, as formatted for the model, are dropped once the tokenizer
            is loaded (`drop_long_prompts`, counted and logged); None keeps every prompt.
        dedup_prompts: keep the first row of each distinct prompt only, in each split (counted in
            `dropped_duplicates` and logged): DAPO-Math-17k's hub copy holds each of its 17.9k prompts 100 times.
        Other arguments: see `Task`.
    """

    name = "hf"

    def __init__(self, path=None, name=None, data_files=None, split="train", eval_split=None, revision=None,
                 prompt_column="prompt", answer_column="answer", answer_pattern=None, solution_column=None,
                 match="math_verify", max_prompt_tokens=None, dedup_prompts=False, rows=None, eval_rows=None,
                 **kwargs) -> None:
        Task.__init__(self, **kwargs)
        if match not in MATCHES:
            raise ValueError(f"task.match={match!r} must be one of {list(MATCHES)}")
        if path is None and rows is None:
            raise ValueError("task.path is not set: task=hf needs task.path=<hub id, dataset folder or data file>")
        if max_prompt_tokens is not None and not (isinstance(max_prompt_tokens, int) and max_prompt_tokens >= 1):
            raise ValueError(f"task.max_prompt_tokens={max_prompt_tokens!r} must be null or an integer >= 1")
        if not isinstance(dedup_prompts, bool):
            raise ValueError(f"task.dedup_prompts={dedup_prompts!r} must be true or false")
        self.match, self.max_prompt_tokens, self.dropped_long = match, max_prompt_tokens, 0
        self.prompt_column, self.answer_column, self.solution_column = prompt_column, answer_column, solution_column
        self.has_answers = answer_column is not None  # null: no reference answers (an environment or a learned reward)
        if answer_column is None and answer_pattern is not None:
            raise ValueError(f"task.answer_pattern={answer_pattern!r} with task.answer_column=null: there is no answer "
                             "to search")
        self.pattern = re.compile(answer_pattern) if answer_pattern else None
        source = path or "the rows given"
        rows = rows if rows is not None else load_split(path, name, data_files, split, revision)
        self.records = self._examples(rows, f"{source} split {split!r}")
        self.eval_records = None
        if eval_split is not None or eval_rows is not None:
            eval_rows = eval_rows if eval_rows is not None else load_split(path, name, data_files, eval_split, revision)
            self.eval_records = self._examples(eval_rows, f"{source} split {eval_split!r}")
        self.dropped_duplicates = self._drop_repeated_prompts() if dedup_prompts else 0
        if self.eval_records is None:
            self._check_split(source)

    def _drop_repeated_prompts(self) -> int:
        """Keep the first example of each distinct prompt in each split; returns how many were dropped."""
        before = len(self.records) + len(self.eval_records or [])
        self.records = first_of_each_prompt(self.records)
        if self.eval_records is not None:
            self.eval_records = first_of_each_prompt(self.eval_records)
        dropped = before - len(self.records) - len(self.eval_records or [])
        log.info("task=hf: dropped %d of %d rows repeating an earlier prompt (task.dedup_prompts)", dropped, before)
        return dropped

    def _examples(self, rows: list[dict], where: str) -> list[Example]:
        """Every row as an example, each row's columns checked; rows without a reference answer (null) are left
        out, counted and logged: nothing could grade them."""
        if not rows:
            raise ValueError(f"{where}: no rows")
        examples = [self._example(row, f"{where}, row {i}") for i, row in enumerate(rows)]
        kept = [e for e in examples if e is not None]
        if len(kept) < len(examples):
            log.warning("task=hf: %d of %d rows of %s have no answer (null in %s) and are left out",
                        len(examples) - len(kept), len(examples), where, self.answer_column)
        if not kept:
            raise ValueError(f"{where}: every row's task.answer_column={self.answer_column!r} is null")
        return kept

    def _column(self, row: dict, key: str, name: str, where: str):
        try:
            return column(row, name)
        except KeyError:
            hint = ("; with a reward that needs no reference answer (an environment, a reward model, a judge), set "
                    "task.answer_column=null" if key == "task.answer_column" else "")
            raise ValueError(f"{key}={name!r} is not a column of {where}; its columns are {sorted(row)}"
                             f"{hint}") from None

    def _example(self, row: dict, where: str) -> Example | None:
        prompt = self._column(row, "task.prompt_column", self.prompt_column, where)
        if self.answer_column is None:
            reference = ""  # no reference answer: nothing here reads one (plan.check_answers)
        else:
            reference = self._column(row, "task.answer_column", self.answer_column, where)
        if reference is None:
            return None
        reference = str(reference)
        if not (isinstance(prompt, str) and prompt) and not (isinstance(prompt, list) and prompt):
            raise ValueError(f"{where}: column {self.prompt_column!r} must be non-empty text or a list of messages, "
                             f"got {prompt!r}")
        if self.pattern is not None:
            found = self.pattern.search(reference)
            if found is None:
                raise ValueError(f"{where}: task.answer_pattern={self.pattern.pattern!r} finds nothing in "
                                 f"{self.answer_column}={reference!r}")
            reference = found.group(1) if found.groups() else found.group(0)
        # every other column reaches the rewards; `answer` is the reference's name there
        meta = {key: value for key, value in row.items() if key not in (self.prompt_column, "answer")}
        solution = (None if self.solution_column is None
                    else str(self._column(row, "task.solution_column", self.solution_column, where)))
        return Example(prompt=prompt, answer=reference.strip(), meta=meta, solution=solution)

    def split_of(self, prompt) -> str:
        return super().split_of(prompt_key(prompt))

    def drop_long_prompts(self, render, tokenizer, max_tokens: int) -> int:
        """Drop the examples whose formatted prompt is longer than `max_tokens` tokens; returns how many (a second
        call with the same tokenizer drops none; `dropped_long` counts them all)."""
        def fitting(examples: list[Example]) -> list[Example]:  # one batched tokenizer call per split
            ids = tokenizer(render.texts(examples), add_special_tokens=render.add_special_tokens)["input_ids"]
            return [e for e, row in zip(examples, ids) if len(row) <= max_tokens]

        before = len(self.records) + len(self.eval_records or [])
        self.records = fitting(self.records)
        if self.eval_records is not None:
            self.eval_records = fitting(self.eval_records)
        dropped = before - len(self.records) - len(self.eval_records or [])
        self.dropped_long += dropped
        if not self.records or self.eval_records == [] or not self.pool("eval"):
            raise ValueError(f"task.max_prompt_tokens={max_tokens}: no prompt of the training or held-out data fits")
        if dropped:
            log.info("task=hf: dropped %d of %d prompts longer than %d tokens", dropped, before, max_tokens)
        return dropped

    def demonstration(self, example: Example) -> str:
        return example.answer if example.solution is None else example.solution

    def answer_of(self, completion: str, example: Example | None = None) -> str | None:
        """What the checker reads: the whole text (exact), the last number (numeric), or math-verify's answer."""
        if self.match == "exact":
            return super().answer_of(completion, example)
        if self.match == "numeric":
            number = last_number(completion)
            return None if number is None else repr(number)
        return math_answer(completion, latex_only=False)

    @property
    def checker_may_hang(self) -> bool:  # math-verify can; a string or a number match cannot
        return self.match == "math_verify"

    def is_correct(self, example: Example, completion: str) -> bool:
        if self.match == "exact":
            return completion.strip() == example.answer
        if self.match == "numeric":
            got, want = last_number(completion), last_number(example.answer)
            return got is not None and want is not None and abs(got - want) <= 1e-6
        try:
            return math_equal(example.answer, completion, latex_only=False) == 1.0
        except Exception:  # noqa: BLE001 - the checker must not raise on model output
            return False

    def is_well_formed(self, example: Example, completion: str) -> bool:
        return bool(completion.strip())
