"""Multi-turn RL end to end (task=calculator after a short cold start, with a TRL-style tool and environment from
tests/tools/trl_style.py given through task.tools and task.environment): the trajectories call tools, the tools'
tokens are attended but never the policy's, and r2 and r3 replay every position of the whole trajectory."""

import json

import pytest
import torch
from hydra.utils import instantiate

from gspo_lab.cold_start import policy_from_config
from gspo_lab.rollout import token_logprobs
from gspo_lab.rollout.generation import position_ids
from gspo_lab.train import ConfigError, build, plan, train
from tests.numerics import RATIO_ROUNDING, assert_rounding_close, logit_scale
from tests.test_train import read_rows, without_timing


@pytest.mark.slow
@pytest.mark.long
def test_a_trl_tool_and_environment_train_unchanged_through_the_config(compose, tool_rl, tmp_path):
    # a length term besides the task's and the environment's rewards: the short cold start's samples can all score
    # the same on those two (0.5 each, seen under another thread count), which leaves nothing to update with
    rewards = ("reward.functions=[{_target_: gspo_lab.rewards.TaskReward, weight: 1.0},"
               "{_target_: gspo_lab.rewards.environment_reward, weight: 0.1},"
               "{_target_: tests.rewards.user_rewards.LengthPenalty, weight: 0.5, per_char: 0.02}]")
    cfg = compose(tool_rl + [f"paths.output_dir={tmp_path / 'run'}", rewards])
    start, _, _ = policy_from_config(cfg, instantiate(cfg.task))
    train(cfg)
    rows = read_rows(tmp_path / "run")
    first = rows[0]
    assert float(first["tools/call_frequency"]) > 0 and float(first["turns/mean"]) > 1
    assert 0 < float(first["tokens/tool_fraction"]) < 1
    assert "tools/multiply/call_frequency" in first and "tools/increment/call_frequency" in first
    assert first["reward/environment_reward/mean"] != ""  # CounterEnv's get_reward scored the rows
    trained, _ = instantiate(cfg.model).load_from(tmp_path / "run" / "final")
    assert any(not torch.equal(a, b) for a, b in zip(start.parameters(), trained.parameters()))
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples" / "step_0.jsonl").read_text().splitlines()]
    assert any("⟦tool: <tool_response>" in row["trajectory"] for row in samples), samples[0]


@pytest.mark.slow
def test_the_tools_tokens_are_attended_and_out_of_the_loss(compose, tool_rl, tmp_path, updated_batches):
    """A real multi-turn batch: its tool tokens are in attention_mask and not in loss_mask, and log-probs changed
    there change neither the loss nor its gradient."""
    run, module, _ = build(compose(tool_rl + [f"paths.output_dir={tmp_path / 'run'}", "train.steps=1"]))
    run.trainer.fit(module)
    batch = updated_batches[0]
    attended = batch.attention_mask[:, -batch.completion_len :].bool()
    tools = attended & (batch.turns == 0)
    assert tools.any() and not batch.loss_mask.bool()[tools].any()
    assert torch.equal(batch.loss_mask.bool(), attended & (batch.turns > 0))
    logp = module.policy.logprobs(batch)[0].detach()
    results = []
    for noise in (0.0, 3.0):
        moved = (logp + noise * tools).requires_grad_(True)
        out = module.objective(moved, batch.old_logp, batch.advantages, batch.loss_mask, turns=batch.turns)
        (grad,) = torch.autograd.grad(out.loss, moved)
        results.append((out.loss.item(), grad))
    assert results[0][0] == results[1][0] and torch.equal(results[0][1], results[1][1])
    assert results[0][1][tools].eq(0).all()
    # padding-free (train.padding_free): the multi-turn rows packed give the padded log-probs at every model and
    # tool token, and the same loss, per turn-sequence
    module.model.eval()
    with torch.no_grad():
        rows = [token_logprobs(module.model, batch.input_ids, batch.attention_mask, batch.completion_len,
                               packed=packed)[0] for packed in (False, True)]
        logits = module.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                              position_ids=position_ids(batch.attention_mask)).logits
        losses = [module.objective(logp, batch.old_logp, batch.advantages, batch.loss_mask, turns=batch.turns).loss
                  for logp in rows]
    assert_rounding_close(rows[1][attended], rows[0][attended], scale=logit_scale(logits), units=16)
    assert losses[1].item() == pytest.approx(losses[0].item(), rel=1e-5, abs=1e-6)


@pytest.mark.slow
@pytest.mark.long
def test_two_runs_of_one_seed_with_an_environment_that_draws_random_numbers_log_the_same_metrics(compose, tool_rl,
                                                                                                 tmp_path):
    """RandomStart draws its start in reset() and its reward in get_reward() with `random` (TRL's IncrementEnv doc
    example): unseeded workers gave two seed=0 runs reward/mean 495,124 and 651,701. Seeded from the run's seed,
    the step and the row, they log the same metrics.csv, timings aside, and the rows drew different numbers."""
    overrides = tool_rl + ["task.environment=tests.tools.trl_style.RandomStart", "train.eval_every=100",
                           "reward.functions=[{_target_: gspo_lab.rewards.environment_reward, weight: 1.0}]"]
    runs = []
    for name in ("a", "b"):
        train(compose(overrides + [f"paths.output_dir={tmp_path / name}"]))
        runs.append(read_rows(tmp_path / name))
    assert len(runs[0]) >= 2 and without_timing(runs[0]) == without_timing(runs[1])
    assert float(runs[0][0]["reward/environment_reward/std"]) > 0.05  # each row drew its own numbers


R3 = ["algorithm=grpo", "routing.replay=r3", "rollout.logprobs_from_generation=true"]


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [["algorithm=grpo_rr"], R3], ids=["r2", "r3"])
def test_replay_reproduces_the_recorded_experts_over_whole_trajectories(overrides, compose, tool_rl, tmp_path):
    """The first mini-batch runs the weights that recorded the experts over prompt, turns and tool results (r2:
    the old-policy forward; r3: generation, each row's trace from its last turn's call, whose prefill ran every
    earlier position): replay (routing/override_frac is logged only where it ran) overrides no expert choice,
    and every token ratio is 1."""
    run, module, _ = build(compose(tool_rl + overrides + [f"paths.output_dir={tmp_path / 'run'}",
                                                          "train.minibatches=1", "train.steps=1"]))
    run.trainer.fit(module)
    first = module.history[0]
    assert first["turns/mean"] > 1
    assert first["routing/override_frac"] == 0
    assert abs(first["ratio/token/max"] - 1) <= RATIO_ROUNDING and abs(first["ratio/token/min"] - 1) <= RATIO_ROUNDING


def test_the_replay_backend_is_refused_with_tools(compose, tool_rl, tmp_path):
    recorded = f"rollout.options.path={tmp_path / 'x.jsonl'}"
    with pytest.raises(ConfigError, match="task.tools / task.environment with rollout.backend=replay"):
        plan(compose(tool_rl + ["rollout=replay", recorded, f"paths.output_dir={tmp_path / 'run'}"]))
