"""reward=reward_model (gspo_lab.rewards.reward_model): a sequence-classification model's score with TRL's contract,
in batches, on a tiny reward model saved here; the refusals; TRL's form (a path in the reward list); a run trains
on it."""

import math
import os

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from gspo_lab.rewards import RewardModel, build_rewards
from gspo_lab.train import build
from tests.rewards.graders import save_grader

PROMPTS = ["12+34=", "5+6=", "70+8=", "9+90=", "1+1="]
COMPLETIONS = ["46", "11", "7", "99 and more", "2"]


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory):
    return save_grader(tmp_path_factory.mktemp("reward_model"))


def test_scores_are_the_models_own_in_batches_whatever_the_batch_size(reward_model_dir):
    """Each score is the model's logit for the text alone (prompt + completion, no special tokens); batches of 2
    (right-padded, the model pools each row's last real token) give the same to float32 rounding, in
    ceil(5 / 2) = 3 forwards."""
    scorer = RewardModel(str(reward_model_dir), batch_size=2)
    model = AutoModelForSequenceClassification.from_pretrained(reward_model_dir).eval()
    alone = []
    for prompt, completion in zip(PROMPTS, COMPLETIONS):
        ids = scorer.tokenizer(prompt + completion, return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            alone.append(model(**ids).logits[0, 0].item())
    calls = []
    scorer.model.register_forward_hook(lambda module, args, output: calls.append(1))
    scores = scorer(PROMPTS, COMPLETIONS)
    assert len(calls) == 3 and len(set(scores)) == 5
    assert scores == pytest.approx(alone, abs=1e-5)


def test_max_length_keeps_the_end_of_a_long_input(reward_model_dir):
    """max_length=4 reads the last 4 characters: "9+90=99 and more" scores as " more" does, minus its first."""
    short = RewardModel(str(reward_model_dir), max_length=4)
    assert short(["9+90="], ["99 and more"]) == pytest.approx(short([""], ["more"]), abs=1e-5)


def test_offload_returns_the_model_to_the_host_between_calls(reward_model_dir):
    scorer = RewardModel(str(reward_model_dir), offload=True, device="cpu")
    assert scorer(PROMPTS[:1], COMPLETIONS[:1]) and next(scorer.model.parameters()).device.type == "cpu"


def test_what_is_not_a_reward_model_is_refused_naming_the_key(reward_model_dir, tmp_path):
    two = save_grader(tmp_path / "two", num_labels=2)
    for cfg, message in (
        ({"functions": [{"_target_": "gspo_lab.rewards.RewardModel", "path": str(two)}]},
         r"reward\.functions\.0.path=.*its head has 2 labels"),
        ({"functions": [{"_target_": "gspo_lab.rewards.RewardModel", "path": str(tmp_path / "none")}]},
         r"reward\.functions\.0.path=.*no reward model there"),
        ({"functions": [{"_target_": "gspo_lab.rewards.RewardModel", "path": str(reward_model_dir),
                         "batch_size": 0}]}, r"reward\.functions\.0.batch_size=0 is invalid"),
    ):
        with pytest.raises(ValueError, match=message):
            build_rewards(cfg, None)
    scorer = RewardModel(str(reward_model_dir))  # the char tokenizer has no chat template
    with pytest.raises(ValueError, match="the prompts are conversations.*has no chat template"):
        scorer([[{"role": "user", "content": "1+1="}]], [[{"role": "assistant", "content": "2"}]])


def test_a_path_in_the_reward_list_is_a_reward_model_as_in_trl(reward_model_dir):
    rewards = build_rewards({"functions": [str(reward_model_dir)]}, None)
    (function,) = rewards.functions
    assert isinstance(function.fn, RewardModel) and function.weight == 1.0
    assert function.fn(PROMPTS, COMPLETIONS) == pytest.approx(RewardModel(str(reward_model_dir))(PROMPTS, COMPLETIONS))


def test_a_hub_id_in_the_reward_list_loads_from_the_hub_cache_as_in_trl(reward_model_dir, tmp_path):
    """TRL's reward_funcs=["org/name"]: the id resolves through the hub cache (offline here: a cache laid out as
    huggingface_hub writes it), in a fresh process so that HF_HUB_CACHE is read at import."""
    import json
    import shutil
    import subprocess
    import sys

    repo = tmp_path / "hub" / "models--gspo-lab--tiny-rm"
    shutil.copytree(reward_model_dir, repo / "snapshots" / ("0" * 40))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    code = ("import json, sys; from gspo_lab.rewards import build_rewards; "
            "fn = build_rewards({'functions': ['gspo-lab/tiny-rm']}, None).functions[0].fn; "
            f"print(json.dumps([fn.__name__, fn({PROMPTS!r}, {COMPLETIONS!r})]))")
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    name, scores = json.loads(done.stdout.splitlines()[-1])
    assert name == "tiny-rm"
    assert scores == pytest.approx(RewardModel(str(reward_model_dir))(PROMPTS, COMPLETIONS), abs=1e-5)


def test_a_folder_under_home_is_found_from_its_tilde_path(tmp_path, monkeypatch):
    """A config names a cached reward model as ~/...: the folder under $HOME loads (a hub id would not start so)."""
    save_grader(tmp_path / "models" / "rm")
    monkeypatch.setenv("HOME", str(tmp_path))
    scorer = RewardModel("~/models/rm")
    assert scorer.path == str(tmp_path / "models" / "rm") and scorer.__name__ == "rm"


def test_a_run_trains_on_the_reward_models_scores(compose, rl_overrides, reward_model_dir, updated_batches):
    """reward=reward_model: the step's rewards are the model's scores of its completions (their mean is
    reward/mean), and the updates move the policy."""
    run, module, _ = build(compose(rl_overrides + ["reward=reward_model",
                                                   f"reward.functions.0.path={reward_model_dir}",
                                                   "train.steps=1", "train.eval_every=0"]))
    before = [p.detach().clone() for p in module.model.parameters()]
    run.trainer.fit(module)
    batch = updated_batches[0]
    texts = module.tokenizer.batch_decode(batch.input_ids, skip_special_tokens=True)
    scorer = RewardModel(str(reward_model_dir))
    scores = scorer(texts, [""] * len(texts))
    assert batch.rewards.tolist() == pytest.approx(scores, abs=1e-4)
    # one call for the round's 16 completions: ceil(16 / 32) = 1 forward, never one per completion
    function = module.rewards.functions[0].fn
    calls = []
    function.model.register_forward_hook(lambda *_: calls.append(1))
    module.rewards.score(texts, [""] * len(texts), [[0]] * len(texts), {})
    assert len(calls) == 1
    assert math.isclose(module.history[0]["reward/mean"], sum(scores) / len(scores), abs_tol=1e-4)
    assert any(not torch.equal(a, b) for a, b in zip(before, module.model.parameters()))


def test_a_learned_reward_logs_the_gold_reward_and_the_kl_from_the_initial_policy(compose, rl_overrides,
                                                                                  reward_model_dir, tmp_path):
    """reward/gold is the task's checker on the same completions: step 0 samples alike whatever the reward (same
    seed, same initial policy), so it equals reward/mean of a run trained on the checker. kl/to_initial is 0 before
    any update (the policy is the initial one, to float rounding) and grows after it; β = 0 throughout."""
    run, proxy, _ = build(compose(rl_overrides + ["reward=reward_model", f"reward.functions.0.path={reward_model_dir}",
                                                  "train.steps=2", "train.eval_every=0", "objective.beta=0"]))
    run.trainer.fit(proxy)
    run, gold, _ = build(compose(rl_overrides + ["train.steps=1", "train.eval_every=0", "objective.beta=0",
                                                 f"paths.output_dir={tmp_path / 'gold'}"]))
    run.trainer.fit(gold)
    assert proxy.history[0]["reward/gold"] == gold.history[0]["reward/mean"]
    assert "reward/gold" not in gold.history[0] and "kl/to_initial" not in gold.history[0]
    assert 0 <= proxy.history[0]["kl/to_initial"] < 1e-4 and proxy.history[1]["kl/to_initial"] > 1e-3


def test_a_batched_function_is_called_once_and_held_to_one_reward_per_completion():
    """`batched` (as RewardModel is): one call with all completions; a list of the wrong length stops the run, and
    an exception costs every completion of the call (each scored 0, each counted)."""
    from gspo_lab.rewards import RewardContractError, RewardFunction, WeightedRewards

    seen = []

    def lengths(prompts, completions, **kwargs):
        seen.append(len(completions))
        return [float(len(c)) for c in completions]

    def short(prompts, completions, **kwargs):
        return [1.0]

    def broken(prompts, completions, **kwargs):
        raise RuntimeError("no device")

    for fn in (lengths, short, broken):
        fn.batched = True
    scores = WeightedRewards([RewardFunction(lengths)]).score(PROMPTS, COMPLETIONS, [[1]] * 5, {})
    assert seen == [5] and scores.total.tolist() == [2.0, 2.0, 1.0, 11.0, 1.0]
    with pytest.raises(RewardContractError, match=r"short returned list of length 1 for 5 completions"):
        WeightedRewards([RewardFunction(short)]).score(PROMPTS, COMPLETIONS, [[1]] * 5, {})
    rewards = WeightedRewards([RewardFunction(broken)])
    assert rewards.score(PROMPTS, COMPLETIONS, [[1]] * 5, {}).total.tolist() == [0.0] * 5
    assert rewards.errors == {"broken": 5}


def test_the_scripts_reward_model_comes_from_the_verifiers_pairs_and_trains_a_run(compose, rl_overrides, fast_rl,
                                                                                   tmp_path):
    """scripts/train_reward_model.py on the fast run's cold start (TRL's RewardTrainer): the pairs come from the
    checker, the flipped share is as asked, the saved folder loads as reward=reward_model and a run trains on it."""
    import json
    import subprocess
    import sys

    out = tmp_path / "rm"
    result = subprocess.run([sys.executable, "scripts/train_reward_model.py", "--out", str(out), "--prompts", "48",
                             "--epochs", "3", "--flip", "0.25", *fast_rl], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    stats = json.loads((out / "stats.json").read_text())
    assert stats["train_pairs"] > 20 and stats["held_out_pairs"] > 5
    assert 0.1 < stats["flipped_pairs"] / stats["train_pairs"] < 0.4
    run, module, _ = build(compose(rl_overrides + ["reward=reward_model", f"reward.functions.0.path={out}",
                                                   "train.steps=1", "train.eval_every=0"]))
    run.trainer.fit(module)
    assert module.history[0]["reward/gold"] >= 0 and math.isfinite(module.history[0]["reward/mean"])


@pytest.mark.vllm
def test_a_run_on_vllm_trains_on_the_reward_model(compose, rl_overrides, reward_model_dir):
    pytest.importorskip("vllm")
    run, module, _ = build(compose(rl_overrides + ["rollout.backend=vllm", "reward=reward_model",
                                                   f"reward.functions.0.path={reward_model_dir}",
                                                   "train.steps=1", "train.eval_every=0"]))
    run.trainer.fit(module)
    row = module.history[0]
    assert math.isfinite(row["reward/mean"]) and row["reward/std"] > 0 and 0 <= row["reward/gold"] <= 1


def test_a_checkpoint_without_the_score_head_is_refused(tmp_path):
    """A causal LM saved with num_labels=1 passed the label check and scored with a randomly initialised head; the
    only sign was transformers' load report."""
    causal = save_grader(tmp_path / "causal", causal=True, num_labels=1)
    with pytest.raises(ValueError, match=r"reward\.functions\.0\.path=.*no weights for the score head \['score"):
        build_rewards({"functions": [{"_target_": "gspo_lab.rewards.RewardModel", "path": str(causal)}]}, None)


def test_chat_template_kwargs_reach_the_reward_models_template(reward_model_dir, tmp_path):
    """prompt.chat_template_kwargs reached TRL's reward model and not this one's."""
    scorer = RewardModel(str(reward_model_dir), chat_template_kwargs={"mood": "calm"})
    scorer.tokenizer.chat_template = ("{% for m in messages %}{{ m.content }}{% endfor %}"
                                      "{% if mood is defined %}[{{ mood }}]{% endif %}")
    texts = scorer.texts([[{"role": "user", "content": "1+1="}]], [[{"role": "assistant", "content": "2"}]])
    assert texts == ["1+1=2[calm]"]


def test_the_script_trains_on_the_strings_the_reward_model_scores(compose, rl_overrides, reward_model_dir):
    """scripts/train_reward_model.py trained on the rendered prompt (template, chat template, system message) where
    RewardModel scores the data's prompt: its pairs now hold the prompts reward functions get, and their tokens
    are those of RewardModel's texts."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    import train_reward_model as script

    _, module, _ = build(compose(rl_overrides + ["prompt.template='Q: {prompt} A:'"]))
    groups = script.sampled_groups(module, 3, 2, seed=0)
    examples = module.task.examples("train", 3, seed=0)
    assert [prompt for prompt, _, _ in groups] == [e.prompt for e in examples]  # not "Q: ... A:"
    pairs = [{"prompt": prompt, "chosen": completions[0], "rejected": completions[1]}
             for prompt, completions, _ in groups]
    scorer = RewardModel(str(reward_model_dir))
    ids = scorer.tokenizer(scorer.texts([p["prompt"] for p in pairs], [p["chosen"] for p in pairs]),
                           add_special_tokens=False)["input_ids"]
    assert [row["chosen_ids"] for row in script.tokenized(pairs, scorer.tokenizer)] == ids
