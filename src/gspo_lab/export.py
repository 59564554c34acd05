"""gspo-export: any checkpoint of a run as a folder `AutoModelForCausalLM.from_pretrained` and inference servers
load as it is (weights in safetensors, config, generation config, tokenizer with its chat template).

    gspo-export outputs/2026-11-24/10-00-00 exported/              # the run's checkpoints/last.ckpt
    gspo-export outputs/.../checkpoints/rl_step=50.ckpt exported/   # any checkpoint of it
    gspo-export RUN exported/ --merge                               # a LoRA run: the merged model too

The run's config.yaml rebuilds its starting policy (the cold start from its cache; `model=hf`: the checkpoint),
the Lightning checkpoint's weights go into it, and it is saved. A LoRA run's checkpoint holds the adapters
only: `OUT/adapter` (PeftModel.from_pretrained on the base loads it) and, with `--merge`, the merged model in
`OUT` (PEFT's merge_and_unload).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from gspo_lab.cold_start import policy_from_config
from gspo_lab.models.lora import apply_lora

log = logging.getLogger(__name__)


def checkpoint_of(source: Path) -> Path:
    """A run dir's checkpoints/last.ckpt, or the checkpoint file given."""
    ckpt = source / "checkpoints" / "last.ckpt" if source.is_dir() else source
    if not ckpt.is_file():
        raise FileNotFoundError(f"{source}: neither a run dir with checkpoints/last.ckpt nor a checkpoint file")
    return ckpt


def read_checkpoint(ckpt: Path) -> dict:
    """A Lightning checkpoint, memory-mapped, on CPU: pages are read from disk only where a tensor is used (the
    weights; never the optimizer states, twice the weights' size under AdamW). weights_only: pickled code is
    refused."""
    return torch.load(ckpt, map_location="cpu", weights_only=True, mmap=True)


def policy_of_checkpoint(ckpt: Path, cfg: DictConfig | None = None):
    """The policy of a Lightning checkpoint of a run: the model its run's config builds (`cfg`, by default the
    run's config.yaml) with the checkpoint's weights; returns (model, tokenizer, LoraPolicy or None)."""
    run_dir = ckpt.parent.parent
    if cfg is None:
        if not (run_dir / "config.yaml").is_file():
            raise FileNotFoundError(f"{run_dir / 'config.yaml'}: the run's config is needed to rebuild its model")
        cfg = OmegaConf.load(run_dir / "config.yaml")
    model, tokenizer, _ = policy_from_config(cfg, instantiate(cfg.task))
    lora = apply_lora(model, instantiate(cfg.model).lora, cfg.seed) if cfg.model.lora.enabled else None
    state = read_checkpoint(ckpt)["state_dict"]
    weights = {key.removeprefix("model."): value for key, value in state.items() if key.startswith("model.")}
    missing, unexpected = model.load_state_dict(weights, strict=lora is None)
    if unexpected or (lora is not None and not weights):
        raise ValueError(f"{ckpt}: its weights do not fit the model its run's config builds (unexpected "
                         f"{unexpected[:3]}); was the config changed after the run?")
    return model, tokenizer, lora


def export(source: str | Path, out: str | Path, merge: bool = False) -> Path:
    """Write the checkpoint's policy to `out`; returns `out`."""
    ckpt, out = checkpoint_of(Path(source)), Path(out)
    model, tokenizer, lora = policy_of_checkpoint(ckpt)
    out.mkdir(parents=True, exist_ok=True)
    if lora is None:
        model.save_pretrained(out)
    else:
        lora.peft.save_pretrained(out / "adapter")
        if merge:
            lora.peft.merge_and_unload().save_pretrained(out)
    tokenizer.save_pretrained(out if lora is None or merge else out / "adapter")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="gspo-export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path, help="a run dir (its checkpoints/last.ckpt) or a checkpoint file")
    parser.add_argument("out", type=Path, help="the folder to write")
    parser.add_argument("--merge", action="store_true", help="LoRA runs: also write the merged model to OUT")
    args = parser.parse_args(argv)
    try:
        print(export(args.source, args.out, args.merge))
    except (FileNotFoundError, ValueError) as error:
        raise SystemExit(f"gspo-export: {error}") from error


if __name__ == "__main__":
    main()
