"""The recipes (conf/experiment/recipe_*.yaml) for GPU users, each run here for two RL steps on CPU with its
model and data paths pointed at tiny local stand-ins: the recipe's whole path (chat template, dataset columns,
rewards, stop tokens, and the FSDP settings that apply on CPU) is exercised."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from gspo_lab import CONFIG_DIR
from tests.chat_model import save_chat_model, word_problems, write_jsonl

RECIPES = sorted(p.stem for p in (Path(CONFIG_DIR) / "experiment").glob("recipe_*.yaml"))
SMALL = ["rollout.prompts_per_step=4", "rollout.group_size=2", "rollout.max_new_tokens=8", "train.steps=2",
         "train.eval_every=2", "task.eval_size=4", "callbacks.progress.refresh_rate=0", "reward.num_workers=1"]


def data_files(folder: Path, rows: list[dict], held_out: list[dict]) -> str:
    files = {"train": str(write_jsonl(folder / "train.jsonl", rows)),
             "test": str(write_jsonl(folder / "test.jsonl", held_out))}
    return "task.data_files=" + json.dumps(files).replace('"', "")


def math_rows(n: int, seed: int) -> list[dict]:
    boxed = ", so the answer is $\\boxed{"
    return [{"problem": r["question"], "solution": r["answer"].replace("\n#### ", boxed) + "}$"}
            for r in word_problems(n, seed)]


def dapo_rows(n: int, seed: int) -> list[dict]:
    return [{"data_source": "math_dapo", "prompt": [{"role": "user", "content": r["question"]}],
             "reward_model": {"ground_truth": r["answer"].split("#### ")[1], "style": "rule"}}
            for r in word_problems(n, seed)]


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory) -> dict[str, list[str]]:
    """Per recipe, the overrides that point it at tiny local stand-ins of its model and data on CPU."""
    root = tmp_path_factory.mktemp("recipes")
    dense, moe = save_chat_model(root / "dense"), save_chat_model(root / "moe", moe=True)
    (root / "gsm8k").mkdir(), (root / "math").mkdir()
    return {
        "recipe_gsm8k": [f"model.path={dense}", "trainer=cpu", "task.path=json", "task.name=null",
                         data_files(root / "gsm8k", word_problems(40), word_problems(10, seed=1))],
        "recipe_fp16_sanity": [f"model.path={dense}", "trainer=cpu", "task.path=json",
                               data_files(root / "math", math_rows(40, 0), math_rows(10, 1))],
        "recipe_math_moe": [f"model.path={moe}", "trainer.accelerator=cpu", "trainer.devices=2",
                            "trainer.precision=32-true",
                            f"task.path={write_jsonl(root / 'dapo.jsonl', dapo_rows(60, 0))}"],
    }


def test_every_recipe_has_stand_ins_and_a_header(stand_ins):
    assert RECIPES == sorted(stand_ins) == ["recipe_fp16_sanity", "recipe_gsm8k", "recipe_math_moe"]
    for name in RECIPES:
        header = (Path(CONFIG_DIR) / "experiment" / f"{name}.yaml").read_text()
        assert "# Hardware:" in header and "# Source reports" in header and f"experiment={name}" in header


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_a_recipe_runs_two_rl_steps_on_its_stand_ins(recipe, stand_ins, tmp_path):
    env = {**os.environ, "WANDB_MODE": "offline", "HYDRA_FULL_ERROR": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run([sys.executable, "-m", "gspo_lab.train", f"experiment={recipe}", *stand_ins[recipe], *SMALL,
                             f"hydra.run.dir={tmp_path}", f"paths.cache_dir={tmp_path / 'cache'}"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    with open(tmp_path / "metrics.csv") as file:
        rows = [row for row in csv.DictReader(file) if row.get("reward/mean")]
    assert len(rows) == 2 and all(row["reward/math_accuracy/timeouts"] == "0.0" for row in rows)
    config = OmegaConf.load(tmp_path / "config.yaml")
    assert config.reward.functions[0]._target_ == "gspo_lab.rewards.math_accuracy"
    assert (tmp_path / "final" / "tokenizer_config.json").is_file()
