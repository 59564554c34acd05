"""FSDP2 sharding of a transformers causal LM for `trainer=fsdp` (Lightning's ModelParallelStrategy).

Lightning hands the LightningModule a device mesh and calls its `configure_model`; `shard` applies torch's
`fully_shard` there. Units, innermost first: every transformer block (the classes the model lists in
`_no_split_modules`, as accelerate's FSDP wrapping does), the LM head, then the decoder (embeddings and final
norm). The decoder and the head are separate roots because training calls them separately (the chunked
log-probs run the head on a few rows at a time), so every direct call goes through an FSDP unit's own
forward, which gathers its parameters and, in backward, reduce-scatters their gradients.

    shard(model, mesh)                      # in configure_model, before the optimizer exists
    state = full_state_dict(model)          # on every rank; the full tensors on CPU (rank 0 saves them)
"""

from __future__ import annotations

import logging

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel

from gspo_lab.decoder import decoder_of

log = logging.getLogger(__name__)


def is_sharded(model: torch.nn.Module) -> bool:
    return any(isinstance(m, FSDPModule) for m in model.modules())


def shard(model: PreTrainedModel, mesh: DeviceMesh) -> None:
    """Shard `model` in place over `mesh` (idempotent: a sharded model is left as it is). A 1-D mesh shards
    over all its ranks; a 2-D mesh replicates over the first dimension and shards over the second (HSDP)."""
    if is_sharded(model):
        return
    if model.config.get_text_config().tie_word_embeddings:
        raise ValueError(
            f"trainer=fsdp shards the LM head and the embeddings separately, so it cannot train "
            f"{type(model).__name__} with tie_word_embeddings=true; use trainer=ddp or an untied model"
        )
    block_names = set(model._no_split_modules or ())
    blocks = [m for m in model.modules() if type(m).__name__ in block_names]
    if not blocks:
        raise ValueError(f"trainer=fsdp: {type(model).__name__} names no transformer blocks in _no_split_modules")
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model.get_output_embeddings(), mesh=mesh)
    fully_shard(decoder_of(model), mesh=mesh)
    log.info("FSDP2: %d %s blocks, the LM head and the decoder sharded over mesh %s", len(blocks),
             type(blocks[0]).__name__.removeprefix("FSDP"), tuple(mesh.shape))


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded state dict on CPU; collective, so every rank must call it."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of an FSDP parameter, or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def refuse_non_finite(model: torch.nn.Module, strategy) -> None:
    """FloatingPointError where a weight is NaN or ±inf (a checkpoint is never written with one); under FSDP each rank
    holds its own shards, so a bad one anywhere stops every rank (collective there: every rank calls it)."""
    bad = [name for name, p in model.named_parameters() if not torch.isfinite(local(p)).all()]
    if is_sharded(model):
        anywhere = strategy.reduce_boolean_decision(bool(bad), all=False)
        bad = bad or (["another rank's shard"] if anywhere else [])
    if bad:
        raise FloatingPointError(f"refusing to write a checkpoint with non-finite weights in {bad[:5]}")
