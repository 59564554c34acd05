"""gspo-eval: evaluate any checkpoint on any evaluation sets, as training evaluates (gspo_lab.evaluation).

    gspo-eval checkpoint=outputs/2026-11-25/10-00-00               # a run dir: its final/
    gspo-eval checkpoint=<run>/checkpoints/rl_step=50.ckpt eval=sampled
    gspo-eval checkpoint=<folder> task=countdown eval.n=16 'eval.k=[1,4,16]'   # a save_pretrained folder

A checkpoint is a run dir (its final/, else checkpoints/last.ckpt), a `save_pretrained` folder (final/, a
gspo-export folder, LoRA adapters with adapter_config.json on the base the run's config builds), or a Lightning
checkpoint of a run. When it belongs to a run dir, the run's config.yaml is the starting point, so its task,
prompt, seed and generation settings apply, and the command line changes it (`key=value`, or `group=option` for
a whole group such as task=countdown or eval=sampled); else the config is gspo-train's defaults plus the command
line. Writes eval.json (metrics, settings, checkpoint, tokenizer) and samples.jsonl (every completion: prompt,
completion, extracted answer, correct, rewards) to the Hydra run dir. A rollout.backend=vllm run evaluates on its
vLLM engine, as in training; eval.engine=trainer evaluates it with transformers on the same weights, as an hf run
(eval.json's eval/engine says which). The same checkpoint, seed and eval.batch_size give the numbers a
single-process training run logged at that step (a DDP run's ranks drew the same per-sample seeds, but batched
other prompts together, so their logits may differ by float rounding).
"""

from __future__ import annotations

import json
import logging
import math
import sys
from pathlib import Path

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf, open_dict
from tqdm import tqdm

from gspo_lab import CONFIG_DIR
from gspo_lab.eval_sets import build_eval, evaluation_backend, load_option
from gspo_lab.evaluation import write_jsonl
from gspo_lab.export import policy_of_checkpoint
from gspo_lab.loggers import quiet_libraries
from gspo_lab.models.builders import load_pretrained
from gspo_lab.report.summary import eval_engine
from gspo_lab.rollout.backend import RolloutBackend, backend_class, build_backend
from gspo_lab.rollout.multi_turn import MultiTurn
from gspo_lab.tools import ToolRunner

log = logging.getLogger(__name__)
TOOL_KEYS = ("checkpoint", "tokenizer", "progress")  # gspo-eval's own keys (conf/gspo_eval.yaml)


class EvalError(ValueError):
    """A checkpoint, tokenizer or setting gspo-eval cannot use; the message names them."""


def run_dir_of(checkpoint: Path) -> Path | None:
    """The run dir a checkpoint belongs to (it holds config.yaml), or None."""
    candidates = [checkpoint, checkpoint.parent, checkpoint.parent.parent]
    return next((c for c in candidates if (c / "config.yaml").is_file()
                 and ((c / "checkpoints").is_dir() or (c / "final").is_dir())), None)


def run_config(cfg: DictConfig, run_dir: Path | None, overrides: list[str]) -> DictConfig:
    """The run's config.yaml with the command line's overrides applied, plus gspo-eval's own keys and output
    dir; without a run dir, the composed config as it is."""
    if run_dir is None:
        return cfg
    base = OmegaConf.load(run_dir / "config.yaml")
    with open_dict(base):
        if "eval" not in base:  # a run from before the eval group evaluated what eval=default does
            base.eval = load_option("eval", "default", "gspo-eval")
        for override in overrides:
            if override.startswith("~"):
                raise EvalError(f"{override}: deleting a key is not supported by gspo-eval on a run dir; set it "
                                "instead (e.g. eval.sets={heldout: {}} to keep one set)")
            key, _, value = override.lstrip("+").partition("=")
            if key in TOOL_KEYS or key == "ckpt_path":
                continue
            if "." not in key and (Path(CONFIG_DIR) / key).is_dir():  # group=option: the whole group
                if key == "experiment":
                    raise EvalError(f"{override}: an experiment changes many groups at once; gspo-eval on a run dir "
                                    "takes key=value and group=option overrides")
                base[key] = load_option(key, value, "gspo-eval")
            else:
                base.merge_with_dotlist([f"{key}={value}"])
        for key in TOOL_KEYS:
            base[key] = cfg[key]
        base.paths.output_dir = cfg.paths.output_dir
    return base


def load_checkpoint(cfg: DictConfig, checkpoint: Path, run_dir: Path | None):
    """(model, tokenizer, where the tokenizer came from) of any supported checkpoint."""
    if checkpoint.is_dir() and run_dir == checkpoint:
        final = checkpoint / "final"
        checkpoint = final if final.is_dir() else checkpoint / "checkpoints" / "last.ckpt"
    if checkpoint.is_file():
        if run_dir is None:
            raise EvalError(f"checkpoint={str(checkpoint)!r}: a Lightning checkpoint is read with its run's config, "
                            "and no run dir (config.yaml) holds it")
        model, tokenizer, _ = policy_of_checkpoint(checkpoint, cfg)
        return model, tokenizer, f"the run's ({run_dir})"
    if (checkpoint / "adapter_config.json").is_file():
        from peft import PeftModel

        if run_dir is None:
            raise EvalError(f"checkpoint={str(checkpoint)!r}: LoRA adapters need their base, which the run's config "
                            "builds, and no run dir (config.yaml) holds them")
        from gspo_lab.cold_start import policy_from_config

        base, tokenizer, _ = policy_from_config(cfg, instantiate(cfg.task))
        model = PeftModel.from_pretrained(base, checkpoint).merge_and_unload()
        return model, tokenizer, f"the run's ({run_dir})"
    if not (checkpoint / "config.json").is_file():
        raise EvalError(f"checkpoint={str(checkpoint)!r} is not a run dir, a save_pretrained folder (config.json), "
                        "LoRA adapters (adapter_config.json) or a Lightning checkpoint file")
    model, tokenizer = load_pretrained(checkpoint, cfg.model.get("dtype", "float32"))
    return model, tokenizer, str(checkpoint)


def check_tokenizer(model, tokenizer, checkpoint: str, source: str) -> None:
    """Refuse a tokenizer whose ids the model cannot embed, or one another than the checkpoint's own."""
    rows = model.get_input_embeddings().num_embeddings
    special = {name: getattr(tokenizer, f"{name}_token_id") for name in ("eos", "pad", "bos")}
    too_big = {name: i for name, i in special.items() if i is not None and i >= rows}
    if len(tokenizer) > rows or too_big:
        raise EvalError(f"checkpoint={checkpoint} and tokenizer {source} do not belong together: the tokenizer has "
                        f"{len(tokenizer)} tokens {too_big or ''} and the model embeds {rows} rows")


def rollout_backend(cfg: DictConfig, model, setting: str) -> RolloutBackend | None:
    """The run's rollout backend where evaluation generates through it (eval.engine=rollout and a backend that
    serves evaluations: vLLM's), as in training; None where transformers evaluates the model itself."""
    if setting != "rollout":
        return None
    try:
        rollout = instantiate(cfg.rollout)
        serves = backend_class(rollout.backend).serves_evaluation
    except Exception as error:  # noqa: BLE001 - Hydra wraps the dataclass's ValueError
        raise EvalError(str(error.__cause__ or error)) from None
    if not serves:
        return None
    try:
        return build_backend(model, rollout)
    except ValueError as error:  # not installed here
        raise EvalError(f"{error}; or evaluate with transformers: rollout.backend=hf") from None


def evaluate_checkpoint(cfg: DictConfig) -> dict:
    """Evaluate `cfg.checkpoint` on `cfg.eval`'s sets; writes eval.json and samples.jsonl; returns eval.json."""
    quiet_libraries()
    checkpoint = Path(str(cfg.checkpoint)).expanduser()
    if not checkpoint.exists():
        raise EvalError(f"checkpoint={str(cfg.checkpoint)!r}: no such file or folder")
    model, tokenizer, source = load_checkpoint(cfg, checkpoint, run_dir_of(checkpoint))
    if cfg.get("tokenizer"):
        from transformers import AutoTokenizer

        given = AutoTokenizer.from_pretrained(str(cfg.tokenizer), local_files_only=True)
        if given.get_vocab() != tokenizer.get_vocab():
            raise EvalError(f"checkpoint={checkpoint} and tokenizer={cfg.tokenizer} do not belong together: the "
                            f"tokenizer's vocabulary differs from {source} tokenizer the checkpoint was trained with")
        given.padding_side, given.pad_token = "left", given.pad_token or given.eos_token
        tokenizer, source = given, str(cfg.tokenizer)
    check_tokenizer(model, tokenizer, str(checkpoint), source)
    model.to("cuda" if torch.cuda.is_available() else "cpu").eval()
    try:
        plan = build_eval(cfg, instantiate(cfg.task), instantiate(cfg.prompt), cfg.train.get("on_reward_error", "zero"))
        plan.fit(model, tokenizer, cfg.rollout.max_new_tokens)  # the prompts training held out, no others
        rollout = instantiate(cfg.rollout)
        tools = ToolRunner(rollout.tool_workers, rollout.tool_timeout_s)  # a task with tools evaluates multi-turn
        agent_of = MultiTurn.factory(rollout, tools, tokenizer, instantiate(cfg.prompt).chat_template_kwargs)
        evaluator = plan.evaluator(tokenizer, rollout.max_new_tokens, rollout.stop_token_ids, cfg.seed, agent_of)
    except ValueError as error:
        raise EvalError(str(error)) from error
    # a backend only where it generates: vLLM's; an hf engine (maybe a quantised copy) evaluates on the model itself
    engine = rollout_backend(cfg, model, evaluator.settings.engine)
    total = sum(len(s.examples) * (evaluator.settings.greedy + evaluator.settings.n) for s in evaluator.sets)
    try:
        backend, generated_by = evaluation_backend(engine, model, evaluator.settings.engine)
        with tqdm(total=total, unit="completion", disable=not cfg.get("progress", True), file=sys.stderr) as bar:
            metrics, rows = evaluator.run(model, tokenizer, progress=bar.update, backend=backend)
    finally:
        plan.close()
        tools.close()
        if engine is not None:
            engine.close()
    metrics.update(generated_by)
    out = Path(cfg.paths.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    result = {"checkpoint": str(checkpoint), "tokenizer": source, "seed": cfg.seed,
              "eval": OmegaConf.to_container(cfg.eval, resolve=True), "metrics": metrics,
              "eval/engine": eval_engine([metrics]),
              "sets": {s.name: len(s.examples) for s in evaluator.sets}}
    (out / "eval.json").write_text(json.dumps(result, indent=2))
    write_jsonl(out / "samples.jsonl", rows)
    return result


def format_metrics(result: dict) -> str:
    """eval.json's metrics as `set: metric value ...` lines."""
    lines, by_set = [f"gspo-eval: {result['checkpoint']}"], {}
    for key, value in result["metrics"].items():
        parts = key.split("/")
        if len(parts) >= 3 and parts[0] == "eval":
            by_set.setdefault(parts[1], []).append(f"{'/'.join(parts[2:])} {value:.4g}")
    for name, items in by_set.items():
        seconds = result["metrics"].get(f"time/eval/{name}_s", math.nan)
        lines.append(f"  {name} ({result['sets'][name]} prompts, {seconds:.1f} s): " + ", ".join(items))
    return "\n".join(lines)


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="gspo_eval")
def main(cfg: DictConfig) -> None:
    checkpoint = Path(str(cfg.checkpoint)).expanduser()
    try:
        cfg = run_config(cfg, run_dir_of(checkpoint), list(HydraConfig.get().overrides.task))
        result = evaluate_checkpoint(cfg)
    except (EvalError, FileNotFoundError) as error:
        print(f"gspo-eval: {error}", file=sys.stderr)
        sys.exit(2)
    print(format_metrics(result))
    print(f"  wrote {Path(cfg.paths.output_dir) / 'eval.json'} and samples.jsonl")


if __name__ == "__main__":
    main()
