"""The recipes (conf/experiment/recipe_*.yaml) for GPU users, each run here for two RL steps on CPU with its
model and data paths pointed at tiny local stand-ins: the recipe's whole path (chat template, dataset columns,
rewards, stop tokens, and the FSDP settings that apply on CPU) is exercised. Every job of a recipe's sweep is
planned (the checks a run makes before loading weights), and the GPU memory its header states is the estimate of
gspo_lab.memory for the hub model's shape."""

import csv
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from gspo_lab import CONFIG_DIR
from gspo_lab.memory import GB, ModelShape, estimate_memory
from gspo_lab.rewards import math_accuracy
from gspo_lab.tasks import HFDataset
from gspo_lab.train import plan, warn_inexact_old_logprobs
from tests.chat_model import RECIPE_TWO_STEPS, recipe_stand_ins
from tests.conftest import compose_config

RECIPES = sorted(p.stem for p in (Path(CONFIG_DIR) / "experiment").glob("recipe_*.yaml"))
HEADERS = {name: (Path(CONFIG_DIR) / "experiment" / f"{name}.yaml").read_text() for name in RECIPES}
# the arms a header names besides its sweep ("algorithm=grpo for GRPO on the same seeds")
ARMS = {"recipe_gsm8k": [["algorithm=grpo"]], "recipe_math_moe": [["algorithm=grpo_rr"]]}
# The hub models' shapes, from each model's config.json on the hub (num_hidden_layers, num_key_value_heads, head_dim
# or hidden_size / num_attention_heads, hidden_size, vocab_size) and parameter counts from the model cards:
# DeepSeek-R1-Distill-Qwen-1.5B is Qwen2.5-Math-1.5B (1536 = 12 heads x 128, untied embeddings: 1.78B);
# Qwen2.5-1.5B-Instruct the same layers with tied embeddings (1.54B); Qwen3-30B-A3B 30.5B (3.3B active).
SHAPES = {"deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B": ModelShape(1.78e9, 28, 2, 128, 1536, 151936),
          "Qwen/Qwen2.5-1.5B-Instruct": ModelShape(1.54e9, 28, 2, 128, 1536, 151936),
          "Qwen/Qwen3-30B-A3B-Base": ModelShape(30.5e9, 48, 4, 128, 2048, 151936)}
GPUS = {"recipe_fp16_sanity": 1, "recipe_gsm8k": 1, "recipe_math_moe": 16}  # as each header's Hardware line says


def sweep_jobs(recipe: str) -> list[list[str]]:
    """The overrides of each job `gspo-train -m experiment=<recipe>` launches, as Hydra's BasicSweeper expands the
    recipe's hydra.sweeper.params; one job without overrides where it has none."""
    params = OmegaConf.select(OmegaConf.load(Path(CONFIG_DIR) / "experiment" / f"{recipe}.yaml"),
                              "hydra.sweeper.params") or {}
    overrides = OverridesParser.create().parse_overrides([f"{key}={value}" for key, value in params.items()])
    return BasicSweeper.split_arguments(overrides, None)[0]


JOBS = [(recipe, job) for recipe in RECIPES for job in sweep_jobs(recipe) + ARMS.get(recipe, [])]


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory) -> dict[str, list[str]]:
    """Per recipe, the overrides that point it at tiny local stand-ins of its model and data on CPU."""
    return recipe_stand_ins(tmp_path_factory.mktemp("recipes"))


def test_every_recipe_has_stand_ins_and_a_header(stand_ins):
    assert RECIPES == sorted(stand_ins) == ["recipe_fp16_sanity", "recipe_gsm8k", "recipe_math_moe"]
    for name in RECIPES:
        header = (Path(CONFIG_DIR) / "experiment" / f"{name}.yaml").read_text()
        assert "# Hardware:" in header and "# Source reports" in header and f"experiment={name}" in header


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_header_counts_the_runs_of_the_sweep(recipe):
    runs = re.search(r"\((\d+) runs", HEADERS[recipe].splitlines()[1])
    assert (int(runs.group(1)) if runs else 1) == len(sweep_jobs(recipe))  # fp16_sanity: 2 x 2 x 3 = 12


@pytest.mark.parametrize("recipe, job", JOBS, ids=[" ".join([recipe, *job]) for recipe, job in JOBS])
def test_every_job_of_a_recipe_is_planned(recipe, job, stand_ins, tmp_path):
    run = plan(compose_config([f"experiment={recipe}", *job, *stand_ins[recipe], f"paths.output_dir={tmp_path}"]))
    assert run.task.dropped_duplicates == (120 if recipe == "recipe_math_moe" else 0)  # 60 distinct of 180 rows


@pytest.mark.parametrize("recipe, job", JOBS, ids=[" ".join([recipe, *job]) for recipe, job in JOBS])
def test_no_recipe_takes_old_logprobs_from_16_bit_decode_kernels(recipe, job):
    # the warning of train.py: on a GPU in bf16 the engine's log-probs alone clip GSPO (ratio 1.7e-3 > 4e-4)
    cfg = compose_config([f"experiment={recipe}", *job])
    assert cfg.trainer.accelerator == "gpu" and cfg.trainer.precision == "bf16-mixed"
    assert not warn_inexact_old_logprobs(cfg.rollout.logprobs_from_generation, "cuda", cfg.trainer.precision)


@pytest.mark.parametrize("recipe", RECIPES)
def test_training_reward_and_eval_accuracy_agree_on_a_plain_answer(recipe):
    # eval/accuracy is task=hf's checker, which reads "The answer is 42" as 42; so must the training reward
    cfg = compose_config([f"experiment={recipe}"])
    task = HFDataset(rows=[{"prompt": "6 x 7?", "answer": "42"}], eval_rows=[{"prompt": "6 x 7?", "answer": "42"}])
    assert task.is_correct(task.records[0], "The answer is 42.")
    for function in cfg.reward.functions:
        assert function._target_ == "gspo_lab.rewards.math_accuracy"
        assert math_accuracy(None, ["The answer is 42."], answer=["42"], latex_only=function.latex_only) == [1.0]


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_header_states_the_memory_estimate_and_it_fits(recipe):
    cfg = compose_config([f"experiment={recipe}"])
    estimate = estimate_memory(cfg, SHAPES[cfg.model.path], GPUS[recipe], cfg.task.max_prompt_tokens)
    stated = re.search(r"# Memory per GPU \(gspo_lab\.memory\): about (\d+) GB of (\d+)", HEADERS[recipe])
    assert stated, f"{recipe}: no memory line; the estimate is {estimate}"
    assert int(stated.group(1)) == round(estimate.peak / GB), f"{recipe}: the estimate is {estimate}"
    assert estimate.peak < int(stated.group(2)) * GB


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_a_recipe_runs_two_rl_steps_on_its_stand_ins(recipe, stand_ins, tmp_path):
    env = {**os.environ, "WANDB_MODE": "offline", "HYDRA_FULL_ERROR": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run([sys.executable, "-m", "gspo_lab.train", f"experiment={recipe}", *stand_ins[recipe],
                             *RECIPE_TWO_STEPS,
                             f"hydra.run.dir={tmp_path}", f"paths.cache_dir={tmp_path / 'cache'}"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    with open(tmp_path / "metrics.csv") as file:
        rows = [row for row in csv.DictReader(file) if row.get("reward/mean")]
    assert len(rows) == 2 and all(row["reward/math_accuracy/timeouts"] == "0.0" for row in rows)
    config = OmegaConf.load(tmp_path / "config.yaml")
    assert config.reward.functions[0]._target_ == "gspo_lab.rewards.math_accuracy"
    assert (tmp_path / "final" / "tokenizer_config.json").is_file()
