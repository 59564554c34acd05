"""An LM head whose matmul runs in float32 (train.lm_head_fp32; TRL's cast_lm_head_to_fp32, after MiniMax-M1, arXiv
2506.13585, whose training and inference token probabilities agreed only once the head ran in FP32, and ScaleRL,
arXiv 2510.13786).

Under trainer.precision=bf16-mixed with float32 weights (model.dtype=float32, the setting this project trains in)
autocast runs every Linear in bfloat16, the LM head too, so each logit carries bfloat16's rounding (8 bits of
significant bits: up to 0.4% of the logit) into the log-probs and the ratios. `fp32_lm_head` makes the head compute
F.linear(h, W, b) in float32 with autocast off, wherever it runs: generation, the chunked log-prob forwards, the
reference and evaluation. The decoder's output h stays what the decoder computes (bfloat16 under autocast), as
TRL casts it. Weights in another dtype are cast for each call (a float32 copy of the head's weight per call, where
TRL converts the head's parameters to float32 once), so tied embeddings keep their dtype.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import Tensor


def _float32_forward(head: torch.nn.Linear, hidden: Tensor) -> Tensor:
    """logits = h W^T + b in float32, whatever autocast is on."""
    with torch.autocast(hidden.device.type, enabled=False):
        bias = None if head.bias is None else head.bias.float()
        return F.linear(hidden.float(), head.weight.float(), bias)


def fp32_lm_head(model: torch.nn.Module) -> None:
    """Make `model`'s output embedding compute in float32 (its forward, bound to the module, so a deep copy, as the
    KL reference and an engine copy are made, computes with its own weights). Raises ValueError when the head is
    not a plain Linear (a LoRA adapter on it: its forward is PEFT's, as TRL refuses too)."""
    head = model.get_output_embeddings()
    if type(head) is not torch.nn.Linear:
        raise ValueError(f"train.lm_head_fp32=true needs the model's LM head to be a torch.nn.Linear; it is "
                         f"{type(head).__name__} (a LoRA adapter on lm_head?): remove lm_head from "
                         "model.lora.target_modules, or set train.lm_head_fp32=false")
    head.forward = types.MethodType(_float32_forward, head)
