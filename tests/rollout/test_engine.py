"""The rollout engine: exact by default, measurably different under each dose, kept in sync with the trainer,
and its mismatch to the trainer measured every RL step."""

import math

import pytest
import torch

from gspo_lab.config import EngineConfig
from gspo_lab.models import TinyModel
from gspo_lab.rollout.engine import RolloutEngine, fake_quantise
from gspo_lab.train import build

TINY_MOE = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
            "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16}


@pytest.mark.parametrize("key, value, rule", [("precision", "fp16", "must be one of ['fp32', 'bf16']"),
                                              ("router_noise", -0.1, "must be a finite number >= 0"),
                                              ("weight_bits", 4, "must be one of [None, 8]")])
def test_bad_engine_settings_name_the_key_the_value_and_the_rule(key, value, rule):
    with pytest.raises(ValueError, match=rf"rollout\.engine\.{key}={value!r} is invalid: {rule}".replace("[", r"\[")):
        EngineConfig(**{key: value})


def test_fake_quantisation_is_within_half_a_step_per_output_channel():
    torch.manual_seed(0)
    weight = torch.randn(4, 3, 50) * torch.tensor([1.0, 10.0, 0.01])[None, :, None]  # channels of other scales
    quantised = fake_quantise(weight, 8)
    step = weight.abs().amax(-1, keepdim=True) / 127  # [4, 3, 1] one step per (expert, output channel)
    assert ((quantised - weight).abs() <= step / 2 + 1e-7).all()
    assert ((quantised / step).round() - quantised / step).abs().max() < 1e-4  # on the grid
    assert len(torch.unique(quantised[0, 0])) <= 255


def test_the_default_engine_is_the_trainer_and_a_bf16_engine_follows_its_updates():
    model, _ = TinyModel(arch="qwen3_moe", config=TINY_MOE).load()
    assert RolloutEngine(model, EngineConfig()).model is model  # no copy, nothing to sync
    engine = RolloutEngine(model, EngineConfig(precision="bf16"))
    assert engine.model is not model and next(engine.model.parameters()).dtype == torch.bfloat16
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.01)  # an update
    assert not torch.equal(next(engine.model.parameters()), next(model.parameters()).to(torch.bfloat16))
    engine.sync()
    for mine, theirs in zip(engine.model.parameters(), model.parameters()):
        assert torch.equal(mine, theirs.to(torch.bfloat16))


def run_metrics(compose, rl_overrides, *overrides):
    run, module, _ = build(compose(rl_overrides + ["train.minibatches=1", *overrides]))
    run.trainer.fit(module)
    return module.history[:2]  # the two RL steps


def test_mismatch_is_zero_for_the_default_engine_and_grows_with_bf16_rollouts(compose, rl_overrides):
    for row in run_metrics(compose, rl_overrides):
        assert row["mismatch/kl"] < 1e-8 and row["mismatch/extreme_frac"] == 0
        assert row["routing/rollout_disagreement"] == 0 and row["routing/rollout_disagreement_tokens"] == 0
        assert row["ratio/max"] - 1 < 1e-5  # π_old is the engine's, and the engine is the trainer
    for row in run_metrics(compose, rl_overrides, "rollout.engine.precision=bf16"):
        assert row["mismatch/kl"] > 1e-8 and row["mismatch/seq_log_ratio_abs"] > 1e-5
        assert row["time/engine_sync_s"] > 0


def test_router_noise_moves_the_engines_experts_and_r3_replays_them(compose, rl_overrides):
    """σ = 0.5 of the logits' spread changes many top-2 choices during generation; under r3 the training
    forward uses those experts, so replay overrides the trainer's own choice about as often."""
    rows = run_metrics(compose, rl_overrides, "rollout.engine.router_noise=0.5", "routing.replay=r3")
    for row in rows:
        assert row["routing/rollout_disagreement"] > 0.05
        assert row["routing/override_frac"] > 0.05  # the first (only) mini-batch: weights as at generation
        assert not math.isnan(row["mismatch/kl"])


def test_token_tis_corrects_a_trainer_pi_old_toward_a_bf16_engine(compose, rl_overrides):
    rows = run_metrics(compose, rl_overrides, "algorithm=grpo", "rollout.engine.precision=bf16",
                       "rollout.logprobs_from_generation=false", "objective.rollout_correction=tis_token")
    for row in rows:
        assert row["is/weight_mean"] != 1 and 0 <= row["is/capped_frac"] <= 1
        assert abs(row["ratio/max"] - 1) < 1e-5  # π_old is the trainer's: the PPO ratio is on-policy
