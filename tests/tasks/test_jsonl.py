import json

import pytest

from gspo_lab.tasks import JsonlTask
from gspo_lab.train import ConfigError, plan


def write(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_reads_records_and_scores_exact_and_numeric(tmp_path):
    rows = [json.dumps({"prompt": f"q{i}:", "answer": str(i)}) for i in range(40)]
    path = write(tmp_path / "data.jsonl", rows)
    task = JsonlTask(path=str(path), match="numeric")
    example = next(e for e in task.records if e.prompt == "q7:")
    assert task.reward(example, "7") == 1.0 and task.reward(example, " 7.0 ") == 1.0
    assert task.reward(example, "8") == 0.0 and task.reward(example, "nan") == 0.0
    exact = JsonlTask(path=str(path))
    assert exact.reward(example, "7.0") == 0.0 and exact.reward(example, "7") == 1.0
    train, held_out = task.pool("train"), task.pool("eval")
    assert len(train) + len(held_out) == 40 and not {e.prompt for e in train} & {e.prompt for e in held_out}


@pytest.mark.parametrize(
    "bad, message",
    [
        ('{"prompt": "a", "answer": ', "not valid JSON"),
        ('{"prompt": "a"}', "missing key 'answer'"),
        ('["a", "b"]', "expected a JSON object"),
        ('{"prompt": "a", "answer": [1]}', "'answer' must be a string or a number"),
        ('{"prompt": "", "answer": "1"}', "'prompt' is empty"),
    ],
)
def test_bad_line_names_file_line_and_problem(tmp_path, bad, message):
    path = write(tmp_path / "bad.jsonl", ['{"prompt": "1+1=", "answer": "2"}', "", bad])
    with pytest.raises(ValueError, match=rf"bad\.jsonl:3: .*{message}"):
        JsonlTask(path=str(path))


def test_missing_file_and_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        JsonlTask(path=str(tmp_path / "nope.jsonl"))
    with pytest.raises(ValueError, match="task.path is not set"):
        JsonlTask()


def test_separate_eval_file(tmp_path):
    train = write(tmp_path / "train.jsonl", ['{"prompt": "a", "answer": 1}', '{"prompt": "b", "answer": 2}'])
    held = write(tmp_path / "eval.jsonl", ['{"prompt": "c", "answer": 3}'])
    task = JsonlTask(path=str(train), eval_path=str(held), eval_size=5)
    assert [e.prompt for e in task.eval_examples()] == ["c"]
    assert sorted(e.prompt for e in task.examples("train", 2, seed=0)) == ["a", "b"]
    with pytest.raises(ValueError, match="asked for 3 'train' examples but the data holds 2"):
        task.examples("train", 3, seed=0)


def test_a_file_too_small_to_hold_out_an_evaluation_set_is_refused_at_once(tmp_path):
    """Three records at eval_fraction 0.1: the hash split holds none out; before, evaluation later divided by
    len([]) = 0. Now the task refuses at construction, naming the key, its value and the record count."""
    path = write(tmp_path / "small.jsonl", [json.dumps({"prompt": p, "answer": "1"}) for p in ("a", "b", "c")])
    with pytest.raises(ValueError, match=r"task.eval_fraction=0.1 holds out 0 of the 3 records of .*small\.jsonl"):
        JsonlTask(path=str(path))


def test_the_cli_names_the_key_for_a_too_small_file(compose, tmp_path):
    path = write(tmp_path / "small.jsonl", [json.dumps({"prompt": p, "answer": "1"}) for p in ("a", "b", "c")])
    with pytest.raises(ConfigError, match="task.eval_fraction=0.1 holds out 0 of the 3 records"):
        plan(compose(["task=jsonl", f"task.path={path}", f"paths.output_dir={tmp_path}"]))


def test_each_split_is_hashed_once_not_at_every_request(monkeypatch):
    hashed, split_of = [], JsonlTask.split_of
    monkeypatch.setattr(JsonlTask, "split_of", lambda task, prompt: hashed.append(prompt) or split_of(task, prompt))
    task = JsonlTask.from_records([{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(50)])
    for step in range(3):  # three RL steps' prompts and an evaluation
        task.examples("train", 4, seed=step)
    task.eval_examples()
    assert len(hashed) == 50  # each record once, for both splits (before: 50 per call, 300 in all)
    task.records = task.records[:10]  # a new record list (drop_long_prompts): its split is hashed anew
    assert {e.prompt for e in task.pool("train") + task.pool("eval")} == {f"{i}+{i}=" for i in range(10)}
