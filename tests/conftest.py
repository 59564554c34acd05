"""Shared fixtures: the Hydra config composed once, and tiny-model overrides that keep tests fast."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf, open_dict

from gspo_lab import CONFIG_DIR
from gspo_lab.routing import is_moe
from gspo_lab.routing.adapters import find_routers

os.environ.setdefault("WANDB_MODE", "offline")

# a one-layer tiny MoE: same classes as the default, a fraction of the time
TINY = ["model.config.num_hidden_layers=1", "model.config.hidden_size=64", "model.config.moe_intermediate_size=32"]


def pytest_configure(config) -> None:
    """A pytest-xdist worker computes on its share of the cores: two workers of two torch threads each on two cores
    ran the numerics tests three times slower than one process (OpenMP threads spinning against each other)."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        threads = max(1, (os.cpu_count() or 1) // int(workers))
        torch.set_num_threads(threads)
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))  # what the tests' subprocesses inherit


def pytest_collection_modifyitems(items: list) -> None:
    """Tests marked `long` first: under pytest-xdist (worksteal) a worker starts each at once and the others take
    the rest, where one met at the end of a queue kept the suite waiting on a single core."""
    items.sort(key=lambda item: item.get_closest_marker("long") is None)  # stable: the rest keep their order


def compose_config(overrides: list[str] | None = None) -> DictConfig:
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return hydra_compose(config_name="train", overrides=overrides or [], return_hydra_config=False)


@pytest.fixture(scope="session")
def compose():
    """compose(overrides) -> the root config with those Hydra overrides."""
    return compose_config


@pytest.fixture(scope="session")
def tiny() -> list[str]:
    """Overrides that shrink the default model to one small layer."""
    return list(TINY)


@pytest.fixture(scope="session")
def cold_start_cache(tmp_path_factory) -> str:
    """A cache dir shared by the session's RL tests, so their short cold start is trained once: under pytest-xdist
    by every worker of the run (the cold start's file lock makes a second worker wait for the first's)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's folder, above each worker's own
    path = root / "sft-cache"
    path.mkdir(exist_ok=True)
    return str(path)


@pytest.fixture(scope="session")
def fast_rl(tiny, cold_start_cache) -> list[str]:
    """A fast RL run: the one-layer model after 60 SFT steps, 4 prompts x 4 completions, 2 mini-batches,
    a format reward (so groups have reward variance); outputs go where the test sends them."""
    return tiny + [
        f"paths.cache_dir={cold_start_cache}",
        "sft.steps=60", "sft.eval_every=60", "sft.eval_size=16", "sft.target_accuracy=1.0", "sft.batch_size=64",
        "task.format_weight=0.5", "task.eval_size=32",
        "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=6",
        "train.steps=2", "train.minibatches=2", "train.eval_every=1", "train.lr=1e-3",
        "callbacks.progress.refresh_rate=0",
    ]


@pytest.fixture(scope="session")
def tool_rl(tiny, cold_start_cache) -> list[str]:
    """A fast multi-turn RL run: task=calculator, with a TRL-style tool and environment besides its own
    (tests/tools/trl_style.py) and the environment's reward beside the task's; the one-layer model after a short
    cold start at a high rate, which is enough for well-formed tool calls (wrong numbers) at temperature 0.5."""
    return tiny + [
        f"paths.cache_dir={cold_start_cache}", "task=calculator", "model.config.max_position_embeddings=320",
        "task.tools=[gspo_lab.tasks.calculator.calculate,tests.tools.trl_style.multiply]",
        "task.environment=tests.tools.trl_style.CounterEnv", "task.eval_size=8", "task.format_weight=0.5",
        "reward.functions=[{_target_: gspo_lab.rewards.TaskReward, weight: 1.0},"
        "{_target_: gspo_lab.rewards.environment_reward, weight: 0.1}]",
        "sft.steps=150", "sft.eval_every=150", "sft.eval_size=8", "sft.target_accuracy=1.0", "sft.batch_size=32",
        "sft.lr=3e-3", "sft.max_new_tokens=200",
        "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=200",
        "rollout.temperature=0.5",  # the short cold start's samples at 1 are rarely well-formed calls
        "train.steps=2", "train.minibatches=2", "train.eval_every=2", "train.lr=1e-3",
        "callbacks.progress.refresh_rate=0",
    ]


@pytest.fixture
def updated_batches(monkeypatch) -> list:
    """Every RolloutBatch the updates train on in this test, in order (Updater.update still runs them)."""
    from gspo_lab.step.updater import Updater

    seen, real_update = [], Updater.update

    def kept(self, batch, *args, **kwargs):
        seen.append(batch)
        return real_update(self, batch, *args, **kwargs)

    monkeypatch.setattr(Updater, "update", kept)
    return seen


@pytest.fixture
def rl_overrides(fast_rl, tmp_path) -> list[str]:
    """The fast RL run with its outputs in this test's tmp_path."""
    return fast_rl + [f"paths.output_dir={tmp_path / 'run'}"]


@pytest.fixture(scope="session")
def base_cfg() -> DictConfig:
    """The default config, composed once per session; tests copy it before changing it."""
    return compose_config()


@pytest.fixture
def cfg(base_cfg, tmp_path) -> DictConfig:
    """A copy of the default config whose outputs and caches live in this test's tmp_path."""
    cfg = base_cfg.copy()
    with open_dict(cfg):
        cfg.paths.cache_dir = str(tmp_path / "cache")
    return cfg


def load_family(name: str, **overrides):
    """The model of conf/model/<name>.yaml with 2 layers, seed 0, and `overrides` (dotted keys of that file); an
    MoE's routers get N(0, 0.5) weights, so top-k choices are well separated (random init leaves them near zero)."""
    torch.manual_seed(0)
    cfg = OmegaConf.load(Path(CONFIG_DIR) / "model" / f"{name}.yaml")
    cfg.config.num_hidden_layers = 2
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value)
    model, tokenizer = instantiate(cfg).load()
    for _, router, _ in find_routers(model, "test") if is_moe(model) else []:
        torch.nn.init.normal_(router.weight, std=0.5)
    return model, tokenizer


@pytest.fixture(scope="session")
def tiny_family():
    """tiny_family(name, **overrides) -> a 2-layer model of one conf/model family and its tokenizer (`load_family`)."""
    return load_family
