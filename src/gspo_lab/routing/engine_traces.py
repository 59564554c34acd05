"""Routing traces from an external inference engine: vLLM's and SGLang's `routed_experts` as a `RoutingTrace`.

Both engines can return, for each sequence, the experts they routed every token to: an int32 array of shape
[sequence length - 1, layers, top_k] over the sequence's real tokens (prompt then completion, no padding; the
last token is never fed back, so it has no entry). gspo-lab's batches are left-padded prompts of P columns
followed by right-padded completions, L columns in all; row i's token t (0-based over its real tokens) sits at
column P - p_i + t in its prompt (p_i prompt tokens) and at column P + (t - p_i) in its completion.

    trace = trace_from_routed_experts(outputs_routed_experts, prompt_lens, prompt_len=P, length=L, num_experts=E)
    with replay_routing(model, trace):   # r3 with the engine's experts
        ...

Columns without an engine entry (padding, the last token) are marked not recorded, so replay leaves them to
the live router.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from gspo_lab.routing.trace import RoutingTrace, compact_dtype


def trace_from_routed_experts(routed_experts: Sequence, prompt_lens: Sequence[int], prompt_len: int, length: int,
                              num_experts: int) -> RoutingTrace:
    """routed_experts[i]: row i's [p_i + c_i - 1, layers, k] expert ids (numpy or torch, any integer dtype);
    prompt_lens[i] = p_i; the batch has `prompt_len` prompt columns and `length` columns in all."""
    if len(routed_experts) != len(prompt_lens):
        raise ValueError(f"routed_experts has {len(routed_experts)} rows but prompt_lens has {len(prompt_lens)}")
    arrays = [torch.as_tensor(np.asarray(r)) for r in routed_experts]
    shapes = {tuple(a.shape[1:]) for a in arrays}
    if any(a.dim() != 3 for a in arrays) or len(shapes) != 1:
        raise ValueError(f"routed_experts rows must all be [tokens, layers, top_k] with the same layers and top_k; "
                         f"got shapes {[tuple(a.shape) for a in arrays]}")
    layers, k = shapes.pop()
    indices = torch.zeros(layers, len(arrays), length, k, dtype=compact_dtype(num_experts))
    recorded = torch.zeros(len(arrays), length, dtype=torch.bool)
    for row, (experts, p) in enumerate(zip(arrays, prompt_lens)):
        completion = experts.shape[0] + 1 - p  # c_i: the entries cover every real token but the last
        if not 0 < p <= prompt_len or not 0 < completion <= length - prompt_len:
            raise ValueError(f"routed_experts row {row}: {experts.shape[0]} entries with prompt_lens[{row}]={p} mean "
                             f"a {p}-token prompt and a {completion}-token completion; the batch holds prompts of at "
                             f"most {prompt_len} and completions of 1 to {length - prompt_len} tokens")
        if experts.numel() and not 0 <= int(experts.min()) <= int(experts.max()) < num_experts:
            raise ValueError(f"routed_experts row {row}: expert ids must lie in [0, {num_experts}); "
                             f"got {int(experts.min())}..{int(experts.max())}")
        columns = torch.cat([torch.arange(prompt_len - p, prompt_len), torch.arange(prompt_len, prompt_len + completion - 1)])
        indices[:, row, columns] = experts.permute(1, 0, 2).to(indices.dtype)  # [layers, tokens, k]
        recorded[row, columns] = True
    return RoutingTrace(indices, recorded, prompt_len)
