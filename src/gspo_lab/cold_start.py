"""The cached cold start: SFT once per (model, task, SFT settings, seed), reused by every RL run.

The cache folder is named by a hash of everything that determines the result, so a sweep of 40 RL runs
trains it once; a file lock makes parallel jobs of one sweep wait for the first instead of training twice.
A finished folder holds the model and tokenizer (`save_pretrained`) and `sft_info.json`; it is written
under a temporary name and renamed, so a crash never leaves a half-written cache entry.

    gspo-sft task=countdown seed=1        # run the stage alone (same config tree as gspo-train)
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Callable

import hydra
import lightning as L
import torch
import transformers
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from gspo_lab import CONFIG_DIR
from gspo_lab.config import RolloutConfig
from gspo_lab.loggers import quiet_libraries
from gspo_lab.models.builders import ContextTooLong, fit_task
from gspo_lab.prompts import PromptFormat
from gspo_lab.sft import SFTConfig, SFTModule

log = logging.getLogger(__name__)
CACHE_VERSION = 4  # bump when the SFT procedure changes what it produces (2: demonstrations from their own seed
# stream; 3: the tiny tool template writes pythonic calls; 4: guess_number answers with the range)
INFO_FILE = "sft_info.json"


def cache_key(model_cfg: dict, task_cfg: dict, sft: SFTConfig, seed: int) -> str:
    """A short hash of everything that determines the cold-start checkpoint."""
    identity = {
        "model": model_cfg,
        "task": task_cfg,
        "sft": asdict(sft),
        "seed": seed,
        "version": CACHE_VERSION,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:16]


def cold_start(model_source, task, sft: SFTConfig, seed: int, key: str, cache_dir: str | Path, accelerator="cpu",
               check: Callable[[Any, Any], None] | None = None, precision="32-true",
               prompt: PromptFormat | None = None, rollout: RolloutConfig | None = None):
    """The SFT'd model and tokenizer, trained now (on one device of `accelerator`, at the trainer's `precision`)
    or loaded from the cache; plus the stage's info dict. `check(model, tokenizer)` runs once: on the freshly
    built model before any training, or on a cache hit. Demonstrations are formatted by `prompt` (default: the
    prompt text as it is); a task with tools evaluates with `rollout`'s limits on tool calls (the run's)."""
    entry = Path(cache_dir).expanduser() / key
    entry.parent.mkdir(parents=True, exist_ok=True)
    with open(entry.parent / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # parallel jobs of one sweep wait here for the first
        if (entry / INFO_FILE).is_file():
            info = json.loads((entry / INFO_FILE).read_text())
            log.info("cold start: cache hit %s (held-out accuracy %.3f)", entry, info["accuracy"])
            model, tokenizer = model_source.load_from(entry)
            if check is not None:
                check(model, tokenizer)
            return model, tokenizer, {**info, "cache_hit": True, "path": str(entry)}
        info = _train_and_save(model_source, task, sft, seed, entry, accelerator, check, precision,
                               prompt or PromptFormat(), rollout or RolloutConfig())
    model, tokenizer = model_source.load_from(entry)
    return model, tokenizer, {**info, "cache_hit": False, "path": str(entry)}


def _train_and_save(model_source, task, sft: SFTConfig, seed: int, entry: Path, accelerator,
                    check, precision, prompt: PromptFormat, rollout: RolloutConfig) -> dict[str, Any]:
    L.seed_everything(seed, workers=True, verbose=False)
    model, tokenizer = model_source.load(task)
    if check is not None:
        check(model, tokenizer)
    module = SFTModule(model, tokenizer, task, sft, seed, prompt.bind(tokenizer), rollout)
    trainer = L.Trainer(
        max_steps=sft.steps,
        accelerator=accelerator,
        devices=1,
        precision=precision,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
        deterministic=True,
    )
    started = time.perf_counter()
    try:
        trainer.fit(module)
        seconds = time.perf_counter() - started
        last = module.history[-1] if module.history else None
        step, acc = last or (trainer.global_step, module.evaluate(trainer.global_step))
    finally:
        if module.grader is not None:
            module.grader.close()
        if module.tool_runner is not None:
            module.tool_runner.close()
    if acc < sft.target_accuracy:
        log.warning("cold start ended at step %d with held-out accuracy %.3f < target %.3f", step, acc, sft.target_accuracy)
    info = {"accuracy": acc, "steps": step, "seconds": round(seconds, 2), "history": module.history, "seed": seed}
    partial = entry.with_name(f"{entry.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    (partial / INFO_FILE).write_text(json.dumps(info, indent=2))
    shutil.rmtree(entry, ignore_errors=True)  # a folder without sft_info.json is not a finished entry
    os.replace(partial, entry)  # atomic: the entry is either complete or absent
    log.info("cold start: trained in %.1f s to held-out accuracy %.3f at step %d -> %s", seconds, acc, step, entry)
    return info


def policy_from_config(cfg: DictConfig, task) -> tuple[Any, Any, dict[str, Any]]:
    """The run's starting policy: the cached cold start when `sft.enabled` (true, or auto for a model built
    from config), else the model as built or the checkpoint as saved."""
    model_source = instantiate(cfg.model)
    prompt = instantiate(cfg.prompt) if "prompt" in cfg else PromptFormat()
    sft = SFTConfig(**OmegaConf.to_container(cfg.sft, resolve=True))

    budgets = {"rollout.max_new_tokens": cfg.rollout.max_new_tokens}
    if not sft.runs_on(model_source):
        L.seed_everything(cfg.seed, verbose=False)
        model, tokenizer = model_source.load(task)
        fit_task(model, tokenizer, task, budgets, prompt.bind(tokenizer))
        return model, tokenizer, {"enabled": False}
    sft = replace(sft, enabled=True)  # auto resolved: the cache key of a cold start does not depend on how it was asked
    budgets["sft.max_new_tokens"] = sft.max_new_tokens
    if model_source.pretrained and model_source.lora.enabled:
        log.warning("sft.enabled=true with model.lora.enabled=true: the cold start trains every weight of %s "
                    "before the LoRA adapters exist", model_source.path)

    def check(model, tokenizer) -> None:  # before the cold start trains, or on a cache hit
        fit_task(model, tokenizer, task, budgets, prompt.bind(tokenizer))

    seed = cfg.seed if sft.seed is None else sft.seed
    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    model_cfg.pop("lora", None)  # adapters train in RL only: the cold start (full SFT) is the same with or without
    if model_source.pretrained:  # the checkpoint's contents, not only its path
        model_cfg["contents"] = model_source.fingerprint()
    trainer = cfg.get("trainer", {})
    accelerator, precision = trainer.get("accelerator", "cpu"), trainer.get("precision", "32-true")
    if precision not in ("32-true", "32", 32):  # a 32-bit cold start keeps the key it always had
        model_cfg["precision"] = precision
    if prompt != PromptFormat():  # demonstrations in another prompt format; the default keeps the key it had
        model_cfg["prompt"] = asdict(prompt)
    rollout = instantiate(cfg.rollout) if "rollout" in cfg else RolloutConfig()
    limits = {"max_tool_calls": rollout.max_tool_calls, "max_tool_response_tokens": rollout.max_tool_response_tokens}
    if task.toolset is not None and limits != {"max_tool_calls": None, "max_tool_response_tokens": None}:
        # the evaluation that stops it early runs with them; the defaults keep the key
        model_cfg["tool_limits"] = limits
    key = cache_key(model_cfg, OmegaConf.to_container(cfg.task, resolve=True), sft, seed)
    model, tokenizer, info = cold_start(model_source, task, sft, seed, key, cfg.paths.cache_dir, accelerator, check,
                                        precision, prompt, rollout)
    return model, tokenizer, {"enabled": True, **info}


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="train")
def main(cfg: DictConfig) -> float:
    """gspo-sft: run (or load) the cold start of this configuration and print where it lies."""
    quiet_libraries()
    try:
        _, _, info = policy_from_config(cfg, instantiate(cfg.task))
    except ContextTooLong as error:
        raise SystemExit(f"gspo-sft: invalid configuration: {error}") from error
    if not info["enabled"]:
        raise SystemExit(f"gspo-sft: sft.enabled={cfg.sft.enabled}, so there is no cold start to run (auto runs it "
                         "only for models built from config; sft.enabled=true runs it on a checkpoint)")
    verb = "loaded from cache" if info["cache_hit"] else f"trained in {info['seconds']} s"
    print(f"cold start {verb}: held-out accuracy {info['accuracy']:.3f} at step {info['steps']}\n{info['path']}")
    return info["accuracy"]


if __name__ == "__main__":
    main()
