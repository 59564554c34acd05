"""What a weight sync sends to vLLM's engine: the policy's tensors as its checkpoint names them, one at a time.

    checkpoint_weights(model)   -> (name, tensor), ...   what vLLM's loaders take (a MoE bank split per expert)

The trainer's model may hold its weights in three ways, and the engine gets full, plain weights from each:
- as they are (one process, or DDP: every rank a whole copy);
- sharded by FSDP2 (trainer=fsdp): each parameter a DTensor of which a rank holds a slice. `full` gathers one
  parameter at a time (an all-gather every rank joins in the same order, as every rank's engine takes the same
  weights), hands it on and lets it go, so no rank holds more than one gathered tensor beside its shards (verl's
  `update_weights` takes such a generator; TRL gathers the same way);
- with LoRA adapters (model.lora; PEFT injects them into the model): a wrapped weight is sent merged, W + scale·BA,
  computed for that tensor alone and never written back (`lora_layers`); the adapters themselves are not sent.
  TRL merges the adapters into the model, syncs and unmerges; computing each merged tensor apart leaves the
  trainer's weights untouched, rounding included. Under rollout.vllm.lora_sync=adapter the base weights go once
  (`merged=False`) and then the adapters alone, in PEFT's format (`save_adapter`).

`Layout` packs a version's tensors into one byte buffer for overlap's engine process (gspo_lab.rollout.vllm.process),
and unpacks them there. `reload_in_worker` runs in vLLM's worker and loads what `checkpoint_weights` yields through vLLM's in-place reload;
`quiet_reloads` silences what that reload logs at every sync and that says nothing.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

WRAPPED = re.compile(r"(^|\.)base_layer(?=\.)")  # PEFT's wrapper of a weight: "q_proj.base_layer.weight"
ADAPTER = re.compile(r"\.lora_(A|B|embedding_A|embedding_B|magnitude_vector)\.")  # an adapter's own tensors
ALIGN = 64  # bytes: each tensor's offset in a version's buffer (`Layout`), so that a uint8 slice views as any dtype


def checkpoint_tensors(model: torch.nn.Module) -> Iterator[tuple[str, Tensor]]:
    """What a checkpoint of the model holds, by name: its parameters, then its persistent buffers (a router's
    selection bias, `e_score_correction_bias` of DeepSeek-V3, GLM-4.5, MiniMax-M2, dots1, EXAONE-MoE and
    Solar-Open, which transformers keeps as a buffer and vLLM as a parameter). Non-persistent buffers (rotary
    frequencies) are computed from the config on both sides. Names as the model's own, PEFT's wrappers included."""
    yield from model.named_parameters()
    for prefix, module in model.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if name not in module._non_persistent_buffers_set:
                yield f"{prefix}.{name}" if prefix else name, buffer


def policy_tensors(model: torch.nn.Module, merged: bool = True) -> Iterator[tuple[str, Tensor]]:
    """The policy's weights as a checkpoint of the base model names them, full and detached, one at a time: each
    gathered from its shards (`full`), a LoRA-wrapped one merged with its adapters (`lora_layers`; not `merged`:
    the base weight alone, for an engine that serves the adapters), the adapters left out."""
    layers = lora_layers(model) if merged else {}
    for name, tensor in checkpoint_tensors(model):
        if ADAPTER.search(name):
            continue
        name = WRAPPED.sub("", name)
        value = full(tensor.detach())
        for layer in layers.get(name, ()):
            value = value + full(lora_delta(layer)).to(value.dtype)
        yield name, value


def checkpoint_weights(model: torch.nn.Module, merged: bool = True) -> Iterator[tuple[str, Tensor]]:
    """`policy_tensors` with transformers' conversions reverted per tensor (a fused expert bank [E, 2I, H] becomes
    E gate and E up projections), for vLLM's loaders."""
    from transformers.core_model_loading import revert_weight_conversion

    for name, tensor in policy_tensors(model, merged):
        yield from revert_weight_conversion(model, {name: tensor}).items()


def lora_layers(model: torch.nn.Module) -> dict[str, list]:
    """The LoRA layers PEFT injected, by the name of the base tensor each adds to ("...q_proj.weight"; a router
    gate's or an expert bank's parameter LoRA, `ParamWrapper`, names the parameter it wraps). Empty without PEFT."""
    try:
        from peft.tuners.lora import LoraLayer, ParamWrapper
    except ImportError:
        return {}
    layers: dict[str, list] = {}
    for prefix, module in model.named_modules():
        if isinstance(module, LoraLayer):
            parameter = module.parameter_name if isinstance(module, ParamWrapper) else "weight"
            layers.setdefault(WRAPPED.sub("", f"{prefix}.{parameter}"), []).append(module)
    return layers


def lora_delta(layer) -> Tensor:
    """scale·BA of a LoRA layer's active adapters, in the shape of the weight it adds to (PEFT's own
    `get_delta_weight`, which knows each layer's layout: fan-in-fan-out, an expert bank's [E, in, out])."""
    adapters = [name for name in layer.active_adapters if name in layer.lora_A]
    deltas = [layer.get_delta_weight(name) for name in adapters]
    return torch.stack(deltas).sum(0) if len(deltas) > 1 else deltas[0]


def save_adapter(model: torch.nn.Module, folder: Path) -> int:
    """The model's LoRA adapters in PEFT's format in `folder` (adapter_config.json, adapter_model.safetensors, the
    tensor names PeftModel.save_pretrained writes), which vLLM's LoRA loader reads; returns the rank."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    config = model.peft_config["default"]
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    state = get_peft_model_state_dict(model, adapter_name="default")
    save_file({f"base_model.model.{name}": full(t.detach()).contiguous() for name, t in state.items()},
              folder / "adapter_model.safetensors")
    return config.r


def full(tensor: Tensor) -> Tensor:
    """A sharded (DTensor) tensor gathered whole on every rank; a plain one as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def persistent_buffer_names(model: torch.nn.Module) -> list[str]:
    """The names of the model's persistent buffers (`checkpoint_tensors` without the parameters)."""
    parameters = {name for name, _ in model.named_parameters()}
    return [name for name, _ in checkpoint_tensors(model) if name not in parameters]


def repack_cpu_experts(model: torch.nn.Module) -> int:
    """Repack the expert banks of vLLM's CPU MoE kernel after an in-place reload, which loads them unpacked and
    leaves them so; returns how many layers were repacked (0 off CPU)."""
    repacked = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if type(experts).__name__ == "CPUUnquantizedExperts":
            experts.process_weights_after_loading(module)
            repacked += 1
    return repacked


def reload_in_worker(worker, weights: Iterator[tuple[str, Tensor]]) -> int:
    """In vLLM's worker (this process): reload the weights in place; repack CPU expert banks."""
    worker.model_runner.reload_weights(weights_iterator=weights)
    return repack_cpu_experts(worker.model_runner.model)


class NarrowingLoadFilter(logging.Filter):
    """Drops vLLM's warning that a weight is loaded into a parameter of another dtype, which a reload into an
    engine of a lower `rollout.vllm.dtype` than the trainer's gives for every parameter at every sync (110 lines a
    step for small_moe in bf16): the cast is the dtype the run asked for. Other records pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Attempted to load weight %s with dtype")


def quiet_reloads() -> None:
    """Silence what vLLM's in-place reload logs at every sync and that says nothing: a rotary embedding's missing
    weights, and each weight cast to a lower engine dtype (`NarrowingLoadFilter`); once per process."""
    logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)
    loads = logging.getLogger("vllm.model_executor.models.utils")
    if not any(isinstance(f, NarrowingLoadFilter) for f in loads.filters):
        loads.addFilter(NarrowingLoadFilter())


@dataclass(frozen=True)
class Layout:
    """Where each checkpoint tensor lies in a version's byte buffer: (name, dtype, shape, offset in bytes)."""

    tensors: tuple[tuple[str, torch.dtype, tuple[int, ...], int], ...]
    nbytes: int

    @classmethod
    def of(cls, weights: list[tuple[str, Tensor]]) -> Layout:
        tensors, offset = [], 0
        for name, tensor in weights:
            tensors.append((name, tensor.dtype, tuple(tensor.shape), offset))
            offset += -(-tensor.numel() * tensor.element_size() // ALIGN) * ALIGN
        return cls(tuple(tensors), max(offset, ALIGN))

    def pack(self, weights: list[tuple[str, Tensor]]) -> Tensor:
        """The tensors' bytes in one new host buffer [nbytes] uint8: the version's snapshot."""
        buffer = torch.empty(self.nbytes, dtype=torch.uint8)
        for (name, dtype, shape, offset), (_, tensor) in zip(self.tensors, weights, strict=True):
            data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
            buffer[offset : offset + data.numel()].copy_(data)
        return buffer

    def unpack(self, buffer: Tensor) -> list[tuple[str, Tensor]]:
        """Views of `buffer`'s bytes as the named tensors (no copy)."""
        views = []
        for name, dtype, shape, offset in self.tensors:
            size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            views.append((name, buffer[offset : offset + size].view(dtype).view(shape)))
        return views
