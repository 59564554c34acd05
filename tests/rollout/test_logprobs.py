"""Training log-probs equal the model's own log_softmax(logits / T) for architectures that post-process the LM
head's output (soft-capping, logit scales); a model whose post-processing is unknown is refused when it loads."""

import pytest
import torch
from transformers import Qwen3ForCausalLM

from gspo_lab.models import TinyModel
from gspo_lab.rollout.generation import position_ids
from gspo_lab.rollout.logprobs import LOGIT_SCALES, check_logprobs_match, token_logprobs
from tests.numerics import assert_rounding_close, logit_scale

SMALL = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
         "head_dim": 16, "intermediate_size": 32, "tie_word_embeddings": False}
POST_PROCESSING = {
    "gemma2": {"final_logit_softcapping": 30.0},  # logits = 30 tanh(z / 30)
    "granitemoe": {"logits_scaling": 8.0, "num_local_experts": 4, "num_experts_per_tok": 2},  # logits = z / 8
    "cohere": {"logit_scale": 0.0625},  # logits = z * 0.0625
}


def left_padded_batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    input_ids = torch.randint(3, vocab, (3, 10))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :4] = 0  # left padding
    return input_ids.masked_fill(attention_mask == 0, 0), attention_mask


@pytest.mark.numerics
@pytest.mark.parametrize("arch", sorted(POST_PROCESSING))
def test_chunked_logprobs_equal_the_models_own_log_softmax(arch):
    torch.manual_seed(0)
    model, tok = TinyModel(arch=arch, config={**SMALL, **POST_PROCESSING[arch]}).load()
    model.eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(1000)  # head outputs of about +-100, so a cap at 30 matters
    ids, mask = left_padded_batch(len(tok))
    C, temperature = 5, 0.7
    with torch.no_grad():
        chunked, _ = token_logprobs(model, ids, mask, C, temperature, chunk_rows=2)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask)).logits[:, -C - 1 : -1]
        reference = (logits / temperature).log_softmax(-1).gather(-1, ids[:, -C:, None]).squeeze(-1)
        hidden = model.model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask)).last_hidden_state
        head_only = (model.lm_head(hidden[:, -C - 1 : -1]) / temperature).log_softmax(-1)
        head_only = head_only.gather(-1, ids[:, -C:, None]).squeeze(-1)
    assert (head_only - reference).abs().max() > 0.1  # the post-processing matters here ...
    # ... and training applies it: 2-row chunks and a 3-row batch take other GEMM blockings, so equal to rounding
    # of the logits (up to |z / T| ~ 1,400 here); 16 roundings where 1-6 were measured across CPU kernels
    assert_rounding_close(chunked, reference, scale=logit_scale(logits, temperature), units=16)


def test_a_model_with_unknown_logit_post_processing_is_refused_when_it_loads(monkeypatch):
    monkeypatch.delitem(LOGIT_SCALES, "granitemoe")  # as if transformers had added a new architecture
    with pytest.raises(ValueError, match=r"GraniteMoeForCausalLM \(model_type 'granitemoe'\): training log-probs "
                                         r"differ from the model's own log_softmax\(logits\) by up to"):
        TinyModel(arch="granitemoe", config={**SMALL, **POST_PROCESSING["granitemoe"]}).load()


def test_a_forward_that_rescales_its_logits_is_refused():
    class RescaledQwen3(Qwen3ForCausalLM):
        def forward(self, *args, **kwargs):
            output = super().forward(*args, **kwargs)
            output.logits = output.logits * 3  # post-processing the chunked path cannot know about
            return output

    torch.manual_seed(0)
    model, _ = TinyModel(arch="qwen3", config=SMALL).load()
    check_logprobs_match(model)  # the plain architecture passes
    rescaled = RescaledQwen3(model.config)
    with pytest.raises(ValueError, match=r"RescaledQwen3 \(model_type 'qwen3'\).*head_transform does not know"):
        check_logprobs_match(rescaled)


def head_positions(model) -> tuple[list[int], object]:
    """Records the (row, token) positions of every LM-head call: the leading dims of its [*, V] output."""
    seen: list[int] = []
    handle = model.get_output_embeddings().register_forward_hook(
        lambda module, args, out: seen.append(out.numel() // out.shape[-1]))
    return seen, handle


@pytest.mark.numerics
def test_token_chunks_bound_the_logits_and_keep_values_and_gradients():
    """chunk_tokens=3 on 2-row chunks runs the head on 2 x 1 positions at a time (never more than 3), also when
    the backward pass recomputes a chunk; log-probs and gradients equal whole-row chunks to float rounding."""
    torch.manual_seed(0)
    model, tok = TinyModel(arch="qwen3", config=SMALL).load()
    model.eval()
    ids, mask = left_padded_batch(len(tok))
    C, temperature = 5, 0.7
    results = {}
    for chunk_tokens in (None, 3):
        model.zero_grad()
        seen, handle = head_positions(model)
        logp, entropy = token_logprobs(model, ids, mask, C, temperature, chunk_rows=2, chunk_tokens=chunk_tokens)
        weights = torch.linspace(-1, 1, logp.numel()).view_as(logp)
        (logp * weights).sum().backward()
        handle.remove()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        results[chunk_tokens] = (logp.detach(), entropy, grads, seen)
    whole, chunked = results[None], results[3]
    # rows 0-1 then row 2, in the forward and again when backward recomputes them: 2 x 5 and 1 x 5 positions ...
    assert sorted(whole[3]) == [5, 5, 10, 10]
    # ... or, bounded to 3 positions, rows 0-1 one column at a time (5 x 2 positions), row 2 three at a time (3, 2)
    assert sorted(chunked[3]) == sorted([2] * 5 * 2 + [3, 2] * 2)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask)).logits
    scale = logit_scale(logits, temperature)
    assert_rounding_close(chunked[0], whole[0], scale=scale, units=16)
    assert_rounding_close(chunked[1], whole[1], scale=scale, units=16)
    assert_rounding_close(chunked[2], whole[2], scale=whole[2].abs().max().item(), units=64)


def test_token_chunks_as_wide_as_the_completion_are_the_row_chunks_themselves():
    """A bound every chunk fits in (2 rows x 5 tokens <= 10) computes exactly today's chunks: bitwise equal (the
    same operations on the same shapes in one process)."""
    torch.manual_seed(0)
    model, tok = TinyModel(arch="qwen3", config=SMALL).load()
    model.eval()
    ids, mask = left_padded_batch(len(tok))
    with torch.no_grad():
        rows_only, _ = token_logprobs(model, ids, mask, 5, 1.0, chunk_rows=2)
        bounded, _ = token_logprobs(model, ids, mask, 5, 1.0, chunk_rows=2, chunk_tokens=10)
    assert torch.equal(rows_only, bounded)


def test_the_token_bound_holds_below_the_row_chunk():
    """chunk_tokens=1 with 2-row chunks: one position per head call, the rows split too."""
    torch.manual_seed(0)
    model, tok = TinyModel(arch="qwen3", config=SMALL).load()
    ids, mask = left_padded_batch(len(tok))
    seen, handle = head_positions(model)
    with torch.no_grad():
        token_logprobs(model, ids, mask, 5, 1.0, chunk_rows=2, chunk_tokens=1)
    handle.remove()
    assert seen == [1] * 15  # 3 rows x 5 tokens
