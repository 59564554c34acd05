"""task=reasoning_gym: the reward is the dataset's own score (partial credit kept), the splits are disjoint,
sampling is deterministic, demonstrations score 1, bad names and settings are refused in one line, the
task's BPE tokenizer round-trips and reloads, and one real RL step runs on it."""

import random
import re

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf
from transformers import AutoTokenizer

from gspo_lab.cold_start import cache_key
from gspo_lab.eval_sets import build_eval
from gspo_lab.grading.scan import risky_call
from gspo_lab.models import TinyModel
from gspo_lab.rewards import build_rewards
from gspo_lab.rollout.completions import Completions, Generated, reward_inputs
from gspo_lab.sft import SFTConfig
from gspo_lab.tasks import Example, ReasoningGym
from gspo_lab.tasks.reasoning_gym import registry
from gspo_lab.train import ConfigError, build, plan, train

WORDS = {"min_words": 3, "max_words": 3}


@pytest.fixture(scope="module")
def word_sorting():
    return ReasoningGym(dataset="word_sorting", config=WORDS)


def entry(words: list[str]) -> Example:
    """A hand-made ascending word_sorting example (the verifier reads metadata.sorted_words)."""
    answer = ", ".join(sorted(words))
    return Example("sort", answer, {"entry": {"answer": answer, "metadata": {"sorted_words": sorted(words)}}})


@pytest.mark.parametrize("completion, score", [
    ("ant, bee, cat", 1.0),
    (" ant, bee, cat \n", 1.0),  # stripped first
    ("ant, cat, bee", 1 / 3),  # one word of three in its place
    ("cat, ant, bee", 0.2),  # the right words, none in place: the verifier's floor for a permutation
    ("ant, bee", 2 / 3),  # two of three in place
    ("dog", 0.0),
    ("", 0.0),
])
def test_reward_is_the_datasets_score_with_partial_credit(word_sorting, completion, score):
    assert word_sorting.reward(entry(["cat", "ant", "bee"]), completion) == pytest.approx(score)
    assert word_sorting.is_correct(entry(["cat", "ant", "bee"]), completion) == (score == 1.0)


def test_format_weight_raises_a_non_empty_completion_to_that_floor():
    task = ReasoningGym(dataset="word_sorting", config=WORDS, format_weight=0.5)
    example = entry(["cat", "ant", "bee"])
    assert [task.reward(example, c) for c in ("dog", "", "ant, bee", "ant, bee, cat")] == [0.5, 0.0, 2 / 3, 1.0]


def test_all_or_nothing_dataset_and_a_verifier_that_raises(word_sorting):
    task = ReasoningGym(dataset="number_sorting", config={"min_numbers": 3, "max_numbers": 3})
    example = task.sample(random.Random(0))
    assert task.reward(example, example.answer) == 1.0
    assert task.reward(example, "['1', '2']") == 0.0  # wrong length: number_sorting gives no partial credit
    broken = Example("sort", "x", {"entry": {"metadata": {}}})  # no sorted_words: the verifier raises KeyError
    assert word_sorting.reward(broken, "x") == 0.0


def test_demonstrations_score_one_and_splits_are_disjoint(word_sorting):
    train, held_out = word_sorting.examples("train", 200, seed=0), word_sorting.eval_examples()
    assert all(word_sorting.reward(e, word_sorting.demonstration(e)) == 1.0 for e in train + held_out)
    assert not {e.prompt for e in train} & {e.prompt for e in held_out}
    assert {word_sorting.split_of(e.prompt) for e in held_out} == {"eval"}


def test_sampling_is_deterministic_for_a_seed(word_sorting):
    again = ReasoningGym(dataset="word_sorting", config=WORDS)
    assert word_sorting.examples("train", 20, seed=3) == again.examples("train", 20, seed=3)
    assert word_sorting.examples("train", 20, seed=3) != word_sorting.examples("train", 20, seed=4)


@pytest.mark.parametrize("overrides, message", [
    (["task.dataset=word_sortin"], r"^task.dataset='word_sortin' is not a reasoning-gym dataset; choose one of "
                                   r"\[.*'number_sorting'.*'word_sorting'.*\]$"),
    (["+task.config.min_words=0"], r"^task.config.min_words=0 is rejected by reasoning-gym's word_sorting: "
                                   r"min_words must be positive$"),
    (["+task.config.colour=1"], r"^task.config.colour=1 is not a setting of reasoning-gym's word_sorting; its "
                                r"settings are \['min_words', 'max_words', "),
    (["+task.config.seed=1"], r"task.config.seed=1 is not a setting .* \(the seed is the task's; the size is "
                              r"task.dataset_size\)$"),
    (["+task.config.min_words=5", "+task.config.max_words=3"],
     r"^task.config.min_words=5, task.config.max_words=3, task.dataset_size=1000000: rejected together by "
     r"reasoning-gym's word_sorting: max_words must be >= min_words$"),
    (["task.dataset=word_ladder"], r"^task.dataset_size=1000000: rejected together by reasoning-gym's word_ladder: "),
    (["task.dataset_size=0"], r"^task.dataset_size=0 must be >= 1$"),
    (["model.tokenizer=bpe"], r"^model.tokenizer='bpe' must be one of \('char', 'task_bpe'\)$"),
    (["model.tokenizer=task_bpe", "model.tokenizer_vocab_size=50"], r"^model.tokenizer_vocab_size=50 must be >= 100"),
])
def test_bad_input_is_refused_in_one_line_naming_key_and_value(overrides, message, compose, tmp_path):
    with pytest.raises(ConfigError, match=message) as refused:
        plan(compose(["task=reasoning_gym", f"paths.output_dir={tmp_path}"] + overrides))
    assert "\n" not in str(refused.value)


def test_task_bpe_tokenizer_is_shorter_round_trips_and_reloads(word_sorting, tmp_path):
    model, tok = TinyModel(arch="qwen3", config={"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                                                 "num_key_value_heads": 1, "head_dim": 16, "intermediate_size": 32},
                           tokenizer="task_bpe", tokenizer_vocab_size=300).load(word_sorting)
    assert len(tok) == 300 == model.config.vocab_size and tok.padding_side == "left"
    example = word_sorting.eval_examples()[0]  # held-out text, never seen by the tokenizer's training
    for text in (example.prompt, example.answer, "Zebra, 42, ~`|"):
        ids = tok(text)["input_ids"]
        assert ids[0] == tok.bos_token_id and tok.decode(ids, skip_special_tokens=True) == text
    assert len(tok(example.prompt)["input_ids"]) < len(example.prompt) / 2  # English text: several characters a token
    tok.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    assert reloaded(example.prompt)["input_ids"] == tok(example.prompt)["input_ids"]
    assert (reloaded.pad_token_id, reloaded.eos_token_id, reloaded.padding_side) == (0, 2, "left")


def test_task_bpe_needs_the_task():
    with pytest.raises(ValueError, match="model.tokenizer='task_bpe' is trained on the task's text"):
        TinyModel(arch="qwen3", tokenizer="task_bpe").load()


def test_one_rl_step_runs_with_the_task_bpe_tokenizer(compose, rl_overrides, tmp_path):
    cfg = compose(rl_overrides + [
        "task=reasoning_gym", "+task.config.min_words=3", "+task.config.max_words=3", "task.eval_size=8",
        "model.tokenizer=task_bpe", "model.tokenizer_vocab_size=300", "sft.steps=2", "sft.eval_every=2",
        "sft.eval_size=4", "sft.batch_size=8", "sft.max_new_tokens=8", "train.steps=1", "rollout.max_new_tokens=8",
    ])
    summary = train(cfg)
    final = AutoTokenizer.from_pretrained(tmp_path / "run" / "final")  # saved beside the final checkpoint
    assert len(final) == 300 and summary is not None


def test_the_cold_start_cache_key_covers_the_tokenizer_choice(compose):
    def key(*overrides):
        cfg = compose(["task=rg_word_sorting", *overrides])
        model, task = (OmegaConf.to_container(cfg[k], resolve=True) for k in ("model", "task"))
        return cache_key(model, task, SFTConfig(**OmegaConf.to_container(cfg.sft, resolve=True)), cfg.seed)

    keys = {key(), key("model.tokenizer=task_bpe"), key("model.tokenizer=task_bpe", "model.tokenizer_vocab_size=256")}
    assert len(keys) == 3


@pytest.mark.parametrize("overrides, key", [
    (["sft.enabled=false"], "rollout.max_new_tokens=80"),
    (["sft.max_new_tokens=80", "rollout.max_new_tokens=8"], "sft.max_new_tokens=80"),
])
def test_a_prompt_and_budget_beyond_the_models_positions_are_refused_before_training(overrides, key, compose, tmp_path):
    # word_sorting's longest instruction is 415 char tokens: it fits 480 positions, and
    # with 80 new tokens it does not
    cfg = compose(["task=rg_word_sorting", "rollout.max_new_tokens=80", "model.config.max_position_embeddings=480",
                   f"paths.output_dir={tmp_path}", f"paths.cache_dir={tmp_path / 'cache'}", *overrides])
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)} does not fit: the longest prompt of task=reasoning_gym "
                                          r"is 415 tokens .* > model.config.max_position_embeddings=480; ") as refused:
        build(cfg)
    assert "\n" not in str(refused.value) and not list(tmp_path.glob("cache/*/sft_info.json"))  # none trained
    build(compose(["task=rg_word_sorting", "rollout.max_new_tokens=80", "model.tokenizer=task_bpe",
                   "sft.enabled=false", f"paths.output_dir={tmp_path}"]))  # ~115-token prompts + 80 fit 256


EVALS = ["string_insertion", "spiral_matrix", "binary_matrix", "n_queens"]  # score_answer eval()s the completion
TOWER = "9**9**9**9"  # eval never returns: 9 ** (9 ** 387420489)


@pytest.mark.parametrize("dataset, reached", [
    ("word_sorting", None),
    ("word_sequence_reversal", None),
    ("polynomial_equations", None),  # sympy builds the equations; the verifier compares floats
    ("polynomial_multiplication", "sp (sympy) in PolynomialMultiplicationDataset.score_answer"),
    ("countdown", "parse_expr (sympy) in CountdownDataset.score_answer"),
    ("string_insertion", "eval in StringInsertionDataset.score_answer"),
    ("spiral_matrix", "eval in SpiralMatrixDataset.score_answer"),
    ("binary_matrix", "eval in BinaryMatrixDataset.score_answer"),
    ("n_queens", "eval in NQueensDataset.score_answer"),
    ("bitwise_arithmetic", "eval in verify_solution"),  # of the reference, through a function it calls
])
def test_verifiers_that_run_text_or_sympy_are_read_from_their_code_and_grade_apart(dataset, reached):
    """sympy can run without end on model output, and eval() runs it as Python; string checks do neither and
    grade in the training process."""
    verifier = registry()[dataset][0]
    assert risky_call(verifier.score_answer, verifier) == reached
    assert ReasoningGym(dataset=dataset, dataset_size=10).checker_may_hang == (reached is not None)


def writer(path) -> str:
    """A completion that, evaluated as Python, appends the id of the process evaluating it to `path`."""
    return f"__import__('builtins').open(r'{path}', 'a').write(str(__import__('os').getpid()) + ' ')"


class Replies:
    """A rollout backend that answers every prompt with the same texts (gspo_lab.rollout.backend's contract)."""

    def __init__(self, texts: list[str]) -> None:
        self.texts = texts

    def generate(self, tokenizer, prompts, sampling, row_seeds=None, routing=None) -> Generated:
        return Generated(completions_of(self.texts))


def completions_of(texts: list[str]) -> Completions:
    """What a sampler returns for `texts` (one token each: only the texts are graded)."""
    ones = torch.ones(len(texts), 1, dtype=torch.long)
    return Completions(ones, ones, ones, ones, torch.zeros(len(texts), dtype=torch.bool), list(texts))


@pytest.mark.parametrize("dataset", EVALS)
def test_completions_a_verifier_evals_grade_outside_the_trainer_in_rl(dataset, compose, tmp_path):
    """A power tower stopped the run for good, and any expression the policy wrote ran inside the trainer."""
    cfg = compose(["task=reasoning_gym", f"task.dataset={dataset}", "task.eval_size=1", "reward.timeout_s=1"])
    task = instantiate(cfg.task)
    rewards = build_rewards(cfg.reward, task)  # reward=task: num_workers null, a worker where the checker can hang
    assert rewards.runner is not None
    example, written = task.eval_examples()[0], tmp_path / "pids"
    try:  # the tower last: its worker is killed and replaced, and the run goes on
        scores = rewards.score(*reward_inputs([example] * 3, completions_of([example.answer, writer(written), TOWER])))
    finally:
        rewards.runner.close()
    assert scores.total.tolist() == [1.0, 0.0, 0.0]
    # the writer: evaluated in the worker, its write refused there (gspo_lab.grading.guard), a counted error
    assert (scores.metrics["reward/timeouts"], scores.metrics["reward/errors"]) == (1.0, 1.0)
    assert not written.exists()


def test_completions_a_verifier_evals_grade_outside_the_trainer_in_evaluation(compose, tmp_path):
    """The same in evaluation, where the run's held-out set (word_sorting, a string check) grades in this process."""
    written = tmp_path / "pids"
    cfg = compose(["task=reasoning_gym", "task.eval_size=2", "eval.grading_timeout_s=1",
                   *[f"+eval.sets.{name}.task.dataset={name}" for name in EVALS]])
    plan = build_eval(cfg, instantiate(cfg.task), instantiate(cfg.prompt))
    evaluator = plan.evaluator(None, 4, [], 0)
    assert plan.grader is not None and [s.grader is plan.grader for s in evaluator.sets] == [False] + [True] * 4
    try:
        metrics, _ = evaluator.run(None, None, backend=Replies([writer(written), TOWER]))
    finally:
        plan.close()
    for name in EVALS:  # the writer's write refused in the worker, the tower timed out: both failures
        assert (metrics[f"eval/{name}/greedy"], metrics[f"eval/{name}/grading_failures"]) == (0.0, 2.0), name
    assert metrics["eval/heldout/grading_failures"] == 0.0
    assert not written.exists()
