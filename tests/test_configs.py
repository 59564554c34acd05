"""Every option of every config group composes and instantiates (lightning-hydra-template's habit), and
every algorithm picks the objective and routing mode it claims."""

import math
from pathlib import Path

import lightning as L
import pytest
import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import OmegaConf

from gspo_lab import CONFIG_DIR
from gspo_lab.config import RolloutConfig, RoutingConfig, TrainConfig
from gspo_lab.objectives import GRPO, GSPO, GSPOToken, Objective
from gspo_lab.prompts import PromptFormat
from gspo_lab.rewards import build_rewards
from gspo_lab.rollout.trajectory import final_text
from gspo_lab.sft import SFTConfig

CONF = Path(CONFIG_DIR)


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def test_every_group_has_options():
    for group in ("model", "task", "objective", "advantage", "rollout", "routing", "optimizer", "trainer",
                  "logger", "callbacks", "algorithm", "sft"):
        assert options(group), group


@pytest.mark.parametrize("name", options("model"))
def test_model_options(name, compose, tmp_path):
    cfg = compose([f"model={name}"])
    if name == "hf":  # needs a checkpoint: tests/models/test_models.py loads one it saved
        with pytest.raises(InstantiationException, match="model.path is not set"):
            instantiate(cfg.model)
        return
    model, tokenizer = instantiate(cfg.model).load()
    assert isinstance(model, torch.nn.Module) and len(tokenizer) == model.config.vocab_size


@pytest.mark.parametrize("name", options("task"))
def test_task_options(name, compose, tmp_path):
    overrides = [f"task={name}"]
    if name in ("jsonl", "hf"):
        data = tmp_path / "data.jsonl"
        data.write_text("".join(f'{{"prompt": "{i}+{i}=", "answer": "{2 * i}"}}\n' for i in range(50)))
        overrides.append(f"task.path={data}")
    task = instantiate(compose(overrides).task)
    example = task.examples("train", 3, seed=0)[0]
    demonstration = task.demonstration(example)
    if not isinstance(demonstration, str):  # multi-turn: the checker reads the last turn
        demonstration = final_text(demonstration)
    assert task.reward(example, demonstration) == 1.0


# the learned graders need a model: a tiny one saved here (tests/rewards/graders.py), random, so only finite scores
LEARNED = {"reward_model": [], "judge": ["reward.functions.0.verdicts={y: 1.0, n: 0.0}"]}


@pytest.mark.parametrize("name", options("reward"))
def test_reward_options_build_and_score_a_demonstration(name, compose, tmp_path):
    overrides = []
    if name in LEARNED:
        from tests.rewards.graders import save_grader

        folder = save_grader(tmp_path / name, causal=name == "judge")
        overrides = [f"reward.functions.0.path={folder}", *LEARNED[name]]
    cfg = compose([f"reward={name}", *overrides])
    task = instantiate(cfg.task)
    rewards = build_rewards(cfg.reward, task)
    try:
        example = task.examples("train", 1, seed=0)[0]
        answers = [task.demonstration(example), f"$\\boxed{{{task.demonstration(example)}}}$", "-1"]
        scores = rewards.score([example.prompt] * 3, answers, [[1]] * 3, {"answer": [example.answer] * 3})
        # any reward option: finite numbers, and a right answer (bare, or boxed for LaTeX readers) never below a
        # wrong one; the built-in accuracy rewards give it 1 and the wrong one 0
        right, boxed, wrong = scores.total.tolist()
        assert all(math.isfinite(x) for x in (right, boxed, wrong))
        if name not in LEARNED:
            assert max(right, boxed) >= wrong
        if name in ("task", "math_verify"):
            assert (max(right, boxed), wrong) == (1.0, 0.0)
    finally:
        if rewards.runner is not None:
            rewards.runner.close()


@pytest.mark.parametrize("name", options("prompt"))
def test_prompt_options(name, compose):
    assert isinstance(instantiate(compose([f"prompt={name}"]).prompt), PromptFormat)


@pytest.mark.parametrize("group, cls", [("rollout", RolloutConfig), ("routing", RoutingConfig)])
def test_settings_nodes(group, cls, compose):
    for name in options(group):
        assert isinstance(instantiate(compose([f"{group}={name}"])[group]), cls)


def test_train_and_sft_nodes(base_cfg):
    assert isinstance(instantiate(base_cfg.train), TrainConfig)
    assert SFTConfig(**OmegaConf.to_container(base_cfg.sft, resolve=True)).runs_on(instantiate(base_cfg.model))


@pytest.mark.parametrize("name", options("optimizer"))
def test_optimizer_options(name, compose):
    parameter = torch.nn.Parameter(torch.zeros(8))
    optimizer = instantiate(compose([f"optimizer={name}"]).optimizer)([parameter])
    assert optimizer.param_groups[0]["lr"] == 3e-5  # ${train.lr}


@pytest.mark.parametrize("name", options("trainer"))
def test_trainer_options(name, compose, tmp_path):
    cfg = compose([f"trainer={name}", f"paths.output_dir={tmp_path}"])
    if cfg.trainer.accelerator == "gpu" and not torch.cuda.is_available():
        cfg.trainer.accelerator, cfg.trainer.devices = "cpu", 1  # the rest of the file must still be valid
        cfg.trainer.precision = "bf16-mixed"
    assert isinstance(instantiate(cfg.trainer), L.Trainer)


@pytest.mark.parametrize("name", options("logger"))
def test_logger_options(name, compose, tmp_path):
    loggers = [instantiate(c) for c in compose([f"logger=[{name}]", f"paths.output_dir={tmp_path}"]).logger.values()]
    assert len(loggers) == 1 and loggers[0].save_dir.startswith(str(tmp_path))


def test_several_loggers_at_once(compose, tmp_path):
    cfg = compose(["logger=[csv,wandb,tensorboard]", f"paths.output_dir={tmp_path}"])
    assert sorted(cfg.logger) == ["csv", "tensorboard", "wandb"]


def test_callbacks(base_cfg, tmp_path, compose):
    cfg = compose([f"paths.output_dir={tmp_path}"])
    callbacks = [instantiate(c) for c in cfg.callbacks.values()]
    checkpoint = next(c for c in callbacks if isinstance(c, L.pytorch.callbacks.ModelCheckpoint))
    assert checkpoint.every_n_rl_steps == cfg.train.ckpt_every  # RL steps, not Lightning's optimizer steps
    assert checkpoint._every_n_train_steps == 0 and checkpoint._every_n_epochs == 0  # nothing else triggers it


@pytest.mark.parametrize(
    "name, cls, replay",
    [("gspo", GSPO, "off"), ("gspo_token", GSPOToken, "off"), ("grpo", GRPO, "off"), ("grpo_rr", GRPO, "r2"),
     ("gspo_shuffled_rewards", GSPO, "off"), ("grpo_r3", GRPO, "r3"), ("gspo_r3", GSPO, "r3"),
     ("grpo_tis", GRPO, "off")],
)
def test_algorithms(name, cls, replay, compose):
    cfg = compose([f"algorithm={name}"])
    objective = instantiate(cfg.objective)
    assert type(objective) is cls
    assert objective.rollout_correction == ("tis_token" if name == "grpo_tis" else "none")
    assert instantiate(cfg.routing).replay == replay
    assert instantiate(cfg.train).shuffle_rewards == (name == "gspo_shuffled_rewards")
    # objective.* still overrides what the algorithm chose
    assert instantiate(compose([f"algorithm={name}", "objective.clip_high=0.5"]).objective).clip_high == 0.5


# objectives composed from the axes in YAML
COMPOSED = ["cispo", "clip_cov", "dapo", "dppo_kl", "dppo_tv", "dr_grpo", "dro", "gmpo", "gpg", "gspo_clip_cov",
            "gspo_kl_cov", "gspo_turn", "kl_cov", "luspo", "sapo", "vespo"]


@pytest.mark.parametrize("name", COMPOSED)
def test_composed_algorithms(name, compose):
    cfg = compose([f"algorithm={name}"])
    objective = instantiate(cfg.objective)
    assert type(objective) is Objective and objective.name == name and objective.rollout_correction == "none"
    assert instantiate(cfg.routing).replay == "off"
    assert instantiate(cfg.advantage).scale == ("none" if name == "dr_grpo" else "group")  # Dr. GRPO: no std
    # objective.* still overrides what the algorithm chose
    assert instantiate(compose([f"algorithm={name}", "objective.beta=0.5"]).objective).beta == 0.5


def test_algorithm_options_are_the_tested_ones():
    assert options("algorithm") == sorted(["grpo", "grpo_r3", "grpo_rr", "grpo_tis", "gspo", "gspo_r3",
                                           "gspo_shuffled_rewards", "gspo_token", *COMPOSED])
