"""experts_implementation=index_add computes what transformers' grouped_mm computes, values and gradients,
on every MoE architecture the framework ships; it really is the kernel that runs; checkpoints stay loadable."""

import copy
import math
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from gspo_lab import CONFIG_DIR
from gspo_lab.models import experts
from gspo_lab.models.builders import load_pretrained
from gspo_lab.rollout import token_logprobs
from tests.numerics import assert_rounding_close

MOE_MODELS = ["tiny_moe", "tiny_mixtral", "tiny_olmoe", "tiny_qwen2_moe"]


def load(name: str, dtype: str = "float32", **config):
    cfg = OmegaConf.load(Path(CONFIG_DIR) / "model" / f"{name}.yaml")
    cfg.config.update(config)
    cfg.dtype = dtype
    torch.manual_seed(0)
    return instantiate(cfg).load()


def logprobs_and_grads(model, tokenizer):
    batch = tokenizer(["12+345=357", "9*9=81", "7-8=-1"], return_tensors="pt", padding=True)
    model.zero_grad()
    logp, _ = token_logprobs(model, batch["input_ids"], batch["attention_mask"], 4)
    (logp * torch.tensor([[1.0, -2.0, 0.5, 3.0]])).sum().backward()  # an uneven weighting of the tokens
    return logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def with_kernel(model, name: str):
    other = copy.deepcopy(model)
    other.set_experts_implementation(name)
    return other


@pytest.mark.parametrize("name", MOE_MODELS)
@pytest.mark.numerics
def test_index_add_equals_grouped_mm_bitwise_for_top2(name):
    model, tokenizer = load(name)
    assert model.config._experts_implementation == "index_add"  # the shipped configs select it
    assert model.config.num_experts_per_tok == 2
    logp, grads = logprobs_and_grads(model, tokenizer)
    reference_logp, reference_grads = logprobs_and_grads(with_kernel(model, "grouped_mm"), tokenizer)
    # bitwise on any CPU so far: both kernels run the same per-expert GEMMs on the same rows, then add each token's
    # two expert outputs (a 2-term sum is order-free); the numerics marker re-checks it on other kernels
    assert torch.equal(logp, reference_logp)
    assert grads.keys() == reference_grads.keys()
    assert any(".experts." in n for n in grads)  # expert weights did receive gradients
    for n in grads:
        assert torch.equal(grads[n], reference_grads[n]), n


@pytest.mark.numerics
def test_index_add_equals_grouped_mm_in_bfloat16():
    """Each token's experts are summed in float32 then rounded once, as grouped_mm does."""
    model, tokenizer = load("tiny_moe", dtype="bfloat16")
    logp, grads = logprobs_and_grads(model, tokenizer)
    reference_logp, reference_grads = logprobs_and_grads(with_kernel(model, "grouped_mm"), tokenizer)
    assert torch.equal(logp, reference_logp)
    for n in grads:
        assert torch.equal(grads[n], reference_grads[n]), n


@pytest.mark.numerics
def test_index_add_matches_grouped_mm_for_top3():
    model, tokenizer = load("tiny_moe", num_experts_per_tok=3)
    logp, grads = logprobs_and_grads(model, tokenizer)
    reference_logp, reference_grads = logprobs_and_grads(with_kernel(model, "grouped_mm"), tokenizer)
    # a 3-term sum may round differently: equal to rounding at the logits' size (at most 1 + log V here)
    assert_rounding_close(logp, reference_logp, scale=1 + math.log(len(tokenizer)), units=16)
    for n in grads:  # rounding of each gradient's largest entry, summed over the batch's tokens
        assert_rounding_close(grads[n], reference_grads[n], scale=reference_grads[n].abs().max(), units=256)


def test_index_add_is_the_kernel_that_runs(monkeypatch):
    model, tokenizer = load("tiny_moe")
    calls = []
    original = experts.ALL_EXPERTS_FUNCTIONS[experts.NAME]

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setitem(experts.ALL_EXPERTS_FUNCTIONS._global_mapping, experts.NAME, counting)
    logprobs_and_grads(model, tokenizer)
    assert len(calls) == model.config.num_hidden_layers  # once per MoE layer


def test_an_index_add_checkpoint_reloads_with_any_kernel(tmp_path):
    model, tokenizer = load("tiny_moe")
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    for kernel in ["index_add", "grouped_mm"]:
        reloaded, _ = load_pretrained(tmp_path, experts_implementation=kernel)
        assert reloaded.config._experts_implementation == kernel
        assert torch.equal(logprobs_and_grads(reloaded, tokenizer)[0], logprobs_and_grads(model, tokenizer)[0])
