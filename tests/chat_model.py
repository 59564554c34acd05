"""The tiny chat model and GSM8K-format data of scripts/make_chat_example.py, for tests."""

import json
from pathlib import Path

from scripts.make_chat_example import CHATML, EXTRA_ROWS, save_chat_model, word_problems, write_jsonl

__all__ = ["CHATML", "EXTRA_ROWS", "RECIPE_TWO_STEPS", "recipe_stand_ins", "save_chat_model", "word_problems",
           "write_jsonl"]

# a recipe's run shrunk to two RL steps on its stand-ins (tests/test_recipes.py, scripts/gpu_check.py)
RECIPE_TWO_STEPS = ["rollout.prompts_per_step=4", "rollout.group_size=2", "rollout.max_new_tokens=8",
                    "train.steps=2", "train.eval_every=2", "task.eval_size=4", "callbacks.progress.refresh_rate=0",
                    "reward.num_workers=1"]


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


def recipe_stand_ins(root: Path) -> dict[str, list[str]]:
    """Per recipe (conf/experiment/recipe_*.yaml), the overrides that point it at tiny local stand-ins of its model
    and data, written under `root`, on CPU (tests/test_recipes.py; scripts/gpu_check.py runs them on a GPU)."""
    dense, moe = save_chat_model(root / "dense"), save_chat_model(root / "moe", moe=True)
    (root / "gsm8k").mkdir(), (root / "math").mkdir()
    return {
        "recipe_gsm8k": [f"model.path={dense}", "trainer=cpu", "task.path=json", "task.name=null",
                         data_files(root / "gsm8k", word_problems(40), word_problems(10, seed=1))],
        "recipe_fp16_sanity": [f"model.path={dense}", "trainer=cpu", "task.path=json",
                               data_files(root / "math", math_rows(40, 0), math_rows(10, 1))],
        # each prompt three times, as the hub copy repeats them
        "recipe_math_moe": [f"model.path={moe}", "trainer.accelerator=cpu", "trainer.devices=2",
                            "trainer.precision=32-true",
                            f"task.path={write_jsonl(root / 'dapo.jsonl', dapo_rows(60, 0) * 3)}"],
    }

