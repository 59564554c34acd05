"""Bounded staleness, rollout.async_mode=lagged (gspo_lab.rollout.sources.lagged): at RL step t the engine generates from
weight version max(t - k, 0), each row records it, the run repeats exactly and resumes exactly, and k = 0 leaves
the synchronous step as it was."""

from __future__ import annotations

import copy

import pytest
import torch

from gspo_lab.rollout import token_logprobs
from gspo_lab.rollout.engine import RolloutEngine
from gspo_lab.rollout.sources.lagged import LaggedWeights
from gspo_lab.train import ConfigError, build, plan

TIMING = ("time/", "throughput/")


class WeightsAtSync:
    """A backend whose sync keeps a copy of the model's weights as they are at that moment."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.seen = model, []

    def sync(self) -> None:
        self.seen.append(self.model.weight.detach().clone())


def test_the_backend_syncs_the_version_k_steps_back_and_the_trainer_keeps_its_own():
    model = torch.nn.Linear(2, 1, bias=False)
    frozen = torch.nn.Linear(2, 1)  # a parameter that does not train (LoRA's base) is never copied
    model.register_module("frozen", frozen.requires_grad_(False))
    lag, backend, versions = LaggedWeights(model, max_staleness=2), WeightsAtSync(model), []
    for step in range(5):
        versions.append(model.weight.detach().clone())  # version `step`: the weights at the start of step `step`
        assert lag.sync(backend, step) == max(step - 2, 0)
        assert torch.equal(model.weight, versions[step])  # the trainer's own weights are back
        with torch.no_grad():
            model.weight.add_(1.0)  # the step's update
    for step, seen in enumerate(backend.seen):
        assert torch.equal(seen, versions[max(step - 2, 0)])
    assert sorted(lag.versions) == [2, 3, 4]  # what steps 5 and 6 still need
    assert list(lag.versions[4]) == ["weight"]
    restored = LaggedWeights(model, max_staleness=2)
    restored.load_state_dict(lag.state_dict())
    assert restored.sync(backend, 5) == 3 and torch.equal(backend.seen[-1], versions[3])


def test_a_version_never_recorded_is_a_clear_error():
    model = torch.nn.Linear(2, 1)
    with pytest.raises(RuntimeError, match=r"version 1 of the weights, needed at RL step 3, was never recorded"):
        LaggedWeights(model, max_staleness=2).sync(WeightsAtSync(model), 3)
    with pytest.raises(ValueError, match=r"rollout.max_staleness=0: LaggedWeights needs a lag >= 1"):
        LaggedWeights(model, max_staleness=0)


def fit(compose, overrides: list[str], out, *extra: str, ckpt_path=None):
    run, module, _ = build(compose(overrides + list(extra) + [f"paths.output_dir={out}"]))
    starting = copy.deepcopy(module.model)  # version 0
    run.trainer.fit(module, ckpt_path=ckpt_path, weights_only=True)
    return module, starting


def untimed(history: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith(TIMING)} for row in history]


@pytest.mark.numerics
def test_lagged_rollouts_come_from_the_lagged_weights_and_repeat_exactly(compose, fast_rl, tmp_path, updated_batches):
    steps = ["train.steps=3", "train.eval_every=0"]
    lagged, starting = fit(compose, fast_rl, tmp_path / "lagged", "rollout.max_staleness=1", *steps)
    assert [row["off_policy/staleness_mean"] for row in lagged.history] == [0, 1, 1]
    assert [row["off_policy/staleness_max"] for row in lagged.history] == [0, 1, 1]
    # every completion token records the version that wrote it
    assert [batch.versions.unique().tolist() for batch in updated_batches] == [[0], [0], [1]]
    assert [batch.versions.shape for batch in updated_batches] == [batch.loss_mask.shape for batch in updated_batches]
    assert [row["off_policy/mixed_frac"] for row in lagged.history] == [0, 0, 0]
    # step 1 was sampled by version 0, the starting weights, though the trainer had taken a step since: the engine's
    # log-probs are version 0's (to the rounding of generate against a forward), π_old too (bypass)
    batch = updated_batches[1]
    version_0 = token_logprobs(starting, batch.input_ids, batch.attention_mask, batch.completion_len, 1.0)[0]
    mask = batch.policy_mask.bool()
    assert torch.allclose(batch.rollout_logp[mask], version_0[mask], atol=1e-5)
    assert torch.equal(batch.old_logp, batch.rollout_logp)
    assert lagged.history[1]["mismatch/seq_log_ratio_abs"] > 100 * lagged.history[0]["mismatch/seq_log_ratio_abs"]
    # k = 0: the synchronous step; its first rollout is the lagged run's, whose engine then held the same weights
    synchronous, _ = fit(compose, fast_rl, tmp_path / "sync", *steps)
    assert torch.equal(updated_batches[3].input_ids, updated_batches[0].input_ids)
    assert torch.equal(updated_batches[3].old_logp, updated_batches[0].old_logp)
    assert updated_batches[3].versions is None and "off_policy/staleness_mean" not in synchronous.history[0]
    again, _ = fit(compose, fast_rl, tmp_path / "again", "rollout.max_staleness=1", *steps)
    assert untimed(again.history) == untimed(lagged.history)


def test_a_lagged_run_resumes_from_its_checkpoint_exactly(compose, fast_rl, tmp_path):
    """A checkpoint after step 2 carries versions 0 and 1; the resumed steps 2 and 3 generate from them."""
    keep_all = ["rollout.max_staleness=2", "train.eval_every=0", "train.ckpt_every=1",
                "callbacks.checkpoint.save_top_k=-1"]
    whole, _ = fit(compose, fast_rl, tmp_path / "whole", "train.steps=4", *keep_all)
    checkpoint = tmp_path / "whole" / "checkpoints" / "rl_step=2.ckpt"
    assert sorted(torch.load(checkpoint, weights_only=True)["lagged_weights"]) == [0, 1]
    resumed, _ = fit(compose, fast_rl, tmp_path / "resumed", "train.steps=4", *keep_all, ckpt_path=str(checkpoint))
    assert untimed(resumed.history) == untimed(whole.history)
    for (name, a), b in zip(whole.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), name


@pytest.mark.numerics
def test_the_decoupled_loss_trains_on_stale_rows(compose, fast_rl, tmp_path, updated_batches):
    """π_old recomputed (π_prox, the current weights), π_behave the engine's: at step 0 they are one policy (to
    rounding), from step 1 the weight carries the one step of staleness."""
    module, starting = fit(compose, fast_rl, tmp_path / "decoupled", "rollout.max_staleness=1", "train.steps=2",
                           "train.eval_every=0", "rollout.logprobs_from_generation=false", "objective.decoupled=true")
    first, second = module.history
    assert first["behave/weight_mean"] == pytest.approx(1, abs=1e-5)
    assert abs(second["behave/approx_kl"]) > 100 * abs(first["behave/approx_kl"])
    assert not torch.equal(updated_batches[1].old_logp, updated_batches[1].rollout_logp)
    assert any(not torch.equal(a, b) for a, b in zip(starting.parameters(), module.model.parameters()))


class SamplesTheTrainersModel(RolloutEngine):
    """A backend of a user's own that generates from the trainer's model itself and has no copy to sync: it does
    not declare samples_synced_weights."""

    samples_synced_weights = False


def test_lagged_mode_is_refused_for_a_backend_that_samples_the_trainers_model(compose, fast_rl, tmp_path):
    """Such a backend reported staleness_max 2 while sampling the current weights: lagged mode reaches a backend
    through its sync() alone."""
    backend = f"{__name__}:SamplesTheTrainersModel"
    with pytest.raises(ConfigError, match=r"rollout.max_staleness=2 with rollout.backend=.*SamplesTheTrainersModel does "
                                          r"not declare samples_synced_weights = True"):
        plan(compose(fast_rl + [f"rollout.backend='{backend}'", "rollout.max_staleness=2",
                                "rollout.logprobs_from_generation=true", f"paths.output_dir={tmp_path}"]))
    plan(compose(fast_rl + [f"rollout.backend='{backend}'", f"paths.output_dir={tmp_path}"]))  # k = 0: no lag


@pytest.mark.parametrize("setting, message", [
    ("rollout.stale_policy=drop", r"rollout.stale_policy='drop' is invalid: applies under rollout.async_mode=overlap"),
    ("rollout.overlap.queue_size=1", r"rollout.overlap.queue_size=1 is invalid: applies under rollout.async_mode="),
])
def test_overlaps_own_settings_are_refused_in_lagged_mode(setting, message, compose, fast_rl, tmp_path):
    """They were accepted and did nothing."""
    with pytest.raises(ConfigError, match=message):
        plan(compose(fast_rl + [setting, "rollout.max_staleness=2", "rollout.logprobs_from_generation=true",
                                f"paths.output_dir={tmp_path}"]))
