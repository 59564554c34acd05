"""Bring your own: a user's chat checkpoint (save_pretrained), a GSM8K-format file through datasets, ChatML,
math-verify graded in worker processes, the checkpoint's two-id EOS list, and a cold start on the solution
column, end to end through the real Trainer."""

import json

import pytest
import torch
from omegaconf import open_dict

from gspo_lab.eval_cli import evaluate_checkpoint, run_config, run_dir_of
from gspo_lab.sft import Demonstrations
from gspo_lab.train import build, train
from tests.chat_model import save_chat_model, word_problems, write_jsonl


@pytest.fixture(scope="module")
def byo(tmp_path_factory):
    """The overrides of a run on the user's model and data."""
    folder = tmp_path_factory.mktemp("byo")
    model = save_chat_model(folder / "model")
    data = write_jsonl(folder / "gsm8k.jsonl", word_problems(80))
    return [
        "model=hf", f"model.path={model}",
        "task=hf", f"task.path={data}", "task.prompt_column=question", "task.answer_pattern='#### (.+)'",
        "task.solution_column=answer", "task.eval_size=8",
        "reward=math_verify", "reward.num_workers=1", "reward.timeout_s=30",
        "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=12",
        "train.steps=2", "train.minibatches=1", "train.eval_every=2",
        f"paths.cache_dir={folder / 'cache'}",
    ]


def test_a_run_on_a_users_chat_model_and_gsm8k_file_trains_on_chatml_prompts(byo, compose, tmp_path):
    # math-verify and a user's callable class from their own module: the length term gives groups reward variance
    functions = ("reward.functions=[{_target_:gspo_lab.rewards.math_accuracy,latex_only:false},"
                 "{_target_:tests.rewards.user_rewards.LengthPenalty,weight:0.5,per_char:0.02}]")
    run, module, cold = build(compose(byo + [f"paths.output_dir={tmp_path}", functions]))
    assert cold == {"enabled": False}  # a checkpoint starts RL as saved
    example = module.evaluator.sets[0].examples[0]
    assert module.render.text(example) == f"<|im_start|>user\n{example.prompt}<|im_end|>\n<|im_start|>assistant\n"
    assert [(f.name, f.weight) for f in module.rewards.functions] == [("math_accuracy", 1.0), ("LengthPenalty", 0.5)]
    before = [p.detach().clone() for p in module.model.parameters()]
    run.trainer.fit(module)
    rows = [row for row in module.history if "reward/mean" in row]
    assert len(rows) == 2 and all(row["reward/math_accuracy/timeouts"] == 0 for row in rows)
    assert all(row["reward/LengthPenalty/mean"] < 0 and row["reward/LengthPenalty/std"] > 0 for row in rows)
    assert all(row["reward/errors"] == 0 for row in rows)
    # one on-policy mini-batch: the sampled log-probs are the trainer's, whichever token stopped a completion
    assert all(abs(row["ratio/seq/max"] - 1) < 1e-4 and abs(row["ratio/seq/min"] - 1) < 1e-4 for row in rows)
    assert any(not torch.equal(a, b) for a, b in zip(before, module.model.parameters()))
    assert module.rewards.runner.workers == []  # the grading processes ended with the run


def test_the_cold_start_imitates_the_solution_column_in_the_chat_format(byo, compose, tmp_path):
    cfg = compose(byo + [f"paths.output_dir={tmp_path}", "sft.enabled=true", "sft.steps=3", "sft.eval_every=3",
                         "sft.eval_size=4", "sft.batch_size=4", "sft.max_new_tokens=8"])
    _, module, cold = build(cfg)
    assert cold["enabled"] and not cold["cache_hit"] and cold["steps"] == 3
    example = module.task.records[0]
    batch = Demonstrations(module.task, module.tokenizer, 1, 0, module.render).batch([example])
    row = module.tokenizer.decode(batch["input_ids"][0])
    # the prompt in ChatML, then the worked solution and the end of turn, which alone carry the loss
    assert row == f"{module.render.text(example)}{example.solution}<|im_end|>" and "#### " in example.solution
    learned = module.tokenizer.decode(batch["input_ids"][0][batch["labels"][0] >= 0])
    assert learned == f"{example.solution}<|im_end|>"


def test_prompts_over_the_token_budget_are_dropped_and_counted(byo, compose, tmp_path):
    def lengths(module):  # of every prompt (both splits: no eval_split, so the hash split of one file)
        return [len(module.tokenizer(module.render.text(e), add_special_tokens=False)["input_ids"])
                for e in module.task.records]

    rows = word_problems(80)
    for row in rows[::3]:  # a third of the questions ask for more
        row["question"] += " Explain every step of your answer."
    data = [f"task.path={write_jsonl(tmp_path / 'mixed.jsonl', rows)}"]
    _, whole, _ = build(compose(byo + data + [f"paths.output_dir={tmp_path / 'whole'}"]))
    budget = min(lengths(whole))
    assert max(lengths(whole)) > budget
    budgeted = [f"paths.output_dir={tmp_path / 'cut'}", f"task.max_prompt_tokens={budget}"]
    _, cut, _ = build(compose(byo + data + budgeted))
    assert max(lengths(cut)) <= budget and cut.task.dropped_long == sum(n > budget for n in lengths(whole)) > 0


def test_a_hub_id_loads_from_the_hub_cache_offline_and_a_missing_one_is_named(tmp_path, monkeypatch):
    """No hub is reachable here: the checkpoint is laid out as the hub cache holds a downloaded snapshot."""
    import huggingface_hub

    from gspo_lab.models import PretrainedModel

    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--acme--tiny-chat"
    save_chat_model(repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    source = PretrainedModel(path="acme/tiny-chat")
    assert source.folder == repo / "snapshots" / revision
    model, tokenizer = source.load()
    assert model.generation_config.eos_token_id == [tokenizer.eos_token_id, tokenizer.pad_token_id]
    with pytest.raises(FileNotFoundError, match=r"model.path='acme/missing' is not a local folder, and the hub model"):
        PretrainedModel(path="acme/missing")


def test_gspo_eval_scores_the_held_out_prompts_training_scored(byo, compose, tmp_path):
    """With task.max_prompt_tokens, training held out the prompts that fit; gspo-eval read the task unfiltered and
    scored another held-out set (11 of 50 prompts shared in one check)."""
    rows = word_problems(80)
    for row in rows[::2]:  # half the questions ask for more
        row["question"] += " Explain every step of your answer."
    run_dir = tmp_path / "run"
    data = [f"task.path={write_jsonl(tmp_path / 'mixed.jsonl', rows)}", "eval.samples=100", "train.steps=1",
            "train.eval_every=1", f"paths.output_dir={run_dir}"]
    _, whole, _ = build(compose(byo + data))
    budget = sorted(len(whole.tokenizer(whole.render.text(e), add_special_tokens=False)["input_ids"])
                    for e in whole.task.records)[len(rows) // 2]
    train(compose(byo + data + [f"task.max_prompt_tokens={budget}"]))
    trained = {json.dumps(r["prompt"]) for r in map(json.loads, (run_dir / "samples" / "step_1.jsonl").open())}
    cfg = compose([f"paths.output_dir={tmp_path / 'eval'}"])
    with open_dict(cfg):
        cfg.checkpoint, cfg.tokenizer, cfg.progress = str(run_dir), None, False
    evaluate_checkpoint(run_config(cfg, run_dir_of(run_dir), []))
    evaluated = {json.dumps(r["prompt"]) for r in map(json.loads, (tmp_path / "eval" / "samples.jsonl").open())}
    unfiltered = {json.dumps(e.prompt) for e in whole.task.eval_examples()}
    assert evaluated == trained and evaluated != unfiltered


def test_data_without_an_answer_column_trains_where_the_reward_needs_none(byo, compose, tmp_path):
    """task=hf refused data without reference answers ("'answer' is not a column"), and answer_column=null failed
    with an AttributeError. With task.answer_column=null a reward that reads no answer trains; what needs one (the
    task's checker, a function with an `answer` parameter, the cold start's imitation, held-out accuracy) is refused
    by its key."""
    from gspo_lab.train import ConfigError, plan

    questions = write_jsonl(tmp_path / "questions.jsonl", [{"question": row["question"]} for row in word_problems(40)])
    overrides = [o for o in byo if not o.startswith(("task.answer_pattern", "task.solution_column", "task.path",
                                                     "reward.", "train.eval_every"))]
    overrides += [f"task.path={questions}", f"paths.output_dir={tmp_path / 'run'}"]
    with pytest.raises(ConfigError, match=r"task.answer_column='answer' is not a column .*task.answer_column=null"):
        plan(compose(overrides))
    length = "reward.functions=[{_target_:tests.rewards.user_rewards.LengthPenalty,per_char:0.02}]"
    free = overrides + ["task.answer_column=null", "train.eval_every=0"]
    for changed, message in [
            (["reward=task"], r"reward.functions.0 \(hf\) needs the reference answer, and the data has none"),
            (["reward.functions=[{_target_:tests.rewards.user_rewards.needs_answer}]"],
             r"reward.functions.0 \(needs_answer\) needs the reference answer"),
            ([length, "sft.enabled=true"], r"sft.enabled=True: the cold start imitates the reference answers"),
            ([length, "train.eval_every=2"], r"train.eval_every=2: eval.sets.heldout grades held-out accuracy")]:
        with pytest.raises(ConfigError, match=message):
            plan(compose(free + changed))
    free.append(length)
    run, module, _ = build(compose(free))
    before = [p.detach().clone() for p in module.model.parameters()]
    run.trainer.fit(module)
    assert {e.answer for e in module.task.records} == {""} and len(module.history) == 2
    assert any(not torch.equal(a, b) for a, b in zip(before, module.model.parameters()))
