"""train.micro_batch_size in a real run: the gradient each optimizer step takes does not depend on it (single
process, with and without routing replay; two DDP ranks in the full suite), and a user's aggregation that cannot
be split is refused before anything runs. rollout.generation_batch_size: the samples do not depend on it."""

from __future__ import annotations

import csv
import os
import subprocess
import sys

import lightning as L
import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from gspo_lab.decoder import decoder_of
from gspo_lab.rollout.batch import RolloutBatch
from gspo_lab.step.budget import micro_batch_parts
from gspo_lab.train import ConfigError, build, plan


# real tokens per micro-batch: the fast run's rows hold 13-15 tokens, 4 per rank and mini-batch, so that a pair
# fits one budget or not by a token or two, and the ranks' counts differ (at 26, half of the (rank, mini-batch)
# pairs added one micro-batch to match the other rank; at 27, a quarter)
DDP_BUDGETS = (26, 27)


def first_step_gradients(compose, overrides: list[str], callbacks: tuple = ()) -> list[torch.Tensor]:
    """The gradients the first optimizer step of a one-step run receives (after accumulation, before clipping)."""
    run, module, _ = build(compose(overrides))
    run.trainer.callbacks.extend(callbacks)
    captured: list[list[torch.Tensor]] = []
    factory = module.optimizer_factory

    def optimizer(params):
        made = factory(params)
        made.register_step_pre_hook(lambda opt, args, kwargs: captured.append(
            [p.grad.detach().clone() for group in opt.param_groups for p in group["params"] if p.grad is not None]))
        return made

    module.optimizer_factory = optimizer
    run.trainer.fit(module)
    assert len(captured) == 2  # train.minibatches=2: two optimizer steps
    return captured[0]


@pytest.mark.parametrize("replay", ["off", "r3"])
def test_the_update_does_not_depend_on_the_micro_batch_size(replay, compose, rl_overrides, tmp_path):
    """8-row mini-batches whole, in 8 micro-batches of 1 row and in 3 of 3, 3 and 2 rows: the same gradient to
    float32 rounding (sums regrouped), routing replay (r3) included."""
    gradients = {}
    for size in ("null", "1", "3"):
        overrides = [o for o in rl_overrides if not o.startswith("paths.output_dir")]
        gradients[size] = first_step_gradients(compose, overrides + [
            f"train.micro_batch_size={size}", "train.steps=1", f"routing.replay={replay}",
            f"paths.output_dir={tmp_path / size}"])
    whole = gradients["null"]
    assert max(g.abs().max().item() for g in whole) > 0
    for size in ("1", "3"):
        assert len(gradients[size]) == len(whole)
        for got, expected in zip(gradients[size], whole):
            # float32 sums of a few hundred terms in another grouping: a few eps of the tensor's largest entry
            torch.testing.assert_close(got, expected, rtol=0, atol=64 * 1.2e-7 * expected.abs().max().item() + 1e-12)


@pytest.mark.parametrize("replay", ["off", "r3"])
def test_the_update_does_not_depend_on_the_token_budget_or_on_padding(replay, compose, rl_overrides, tmp_path):
    """The 8-row mini-batches whole and padded, against packed forwards (train.padding_free) in micro-batches of
    one row each (a budget of 1 token), of a budget that groups 2-3 rows (40 tokens), and whole: the same gradient
    to float32 rounding, routing replay (r3) included. The normalisers count the mini-batch, not a micro-batch."""
    gradients = {}
    packed = ["train.padding_free=true", "train.pack_min_saving=0"]  # these rows would save too little to pack
    runs = {"padded": ["train.padding_free=false"], "1": ["train.micro_batch_tokens=1", *packed],
            "40": ["train.micro_batch_tokens=40", *packed], "packed": packed}
    for name, extra in runs.items():
        overrides = [o for o in rl_overrides if not o.startswith("paths.output_dir")]
        gradients[name] = first_step_gradients(compose, overrides + extra + [
            "train.steps=1", f"routing.replay={replay}", f"paths.output_dir={tmp_path / name}"])
    whole = gradients["padded"]
    assert max(g.abs().max().item() for g in whole) > 0
    for name in ("1", "40", "packed"):
        assert len(gradients[name]) == len(whole)
        for got, expected in zip(gradients[name], whole):
            # other shapes and groupings of the same sums: rounding of the tensor's largest entry
            torch.testing.assert_close(got, expected, rtol=0, atol=256 * 1.2e-7 * expected.abs().max().item() + 1e-12)


def test_a_token_budget_groups_rows_in_order_and_matches_the_other_ranks_count():
    """Rows of 5, 9, 3, 3 and 7 tokens under a budget of 12: [0], [1, 2], [3, 4], in order. A rank that must run 5
    micro-batches splits its heaviest groups, then repeats its last one with weight 0; the counted parts still
    hold every row once, in order, and the added ones are marked."""
    mask = torch.zeros(5, 9, dtype=torch.long)
    for row, length in enumerate([5, 9, 3, 3, 7]):
        mask[row, -length:] = 1
    parts = micro_batch_parts(mask, None, 12)
    assert [p.rows for p in parts] == [[0], [1, 2], [3, 4]] and not any(p.added for p in parts)
    parts = micro_batch_parts(mask, None, 12, agree=lambda count: count + 2)
    assert [p.rows for p in parts] == [[0], [1], [2], [3], [4]]
    assert [p.added for p in parts] == [False, False, True, False, True]
    parts = micro_batch_parts(mask, None, 12, agree=lambda count: 7)
    assert [(p.rows, p.weight) for p in parts][-2:] == [([4], False), ([4], False)]
    assert [r for p in parts if p.weight for r in p.rows] == [0, 1, 2, 3, 4]
    assert [p.rows for p in micro_batch_parts(mask, 2, None)] == [[0, 1], [2, 3], [4]]


class CountAllReduces(L.Callback):
    """Counts the gradient all-reduces of the DDP-wrapped module (one per bucket per synchronised backward), each
    still done by DDP's default hook."""

    def __init__(self) -> None:
        self.calls = 0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        trainer.strategy.model.register_comm_hook(None, self.all_reduce)

    def all_reduce(self, process_group, bucket):
        self.calls += 1
        return default_hooks.allreduce_hook(process_group, bucket)  # None: the default group


def test_ddp_all_reduces_once_per_optimizer_step_whatever_the_micro_batch_size(compose, rl_overrides, tmp_path):
    """One DDP rank (gloo, in this process): 8-row mini-batches in 3 micro-batches (3, 3, 2 rows) all-reduce their
    gradients in the last micro-batch's backward only (DDP's no_sync around the others), so as often as whole
    mini-batches do: once per bucket per optimizer step, 2 steps. The gradient is the same to float32 rounding."""
    gradients, counts = {}, {}
    environ, threads = dict(os.environ), torch.get_num_threads()  # Lightning sets MASTER_PORT, OMP_NUM_THREADS
    try:
        for size in ("null", "3"):
            counter = CountAllReduces()
            overrides = [o for o in rl_overrides if not o.startswith("paths.output_dir")]
            gradients[size] = first_step_gradients(compose, overrides + [
                "trainer=ddp", "trainer.devices=1", "trainer.accelerator=cpu", f"train.micro_batch_size={size}",
                "train.steps=1", f"paths.output_dir={tmp_path / size}"], callbacks=(counter,))
            counts[size] = counter.calls
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        os.environ.clear()
        os.environ.update(environ)
        torch.set_num_threads(threads)
    assert counts["null"] > 0 and counts["null"] % 2 == 0  # 2 optimizer steps, the same buckets each
    assert counts["3"] == counts["null"]
    for got, expected in zip(gradients["3"], gradients["null"], strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=64 * 1.2e-7 * expected.abs().max().item() + 1e-12)


def test_the_samples_do_not_depend_on_the_generation_batch_size(compose, rl_overrides, tmp_path):
    """16 rows per step sampled at once and in generate calls of 3 rows (groups of 4 split, prompts padded
    apart, then re-padded to one batch): the same tokens in both steps' batches, and under r3 the experts recorded
    in separate calls replay exactly (one on-policy update: nothing overridden); losses equal to float rounding."""
    histories, batches = {}, {}
    for size in ("null", "3"):
        overrides = [o for o in rl_overrides if not o.startswith("paths.output_dir")]
        run, module, _ = build(compose(overrides + [f"rollout.generation_batch_size={size}", "routing.replay=r3",
                                                    "train.minibatches=1", "rollout.temperature=2.0",
                                                    f"paths.output_dir={tmp_path / size}"]))
        batches[size] = []

        def collect_kept(step, ranks, collect=module.collector.collect, kept=batches[size]):
            rollout = collect(step, ranks)
            kept.append(rollout.batch)
            return rollout

        module.collector.collect = collect_kept
        run.trainer.fit(module)
        histories[size] = [row for row in module.history if "reward/mean" in row]
    for a, b in zip(batches["null"], batches["3"], strict=True):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.attention_mask, b.attention_mask)
        # the same experts for every real token but each row's last: generate feeds a finished row's stop token
        # back (and pads after it) only while other rows of its call still decode, and no log-prob needs the
        # experts of the last token (nor of padding)
        real = a.attention_mask.bool().cpu()
        last = real & ~torch.nn.functional.pad(real[:, 1:], (0, 1), value=False)  # [B, L]
        both = a.routing_trace.recorded & b.routing_trace.recorded
        assert torch.equal(both & real & ~last, real & ~last)
        assert torch.equal(a.routing_trace.indices[:, both], b.routing_trace.indices[:, both])
    completions = batches["null"][0].input_ids[:4, -batches["null"][0].completion_len :]  # the first group
    assert len({tuple(row.tolist()) for row in completions}) > 1  # sampled, not all alike
    for a, b in zip(histories["null"], histories["3"], strict=True):
        assert a["routing/override_frac"] == b["routing/override_frac"] == 0
        for key in ("loss/total", "ratio/seq/mean", "entropy"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key


def test_an_aggregation_without_a_denominator_is_refused_with_micro_batches(compose, tmp_path):
    cfg = compose(["algorithm=dapo", "train.micro_batch_size=2", f"paths.output_dir={tmp_path}",
                   "objective.aggregation._target_=tests.objectives.user_aggregation.SquaredMean"])
    with pytest.raises(ConfigError, match="the aggregation SquaredMean of .* has no denominator"):
        plan(cfg)


@pytest.mark.slow
def test_ddp_ranks_accumulate_micro_batches_to_the_same_update(rl_overrides, tmp_path):
    """Two gloo ranks, each with its share of the prompts, padded and whole against: micro-batches of 2 rows, and
    packed forwards in micro-batches of a token budget, where the ranks' counts differ (one rank's lengths need more
    micro-batches; the other splits to match, train/micro_batches_added > 0) and neither waits on a collective the
    other skips: the same metrics to float rounding, and the ranks identical."""
    rows = {}
    runs = {"whole": ["train.padding_free=false"], "2": ["train.micro_batch_size=2"],
            **{str(budget): [f"train.micro_batch_tokens={budget}", "train.pack_min_saving=0"]
               for budget in DDP_BUDGETS}}
    for name, extra in runs.items():
        run_dir = tmp_path / name
        overrides = [o for o in rl_overrides if not o.startswith("paths.output_dir")]
        result = subprocess.run(
            [sys.executable, "-m", "gspo_lab.train", *overrides, "trainer=ddp", "trainer.devices=2", "train.steps=1",
             "train.eval_every=1", *extra, f"hydra.run.dir={run_dir}"],
            cwd=tmp_path, env={**os.environ, "WANDB_MODE": "offline"}, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        with open(run_dir / "metrics.csv", newline="") as file:
            rows[name] = list(csv.DictReader(file))
    whole = rows["whole"]
    budgets = [rows[str(budget)][0] for budget in DDP_BUDGETS]
    assert max(float(row["train/micro_batches_added"]) for row in budgets) > 0  # the ranks' own counts differed
    for micro in (rows["2"], *(rows[str(budget)] for budget in DDP_BUDGETS)):
        assert float(micro[-1]["params/rank_spread"]) == 0
        for key in ("loss/total", "loss/policy", "grad_norm", "clip/frac", "entropy", "ratio/seq/mean"):
            assert float(micro[0][key]) == pytest.approx(float(whole[0][key]), rel=1e-4, abs=1e-6), key


@pytest.mark.parametrize("replay", ["off", "r2"])
def test_the_old_policy_forward_takes_micro_batches_and_gives_the_same_values(replay, compose, rl_overrides):
    """π_old came from one forward of the rank's whole batch, whatever train.micro_batch_size: a long-generation
    recipe (512 rows x 4,608 tokens) could not hold it. In forwards of micro_batch_size rows it is the same to
    float32 rounding, and it records the same experts."""
    results = {}
    for size in ("null", "3"):
        _, module, _ = build(compose(rl_overrides + [f"train.micro_batch_size={size}", f"routing.replay={replay}",
                                                     "rollout.logprobs_from_generation=false"]))
        generator = torch.Generator().manual_seed(0)
        input_ids = torch.randint(3, 12, (8, 10), generator=generator)
        attention_mask = torch.ones_like(input_ids)
        attention_mask[2, :3] = 0  # a left-padded prompt
        batch = RolloutBatch(input_ids, attention_mask, torch.ones(8, 4), None, torch.zeros(8), torch.zeros(8),
                             torch.zeros(8, dtype=torch.bool))
        rows = []
        hook = decoder_of(module.model).register_forward_pre_hook(
            lambda _, args, kwargs: rows.append(kwargs["input_ids"].shape[0]), with_kwargs=True)
        results[size] = module.policy.old_logprobs(batch)
        hook.remove()
        assert rows == ([8] if size == "null" else [3, 3, 2])
    (whole, whole_trace), (parts, parts_trace) = results["null"], results["3"]
    torch.testing.assert_close(parts, whole, rtol=0, atol=16 * 1.2e-7 * whole.abs().max().item())
    # the MoE's experts are recorded with replay off too (for the diagnostics)
    assert torch.equal(parts_trace.indices, whole_trace.indices) and parts_trace.indices.shape[1] == 8
    assert torch.equal(parts_trace.recorded, whole_trace.recorded)
