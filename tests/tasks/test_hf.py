"""task=hf: data through datasets.load_dataset from local files, columns mapped, answers extracted, split."""

import pandas as pd
import pytest

from gspo_lab.tasks import HFDataset
from tests.chat_model import word_problems, write_jsonl

GSM8K = dict(prompt_column="question", answer_pattern="#### (.+)")


@pytest.fixture
def gsm8k_jsonl(tmp_path):
    return write_jsonl(tmp_path / "gsm8k.jsonl", word_problems(60))


def test_a_gsm8k_file_loads_with_its_answer_extracted_and_every_other_column_kept(gsm8k_jsonl):
    task = HFDataset(path=str(gsm8k_jsonl), solution_column="answer", **GSM8K)
    first = word_problems(60)[0]  # "Tom has a apples and buys b more. ...", "a + b = c\n#### c"
    example = next(e for e in task.records if e.prompt == first["question"])
    assert example.answer == first["answer"].split("#### ")[1] and example.meta == {"level": first["level"]}
    assert task.demonstration(example) == first["answer"]  # the worked solution, for the cold start
    assert len(task.pool("train")) + len(task.pool("eval")) == 60 and task.pool("eval")  # the hash split
    assert task.reward(example, f"so the answer is {example.answer}") == 1.0  # math_verify reads plain answers
    assert task.reward(example, "so the answer is 1000") == 0.0


def test_parquet_and_a_named_held_out_split_load_through_datasets(tmp_path):
    pd.DataFrame(word_problems(30)).to_parquet(tmp_path / "train.parquet")
    pd.DataFrame(word_problems(10, seed=1)).to_parquet(tmp_path / "test.parquet")
    files = {"train": str(tmp_path / "train.parquet"), "test": str(tmp_path / "test.parquet")}
    task = HFDataset(path="parquet", data_files=files, eval_split="test", **GSM8K)
    assert len(task.records) == 30 and len(task.eval_records) == 10
    assert {e.prompt for e in task.eval_examples()} == {r["question"] for r in word_problems(10, seed=1)}


def test_conversational_prompts_are_kept_as_messages(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": f"{i}+{i}?"}], "answer": str(2 * i)} for i in range(40)]
    task = HFDataset(path=str(write_jsonl(tmp_path / "chat.jsonl", rows)), match="numeric")
    assert all(isinstance(e.prompt, list) for e in task.records) and task.pool("eval")
    example = task.records[3]
    assert task.reward(example, f"it is {example.answer}") == 1.0


@pytest.mark.parametrize("overrides, message", [
    ({"prompt_column": "prompt"}, r"task.prompt_column='prompt' is not a column of .*gsm8k.jsonl split 'train', row 0; "
                                  r"its columns are \['answer', 'level', 'question'\]"),
    ({"prompt_column": "question", "answer_pattern": "=== (.+)"}, r"row 0: task.answer_pattern='=== \(.\+\)' finds "
                                                                 r"nothing in answer="),
    ({"prompt_column": "question", "match": "fuzzy"}, r"task.match='fuzzy' must be one of"),
])
def test_bad_columns_and_patterns_are_refused_naming_the_key(gsm8k_jsonl, overrides, message):
    with pytest.raises(ValueError, match=message):
        HFDataset(path=str(gsm8k_jsonl), **overrides)


def test_a_missing_file_is_refused_naming_it(tmp_path):
    with pytest.raises(ValueError, match=r"task.path='.*missing.jsonl'.*could not be loaded"):
        HFDataset(path=str(tmp_path / "missing.jsonl"))


def test_nested_answer_columns_and_chat_prompts_as_dapo_math_stores_them(tmp_path):
    rows = [{"data_source": "math_dapo", "prompt": [{"role": "user", "content": f"Compute {i} squared."}],
             "reward_model": {"ground_truth": str(i * i), "style": "rule"}} for i in range(40)]
    task = HFDataset(path=str(write_jsonl(tmp_path / "dapo.jsonl", rows)), answer_column="reward_model.ground_truth")
    example = next(e for e in task.records if e.prompt[0]["content"] == "Compute 7 squared.")
    assert example.answer == "49" and example.meta["data_source"] == "math_dapo"
    assert task.reward(example, r"so $\boxed{49}$") == 1.0


def test_repeated_prompts_are_dropped_and_counted_when_asked(caplog):
    # DAPO-Math-17k on the hub repeats each prompt 100 times; here 3 distinct prompts, the first two repeated
    chat = [{"role": "user", "content": "What is 2+2?"}]
    rows = [{"prompt": chat, "answer": "4"}, {"prompt": "1+1?", "answer": "2"}, {"prompt": "3+3?", "answer": "6"},
            {"prompt": [dict(m) for m in chat], "answer": "4"}, {"prompt": "1+1?", "answer": "2"}]
    held_out = [{"prompt": "9+9?", "answer": "18"}]
    assert len(HFDataset(rows=rows, eval_rows=held_out).records) == 5  # off by default: every row kept
    with caplog.at_level("INFO", logger="gspo_lab.tasks.hf"):
        task = HFDataset(rows=rows, eval_rows=held_out, dedup_prompts=True)
    assert [e.prompt for e in task.records] == [chat, "1+1?", "3+3?"]  # the first of each, in order
    assert task.dropped_duplicates == 2 and "dropped 2 of 6 rows repeating an earlier prompt" in caplog.text


def test_every_row_is_checked_and_a_row_without_an_answer_is_left_out(caplog):
    """Columns were checked on row 0 only (a later row without one raised a bare KeyError), and a null answer
    became the reference "None"."""
    rows = [{"question": f"{i}+1=", "answer": str(i + 1)} for i in range(40)]
    rows[7] = {"question": "7+1="}
    with pytest.raises(ValueError, match=r"task.answer_column='answer' is not a column of the rows given split "
                                         r"'train', row 7; its columns are \['question'\]"):
        HFDataset(rows=rows, prompt_column="question")
    rows[7] = {"question": "7+1=", "answer": None}
    task = HFDataset(rows=rows, prompt_column="question")
    assert len(task.records) == 39 and "None" not in {e.answer for e in task.records}
    left_out = "1 of 40 rows of the rows given split 'train' have no answer (null in answer) and are left out"
    assert left_out in caplog.text
