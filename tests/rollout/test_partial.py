"""Partial rollouts in lagged mode (gspo_lab.rollout.sources.lagged): a row starts from version max(t - k, 0) and
advances one version every rollout.segment_tokens tokens, capped at t. Each token records its version, the engine's
log-prob of each token is its own version's, the same seed gives the same run, a resumed run is the one that never
stopped; rollout.lag_spread=uniform gives each group an age of its own."""

from __future__ import annotations

import copy

import pytest
import torch

from gspo_lab.rollout import token_logprobs
from gspo_lab.train import ConfigError, plan
from tests.rollout.test_staleness import fit, untimed

K, SEGMENT = 2, 2
PARTIAL = [f"rollout.max_staleness={K}", "rollout.partial=true", f"rollout.segment_tokens={SEGMENT}",
           "train.eval_every=0"]
KEEP = ["train.ckpt_every=1", "callbacks.checkpoint.save_top_k=-1"]


def at_version(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A copy of `model` with its trained parameters set to `weights` (a LaggedWeights version)."""
    copied = copy.deepcopy(model)
    for name, parameter in copied.named_parameters():
        if name in weights:
            parameter.data.copy_(weights[name])
    return copied


@pytest.mark.numerics
def test_each_segment_of_a_partial_rollout_comes_from_its_own_version(compose, fast_rl, tmp_path, updated_batches):
    module, starting = fit(compose, fast_rl, tmp_path / "partial", *PARTIAL, "train.steps=3", *KEEP)
    for step, batch in enumerate(updated_batches):
        mask = batch.policy_mask.bool()
        position = torch.arange(batch.completion_len).expand_as(batch.versions)
        expected = (max(step - K, 0) + position // SEGMENT).clamp(max=step)  # [B, C]
        assert torch.equal(batch.versions[mask], expected[mask]), step
    first, second, third = module.history
    assert (first["off_policy/mixed_frac"], first["off_policy/versions_per_sequence_max"]) == (0, 1)
    assert second["off_policy/mixed_frac"] > 0 and second["off_policy/versions_per_sequence_max"] == 2
    assert third["off_policy/versions_per_sequence_max"] == 3 and third["off_policy/staleness_max"] == K
    assert 0 < third["off_policy/token_staleness_mean"] < third["off_policy/staleness_mean"] <= K
    # step 2's rows: tokens 0-1 from version 0, 2-3 from version 1, 4-5 from version 2 (the checkpoint after step 1
    # holds versions 0 and 1; the trainer's weights then are version 2)
    checkpoint = torch.load(tmp_path / "partial" / "checkpoints" / "rl_step=2.ckpt", weights_only=True)
    current = {name: checkpoint["state_dict"][f"model.{name}"] for name, _ in starting.named_parameters()}
    weights = {**checkpoint["lagged_weights"], 2: current}
    batch, mask = updated_batches[2], updated_batches[2].policy_mask.bool()
    logps = {v: token_logprobs(at_version(starting, w), batch.input_ids, batch.attention_mask, batch.completion_len,
                               1.0)[0] for v, w in weights.items()}
    for version, logp in logps.items():
        written = mask & (batch.versions == version)
        assert written.any()
        assert torch.allclose(batch.rollout_logp[written], logp[written], atol=1e-5), version
    assert (logps[0] - logps[2])[mask].abs().max() > 1e-3  # the versions differ: the test could fail


def test_a_partial_run_repeats_and_resumes_exactly(compose, fast_rl, tmp_path):
    whole, _ = fit(compose, fast_rl, tmp_path / "whole", *PARTIAL, "train.steps=4", *KEEP)
    again, _ = fit(compose, fast_rl, tmp_path / "again", *PARTIAL, "train.steps=4")
    assert untimed(again.history) == untimed(whole.history)
    checkpoint = tmp_path / "whole" / "checkpoints" / "rl_step=2.ckpt"
    resumed, _ = fit(compose, fast_rl, tmp_path / "resumed", *PARTIAL, "train.steps=4", *KEEP,
                     ckpt_path=str(checkpoint))
    assert untimed(resumed.history) == untimed(whole.history)
    assert whole.history[3]["off_policy/mixed_frac"] > 0


def test_a_spread_of_ages_gives_each_group_one_version_drawn_from_the_last_k_plus_one(compose, fast_rl, tmp_path,
                                                                                    updated_batches):
    module, _ = fit(compose, fast_rl, tmp_path / "spread", "rollout.max_staleness=2", "rollout.lag_spread=uniform",
                    "train.eval_every=0", "train.steps=4")
    seen = set()
    for step, batch in enumerate(updated_batches):
        mask = batch.policy_mask.bool()
        for group in range(4):  # 4 prompts x 4 completions
            rows = slice(4 * group, 4 * group + 4)
            versions = batch.versions[rows][mask[rows]].unique().tolist()
            assert len(versions) == 1 and max(step - 2, 0) <= versions[0] <= step
            seen.add(step - versions[0])
    assert seen == {0, 1, 2}  # ages spread over 0..k (as drawn by this seed)
    assert module.history[3]["off_policy/mixed_frac"] == 0


@pytest.mark.parametrize("settings, message", [
    (["rollout.partial=true", "rollout.max_staleness=1"], r"rollout.segment_tokens=None is invalid: must be an integer"),
    (["rollout.segment_tokens=4", "rollout.max_staleness=1"], r"rollout.segment_tokens=4 is invalid: applies under "
                                                             r"rollout.partial=true only"),
    (["rollout.partial=true", "rollout.segment_tokens=4"], r"rollout.partial=True is invalid: a partial rollout's later"),
    (["rollout.lag_spread=uniform"], r"rollout.lag_spread='uniform' is invalid: spreads the versions of async_mode"),
    (["rollout.partial=true", "rollout.segment_tokens=4", "rollout.max_staleness=1", "routing.replay=r3"],
     r"routing.replay=r3 with rollout.partial=True .* not stitched into one trace"),
])
def test_bad_partial_settings_are_refused(settings, message, compose, fast_rl, tmp_path):
    with pytest.raises(ConfigError, match=message):
        plan(compose(fast_rl + settings + ["rollout.logprobs_from_generation=true", f"paths.output_dir={tmp_path}"]))


def test_partial_rollouts_with_tools_are_refused(compose, tool_rl, tmp_path):
    with pytest.raises(ConfigError, match=r"rollout.partial=True with task.tools or task.environment is not built"):
        plan(compose(tool_rl + ["rollout.partial=true", "rollout.segment_tokens=4", "rollout.max_staleness=1",
                                "rollout.logprobs_from_generation=true", f"paths.output_dir={tmp_path}"]))
