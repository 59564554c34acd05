"""The differentiable entropy of the entropy bonus (objective.entropy_coef): `token_logprobs(..., entropy_grad=True)`
returns the no-grad path's log-probs and entropies, its gradient is autograd's of the written-out entropy over the
whole vocabulary, and its chunk keeps no more [*, V] tensors for the backward than the log-probs alone.

The reference is TRL's entropy_from_logits (trl/trainer/utils.py at commit f2cd577, 1.10.0.dev0), written out:
logps = log_softmax(logits); H = -(exp(logps) * logps).sum(-1), on the logits / temperature of a full forward, as
TRL's _get_per_token_logps_and_entropies divides them before it (and keeps the entropy's graph when its bonus is on).
"""

import pytest
import torch
from torch.autograd.graph import saved_tensors_hooks

from gspo_lab.models import TinyModel
from gspo_lab.rollout.generation import position_ids
from gspo_lab.rollout.logprobs import _chunk_logprobs, head_transform, token_logprobs
from tests.numerics import assert_rounding_close, logit_scale

SMALL = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
         "head_dim": 16, "intermediate_size": 32, "tie_word_embeddings": False, "final_logit_softcapping": 3.0}
C, TEMPERATURE = 5, 0.7


def model_and_batch():
    """gemma2 (soft-capped logits, so the head transform is in the path), one layer, left-padded rows."""
    torch.manual_seed(0)
    model, tok = TinyModel(arch="gemma2", config=SMALL).load()
    model.eval()
    input_ids = torch.randint(3, len(tok), (3, 10))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :4] = 0  # left padding
    return model, input_ids.masked_fill(attention_mask == 0, 0), attention_mask


def trl_logps_and_entropy(model, ids, mask):
    """The full forward's log p(target) and TRL's entropy_from_logits, both with their graphs."""
    logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask)).logits[:, -C - 1 : -1]
    logits = logits.float() / TEMPERATURE  # in float32, as gspo-lab's chunks and TRL's upcast logits compute it
    logps = torch.log_softmax(logits, dim=-1)
    entropy = -(torch.exp(logps) * logps).sum(-1)
    return logps.gather(-1, ids[:, -C:, None]).squeeze(-1), entropy


def parameter_grads(model, loss):
    model.zero_grad()
    loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def test_the_entropy_values_are_the_no_grad_paths():
    """Bitwise: the same log_softmax on the same chunks; the entropy sums each position's row over the vocabulary
    alone, in blocks of positions instead of all at once."""
    model, ids, mask = model_and_batch()
    plain_logp, plain_entropy = token_logprobs(model, ids, mask, C, TEMPERATURE, chunk_rows=2)
    logp, entropy = token_logprobs(model, ids, mask, C, TEMPERATURE, chunk_rows=2, entropy_grad=True)
    assert not plain_entropy.requires_grad and entropy.requires_grad
    assert torch.equal(logp, plain_logp) and torch.equal(entropy, plain_entropy)


@pytest.mark.parametrize("chunk_tokens", [None, 4])
@pytest.mark.numerics
def test_the_gradient_is_autograds_of_the_written_out_entropy(chunk_tokens):
    """L = Σ a·log p + Σ b·H with random a, b: the parameters' gradient through the chunked, checkpointed path equals
    autograd's through a full forward and TRL's formula to float32 rounding (other chunk shapes, other GEMM
    blockings: the tolerances of tests/rollout/test_logprobs.py)."""
    model, ids, mask = model_and_batch()
    generator = torch.Generator().manual_seed(1)
    a, b = (torch.randn(3, C, generator=generator) for _ in range(2))
    logp, entropy = token_logprobs(model, ids, mask, C, TEMPERATURE, chunk_rows=2, chunk_tokens=chunk_tokens,
                                   entropy_grad=True)
    grads = parameter_grads(model, (a * logp).sum() + (b * entropy).sum())
    reference_logp, reference_entropy = trl_logps_and_entropy(model, ids, mask)
    reference = parameter_grads(model, (a * reference_logp).sum() + (b * reference_entropy).sum())
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask)).logits
    assert_rounding_close(entropy.detach(), reference_entropy.detach(), scale=logit_scale(logits, TEMPERATURE))
    assert reference.abs().max() > 1e-3  # the loss reaches the weights
    assert_rounding_close(grads, reference, scale=reference.abs().max().item(), units=64)
    entropy_only = parameter_grads(model, (b * token_logprobs(model, ids, mask, C, TEMPERATURE, entropy_grad=True)[1]
                                           ).sum())
    assert entropy_only.abs().max() > 1e-3  # and the entropy's own part of it is not zero


def big_saved_tensors(fn, *args, vocab: int) -> int:
    """How many distinct tensors of at least R x C x V elements autograd keeps for the backward of `fn(*args)` (one
    saved by two nodes, as the log-softmax by itself and by gather, counts once)."""
    storages = set()

    def pack(tensor):
        if tensor.numel() >= 3 * C * vocab:
            storages.add(tensor.untyped_storage().data_ptr())
        return tensor

    with saved_tensors_hooks(pack, lambda tensor: tensor):
        outputs = fn(*args)
    del outputs
    return len(storages)


def test_the_bonus_keeps_no_more_vocabulary_sized_tensors_than_the_log_probs():
    """The chunk's graph keeps as many [R, C, V] tensors with the differentiable entropy as without (the log-softmax,
    and what gemma2's soft-capping keeps); autograd of the written-out -(p * log p).sum(-1) would also keep p."""
    model, ids, mask = model_and_batch()
    hidden = model.model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask)).last_hidden_state
    hidden = hidden[:, -C - 1 : -1].detach().requires_grad_()
    vocab = model.get_output_embeddings().out_features
    piece = (hidden, ids[:, -C:], model.get_output_embeddings(), head_transform(model), TEMPERATURE)
    without = big_saved_tensors(_chunk_logprobs, *piece, vocab=vocab)
    with_bonus = big_saved_tensors(_chunk_logprobs, *piece, True, vocab=vocab)

    def written_out(*args):
        logits = head_transform(model)(model.get_output_embeddings()(hidden)).float() / TEMPERATURE
        logps = logits.log_softmax(-1)
        return logps.gather(-1, ids[:, -C:, None]), -(torch.exp(logps) * logps).sum(-1)

    assert with_bonus == without and big_saved_tensors(written_out, vocab=vocab) > without
