"""train.lm_head_fp32 (gspo_lab.models.lm_head): under bfloat16 autocast the LM head computes in float32, as TRL's
cast_lm_head_to_fp32 does (trl/trainer/grpo_trainer.py at commit f2cd577, 1.10.0.dev0: lm_head.forward =
F.linear(hidden.to(float32), weight.to(float32), bias.to(float32))), in generation and the log-prob forwards of a
real run; copies keep it with their own weights; a head that is not a plain Linear is refused."""

import copy

import pytest
import torch
import torch.nn.functional as F

from gspo_lab.models import TinyModel
from gspo_lab.models.lm_head import fp32_lm_head
from gspo_lab.train import build

SMALL = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
         "head_dim": 16, "intermediate_size": 32, "tie_word_embeddings": False}


def tiny_qwen3():
    torch.manual_seed(0)
    model, _ = TinyModel(arch="qwen3", config=SMALL).load()
    with torch.no_grad():
        model.lm_head.weight.mul_(30)  # logits of a few tens, where bfloat16's rounding is ~0.1
    return model


def test_under_bf16_autocast_the_head_computes_in_float32():
    """TRL's forward, written out, in float64 as the reference: the patched head's logits equal it to float32
    rounding; autocast's bfloat16 head is off by bfloat16's rounding, a hundred times more."""
    model = tiny_qwen3()
    hidden = torch.randn(3, 4, 32, dtype=torch.bfloat16)  # as the decoder hands it over under autocast
    head = model.lm_head
    reference = F.linear(hidden.to(torch.float64), head.weight.to(torch.float64))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = head(hidden)
        fp32_lm_head(model)
        patched = head(hidden)
    assert plain.dtype == torch.bfloat16 and patched.dtype == torch.float32
    scale = reference.abs().max().item()
    assert (patched.double() - reference).abs().max().item() <= 64 * torch.finfo(torch.float32).eps * scale
    assert (plain.double() - reference).abs().max().item() > 100 * 64 * torch.finfo(torch.float32).eps * scale


def test_a_copy_computes_with_its_own_weights():
    """The KL reference and an engine copy are deep copies of the policy: the bound forward follows the copy."""
    model = tiny_qwen3()
    fp32_lm_head(model)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.lm_head.weight.zero_()
    hidden = torch.randn(2, 32)
    assert twin.lm_head(hidden).abs().max() == 0 and model.lm_head(hidden).abs().max() > 0


def test_a_head_that_is_not_a_plain_linear_is_refused():
    model = tiny_qwen3()
    model.lm_head = torch.nn.Sequential(model.lm_head)  # as a LoRA wrapper replaces it
    with pytest.raises(ValueError, match=r"train.lm_head_fp32=true needs the model's LM head to be a torch.nn.Linear; "
                                         r"it is Sequential"):
        fp32_lm_head(model)


@pytest.mark.parametrize("fp32", [False, True])
def test_a_bf16_mixed_run_computes_every_head_call_in_float32(fp32, compose, rl_overrides):
    """trainer.precision=bf16-mixed on CPU (autocast), KL reference on: every call of the policy's and the
    reference's head, in generation, evaluation and every log-prob forward, returns float32 logits with the key,
    bfloat16 without it (so the key reaches the log-probs and the loss)."""
    overrides = rl_overrides + ["sft.enabled=false", "trainer.precision=bf16-mixed", "train.steps=1",
                                "objective.beta=0.01", f"train.lm_head_fp32={str(fp32).lower()}"]
    run, module, _ = build(compose(overrides))
    dtypes = []
    for model in (module.model, module.reference):
        model.get_output_embeddings().register_forward_hook(lambda head, args, out: dtypes.append(out.dtype))
    run.trainer.fit(module)
    assert len(dtypes) > 10 and set(dtypes) == {torch.float32 if fp32 else torch.bfloat16}
    assert module.history[0]["kl/ref"] == 0  # the reference computes as the policy does
