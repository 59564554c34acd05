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
from typing import NamedTuple

import torch
from torch import Tensor
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, _grouped_linear, grouped_mm_experts_forward

from gspo_lab.decoder import CACHE, decoder_of

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


class KernelCall(NamedTuple):
    kernel: str  # the registered name of the experts kernel
    tokens: int  # the tokens it ran on
    phase: str  # "prefill" or "decode": that of the decoder forward it ran in (`recorded_kernels`)


@contextmanager
def recorded_kernels(model: torch.nn.Module) -> Iterator[list[KernelCall]]:
    """Meanwhile every call of a registered experts kernel in `model` (a causal LM) appends a `KernelCall` to the
    list yielded, then runs the kernel: which kernel each phase of `generate` runs. The phase is read from each
    decoder forward, not from token counts (a shared prefill of U prompts of P tokens and a decode step of N rows
    both run N tokens where U (P - 1) = N): a prefill is `generate`'s first forward (`GenerationMixin._prefill`,
    which samples the first token and runs before transformers' decode-kernel swap, also when it continues a
    shared prefill's cache) or a forward from an empty KV cache (a shared prefill, the floor's first call); any
    other forward is a decode step. A diagnostic for tests and scripts/gpu_check.py."""
    calls: list[KernelCall] = []
    saved = dict(ALL_EXPERTS_FUNCTIONS.items())
    phase, in_prefill = "prefill", False

    def recording(name, kernel):
        def run(module, hidden_states, *args, **kwargs):
            calls.append(KernelCall(name, hidden_states.shape[0], phase))
            return kernel(module, hidden_states, *args, **kwargs)
        return run

    def read_phase(_module, _args, kwargs) -> None:
        nonlocal phase
        cache = kwargs.get(CACHE)
        phase = "prefill" if in_prefill or cache is None or cache.get_seq_length() == 0 else "decode"

    def prefill(*args, **kwargs):
        nonlocal in_prefill
        in_prefill = True
        try:
            return generate_prefill(*args, **kwargs)
        finally:
            in_prefill = False

    generate_prefill, model._prefill = model._prefill, prefill
    hook = decoder_of(model).register_forward_pre_hook(read_phase, with_kwargs=True)
    for name, kernel in saved.items():
        ALL_EXPERTS_FUNCTIONS.register(name, recording(name, kernel))
    try:
        yield calls
    finally:
        for name, kernel in saved.items():
            ALL_EXPERTS_FUNCTIONS.register(name, kernel)
        hook.remove()
        del model._prefill  # the class's again
