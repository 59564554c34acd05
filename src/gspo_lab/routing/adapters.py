"""One adapter per supported router class: how that router turns logits into its top-k gate weights.

Under replay the gate weights are recomputed from the live router logits at the replayed experts, the way
the router itself would have computed them for those experts, so the router keeps its gradient:
    p = softmax(logits) over all experts; w = p[replayed]; w /= Σ w where the router renormalises.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor


@dataclass(frozen=True)
class RouterAdapter:
    """What replay needs to know about one router class.

    renormalises: whether the router divides its top-k probabilities by their sum (a function of the
        module, since some routers read it from config).
    keep_float: whether the router returns float32 weights instead of casting them back to the logits dtype.
    """

    renormalises: Callable[[torch.nn.Module], bool]
    keep_float: bool = False

    def gate_weights(self, router: torch.nn.Module, logits: Tensor, indices: Tensor) -> Tensor:
        """logits [N, E] (live, with gradient), indices [N, k] -> gate weights [N, k]."""
        probs = torch.softmax(logits.float(), dim=-1)  # softmax over the full logits
        weights = probs.gather(-1, indices.long())  # ... gathered at the replayed experts
        if self.renormalises(router):
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights if self.keep_float else weights.to(logits.dtype)


def _norm_topk_prob(router: torch.nn.Module) -> bool:
    return bool(router.norm_topk_prob)


# keyed by class name: the transformers classes are not imported until a model of that kind exists
ADAPTERS: dict[str, RouterAdapter] = {
    "Qwen3MoeTopKRouter": RouterAdapter(renormalises=_norm_topk_prob),
    "Qwen2MoeTopKRouter": RouterAdapter(renormalises=_norm_topk_prob),
    "OlmoeTopKRouter": RouterAdapter(renormalises=_norm_topk_prob),
    "MixtralTopKRouter": RouterAdapter(renormalises=lambda router: True, keep_float=True),
}
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def find_routers(model: torch.nn.Module, purpose: str) -> list[tuple[str, torch.nn.Module, RouterAdapter]]:
    """The model's routers in layer order, each with its adapter; a clear error when there are none."""
    routers = [(name, m, ADAPTERS[type(m).__name__]) for name, m in model.named_modules() if type(m).__name__ in ADAPTERS]
    if routers:
        return routers
    model_class = type(model).__name__
    config = getattr(model, "config", None)
    if any(getattr(config, key, None) for key in EXPERT_COUNT_KEYS):
        raise ValueError(
            f"{purpose}: {model_class} is a mixture-of-experts architecture without a routing adapter; "
            f"supported routers: {sorted(ADAPTERS)} (add one in gspo_lab/routing/adapters.py)"
        )
    raise ValueError(f"{purpose}: {model_class} is a dense model (no MoE router), so there is no routing to replay")
