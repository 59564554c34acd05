"""Where a run's policy comes from: a tiny transformers model built from config, or a local checkpoint.

`model=` in the Hydra config instantiates one of the two classes below; `.load(task)` returns the model and
its tokenizer (the task's text trains a tiny model's `task_bpe` tokenizer; a checkpoint keeps its own). Both
are real Hugging Face classes: `AutoModelForCausalLM.from_config` for the tiny architectures (Qwen3-MoE,
Qwen3, Mixtral, OLMoE, Qwen2-MoE, or any other `model_type` transformers ships),
`AutoModelForCausalLM.from_pretrained(path, local_files_only=True)` for checkpoints. Loading refuses a model
whose own log-probs training would not reproduce (gspo_lab.rollout.logprobs.check_logprobs_match).
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from omegaconf import DictConfig, OmegaConf
from torch.distributed._composable import checkpoint
from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer

from gspo_lab.models.lora import LoraSettings
from gspo_lab.models.tokenizer import char_tokenizer, check_bpe_vocab_size, task_bpe_tokenizer
from gspo_lab.tools.template import with_tool_template
from gspo_lab.rollout.logprobs import check_logprobs_match

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TOKENIZERS = ("char", "task_bpe")
BPE_CORPUS_DRAWS = 4000  # task samples drawn to train a task_bpe tokenizer; those of the training split are kept
BPE_CORPUS_SEED = "task_bpe"


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
            special-token ids come from the tokenizer, and so does the vocabulary size unless `vocab_size` pads
            it: embedding and output rows beyond the tokenizer's tokens, as Qwen3 pads its 151,669 tokens to
            151,936 rows (a token id there decodes to no text).
        dtype: parameter dtype, "float32" (default), "bfloat16" or "float16".
        gradient_checkpointing: recompute activations in the backward pass (`checkpoint_blocks`).
        experts_implementation: the MoE expert kernel: "index_add" (gspo_lab.models.experts), or
            transformers' "grouped_mm" or "eager".
        tokenizer: "char" (one token per character) or "task_bpe" (BPE trained on the task's training-split
            prompts and answers when the model loads; `tokenizer_vocab_size` tokens at most).
        lora: LoRA adapters for RL (gspo_lab.models.lora.LoraSettings; conf/train.yaml's model.lora).
    """

    pretrained: ClassVar[bool] = False  # built from config: sft.enabled=auto runs the cold start
    arch: str
    config: dict[str, Any] = field(default_factory=dict)
    dtype: str = "float32"
    gradient_checkpointing: bool = False
    experts_implementation: str | None = None
    tokenizer: str = "char"
    tokenizer_vocab_size: int = 512
    lora: Any = None

    def __post_init__(self) -> None:
        self.lora = LoraSettings.of(self.lora)
        if isinstance(self.config, DictConfig):  # nested values (rope_parameters) must reach transformers as dicts
            self.config = OmegaConf.to_container(self.config, resolve=True)
        if self.arch not in CONFIG_MAPPING:
            raise ValueError(f"model.arch={self.arch!r} is not a transformers model_type (e.g. qwen3_moe, mixtral)")
        _dtype(self.dtype, "model.dtype")
        if self.tokenizer not in TOKENIZERS:
            raise ValueError(f"model.tokenizer={self.tokenizer!r} must be one of {TOKENIZERS}")
        if self.tokenizer == "task_bpe":
            check_bpe_vocab_size(self.tokenizer_vocab_size)

    def build_tokenizer(self, task=None):
        """The character tokenizer, or a BPE tokenizer trained on `task`'s training-split text; for a task with
        tools, with the tiny tool template (gspo_lab.tools.template)."""
        tokenizer = self._base_tokenizer(task)
        if task is not None and task.toolset is not None:
            with_tool_template(tokenizer)
        return tokenizer

    def _base_tokenizer(self, task=None):
        if self.tokenizer == "char":
            return char_tokenizer()
        if task is None:
            raise ValueError("model.tokenizer='task_bpe' is trained on the task's text: load(task) needs the task")
        rng = random.Random(BPE_CORPUS_SEED)
        drawn = (task.sample(rng) for _ in range(BPE_CORPUS_DRAWS))
        train = [e for e in drawn if task.split_of(e.prompt) == "train"]
        return task_bpe_tokenizer(
            [text for e in train for text in (e.prompt, demonstration_text(task.demonstration(e)))],
            self.tokenizer_vocab_size
        )

    def load(self, task=None):
        tokenizer = self.build_tokenizer(task)
        settings = dict(self.config)
        vocab_size = settings.pop("vocab_size", None) or len(tokenizer)
        if not (isinstance(vocab_size, int) and vocab_size >= len(tokenizer)):
            raise ValueError(f"model.config.vocab_size={vocab_size!r} must be an integer >= the tokenizer's "
                             f"{len(tokenizer)} tokens (rows beyond them pad the vocabulary)")
        try:
            config = AutoConfig.for_model(
                self.arch,
                vocab_size=vocab_size,
                pad_token_id=tokenizer.pad_token_id,
                bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id,
                **settings,
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

    def skeleton(self) -> PreTrainedModel:
        """The architecture on the meta device (no weights, no tokenizer): what a plan can check cheaply."""
        return _on_meta(AutoConfig.for_model(self.arch, **self.config))


@dataclass
class PretrainedModel:
    """A pretrained checkpoint with its own tokenizer: a local `save_pretrained` folder, or a hub id fetched
    through the hub cache (`checkpoint_folder`; from the cache alone with HF_HUB_OFFLINE=1).

    Args:
        path: a folder holding config.json, the weights and the tokenizer files, or a hub id ("Qwen/Qwen3-1.7B").
        dtype: "float32", "bfloat16" or "float16".
        gradient_checkpointing: recompute activations in the backward pass (`checkpoint_blocks`).
        experts_implementation: transformers' MoE expert kernel, or null for the checkpoint's default.
        lora: LoRA adapters for RL (gspo_lab.models.lora.LoraSettings; conf/train.yaml's model.lora).
    """

    pretrained: ClassVar[bool] = True  # sft.enabled=auto starts RL from the checkpoint as it is
    path: str | None = None
    dtype: str = "float32"
    gradient_checkpointing: bool = False
    experts_implementation: str | None = None
    lora: Any = None

    def __post_init__(self) -> None:
        self.lora = LoraSettings.of(self.lora)
        _dtype(self.dtype, "model.dtype")
        if self.path is None:
            raise ValueError("model.path is not set: model=hf needs model.path=/path/to/checkpoint or a hub id")
        self.folder = checkpoint_folder(str(self.path))

    def load(self, task=None):
        """The checkpoint and its own tokenizer; `task` is accepted for a uniform interface and not used."""
        return self.load_from(self.folder)

    def load_from(self, path: str | Path):
        return load_pretrained(path, self.dtype, self.gradient_checkpointing, self.experts_implementation)

    def skeleton(self) -> PreTrainedModel:
        """The checkpoint's architecture on the meta device, from its config.json alone."""
        return _on_meta(AutoConfig.from_pretrained(self.folder, local_files_only=True))

    def fingerprint(self) -> str:
        """A hash of the checkpoint folder's contents (`checkpoint_fingerprint`), for cache keys."""
        return checkpoint_fingerprint(self.folder)


def checkpoint_fingerprint(folder: Path, block: int = 1 << 24) -> str:
    """SHA-256 over every file of a checkpoint folder (relative names and bytes; about 1 s per GB), so a
    checkpoint saved again at the same path gets another hash.

    >>> import tempfile; folder = Path(tempfile.mkdtemp()); _ = (folder / "config.json").write_text("{}")
    >>> before = checkpoint_fingerprint(folder); _ = (folder / "config.json").write_text('{"a": 1}')
    >>> before == checkpoint_fingerprint(folder)
    False
    """
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(folder)).encode() + b"\0")
        with open(path, "rb") as file:
            while chunk := file.read(block):
                digest.update(chunk)
    return digest.hexdigest()


def _on_meta(config) -> PreTrainedModel:
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


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


HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")
# what a checkpoint needs from a hub repository: config, safetensors weights, tokenizer, chat template
HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


def checkpoint_folder(path: str) -> Path:
    """The local folder of a checkpoint: `path` itself when it exists, else, for a hub id, its snapshot in the
    hub cache, downloaded when online (huggingface_hub.snapshot_download; HF_HUB_OFFLINE=1 reads the cache only)."""
    local = Path(path).expanduser()
    if local.exists() or not HUB_ID.fullmatch(path):
        _check_checkpoint_dir(local)
        return local
    from huggingface_hub import snapshot_download

    try:
        folder = Path(snapshot_download(path, allow_patterns=HUB_FILES))
    except Exception as error:  # noqa: BLE001 - offline, unknown repository, no network: one clear message
        raise FileNotFoundError(
            f"model.path={path!r} is not a local folder, and the hub model of that name could not be fetched "
            f"({type(error).__name__}: {error}); offline (HF_HUB_OFFLINE=1) only models already in the hub cache "
            "load, else give the folder written by save_pretrained") from None
    _check_checkpoint_dir(folder)
    return folder


def _check_checkpoint_dir(path: Path) -> None:
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model.path={str(path)!r} is not a checkpoint folder: no config.json there "
            "(model=hf takes a folder written by save_pretrained, or a hub id)"
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


class ContextTooLong(ValueError):
    """A prompt plus a generation budget exceeds the model's positions (`check_context`)."""


CONTEXT_SAMPLE = 200  # prompts drawn (either split) whose lengths `check_context` measures, beside the held-out set


def fit_task(model: PreTrainedModel, tokenizer, task, max_new_tokens: dict[str, int], render) -> None:
    """A task made to fit the model, the same way in training and in gspo-eval (so both score one held-out set):
    its prompts longer than `task.max_prompt_tokens` (task=hf), as `render` formats them, dropped; then
    `check_context`."""
    if getattr(task, "max_prompt_tokens", None):
        task.drop_long_prompts(render, tokenizer, task.max_prompt_tokens)
    check_context(model, tokenizer, task, max_new_tokens, render)


def check_context(model: PreTrainedModel, tokenizer, task, max_new_tokens: dict[str, int], render=None) -> None:
    """Refuse a run whose sequences would not fit the model's positions: the longest prompt (of the held-out
    set and a sample of the whole prompt space) plus each generation budget in `max_new_tokens` (config key ->
    tokens) must fit `max_position_embeddings`, prompts as `render` (gspo_lab.prompts.Renderer) formats them, with
    the tools' schemas where the task has tools (what an environment's reset adds is not known before it runs).
    Beyond it a rotary model still runs, on positions it never learned, so nothing else would say so;
    reasoning-gym's long instructions under the char tokenizer do it.
    """
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is None:
        return
    rng = random.Random("check_context")
    examples = task.eval_examples() + [task.sample(rng) for _ in range(CONTEXT_SAMPLE)]
    toolset = getattr(task, "toolset", None)
    if render is None:
        encoded = tokenizer([e.prompt for e in examples])
    else:  # as the rollout renders them: a multi-turn task's prompts list its tools' schemas
        tools = toolset.schemas() if toolset is not None else None
        encoded = tokenizer(render.texts(examples, tools), add_special_tokens=render.add_special_tokens)
    longest = max(len(ids) for ids in encoded["input_ids"])
    for key, tokens in max_new_tokens.items():
        if longest + tokens > limit:
            raise ContextTooLong(
                f"{key}={tokens} does not fit: the longest prompt of task={task.name} is {longest} tokens with "
                f"this tokenizer, and {longest} + {tokens} > model.config.max_position_embeddings={limit}; "
                "lower the budget, raise the model's positions, or shorten prompts (model.tokenizer=task_bpe)"
            )


def demonstration_text(demonstration: str | list[dict]) -> str:
    """A demonstration's text: a multi-turn one's (a list of messages) is its messages' contents."""
    if isinstance(demonstration, str):
        return demonstration
    return " ".join(str(message.get("content") or "") for message in demonstration)
