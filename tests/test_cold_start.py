"""The cached cold start: a miss trains and saves, a hit loads the same weights without training, and
every setting that determines the result changes the cache key."""

import json

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from gspo_lab.cold_start import INFO_FILE, cache_key, cold_start, policy_from_config
from gspo_lab.sft import SFTConfig, SFTModule
from tests.checked_tasks import GradedApart

FAST_SFT = SFTConfig(steps=3, batch_size=8, eval_every=2, eval_size=8, max_new_tokens=4)


def test_miss_trains_then_hit_loads_identical_weights(tmp_path, compose, tiny):
    cfg = compose(tiny)
    task = instantiate(cfg.task)
    model_source = instantiate(cfg.model)
    fresh, _ = model_source.load()
    model, tok, info = cold_start(model_source, task, FAST_SFT, 0, "key0", tmp_path)
    assert not info["cache_hit"] and info["steps"] == 3 and (tmp_path / "key0" / INFO_FILE).is_file()
    assert [step for step, _ in info["history"]] == [2, 3]  # eval_every=2, and at the last step
    assert not torch.equal(fresh.lm_head.weight, model.lm_head.weight)  # training moved the weights
    again, tok2, info2 = cold_start(model_source, task, FAST_SFT, 0, "key0", tmp_path)
    assert info2["cache_hit"] and info2["accuracy"] == info["accuracy"]
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), name
    assert tok2("12+3=")["input_ids"] == tok("12+3=")["input_ids"]
    assert json.loads((tmp_path / "key0" / INFO_FILE).read_text())["seed"] == 0
    assert not list(tmp_path.glob("*.partial-*"))  # nothing half-written left behind


def test_cache_key_covers_model_task_sft_and_seed(base_cfg):
    cfg = base_cfg
    model, task = (OmegaConf.to_container(cfg[k], resolve=True) for k in ("model", "task"))
    base = cache_key(model, task, FAST_SFT, 0)
    assert base == cache_key(model, task, FAST_SFT, 0)
    assert base != cache_key(model, task, FAST_SFT, 1)
    assert base != cache_key(model, task, SFTConfig(steps=4, batch_size=8, eval_every=2, eval_size=8, max_new_tokens=4), 0)
    assert base != cache_key(model, {**task, "digits": 2}, FAST_SFT, 0)
    assert base != cache_key({**model, "arch": "qwen3"}, task, FAST_SFT, 0)


@pytest.mark.parametrize("key, value", [("steps", 0), ("lr", -1.0), ("target_accuracy", 1.5), ("eval_every", 0),
                                        ("weight_decay", -0.1)])
def test_bad_sft_settings_name_key_value_and_rule(key, value):
    with pytest.raises(ValueError, match=rf"sft\.{key}={value}"):
        SFTConfig(**{key: value})


def test_a_fixed_sft_seed_lets_runs_of_several_seeds_share_one_cold_start(tmp_path, compose, tiny):
    def start(*overrides):
        cfg = compose(tiny + [f"paths.cache_dir={tmp_path}", "sft.steps=2", "sft.eval_every=2", "sft.eval_size=4",
                              "sft.batch_size=8", "sft.max_new_tokens=4", *overrides])
        return policy_from_config(cfg, instantiate(cfg.task))

    model0, _, info0 = start("seed=0")
    assert not info0["cache_hit"] and info0["seed"] == 0
    model1, _, info1 = start("seed=1", "sft.seed=0")  # RL seed 1 on seed 0's cold start
    assert info1["cache_hit"] and info1["path"] == info0["path"]
    assert all(torch.equal(a, b) for a, b in zip(model0.state_dict().values(), model1.state_dict().values()))
    _, _, own = start("seed=1")  # by default each seed trains its own
    assert not own["cache_hit"] and own["seed"] == 1 and own["path"] != info0["path"]


def test_sft_enabled_must_be_true_false_or_auto():
    with pytest.raises(ValueError, match=r"sft\.enabled='yes' is invalid: must be true, false or auto"):
        SFTConfig(enabled="yes")
    with pytest.raises(ValueError, match=r"sft\.enabled=1 is invalid"):
        SFTConfig(enabled=1)


@pytest.fixture
def checkpoint(tmp_path, compose, tiny):
    """A tiny model saved with save_pretrained, as a user's own checkpoint."""
    cfg = compose(tiny)
    torch.manual_seed(0)
    model, tokenizer = instantiate(cfg.model).load()
    model.save_pretrained(tmp_path / "ckpt")
    tokenizer.save_pretrained(tmp_path / "ckpt")
    return tmp_path / "ckpt", model


def hf(compose, tmp_path, path, *overrides):
    cfg = compose(["model=hf", f"model.path={path}", f"paths.cache_dir={tmp_path / 'cache'}", "sft.steps=2",
                   "sft.eval_every=2", "sft.eval_size=4", "sft.batch_size=8", "sft.max_new_tokens=4", *overrides])
    return cfg, policy_from_config(cfg, instantiate(cfg.task))


def test_a_pretrained_checkpoint_starts_rl_as_saved_unless_sft_is_asked_for(checkpoint, compose, tmp_path):
    path, saved = checkpoint
    _, (model, _, info) = hf(compose, tmp_path, path)  # sft.enabled=auto, the default
    assert info == {"enabled": False} and not (tmp_path / "cache").exists()
    for (name, a), b in zip(saved.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), name  # bitwise: the same tensors written and read back
    _, (trained, _, asked) = hf(compose, tmp_path, path, "sft.enabled=true")
    assert asked["enabled"] and not asked["cache_hit"] and asked["steps"] == 2
    assert not torch.equal(trained.lm_head.weight, saved.lm_head.weight)


def test_the_cold_start_of_a_checkpoint_is_keyed_by_its_contents_not_its_path(checkpoint, compose, tmp_path):
    path, saved = checkpoint
    _, (_, _, first) = hf(compose, tmp_path, path, "sft.enabled=true")
    _, (_, _, again) = hf(compose, tmp_path, path, "sft.enabled=true")
    assert again["cache_hit"] and again["path"] == first["path"]
    with torch.no_grad():
        saved.lm_head.weight.add_(0.01)  # the user trains on and saves to the same folder
    saved.save_pretrained(path)
    _, (_, _, changed) = hf(compose, tmp_path, path, "sft.enabled=true")
    assert not changed["cache_hit"] and changed["path"] != first["path"]


@pytest.mark.filterwarnings("ignore:You are trying to `self.log\\(\\)`")  # evaluate() outside a Trainer
def test_the_cold_starts_evaluations_send_its_checker_to_the_grading_worker_once(compose, tiny):
    """A checker that grades in a worker crosses to it with the task's data; each evaluation built a new checker,
    pickled the task again, and the worker kept every copy."""
    task = GradedApart(eval_size=4)
    model, tokenizer = instantiate(compose(tiny).model).load(task)
    module = SFTModule(model, tokenizer, task, SFTConfig(eval_size=4, max_new_tokens=4, target_accuracy=1.0), 0)
    try:
        for step in range(3):
            module.evaluate(step)
        sent = set(module.grader.functions)
        assert len(sent) == 1 and [worker.known for worker in module.grader.workers] == [sent]
    finally:
        module.grader.close()


def test_the_cold_starts_evaluation_keeps_the_runs_limits_on_tool_calls(compose, tiny):
    """It built its multi-turn loop from a default RolloutConfig(), so rollout.max_tool_calls and
    max_tool_response_tokens never reached it (sft.py)."""
    cfg = compose(tiny + ["task=calculator", "model.config.max_position_embeddings=320", "rollout.max_tool_calls=1",
                          "rollout.max_tool_response_tokens=5"])
    task = instantiate(cfg.task)
    model, tokenizer = instantiate(cfg.model).load(task)
    module = SFTModule(model, tokenizer, task, SFTConfig(eval_size=4), 0, rollout=instantiate(cfg.rollout))
    try:
        assert (module.agent.max_tool_calls, module.agent.max_tool_response_tokens) == (1, 5)
    finally:
        module.tool_runner.close()
