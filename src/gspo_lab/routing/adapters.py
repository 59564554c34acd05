"""One adapter per supported router class: where its output keeps the logits and the chosen experts, and how
the router turns its logits into the gate weights of chosen experts.

Under replay the experts come from the trace and the gate weights are recomputed from the live router logits
at those experts, the way that router computes them for its own choice, so the router keeps its gradient.
A selection-only term never enters the weights: DeepSeek-V3's, GLM-4.5's and MiniMax-M2's
`e_score_correction_bias` and ERNIE 4.5's `moe_statics` only pick experts; their weights come from the
unbiased scores, as in the models themselves. The formulas, N tokens, E experts, k chosen:
    softmax  p = softmax(logits) over E; w = p[chosen]; w /= Σ w where the router renormalises
    top-k softmax (GPT-OSS)  w = softmax(logits[chosen]) over the k
    sigmoid (DeepSeek-V3, GLM-4.5, MiniMax-M2)  s = σ(logits); w = s[chosen]; w /= Σ w (+1e-20 where the
        model adds it) where it renormalises; w *= routed_scaling_factor where the model scales
    ERNIE 4.5  p = softmax(logits); w = p[chosen] / max(Σ p[chosen], moe_norm_min)
    Llama 4  scores [N, E] = σ(logits) at the chosen experts, 0 elsewhere (the router's own output layout)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

GateWeights = Callable[[torch.nn.Module, Tensor, Tensor, Tensor], Tensor]  # (router, logits, indices, hidden)


@dataclass(frozen=True)
class RouterAdapter:
    """What replay needs to know about one router class whose forward returns (logits, weights, indices).

    gate_weights: (router, logits [N, E] with gradient, indices [N, k], router input) -> weights [N, k],
        exactly as the router computes them for its own choice.
    """

    gate_weights: GateWeights

    def choice(self, router: torch.nn.Module, output: Any) -> tuple[Tensor, Tensor]:
        """The router's logits [N, E] and chosen experts [N, k] from its forward output."""
        logits, _, indices = output
        return logits, indices

    def with_logits(self, output: Any, logits: Tensor) -> Any:
        """The router's output with other logits in their place (the rollout engine's router noise)."""
        return (logits, *output[1:])

    def replayed(self, router: torch.nn.Module, hidden: Tensor, output: Any, indices: Tensor) -> Any:
        """The router's output had it chosen `indices`."""
        logits = output[0]
        return logits, self.gate_weights(router, logits, indices, hidden), indices


class Llama4Adapter(RouterAdapter):
    """Llama 4's router returns (scores [N, E], logits [N, E]): σ(logit) at its top-k experts, 0 elsewhere."""

    def choice(self, router, output):
        scores, logits = output  # the experts in use are those with a score: the router's own, or replayed ones
        in_use = logits.masked_fill(scores == 0, float("-inf"))
        return logits, torch.topk(in_use, router.top_k, dim=1).indices  # the router's own top-k call and order

    def with_logits(self, output, logits):
        return output[0], logits

    def replayed(self, router, hidden, output, indices):
        _, logits = output
        weights = self.gate_weights(router, logits, indices, hidden)  # [N, k]
        return torch.zeros_like(logits).scatter(1, indices.long(), weights), logits


def llama4_gate(router, logits, indices, hidden):
    return torch.sigmoid(logits.gather(1, indices.long()).float()).to(logits.dtype)


def softmax_gate(renormalises: Callable[[torch.nn.Module], bool], keep_float: bool = False) -> GateWeights:
    def gate(router, logits, indices, hidden):
        weights = torch.softmax(logits.float(), dim=-1).gather(-1, indices.long())
        if renormalises(router):
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights if keep_float else weights.to(logits.dtype)
    return gate


def top_k_softmax_gate(router, logits, indices, hidden):
    return torch.softmax(logits.gather(-1, indices.long()), dim=1, dtype=logits.dtype)


def sigmoid_gate(epsilon: float, scaled: bool, renormalises: Callable[[torch.nn.Module], bool]) -> GateWeights:
    def gate(router, logits, indices, hidden):
        weights = torch.sigmoid(logits.float()).gather(1, indices.long())
        if renormalises(router):
            weights = weights / (weights.sum(dim=-1, keepdim=True) + epsilon)
        return weights * router.routed_scaling_factor if scaled else weights
    return gate


def ernie_gate(router, logits, indices, hidden):
    weights = torch.softmax(logits.float(), dim=1).gather(-1, indices.long())
    return (weights / torch.clamp(weights.sum(dim=-1, keepdim=True), min=router.norm_min)).to(hidden.dtype)


def _norm_topk_prob(router: torch.nn.Module) -> bool:
    return bool(router.norm_topk_prob)


def _always(router: torch.nn.Module) -> bool:
    return True


SOFTMAX_TOP_K = RouterAdapter(softmax_gate(_norm_topk_prob))  # softmax, renormalised where norm_topk_prob
DEEPSEEK_V3 = RouterAdapter(sigmoid_gate(1e-20, scaled=True, renormalises=_norm_topk_prob))

# keyed by class name: the transformers classes are not imported until a model of that kind exists
ADAPTERS: dict[str, RouterAdapter] = {
    "Qwen3MoeTopKRouter": SOFTMAX_TOP_K,
    "Qwen2MoeTopKRouter": SOFTMAX_TOP_K,
    "OlmoeTopKRouter": SOFTMAX_TOP_K,
    "Qwen3NextTopKRouter": SOFTMAX_TOP_K,
    "Qwen3_5MoeTopKRouter": RouterAdapter(softmax_gate(_always)),
    "MixtralTopKRouter": RouterAdapter(softmax_gate(_always, keep_float=True)),
    "GptOssTopKRouter": RouterAdapter(top_k_softmax_gate),
    "DeepseekV3TopkRouter": DEEPSEEK_V3,
    "Glm4MoeTopkRouter": DEEPSEEK_V3,
    # routers whose forward is DeepSeek-V3's word for word (scripts/moe_families.py)
    "Dots1TopkRouter": DEEPSEEK_V3,
    "ExaoneMoeTopkRouter": DEEPSEEK_V3,
    "SolarOpenTopkRouter": DEEPSEEK_V3,
    "MiniMaxM2TopKRouter": RouterAdapter(sigmoid_gate(0.0, scaled=False, renormalises=_always)),
    "Ernie4_5_MoeTopKRouter": RouterAdapter(ernie_gate),
    "Llama4Router": Llama4Adapter(llama4_gate),
}
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")

# How an expert bank stores each expert's weight: False for [experts, out, in] (applied as F.linear(x, w[e]):
# Qwen, Mixtral, OLMoE, DeepSeek-V3 and the rest), True for [experts, in, out] (applied as x @ w[e]). transformers
# marks the classes its grouped kernels run with `is_transposed` (@use_experts_implementation; True for GPT-OSS);
# this table holds those it does not mark.
EXPERTS_TRANSPOSED: dict[str, bool] = {
    "Llama4TextExperts": True,  # torch.bmm(hidden_states, self.gate_up_proj)
}


def expert_input_dim(experts: torch.nn.Module, purpose: str) -> int:
    """The dimension of an expert bank's 3-D weights that runs along each token's input features: -1 for
    [experts, out, in], -2 for [experts, in, out]."""
    transposed = getattr(experts, "is_transposed", EXPERTS_TRANSPOSED.get(type(experts).__name__))
    if transposed is None:
        raise ValueError(f"{purpose}: the layout of {type(experts).__name__}'s expert weights ([experts, out, in] "
                         f"or [experts, in, out]) is not known; add it to EXPERTS_TRANSPOSED in "
                         f"gspo_lab/routing/adapters.py")
    return -2 if transposed else -1


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
