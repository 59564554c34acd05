"""The decoder stack of a transformers causal LM: the module whose forward takes input_ids and returns hidden
states, which routing hooks, the log-prob check and FSDP sharding attach to.

`base_model_prefix` names it for most families (`model.model`); a multimodal family's text-only class may keep
the multimodal prefix while holding the decoder in `.model` (Llama 4's Llama4ForCausalLM: prefix
"language_model", decoder `model`).

`CACHE` is the name its forward (and `generate`) gives the KV cache, argument and output field alike.
"""

from __future__ import annotations

import torch
from transformers.modeling_outputs import BaseModelOutputWithPast

# transformers 5.24 renamed `past_key_values` to `cache`, and warns at every call that uses the old name; 5.19 (the
# vLLM environment's, pyproject.toml) knows only the old one
CACHE = "cache" if "cache" in BaseModelOutputWithPast.__dataclass_fields__ else "past_key_values"


def decoder_of(model: torch.nn.Module) -> torch.nn.Module:
    """model.<base_model_prefix>, else model.model, else the model itself (a bare decoder such as
    Qwen3MoeModel is its own decoder stack)."""
    for name in (getattr(model, "base_model_prefix", "model"), "model"):
        found = getattr(model, name, None)
        if isinstance(found, torch.nn.Module):
            return found
    return model
