"""Evaluation sets, metrics during training and gspo-eval on a checkpoint (gspo_lab.evaluation, eval_sets,
eval_cli): the numbers agree between the two, the samples hold what was counted, and bad input is refused."""

from __future__ import annotations

import csv
import json
import math
import random
import shutil
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf, open_dict
from safetensors.torch import load_file

from gspo_lab.eval_cli import EvalError, check_tokenizer, evaluate_checkpoint, run_config, run_dir_of
from gspo_lab.eval_metrics import maj_at_k, pass_at_k
from gspo_lab.eval_sets import build_eval, evaluation_backend
from gspo_lab.sft import accuracy
from gspo_lab.tasks.checks import Checker
from gspo_lab.models.builders import load_pretrained
from gspo_lab.train import ConfigError, plan, train
from tests.chat_model import save_chat_model
from tests.checked_tasks import ExtractionRefused, HangingArithmetic

# one-digit addition, which the one-layer model learns to about half right in a 300-step cold start, so every
# metric is neither 0 nor 1; two sets: the held-out split and subtraction (the run's task with ops changed)
EVAL = ["task.digits=1", "task.eval_fraction=0.3", "task.eval_size=16", "sft.steps=300", "sft.eval_every=300",
        "eval.n=4", "eval.k=[1,2,4]", "eval.samples=3", "+eval.sets.sub.task.ops=[-]", "+eval.sets.sub.size=8"]


def rows_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def evaluated(compose, fast_rl, tmp_path_factory):
    """A two-step run evaluated at steps 0, 1 and 2 on two sets with 4 samples per prompt."""
    out = tmp_path_factory.mktemp("evaluated")
    cfg = compose(fast_rl + EVAL + [f"paths.output_dir={out / 'run'}"])
    train(cfg)
    return out / "run", cfg


def eval_config(compose, run: Path, out: Path, overrides: list[str] = ()):
    """gspo-eval's config for `run`, as its command line builds it: the run's config.yaml plus `overrides`."""
    cfg = compose([f"paths.output_dir={out}"])
    with open_dict(cfg):
        cfg.checkpoint, cfg.tokenizer, cfg.progress = str(run), None, False
    return run_config(cfg, run_dir_of(run), list(overrides))


def test_training_logs_every_sets_metrics_and_keeps_samples(evaluated):
    run, cfg = evaluated
    rows = [r for r in csv.DictReader(open(run / "metrics.csv")) if r.get("eval/heldout/greedy")]
    assert [int(r["step"]) for r in rows] == [0, 1, 2]
    for name in ("heldout", "sub"):
        for metric in ("greedy", "mean@4", "pass@1", "pass@2", "pass@4", "maj@1", "maj@4", "length"):
            assert rows[-1][f"eval/{name}/{metric}"] != "", (name, metric)
        assert float(rows[-1][f"time/eval/{name}_s"]) > 0
    last = {k: float(v) for k, v in rows[-1].items() if v}
    assert last["eval/accuracy"] == last["eval/heldout/greedy"]
    assert 0 < last["eval/heldout/pass@4"] < 1  # the fixture's task is neither solved nor hopeless
    # pass@1 is the mean of per-sample correctness, mean@n; pass@k grows with k
    assert last["eval/heldout/pass@1"] == pytest.approx(last["eval/heldout/mean@4"], abs=1e-12)
    assert last["eval/heldout/pass@1"] <= last["eval/heldout/pass@2"] <= last["eval/heldout/pass@4"]
    for step in (0, 1, 2):
        samples = rows_of(run / "samples" / f"step_{step}.jsonl")
        # the first 3 prompts of each set, greedy once and 4 samples each
        assert {(r["set"], r["index"]) for r in samples} == {(s, i) for s in ("heldout", "sub") for i in range(3)}
        assert len(samples) == 2 * 3 * (1 + 4)
    first = rows_of(run / "samples" / "step_0.jsonl")[0]
    assert set(first) >= {"prompt", "reference", "completion", "answer", "correct", "rewards", "mode"}
    assert "-" in rows_of(run / "samples" / "step_0.jsonl")[-1]["prompt"]  # the sub set renders its own task


def test_heldout_greedy_is_the_accuracy_evaluation_always_computed(evaluated):
    """eval/accuracy is what the previous evaluation (one greedy pass, `accuracy`) gives on the final weights."""
    run, cfg = evaluated
    model, tokenizer = load_pretrained(run / "final")
    task = instantiate(cfg.task)
    expected = accuracy(model, tokenizer, Checker(task), task.eval_examples(), cfg.rollout.max_new_tokens)
    final = [r for r in csv.DictReader(open(run / "metrics.csv")) if r.get("eval/accuracy")][-1]
    assert float(final["eval/accuracy"]) == expected


def test_gspo_eval_of_the_final_checkpoint_gives_the_last_evaluations_numbers(evaluated, compose, tmp_path):
    run, _ = evaluated
    result = evaluate_checkpoint(eval_config(compose, run, tmp_path / "eval"))
    final = [r for r in csv.DictReader(open(run / "metrics.csv")) if r.get("eval/heldout/greedy")][-1]
    counted = {k: v for k, v in result["metrics"].items() if not k.startswith("time/")}
    assert counted and counted == {k: float(final[k]) for k in counted}
    # and the completions themselves: the samples training kept are gspo-eval's for those prompts
    kept = rows_of(run / "samples" / "step_2.jsonl")
    every = {(r["set"], r["index"], r["mode"], r["sample"]): r["completion"] for r in rows_of(tmp_path / "eval" / "samples.jsonl")}
    assert all(every[(r["set"], r["index"], r["mode"], r["sample"])] == r["completion"] for r in kept)


def test_metrics_recomputed_from_samples_jsonl_equal_eval_json(evaluated, compose, tmp_path):
    run, _ = evaluated
    result = evaluate_checkpoint(eval_config(compose, run, tmp_path / "eval"))
    by_prompt = defaultdict(list)
    for row in rows_of(tmp_path / "eval" / "samples.jsonl"):
        by_prompt[(row["set"], row["mode"], row["index"])].append(row)
    for name, size in result["sets"].items():
        sampled = [by_prompt[(name, "sample", i)] for i in range(size)]
        greedy = [by_prompt[(name, "greedy", i)][0]["correct"] for i in range(size)]
        expected = {"greedy": sum(greedy) / size,
                    "mean@4": sum(sum(r["correct"] for r in rows) / 4 for rows in sampled) / size}
        for k in (1, 2, 4):
            expected[f"pass@{k}"] = sum(pass_at_k(4, sum(r["correct"] for r in rows), k) for rows in sampled) / size
            expected[f"maj@{k}"] = sum(maj_at_k([r["answer"] for r in rows],
                                                {r["answer"] for r in rows[:k] if r["correct"]}, k)
                                       for rows in sampled) / size
        for metric, value in expected.items():
            assert result["metrics"][f"eval/{name}/{metric}"] == pytest.approx(value, abs=1e-12), (name, metric)


def test_gspo_eval_takes_overrides_and_a_lightning_checkpoint(evaluated, compose, tmp_path):
    run, _ = evaluated
    cfg = eval_config(compose, run / "checkpoints" / "last.ckpt", tmp_path / "ckpt", ["eval=default"])
    result = evaluate_checkpoint(cfg)
    assert result["eval"]["n"] == 0 and list(result["sets"]) == ["heldout"]  # eval=default replaced the group
    final = [r for r in csv.DictReader(open(run / "metrics.csv")) if r.get("eval/accuracy")][-1]
    assert result["metrics"]["eval/accuracy"] == float(final["eval/accuracy"])  # last.ckpt holds the final weights


def test_sampled_evaluation_leaves_training_unchanged(compose, fast_rl, tmp_path):
    """The evaluation's samples come from its own seed stream: a run with them trains exactly as one without."""
    histories = []
    for n in (0, 4):
        cfg = compose(fast_rl + [f"eval.n={n}", "eval.k=[1]", f"paths.output_dir={tmp_path / str(n)}"])
        train(cfg)
        rows = list(csv.DictReader(open(tmp_path / str(n) / "metrics.csv")))
        timed = ("eval/", "time/", "throughput/")
        histories.append([{k: v for k, v in r.items() if not k.startswith(timed)} for r in rows if r.get("reward/mean")])
    assert len(histories[0]) == 2 and histories[0][0]["loss/total"] != ""
    assert histories[0] == histories[1]


@pytest.mark.parametrize("override, message", [
    ("eval.k=[1,8]", "eval.k=\\[1, 8\\] is invalid: every k must be <= eval.n=4"),
    ("eval.n=-1", "eval.n=-1 is invalid"),
    ("+eval.sets.x.data=gsm8k", "keys among \\['task', 'prompt', 'reward', 'size'\\]"),
    ("+eval.sets.x.task=no_such_task", "eval.sets.x.task='no_such_task' is not an option of conf/task"),
    ("+eval.sets.x.size=0", "eval.sets.x.size=0 is invalid"),
    ("eval.engine=vllm", "eval.engine='vllm' is invalid: must be rollout \\(the run's backend\\) or trainer"),
])
def test_bad_eval_settings_are_refused_by_the_plan(override, message, compose, tmp_path):
    with pytest.raises(ConfigError, match=message):
        plan(compose(["eval.n=4", override, f"paths.output_dir={tmp_path}"]))


def test_a_set_name_that_cannot_be_a_metric_name_is_refused(compose):
    cfg = compose()
    with open_dict(cfg):
        cfg.eval.sets["bad/name"] = {}
    with pytest.raises(ValueError, match="eval.sets.bad/name: the name 'bad/name' is invalid"):
        build_eval(cfg, None, None)


def test_greedy_off_without_samples_is_refused(compose):
    with pytest.raises(ValueError, match="eval.greedy=false with eval.n=0"):
        build_eval(compose(["eval.greedy=false"]), None, None)


def test_a_set_from_an_option_with_its_own_reward_functions(compose):
    """task / prompt / reward by option name; several reward functions are reported per function."""
    cfg = compose(["+eval.sets.cd.task=countdown", "+eval.sets.cd.reward=dapo_overlong", "+eval.sets.cd.size=2"])
    evaluation = build_eval(cfg, instantiate(cfg.task), instantiate(cfg.prompt))
    heldout, cd = evaluation.specs
    assert type(cd.task).__name__ == "Countdown" and cd.size == 2
    assert [f.name for f in cd.rewards.functions] == ["countdown", "soft_overlong_punishment"]
    evaluation.close()


def test_a_set_with_one_reward_function_reports_it(evaluated, compose):
    """A set that names one reward function (an environment's reward, say) scores and reports it beside the
    checker's accuracy: the mean of the function's values over the greedy completions."""
    run, _ = evaluated
    model, tokenizer = load_pretrained(run / "final")
    set_cfg = compose(EVAL + ["+eval.sets.one.reward=task", "+eval.sets.one.size=4", "eval.n=0"])
    evaluator = build_eval(set_cfg, instantiate(set_cfg.task), instantiate(set_cfg.prompt)).evaluator(
        tokenizer, set_cfg.rollout.max_new_tokens, [], set_cfg.seed)
    metrics, rows = evaluator.run(model, tokenizer)
    name = next(k for k in metrics if k.startswith("eval/one/reward/")).split("/")[3]
    rewards = [r["rewards"][name] for r in rows if r["set"] == "one"]
    assert metrics[f"eval/one/reward/{name}/greedy"] == pytest.approx(sum(rewards) / len(rewards), abs=1e-12)


def test_a_tokenizer_the_model_cannot_embed_is_refused_naming_both(evaluated, tmp_path):
    run, _ = evaluated
    model, _ = load_pretrained(run / "final")
    _, chat_tokenizer = load_pretrained(save_chat_model(tmp_path / "chat"))
    assert len(chat_tokenizer) > model.get_input_embeddings().num_embeddings
    with pytest.raises(EvalError, match=f"checkpoint={run}.*and tokenizer {tmp_path / 'chat'} do not belong"):
        check_tokenizer(model, chat_tokenizer, str(run), str(tmp_path / "chat"))


def test_gspo_eval_refuses_another_tokenizer_for_the_checkpoint(evaluated, compose, tmp_path):
    run, _ = evaluated
    save_chat_model(tmp_path / "chat")
    cfg = eval_config(compose, run, tmp_path / "out")
    cfg.tokenizer = str(tmp_path / "chat")
    with pytest.raises(EvalError, match="do not belong together: the tokenizer's vocabulary differs"):
        evaluate_checkpoint(cfg)


def test_answers_that_maj_at_k_votes_on():
    """Each task extracts the answer its checker reads, so equal answers written differently vote together."""
    from gspo_lab.tasks import Arithmetic, Countdown

    assert Arithmetic().answer_of(" 579 ") == "579" and Arithmetic().answer_of("  ") is None
    countdown = Countdown()
    assert countdown.answer_of("(20-18)*5") == countdown.answer_of("5*2") == "10"
    assert countdown.answer_of("5*") is None
    example = countdown.sample(random.Random(0))  # numbers it may use, each as often as given
    a, b = example.meta["numbers"][:2]
    assert countdown.answer_of(f"{a}+{b}", example) == str(a + b)
    assert countdown.answer_of(f"{a}+{a}+{a}+{a}+{a}", example) is None  # a number used more often than given
    from gspo_lab.grading.answers import math_answer

    assert math_answer(r"so $\boxed{\frac{1}{2}}$") == math_answer(r"$\boxed{0.5}$") is not None
    assert math_answer("no answer here") is None


def test_gspo_eval_reads_lora_adapters_on_the_base_their_run_builds(compose, fast_rl, tmp_path):
    """A LoRA run's final/adapter (adapter_config.json), on the base its run's config builds, gives the numbers of
    the run's last evaluation, which ran with the adapters."""
    lora = ["model.lora.enabled=true", "model.lora.rank=4", "train.lr=1e-2", "eval.n=2", "eval.k=[1,2]"]
    train(compose(fast_rl + EVAL[:5] + lora + [f"paths.output_dir={tmp_path / 'run'}"]))
    run = tmp_path / "run"
    assert (run / "final" / "adapter" / "adapter_config.json").is_file()
    result = evaluate_checkpoint(eval_config(compose, run / "final" / "adapter", tmp_path / "eval"))
    rows = [r for r in csv.DictReader(open(run / "metrics.csv")) if r.get("eval/heldout/greedy")]
    for key in ("eval/heldout/greedy", "eval/heldout/pass@2", "eval/heldout/length"):
        assert result["metrics"][key] == pytest.approx(float(rows[-1][key]), abs=1e-9), key
    adapters = load_file(run / "final" / "adapter" / "adapter_model.safetensors")
    assert max(t.abs().max().item() for k, t in adapters.items() if "lora_B" in k) > 0  # trained (B starts at 0)


def test_every_rank_reduces_the_same_keys_and_makes_the_same_generate_calls(evaluated, compose):
    """Two ranks, a one-prompt set with two reward functions: rank 1 has no prompt of its own, yet pads its share
    to rank 0's, so both make the same generate calls and report the same keys, and its padding counts nowhere."""
    run, cfg = evaluated
    model, tokenizer = load_pretrained(run / "final")
    set_cfg = compose(EVAL + ["+eval.sets.one.reward=dapo_overlong", "+eval.sets.one.size=1"])
    evaluator = build_eval(set_cfg, instantiate(set_cfg.task), instantiate(set_cfg.prompt)).evaluator(
        tokenizer, set_cfg.rollout.max_new_tokens, [], set_cfg.seed)
    calls, results = [], []
    for rank in (0, 1):
        counted = []
        metrics, rows = evaluator.run(model, tokenizer, rank=rank, world=2, progress=counted.append)
        calls.append(counted)
        results.append((metrics, rows))
    assert calls[0] == calls[1]  # the same generate calls, of the same sizes
    (first, first_rows), (second, second_rows) = results
    assert first.keys() == second.keys() and "eval/one/reward/soft_overlong_punishment/mean@4" in first
    assert math.isnan(second["eval/one/greedy"])  # no prompt of its own: nothing counted (0 / 0)
    assert not [r for r in second_rows if r["set"] == "one"]


def test_gspo_eval_on_a_run_from_before_the_eval_group(evaluated, compose, tmp_path):
    run, _ = evaluated
    old = tmp_path / "old_run"
    shutil.copytree(run, old)
    config = OmegaConf.load(old / "config.yaml")
    del config["eval"]
    OmegaConf.save(config, old / "config.yaml")
    result = evaluate_checkpoint(eval_config(compose, old, tmp_path / "eval", ["eval.n=2", "eval.k=[2]"]))
    assert list(result["sets"]) == ["heldout"] and "eval/heldout/pass@2" in result["metrics"]


@pytest.mark.parametrize("override, message", [
    ("~eval.sets.heldout", "deleting a key is not supported"),
    ("eval.temprature=0.5", "eval.temprature is not a key of the eval group"),
    ("eval.k=4", "eval.k=4 is invalid: must be a list"),
    ("eval.sets.heldout.size=true", "eval.sets.heldout.size=True is invalid"),
])
def test_gspo_eval_refuses_bad_overrides_naming_them(override, message, evaluated, compose, tmp_path):
    run, _ = evaluated
    with pytest.raises((EvalError, ValueError), match=message):
        evaluate_checkpoint(eval_config(compose, run, tmp_path / "eval", [override]))


def test_what_generated_each_evaluation_is_recorded(evaluated, compose, tmp_path):
    """A float32 hf run evaluates with transformers on the trainer's weights: metrics.csv records it at every
    evaluation (eval/engine_vllm 0, 23 mantissa bits), summary.json and gspo-eval's eval.json name it."""
    run, _ = evaluated
    evaluations = [r for r in csv.DictReader(open(run / "metrics.csv")) if r.get("eval/accuracy")]
    assert len(evaluations) == 3
    assert all((float(r["eval/engine_vllm"]), float(r["eval/engine_mantissa_bits"])) == (0, 23) for r in evaluations)
    assert json.loads((run / "summary.json").read_text())["eval/engine"] == "transformers float32"
    assert evaluate_checkpoint(eval_config(compose, run, tmp_path / "eval"))["eval/engine"] == "transformers float32"


def test_the_trainers_evaluation_computes_in_the_autocast_dtype(tiny_family):
    """Under trainer.precision=bf16-mixed the RL step, and the evaluation in it, runs under autocast: recorded as
    bfloat16, not the weights' float32."""
    model, _ = tiny_family("tiny_moe")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, record = evaluation_backend(None, model, "rollout")
    assert record == {"eval/engine_vllm": 0.0, "eval/engine_mantissa_bits": 7.0}


def test_gspo_eval_builds_no_engine_copy_it_would_not_use(evaluated, compose, tmp_path, monkeypatch):
    """An hf run's evaluation generates on the model itself, so gspo-eval of a run with a quantised bf16 engine
    no longer deep-copies (and quantises) the model for nothing."""
    run, _ = evaluated
    monkeypatch.setattr("gspo_lab.eval_cli.build_backend", lambda *args: pytest.fail("an engine was built"))
    overrides = ["rollout.engine.precision=bf16", "rollout.engine.weight_bits=8"]
    assert evaluate_checkpoint(eval_config(compose, run, tmp_path / "eval", overrides))["metrics"]


def test_summary_json_keeps_every_sets_last_evaluation(evaluated):
    run, _ = evaluated
    summary = json.loads((run / "summary.json").read_text())
    final = [r for r in csv.DictReader(open(run / "metrics.csv")) if r.get("eval/sub/greedy")][-1]
    assert summary["eval/final"]["eval/sub/pass@2"] == float(final["eval/sub/pass@2"])
    assert summary["eval/final"]["eval/heldout/greedy"] == summary["eval/accuracy_after"]


def evaluate_task(compose, tiny, task, overrides=()):
    """Metrics and rows of one evaluation of the untrained tiny model on `task`'s held-out prompts."""
    cfg = compose(tiny + list(overrides))
    model, tokenizer = instantiate(cfg.model).load(task)
    plan = build_eval(cfg, task, instantiate(cfg.prompt))
    try:
        return plan, plan.evaluator(tokenizer, 4, [], 0).run(model, tokenizer)
    finally:
        plan.close()


def test_a_checker_that_never_returns_is_killed_and_counted_wrong(compose, tiny):
    """sympy on a completion such as \\boxed{7^{7^{7^{7}}}} never returned, and the evaluation (every rank of a
    DDP run, through its collectives) waited for good."""
    plan, (metrics, rows) = evaluate_task(compose, tiny, HangingArithmetic(eval_size=2), ["eval.grading_timeout_s=1"])
    assert plan.grader is not None and plan.grader.timeout_s == 1
    assert metrics["eval/heldout/greedy"] == 0.0 and metrics["eval/heldout/grading_failures"] == 2.0
    assert [row["correct"] for row in rows] == [False, False]


def test_answers_are_extracted_only_where_maj_at_k_is_reported(compose, tiny):
    greedy_plan, (greedy, _) = evaluate_task(compose, tiny, ExtractionRefused(eval_size=2))
    assert greedy_plan.grader is None and greedy["eval/heldout/grading_failures"] == 0.0  # never extracted
    _, (sampled, rows) = evaluate_task(compose, tiny, ExtractionRefused(eval_size=2), ["eval.n=2", "eval.k=[2]"])
    assert sampled["eval/heldout/grading_failures"] == 4.0  # 2 prompts x 2 samples, each extraction raised
    assert sampled["eval/heldout/maj@2"] == 0.0 and all(row["answer"] is None for row in rows)
