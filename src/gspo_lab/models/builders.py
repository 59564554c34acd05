"""Where a run's policy comes from: a tiny transformers model built from config, or a local checkpoint.

`model=` in the Hydra config instantiates one of the two classes below; `.load()` returns the model and
its tokenizer. Both are real Hugging Face classes: `AutoModelForCausalLM.from_config` for the tiny
architectures (Qwen3-MoE, Qwen3, Mixtral, OLMoE, Qwen2-MoE, or any other `model_type` transformers ships),
`AutoModelForCausalLM.from_pretrained(path, local_files_only=True)` for checkpoints. Loading refuses a model
whose own log-probs training would not reproduce (gspo_lab.rollout.logprobs.check_logprobs_match).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed._composable import checkpoint
from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer

from gspo_lab.models.tokenizer import char_tokenizer
from gspo_lab.rollout.logprobs import check_logprobs_match

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _dtype(name: str, key: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"{key}={name!r} is not a dtype this framework loads; use one of {sorted(DTYPES)}")
    return DTYPES[name]


@dataclass
class TinyModel:
    """A randomly initialised causal LM of a transformers architecture, sized in YAML.

    Args:
        arch: a transformers `model_type` such as "qwen3_moe", "qwen3", "mixtral", "olmoe", "qwen2_moe".
        config: keyword arguments of that architecture's config class (hidden_size, num_experts, ...);
            vocabulary size and special-token ids come from the character tokenizer.
        dtype: parameter dtype, "float32" (default), "bfloat16" or "float16".
        gradient_checkpointing: recompute activations in the backward pass (`checkpoint_blocks`).
        experts_implementation: the MoE expert kernel: "index_add" (gspo_lab.models.experts), or
            transformers' "grouped_mm" or "eager".
    """

    arch: str
    config: dict[str, Any] = field(default_factory=dict)
    dtype: str = "float32"
    gradient_checkpointing: bool = False
    experts_implementation: str | None = None

    def __post_init__(self) -> None:
        if self.arch not in CONFIG_MAPPING:
            raise ValueError(f"model.arch={self.arch!r} is not a transformers model_type (e.g. qwen3_moe, mixtral)")
        _dtype(self.dtype, "model.dtype")

    def load(self):
        tokenizer = char_tokenizer()
        try:
            config = AutoConfig.for_model(
                self.arch,
                vocab_size=len(tokenizer),
                pad_token_id=tokenizer.pad_token_id,
                bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id,
                **self.config,
            )
        except ValueError as error:
            raise ValueError(f"model.arch={self.arch!r} is not a transformers model_type: {error}") from error
        kwargs = {"dtype": _dtype(self.dtype, "model.dtype")}
        if self.experts_implementation is not None:
            kwargs["experts_implementation"] = self.experts_implementation
        model = AutoModelForCausalLM.from_config(config, **kwargs)
        return _finish(model, self.gradient_checkpointing), tokenizer

    def load_from(self, path: str | Path):
        """This model's settings applied to a checkpoint of it (the cached cold start)."""
        return load_pretrained(path, self.dtype, self.gradient_checkpointing, self.experts_implementation)


@dataclass
class PretrainedModel:
    """A local checkpoint saved with `save_pretrained`, with its own tokenizer; never downloads.

    Args:
        path: folder holding config.json, the weights and the tokenizer files.
        dtype: "float32", "bfloat16" or "float16".
        gradient_checkpointing: recompute activations in the backward pass (`checkpoint_blocks`).
        experts_implementation: transformers' MoE expert kernel, or null for the checkpoint's default.
    """

    path: str | None = None
    dtype: str = "float32"
    gradient_checkpointing: bool = False
    experts_implementation: str | None = None

    def __post_init__(self) -> None:
        _dtype(self.dtype, "model.dtype")
        if self.path is None:
            raise ValueError("model.path is not set: model=hf needs model.path=/path/to/checkpoint")
        _check_checkpoint_dir(Path(self.path).expanduser())

    def load(self):
        return self.load_from(self.path)

    def load_from(self, path: str | Path):
        return load_pretrained(path, self.dtype, self.gradient_checkpointing, self.experts_implementation)


def load_pretrained(path, dtype="float32", gradient_checkpointing=False, experts_implementation=None):
    """Model and tokenizer from a local `save_pretrained` folder (left padding, a pad token guaranteed)."""
    path = Path(path).expanduser()
    _check_checkpoint_dir(path)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    kwargs = {"dtype": _dtype(dtype, "model.dtype"), "local_files_only": True}
    if experts_implementation is not None:
        kwargs["experts_implementation"] = experts_implementation
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    return _finish(model, gradient_checkpointing), tokenizer


def _check_checkpoint_dir(path: Path) -> None:
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model.path={str(path)!r} is not a checkpoint folder: no config.json there "
            "(model=hf loads local files only; save one with save_pretrained)"
        )


def _finish(model: PreTrainedModel, gradient_checkpointing: bool) -> PreTrainedModel:
    if gradient_checkpointing:
        checkpoint_blocks(model)
    model.generation_config.pad_token_id = model.config.pad_token_id
    check_logprobs_match(model)  # refuses an architecture whose logits training would not reproduce
    return model


def checkpoint_blocks(model: PreTrainedModel) -> None:
    """Activation checkpointing of every transformer block, in train and eval mode alike: each block's
    activations are recomputed in the backward pass instead of kept. transformers' own checkpointing
    (`activation_checkpointing_enable`) acts only on modules in train mode, and RL runs in eval mode
    (gspo_lab.module), so torch's composable `checkpoint` (forward hooks; no renamed parameters, FSDP2-compatible)
    is used instead. A forward with gradients must pass use_cache=False: a block recomputed with a KV cache would
    append to it twice (torch's checkpoint then raises rather than return wrong gradients)."""
    blocks = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not blocks:
        raise ValueError(f"model.gradient_checkpointing=true: {type(model).__name__} has no checkpointable blocks")
    for block in blocks:
        checkpoint(block)  # non-reentrant; the RNG state is restored, so train-mode dropout recomputes the same


def parameter_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
