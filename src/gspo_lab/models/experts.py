"""`experts_implementation="index_add"`: transformers' grouped-matmul MoE experts, with cheaper gathers.

Registered in transformers' own `ExpertsInterface` (the extension point its Qwen3-MoE, Qwen2-MoE, Mixtral and
OLMoE experts dispatch through), so `model.experts_implementation=index_add` selects it like any built-in
kernel. The maths is `grouped_mm`'s: sort the (token, expert) pairs by expert, one grouped matmul up, the
gate, one grouped matmul down, weight by the router, sum each token's experts. Only the data movement
differs: pairs are gathered with `index_select` and scattered back with `index_add_`, whose backward passes
are a plain scatter-add and a gather, where `grouped_mm`'s advanced indexing (`x[perm // k]`,
`out[inv_perm]`) costs two accumulating `index_put_` in backward. On the anchor workload's forward+backward
that is ~10% less time, with bitwise-identical outputs and gradients for top-2 routing (a + b is commutative;
for top-k > 2 the per-token sum may differ in the last bit). Like `grouped_mm`, each token's experts are
summed in float32 whatever the model's dtype.

It is a CPU kernel: on other devices (where `index_add_` with repeated indices is not deterministic and
`grouped_mm` has real grouped-GEMM kernels), and for bias, post-expert norm or expert parallelism, it hands
the call to transformers' `grouped_mm` unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, _grouped_linear, grouped_mm_experts_forward

NAME = "index_add"


def index_add_experts_forward(self: torch.nn.Module, hidden_states: Tensor, top_k_index: Tensor,
                              top_k_weights: Tensor) -> Tensor:
    """hidden_states [N, H], top_k_index [N, k], top_k_weights [N, k] -> the experts' weighted sum [N, H]."""
    post_norm = getattr(self, "has_post_expert_norm", False)  # transformers >= 5.20; vLLM's CPU build pins < 5.20
    if hidden_states.device.type != "cpu" or self.has_bias or post_norm or self._is_expert_parallel:
        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    num_top_k = top_k_index.size(-1)
    expert_ids, order = torch.sort(top_k_index.reshape(-1))  # [S = N k] pairs grouped by expert
    token = order // num_top_k  # [S] the token of each sorted pair
    offsets = torch.bincount(expert_ids, minlength=self.num_experts).cumsum(0, dtype=torch.int32)  # [E] group ends
    up_weights = self.gate_up_proj if self.has_gate else self.up_proj
    out = _grouped_linear(hidden_states.index_select(0, token), up_weights, offsets, is_transposed=self.is_transposed)
    out = self._apply_gate(out) if self.has_gate else self.act_fn(out)  # [S, I]
    out = _grouped_linear(out, self.down_proj, offsets, is_transposed=self.is_transposed)  # [S, H]
    out = out * top_k_weights.reshape(-1).index_select(0, order).unsqueeze(-1)  # router weight of each pair
    summed = torch.zeros(hidden_states.shape, dtype=torch.float32, device=out.device)
    return summed.index_add_(0, token, out.float()).to(hidden_states.dtype)  # sum_k w_k E_k(x) per token


ALL_EXPERTS_FUNCTIONS.register(NAME, index_add_experts_forward)


@contextmanager
def recorded_kernels() -> Iterator[list[tuple[str, int]]]:
    """Meanwhile every call of a registered experts kernel appends (its name, the tokens it ran on) to the list
    yielded, then runs the kernel: which kernel each phase of `generate` runs (a prefill's call has the prompt
    tokens of every row, a decode step's one token per row). A diagnostic for tests and scripts/gpu_check.py."""
    calls: list[tuple[str, int]] = []
    saved = dict(ALL_EXPERTS_FUNCTIONS.items())

    def recording(name, kernel):
        def run(module, hidden_states, *args, **kwargs):
            calls.append((name, hidden_states.shape[0]))
            return kernel(module, hidden_states, *args, **kwargs)
        return run

    for name, kernel in saved.items():
        ALL_EXPERTS_FUNCTIONS.register(name, recording(name, kernel))
    try:
        yield calls
    finally:
        for name, kernel in saved.items():
            ALL_EXPERTS_FUNCTIONS.register(name, kernel)
