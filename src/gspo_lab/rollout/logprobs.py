"""Per-token log-probs of completion tokens without a [B, T, V] float32 log-softmax for the whole batch.

The decoder runs once over the batch; the LM head, the temperature and the log-softmax then run on row
chunks of the completion positions only. In training each chunk is activation-checkpointed, so its [rows, C, V]
logits are recomputed in the backward pass instead of kept: peak memory is one chunk's logits. Each row's
log-softmax is the same `log_softmax` a full [B, T, V] computation (or generation) runs, so the values are
identical to it, bit for bit (tested), not merely close.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel

from gspo_lab.rollout.generation import position_ids


def _chunk_logprobs(hidden: Tensor, targets: Tensor, head: torch.nn.Module, temperature: float):
    """hidden [R, C, H], targets [R, C] -> log p(target) [R, C] and entropy [R, C] (no gradient)."""
    logits = head(hidden).float() / temperature  # [R, C, V]: the same scaling as generation's warper
    log_probs = logits.log_softmax(-1)  # [R, C, V], the very op a full log-softmax and generation use
    logp = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # [R, C] log p(target)
    with torch.no_grad():
        entropy = -(log_probs.exp() * log_probs).sum(-1)  # H = -sum_v p log p
    return logp, entropy


def token_logprobs(
    model: PreTrainedModel,
    input_ids: Tensor,
    attention_mask: Tensor,
    completion_len: int,
    temperature: float = 1.0,
    chunk_rows: int = 32,
) -> tuple[Tensor, Tensor]:
    """log π(y_t | x, y_<t) and the policy entropy at each of the last `completion_len` positions.

    input_ids, attention_mask: [B, P + C]; returns two [B, C] tensors (log-probs carry the gradient when
    grad is enabled; entropy is detached).
    """
    decoder = getattr(model, model.base_model_prefix)
    head = model.get_output_embeddings()
    hidden = decoder(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids(attention_mask),
        use_cache=False,
    ).last_hidden_state  # [B, P + C, H]
    hidden = hidden[:, -completion_len - 1 : -1]  # position t predicts token t + 1  [B, C, H]
    targets = input_ids[:, -completion_len:]  # [B, C]
    logps, entropies = [], []
    for rows in range(0, input_ids.shape[0], chunk_rows):
        h, y = hidden[rows : rows + chunk_rows], targets[rows : rows + chunk_rows]
        if torch.is_grad_enabled():
            logp, entropy = checkpoint(_chunk_logprobs, h, y, head, temperature, use_reentrant=False)
        else:
            logp, entropy = _chunk_logprobs(h, y, head, temperature)
        logps.append(logp)
        entropies.append(entropy)
    return torch.cat(logps), torch.cat(entropies).detach()
