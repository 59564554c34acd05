"""rollout.rescore (gspo_lab.rollout.rescore): a second engine's scores of the sampled tokens replace the generating
engine's log-probs, aligned with the tokens they score, and a run trains on them (π_old under
logprobs_from_generation=true). The vLLM side is in tests/rollout/test_vllm_engine.py."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from gspo_lab.config import RolloutConfig
from gspo_lab.rollout import token_logprobs
from gspo_lab.rollout.backend import RunSettings, Sampling, backend_class, check_capabilities
from gspo_lab.rollout.engine import RolloutEngine
from gspo_lab.train import build

# float32 log-probs of one model, computed one token at a time with a KV cache against one forward over the whole
# sequence: a few float32 eps of values of a few units
ROUNDING = 1e-5


def test_the_hf_engine_scores_its_own_samples_as_generation_computed_them(compose, tiny, tmp_path):
    _, module, _ = build(compose(tiny + ["sft.enabled=false", f"paths.output_dir={tmp_path}"]))
    engine = RolloutEngine(module.model, RolloutConfig())  # the trainer itself, float32
    stops = tuple(range(len(module.tokenizer) // 2))  # the untrained model stops early on half its vocabulary
    generated = engine.generate(module.tokenizer, ["12+34=", "5+6=", "70+8=", "1+1="] * 2,
                                Sampling(6, temperature=0.8, stop_token_ids=stops), torch.arange(8))
    completions = generated.completions
    scores = engine.score(module.tokenizer, completions, 0.8)
    mask = completions.completion_mask.bool()
    assert mask.sum() > 3 and not mask.all()  # some completions stopped early: padding is scored 0
    assert torch.equal(scores[~mask], torch.zeros_like(scores[~mask]))
    assert (scores - completions.logprobs)[mask].abs().max() <= ROUNDING
    # the temperature divides the logits: at 1 the same tokens score otherwise
    assert (engine.score(module.tokenizer, completions, 1.0) - scores)[mask].abs().max() > 100 * ROUNDING


@pytest.mark.numerics
def test_a_run_takes_pi_old_from_the_rescoring_engine(compose, fast_rl, tmp_path, updated_batches):
    """The simulated bf16 engine scores its own samples in one forward: π_old (logprobs_from_generation=true) is
    that forward's, and it sits within bfloat16 rounding of the log-probs generation computed."""
    run, module, _ = build(compose(fast_rl + ["train.steps=1", "train.eval_every=0", "rollout.engine.precision=bf16",
                                              "rollout.rescore=hf", "rollout.logprobs_from_generation=true",
                                              f"paths.output_dir={tmp_path}"]))
    engine_model = copy.deepcopy(module.engine.model)  # the bf16 copy at step 0's sync: the starting weights
    run.trainer.fit(module)
    batch = updated_batches[0]
    with torch.no_grad():
        forward = token_logprobs(engine_model, batch.input_ids, batch.attention_mask, batch.completion_len, 1.0)[0]
    mask = batch.loss_mask.bool()
    assert torch.equal(batch.old_logp, batch.rollout_logp)
    assert (batch.old_logp - forward)[mask].abs().max() <= ROUNDING
    row = module.history[0]
    # bfloat16 keeps 8 mantissa bits: a log-prob of a few units may move by some 2^-8 relative between a prefill
    # and a decode (on this one-layer model they agree: 0 measured)
    assert row["rescore/logp_abs_diff"] < 0.1 and row["rescore/seq_log_ratio_abs"] < 0.1


@pytest.mark.parametrize("settings, message", [
    ({"rescore": "sglang"}, r"rollout.rescore='sglang' is invalid: must be null or a backend that scores tokens it "
                            r"did not sample \(a Scorer: one of \['hf', 'vllm'\]\)"),
    ({"rescore": "replay"}, r"rollout.rescore='replay' is invalid: must be null or a backend that scores"),
    ({"rescore": "hf", "backend": "replay"}, r"rollout.rescore=hf with rollout.backend=replay: rescoring replaces the "
                                             r"generating engine's log-probs, and ReplayBackend does not declare "
                                             r"returns_logprobs = True"),
    ({"rescore": "vllm", "temperature": 0.7}, r"rollout.rescore=vllm with rollout.temperature=0.7: vLLM scores a "
                                              r"prompt's tokens on its raw logits"),
])
def test_bad_rescore_settings_name_the_key_the_value_and_the_rule(settings, message):
    with pytest.raises(ValueError, match=message):
        capabilities_checked(RolloutConfig(**settings))


def test_a_scorer_rescores_at_the_temperatures_it_can():
    capabilities_checked(RolloutConfig(rescore="vllm"))
    capabilities_checked(RolloutConfig(rescore="hf", temperature=0.7))


def capabilities_checked(rollout: RolloutConfig) -> None:
    """What the plan checks of the backend's capabilities for `rollout` (no tools, no replay)."""
    run = RunSettings(rollout, None, SimpleNamespace(replay="off"), None, None, "cpu", False)
    check_capabilities(backend_class(rollout.backend), run, multi_turn=False)
