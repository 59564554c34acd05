"""DAPO's dynamic sampling (`rollout.filter_zero_std_groups`): which groups a step keeps, how rounds of
different widths are merged with their routing traces, and that a real run fills its batch with informative
groups while replaying exactly, and changes nothing when it may sample only one round."""

import pytest
import torch

from gspo_lab.rollout import Completions, PromptSchedule
from gspo_lab.step.collector import sample_metrics
from gspo_lab.rollout.dynamic_sampling import SampledRound, merge_rounds
from gspo_lab.routing.trace import RoutingTrace
from gspo_lab.tasks.arithmetic import Arithmetic
from gspo_lab.tasks.base import Example
from gspo_lab.train import build
from tests.numerics import RATIO_ROUNDING

PAD = 0
TRAINED = ("trained/reward/mean", "trained/reward/std", "trained/reward/frac_zero_std", "trained/completion/len_mean",
           "trained/completion/truncated_frac")  # the batch trained on, beside reward/* of the step's own prompts
NEW_METRICS = ("rollout/sampling_rounds", "rollout/unfilled_groups", "rollout/frac_zero_std_sampled") + TRAINED


def sampled_round(tag: int, rewards: list[float], prompt_len: int, completion_len: int,
                  unscored: int | None = None) -> SampledRound:
    """A round of len(rewards) rows whose tokens, log-probs and experts all encode (tag, row, column):
    prompt token 100 * tag + 10 * row + column + 1, completion token the same from column prompt_len on; row
    `unscored` is one no reward function applied to (its reward 0, as the rollout totals it)."""
    rows = len(rewards)
    width = prompt_len + completion_len
    tokens = torch.tensor([[100 * tag + 10 * r + c + 1 for c in range(width)] for r in range(rows)])  # [N, P + C]
    completions = Completions(
        prompt_ids=tokens[:, :prompt_len], prompt_mask=torch.ones(rows, prompt_len, dtype=torch.long),
        completion_ids=tokens[:, prompt_len:], completion_mask=torch.ones(rows, completion_len, dtype=torch.long),
        truncated=torch.zeros(rows, dtype=torch.bool), texts=[f"{tag}.{r}" for r in range(rows)],
        logprobs=-tokens[:, prompt_len:].float(),
    )
    trace = RoutingTrace(tokens[None, :, :, None].to(torch.int16), torch.ones(rows, width, dtype=torch.bool), prompt_len)
    examples = [Example(f"p{tag}.{r // 2}", "a") for r in range(rows)]
    applies = torch.arange(rows) != (-1 if unscored is None else unscored)
    components = torch.where(applies, 100.0 * tag + torch.arange(rows), torch.nan)[:, None]  # [N, 1] (tag, row)
    return SampledRound(examples, completions, torch.tensor(rewards) * applies, applies, components, trace)


def test_merge_keeps_informative_groups_in_sampling_order_and_repads_rows_and_experts():
    # groups of 2: round 0 = [zero std, informative], round 1 = [informative, zero std]; widths differ
    first = sampled_round(1, [1.0, 1.0, 0.0, 1.0], prompt_len=2, completion_len=1)
    second = sampled_round(2, [0.0, 1.0, 0.5, 0.5], prompt_len=3, completion_len=2, unscored=3)
    merged, unfilled = merge_rounds([first, second], group_size=2, needed=2, pad_id=PAD)
    assert unfilled == 0
    assert [e.prompt for e in merged.examples] == ["p1.1", "p1.1", "p2.0", "p2.0"]
    assert merged.completions.texts == ["1.2", "1.3", "2.0", "2.1"]
    assert merged.rewards.tolist() == [0.0, 1.0, 0.0, 1.0]
    torch.testing.assert_close(merged.components, torch.tensor([[102.0], [103.0], [200.0], [201.0]]),
                               rtol=0, atol=0)
    # round 1's rows 2, 3 gain one column of left padding and one of right padding
    assert merged.completions.prompt_ids.tolist() == [[PAD, 121, 122], [PAD, 131, 132], [201, 202, 203], [211, 212, 213]]
    assert merged.completions.prompt_mask.tolist() == [[0, 1, 1], [0, 1, 1], [1, 1, 1], [1, 1, 1]]
    assert merged.completions.completion_ids.tolist() == [[123, PAD], [133, PAD], [204, 205], [214, 215]]
    assert merged.completions.completion_mask.tolist() == [[1, 0], [1, 0], [1, 1], [1, 1]]
    assert merged.completions.logprobs.tolist() == [[-123, 0], [-133, 0], [-204, -205], [-214, -215]]
    trace = merged.rollout_trace
    assert trace.prompt_len == 3 and trace.indices.shape == (1, 4, 5, 1)
    assert trace.indices[0, :, :, 0].tolist() == [[0, 121, 122, 123, 0], [0, 131, 132, 133, 0],
                                                  [201, 202, 203, 204, 205], [211, 212, 213, 214, 215]]
    assert trace.recorded.tolist() == [[False, True, True, True, False]] * 2 + [[True] * 5] * 2


def test_a_step_still_short_after_its_rounds_keeps_the_earliest_zero_std_groups():
    first = sampled_round(1, [1.0, 1.0, 0.0, 1.0], prompt_len=2, completion_len=1)
    second = sampled_round(2, [0.0, 1.0, 0.5, 0.5], prompt_len=3, completion_len=2)
    merged, unfilled = merge_rounds([first, second], group_size=2, needed=3, pad_id=PAD)
    assert unfilled == 1  # two informative groups in all; round 0's zero-std group fills the third place
    assert merged.completions.texts == ["1.0", "1.1", "1.2", "1.3", "2.0", "2.1"]


def test_a_group_with_one_scored_completion_is_not_informative():
    """Row 1 of round 0 no reward function scored: its group holds one scored reward (1.0 against the unscored
    row's 0 total), so it has no advantage to give, and round 1's group replaces it; a short step keeps it as a
    zero-std group, the unscored row with its row (applies, and NaN in each function's rewards, the gdpo input)."""
    first = sampled_round(1, [1.0, 1.0, 0.0, 1.0], prompt_len=2, completion_len=1, unscored=1)
    second = sampled_round(2, [0.0, 1.0, 0.5, 0.5], prompt_len=3, completion_len=2)
    merged, unfilled = merge_rounds([first, second], group_size=2, needed=2, pad_id=PAD)
    assert unfilled == 0 and merged.completions.texts == ["1.2", "1.3", "2.0", "2.1"]
    merged, unfilled = merge_rounds([first, second], group_size=2, needed=3, pad_id=PAD)
    assert unfilled == 1 and merged.completions.texts == ["1.0", "1.1", "1.2", "1.3", "2.0", "2.1"]
    assert merged.applies.tolist() == [True, False, True, True, True, True]
    torch.testing.assert_close(merged.components[:2], torch.tensor([[100.0], [torch.nan]]), equal_nan=True,
                               rtol=0, atol=0)
    metrics = sample_metrics(first.scored_rewards, first.completions, group_size=2)
    assert metrics["reward/mean"] == pytest.approx(2 / 3, rel=1e-6) and metrics["reward/frac_zero_std"] == 0.5
    # rows 0, 2, 3 scored: the mean of 1, 0, 1 in float32, and group 0 (one scored) is all equal


def test_further_rounds_draw_other_prompts_and_round_zero_is_the_step_itself():
    schedule = PromptSchedule(Arithmetic(), prompts_per_step=8, seed=5)
    assert schedule.for_step(3, sampling_round=0) == schedule.for_step(3)
    rounds = [{e.prompt for e in schedule.for_step(3, sampling_round=r)} for r in range(3)]
    assert not rounds[0] & rounds[1] and not rounds[1] & rounds[2]
    assert schedule.for_step(3, 1, 2, sampling_round=1) == schedule.for_step(3, sampling_round=1)[4:]


# groups of 2 after a 60-step cold start: about half of them have equal rewards
SMALL_GROUPS = ["rollout.group_size=2", "rollout.prompts_per_step=8"]


@pytest.mark.numerics
def test_a_filtered_step_holds_only_informative_groups_and_replays_the_engine_exactly(compose, rl_overrides):
    """Step 0 needs further rounds; its batch then has no zero-std group, the same size, and (one on-policy
    update, r3) the experts recorded in rounds of their own replay with nothing overridden and ratios of 1.
    reward/* still describe the step's own prompts (round 0, zero-std groups included); trained/* the batch."""
    overrides = SMALL_GROUPS + ["rollout.filter_zero_std_groups=true", "routing.replay=r3", "train.minibatches=1"]
    run, module, _ = build(compose(rl_overrides + overrides))
    run.trainer.fit(module)
    first = module.history[0]
    assert first["rollout/sampling_rounds"] > 1 and first["rollout/frac_zero_std_sampled"] > 0
    assert first["trained/reward/frac_zero_std"] == 0 and first["rollout/unfilled_groups"] == 0
    assert first["reward/frac_zero_std"] > 0  # round 0 as sampled: the policy's reward, not the filtered batch's
    assert first["rollout/completions"] == 16
    assert first["routing/override_frac"] == 0
    assert abs(first["ratio/seq/max"] - 1) <= RATIO_ROUNDING and abs(first["ratio/seq/min"] - 1) <= RATIO_ROUNDING
    assert first["clip/frac"] == 0


def test_one_sampling_round_changes_nothing_but_counts_the_unfilled_groups(compose, rl_overrides, tmp_path):
    histories = {}
    for name, extra in {"off": [], "one_round": ["rollout.filter_zero_std_groups=true", "rollout.max_sampling_rounds=1"]}.items():
        run, module, _ = build(compose(rl_overrides + SMALL_GROUPS + extra + [f"paths.output_dir={tmp_path / name}"]))
        run.trainer.fit(module)
        histories[name] = [{k: v for k, v in row.items() if not k.startswith(("time/", "throughput/"))}
                           for row in module.history]
    for off, one_round in zip(histories["off"], histories["one_round"]):
        added = {k: one_round.pop(k) for k in NEW_METRICS if k in one_round}
        assert one_round == off
        if added:  # the RL steps (not the final evaluation row)
            assert added["rollout/sampling_rounds"] == 1
            assert all(added[f"trained/{key}"] == off[key] for key in ("reward/mean", "completion/len_mean"))
            assert added["rollout/unfilled_groups"] == pytest.approx(off["reward/frac_zero_std"] * 8)
    assert histories["off"][0]["reward/frac_zero_std"] > 0  # there was something to filter
