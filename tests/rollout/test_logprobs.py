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
