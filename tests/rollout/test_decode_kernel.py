"""An MoE's experts run the model's own kernel in every phase of the rollout's `generate`: transformers swaps
`grouped_mm` for `batched_mm` in the decode steps on a GPU, which copies every (token, expert) pair's weights
(gspo_lab.rollout.generation.experts_kernel_kept)."""

from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from gspo_lab import CONFIG_DIR
from gspo_lab.models.experts import recorded_kernels
from gspo_lab.rollout.generation import KEPT_GROUPED_MM, experts_kernel_kept, generate

ROWS, NEW_TOKENS = 4, 5


def tiny_moe(kernel: str):
    cfg = OmegaConf.load(Path(CONFIG_DIR) / "model" / "tiny_moe.yaml")
    cfg.experts_implementation = kernel
    torch.manual_seed(0)
    return instantiate(cfg).load()


def rollout(model, tokenizer, **kwargs):
    return generate(model, tokenizer, ["12+34=", "5*6=", "7-8=", "9+9="], NEW_TOKENS, suppress_eos=True,
                    return_logprobs=True, row_seeds=torch.arange(ROWS), **kwargs)


def test_generate_runs_grouped_mm_under_its_kept_name_in_every_phase_and_restores_it():
    model, tokenizer = tiny_moe("grouped_mm")
    layers = model.config.num_hidden_layers
    with recorded_kernels(model) as calls:
        kept = rollout(model, tokenizer)
    assert {call.kernel for call in calls} == {KEPT_GROUPED_MM}
    decode_calls = [call.tokens for call in calls if call.phase == "decode"]
    assert decode_calls == [ROWS] * layers * (NEW_TOKENS - 1)  # one token per row; the prefill samples the first
    assert len(calls) == layers * NEW_TOKENS
    assert model.get_experts_implementation()[""] == "grouped_mm"
    with recorded_kernels(model) as calls:
        swapped = rollout(model, tokenizer, decode_experts_kernel="transformers")
    assert {call.kernel for call in calls} == {"grouped_mm"}  # on a CPU transformers keeps grouped_mm itself
    assert torch.equal(kept.completion_ids, swapped.completion_ids)  # one function under two names
    assert torch.equal(kept.logprobs, swapped.logprobs)


def test_other_kernels_are_left_as_they_are():
    model, tokenizer = tiny_moe("index_add")
    with recorded_kernels(model) as calls:
        rollout(model, tokenizer)
    assert {call.kernel for call in calls} == {"index_add"}


def test_transformers_decode_swap_skips_the_kept_kernel_on_an_accelerator():
    """transformers' own swap (`_optimize_model_for_decode`, private, the code generate runs around its decode
    steps) reads only the model's `device`; here the model says it is on a GPU."""
    model, _ = tiny_moe("grouped_mm")
    model.__class__ = type("OnAccelerator", (type(model),), {"device": property(lambda self: torch.device("cuda"))})
    with model._optimize_model_for_decode():
        assert model.get_experts_implementation()[""] == "batched_mm"  # what generate does unless told
    with experts_kernel_kept(model), model._optimize_model_for_decode():
        assert model.get_experts_implementation()[""] == KEPT_GROUPED_MM
    assert model.get_experts_implementation()[""] == "grouped_mm"


def test_an_unknown_decode_kernel_choice_is_refused():
    model, tokenizer = tiny_moe("grouped_mm")
    with pytest.raises(ValueError, match="decode_experts_kernel='fast'.*'keep' or 'transformers'"):
        rollout(model, tokenizer, decode_experts_kernel="fast")


def test_a_static_cache_samples_the_dynamic_caches_tokens():
    """transformers' preallocated cache (what `generate` compiles on a GPU) decodes the same tokens from the same
    row seeds; its attention runs over the padded cache, so log-probs agree to float32 rounding."""
    model, tokenizer = tiny_moe("grouped_mm")
    caches = []

    def cache_of(_, args, kwargs):  # transformers 5.24 names it `cache`, earlier 5.x `past_key_values`
        caches.append(type(kwargs.get("cache", kwargs.get("past_key_values"))).__name__)

    model.register_forward_pre_hook(cache_of, with_kwargs=True)
    dynamic = rollout(model, tokenizer)
    assert set(caches) == {"DynamicCache"}
    caches.clear()
    static = rollout(model, tokenizer, cache_implementation="static")
    assert set(caches) == {"StaticCache"}
    assert torch.equal(dynamic.completion_ids, static.completion_ids)
    # |log p| <= ~5 here: float32 rounding of a log-softmax over sums of O(10) terms, with a wide margin
    torch.testing.assert_close(static.logprobs, dynamic.logprobs, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="cache_implementation='static' with share_prompts=True"):
        rollout(model, tokenizer, cache_implementation="static", share_prompts=True)
