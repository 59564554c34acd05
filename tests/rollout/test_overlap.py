"""rollout.async_mode=overlap: a vLLM engine process generates ahead of the trainer (gspo_lab.rollout.sources.overlap,
gspo_lab.rollout.vllm.process). On vLLM's CPU build (make test-vllm): no trained row is more than k versions old,
under wait and under drop, the engine's log-probs are those of the version each row records, a resumed run goes
on, and the engine process ends with the run. Everywhere: the weight buffer's layout, the core split and the
refusals."""

import csv
import multiprocessing
import os
import re
import signal
import time

import pytest
import torch

from gspo_lab.config import OverlapConfig, RolloutConfig
from gspo_lab.rollout import token_logprobs
from gspo_lab.rollout.sources.overlap import split_cores
from gspo_lab.rollout.vllm.weights import ALIGN, Layout
from gspo_lab.train import ConfigError, build, plan

VLLM = ["rollout.backend=vllm", "rollout.logprobs_from_generation=true"]
ROUNDING = 1e-5  # vLLM's float32 log-probs against transformers' (tests/rollout/test_vllm_engine.py)


def overlap(k: int, *more: str) -> list[str]:
    return VLLM + [f"rollout.max_staleness={k}", "rollout.async_mode=overlap", *more]


def test_a_version_packs_into_one_buffer_and_unpacks_to_the_same_tensors():
    """Each tensor starts at a multiple of ALIGN bytes (a uint8 slice views as any dtype), and unpacking gives the
    packed values bit for bit, whatever the dtype and shape; a shape of 5 bfloat16 (10 bytes) still takes ALIGN."""
    weights = [("a", torch.randn(3, 4)), ("b", torch.randn(5).to(torch.bfloat16)), ("c", torch.arange(7.0).half()),
               ("d", torch.randn(2, 3, 2, dtype=torch.float64))]
    layout = Layout.of(weights)
    assert [offset for *_, offset in layout.tensors] == [0, ALIGN, 2 * ALIGN, 3 * ALIGN]  # 48, 10, 14 bytes: one each
    assert layout.nbytes == 3 * ALIGN + 2 * ALIGN  # d: 96 bytes, two blocks
    unpacked = layout.unpack(layout.pack(weights))
    assert [name for name, _ in unpacked] == ["a", "b", "c", "d"]
    assert all(torch.equal(got, want) and got.dtype == want.dtype for (_, got), (_, want) in zip(unpacked, weights))


def test_the_engine_gets_the_cores_named_and_the_trainer_the_rest():
    assert split_cores(None, {0, 1}) == ({1}, {0})
    assert split_cores([2, 3], {0, 1, 2, 3}) == ({2, 3}, {0, 1})
    for cores in ([0, 1], [5]):  # all of them, or one this process may not use
        with pytest.raises(ValueError, match=re.escape(f"rollout.overlap.engine_cores={cores} is invalid")):
            split_cores(cores, {0, 1})


@pytest.mark.parametrize("settings, message", [
    ({"backend": "vllm"}, "set rollout.max_staleness >= 1"),
    ({"backend": "vllm", "max_staleness": 1, "overlap": OverlapConfig(queue_size=2)},
     "rollout.overlap.queue_size=2 is invalid: under rollout.stale_policy=wait"),
    ({"backend": "vllm", "max_staleness": 1, "filter_zero_std_groups": True}, "rollout.filter_zero_std_groups=True"),
    ({"backend": "vllm", "max_staleness": 1, "rescore": "hf"}, "rollout.rescore='hf' is invalid: not supported"),
    ({"backend": "vllm", "max_staleness": 1, "partial": True, "segment_tokens": 4},
     "rollout.segment_tokens=4 is invalid: applies in async_mode=lagged only"),
])
def test_what_overlap_cannot_run_is_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        RolloutConfig(async_mode="overlap", **settings)


def test_a_drop_policy_may_queue_beyond_k_and_bad_settings_name_their_key():
    assert RolloutConfig(backend="vllm", max_staleness=1, async_mode="overlap", stale_policy="drop",
                         overlap=OverlapConfig(queue_size=3)).overlap.queue_size == 3
    with pytest.raises(ValueError, match="rollout.stale_policy='late' is invalid"):
        RolloutConfig(stale_policy="late")
    with pytest.raises(ValueError, match="rollout.overlap.timeout_s=0 is invalid"):
        OverlapConfig(timeout_s=0)


def test_what_overlap_cannot_run_is_refused_at_plan_time(compose, tmp_path):
    pytest.importorskip("vllm")
    for more, message in ((["task=calculator", "task.environment=tests.tools.trl_style.CounterEnv",
                            "reward.functions=[{_target_: gspo_lab.rewards.TaskReward},"
                            "{_target_: tests.tools.trl_style.counter_reward}]", "reward.num_workers=0"],
                           r"counter_reward takes `environments` with rollout.async_mode=overlap"),
                          (["trainer=ddp", "trainer.devices=2"], r"here: 2 process\(es\) on cpu"),
                          (["algorithm=grpo_r3"], r"routing.replay=r3 with rollout.async_mode=overlap: the engine "
                                                  r"process returns no experts yet"),
                          (["model=tiny_dense", "model.lora.enabled=true", "rollout.vllm.lora_sync=adapter"],
                           r"rollout.vllm.lora_sync=adapter with rollout.async_mode=overlap")):
        with pytest.raises(ConfigError, match=message):
            plan(compose(overlap(1) + more + [f"paths.output_dir={tmp_path}"]))


@pytest.mark.vllm
def test_an_overlapped_run_never_trains_on_a_row_more_than_k_versions_old(compose, rl_overrides, updated_batches):
    """k = 1 under wait: step 0's rows are version 0, every later step's 0 or 1 versions old, and each row's engine
    log-probs are those of the weights of the version it records (to float32 rounding across implementations)
    and π_old (bypass). The engine process ends with the run, and the trainer gets its cores back."""
    pytest.importorskip("vllm")
    cores = os.sched_getaffinity(0)
    run, module, _ = build(compose(rl_overrides + overlap(1) + ["train.steps=3", "train.eval_every=0"]))
    weights = {0: {name: p.detach().clone() for name, p in module.model.named_parameters()}}
    run.trainer.fit(module)
    staleness = [row["off_policy/staleness_max"] for row in module.history]
    assert staleness[0] == 0 and all(s in (0, 1) for s in staleness)
    assert all(row["off_policy/dropped"] == 0 and 0 <= row["off_policy/overlap_frac"] <= 1 for row in module.history)
    assert not multiprocessing.active_children() and os.sched_getaffinity(0) == cores
    batch = updated_batches[0]
    module.model.load_state_dict(weights[0], strict=False)
    with torch.no_grad():
        starting, _ = token_logprobs(module.model, batch.input_ids, batch.attention_mask, batch.completion_len,
                                     module.rollout_cfg.temperature)
    mask = batch.policy_mask.bool()
    assert (batch.rollout_logp - starting)[mask].abs().max() <= ROUNDING
    assert torch.equal(batch.old_logp, batch.rollout_logp)
    assert all(int(b.versions.max()) >= step - 1 for step, b in enumerate(updated_batches))


@pytest.mark.vllm
def test_under_drop_a_rollout_too_old_is_generated_again_from_the_current_weights(compose, rl_overrides,
                                                                                   monkeypatch):
    """k = 1, drop, the engine 3 rollouts ahead of a trainer slower than it (each update held back 1 s, as a large
    model's would be): the engine generates steps 1-3 from version 0 while step 0 trains, so steps 2 and 3 come 2
    and 3 versions old, are dropped (all 16 rows) and generated again from the step's own version; no trained row
    is more than 1 version old."""
    pytest.importorskip("vllm")
    from gspo_lab.step.updater import Updater

    real_update = Updater.update

    def slow(self, *args, **kwargs):
        time.sleep(1.0)
        return real_update(self, *args, **kwargs)

    monkeypatch.setattr(Updater, "update", slow)
    run, module, _ = build(compose(rl_overrides + overlap(1, "rollout.stale_policy=drop",
                                                          "rollout.overlap.queue_size=3")
                                   + ["train.steps=4", "train.eval_every=0"]))
    run.trainer.fit(module)
    rows = module.history
    assert [row["off_policy/dropped"] for row in rows] == [0, 0, 16, 16]
    assert [row["off_policy/staleness_max"] for row in rows] == [0, 1, 0, 0]


@pytest.mark.vllm
def test_sigterm_stops_an_overlapped_run_with_its_engine_and_it_resumes(fast_rl, tmp_path):
    """The run finishes its step, checkpoints and ends its engine process; resumed, it goes on from the next step
    with a new engine, the first rollouts generated again from the checkpoint's weights: no step lost or repeated,
    none trained on a row more than k versions old."""
    pytest.importorskip("vllm")
    from tests.test_reliability import run_cli, stop_after_three_steps

    overrides = fast_rl + overlap(1) + ["train.steps=12", "train.eval_every=0"]
    run_dir = tmp_path / "run"
    returncode, stderr = stop_after_three_steps(overrides, run_dir, signal.SIGTERM)
    assert returncode == 128 + signal.SIGTERM and "stopped by SIGTERM" in stderr, stderr[-2000:]
    engines = {int(pid) for pid in re.findall(r"overlap: engine process (\d+) on cores",
                                                    (run_dir / "train.log").read_text())}
    assert len(engines) == 1 and not any(os.path.exists(f"/proc/{pid}") for pid in engines)
    done = len(metric_rows(run_dir))
    assert 3 <= done < 12
    resumed = run_cli(overrides + [f"hydra.run.dir={run_dir}", "ckpt_path=last"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    rows = metric_rows(run_dir)
    assert [int(row["step"]) for row in rows] == list(range(12))  # no evaluation rows (eval_every=0)
    staleness = [float(row["off_policy/staleness_max"]) for row in rows if row["off_policy/staleness_max"]]
    assert len(staleness) == 12 and max(staleness) <= 1 and staleness[done] == 0  # the first resumed step: fresh


def metric_rows(run_dir) -> list[dict]:
    with open(run_dir / "metrics.csv", newline="") as file:
        return list(csv.DictReader(file))


@pytest.mark.vllm
def test_new_weights_interrupt_a_partial_rollout_which_goes_on_under_them(compose, rl_overrides, monkeypatch,
                                                                          updated_batches):
    """rollout.partial, k = 1 under wait: 64-token rows (EOS suppressed) take the engine longer than a tiny model's
    update takes the trainer, so the version pushed at step t + 1 arrives while step t + 1's rollout is generating
    with version t: its rows go on under t + 1. Every token records its version; a row's versions never go back;
    none is more than k old; and each token's engine log-prob is that of the weights of its own version (the
    trainer's weights at the start of that step), to float32 rounding."""
    pytest.importorskip("vllm")
    from gspo_lab.step.updater import Updater

    versions, real_update = {}, Updater.update

    def kept(self, batch, *args, **kwargs):  # the weights the step starts with: version `step`
        versions[len(versions)] = {name: p.detach().clone() for name, p in self.model.named_parameters()}
        return real_update(self, batch, *args, **kwargs)

    monkeypatch.setattr(Updater, "update", kept)
    run, module, _ = build(compose(rl_overrides + overlap(1, "rollout.partial=true", "rollout.suppress_eos=true",
                                                          "rollout.max_new_tokens=64")
                                   + ["train.steps=4", "train.eval_every=0", "train.minibatches=1"]))
    run.trainer.fit(module)
    assert max(row["off_policy/mixed_frac"] for row in module.history) > 0
    assert all(row["off_policy/staleness_max"] <= 1 and row["off_policy/versions_per_sequence_max"] <= 2
               for row in module.history)
    mixed = 0
    for step, batch in enumerate(updated_batches):
        mask = batch.policy_mask.bool()
        assert int(mask.sum()) == 64 * 16  # no token lost, none generated twice
        assert bool((batch.versions[:, 1:] >= batch.versions[:, :-1]).all())
        for version in batch.versions.unique().tolist():
            written = mask & (batch.versions == version)
            module.model.load_state_dict(versions[version], strict=False)
            with torch.no_grad():
                logp, _ = token_logprobs(module.model, batch.input_ids, batch.attention_mask, batch.completion_len,
                                         module.rollout_cfg.temperature)
            assert (batch.rollout_logp - logp)[written].abs().max() <= ROUNDING, (step, version)
        mixed += int((batch.versions.min(-1).values < batch.versions.max(-1).values).sum())
    assert mixed > 0


@pytest.mark.vllm
def test_a_multi_turn_run_overlaps_with_its_tools_in_the_engine_process(compose, tool_rl, tmp_path,
                                                                         updated_batches):
    """task=calculator with a TRL-style tool and environment (tests/conftest.py's tool_rl), k = 1: the engine
    process runs the turns and its own tool workers while the trainer trains. Trajectories call tools, the tools'
    tokens are out of the loss with engine log-prob 0, every token records its version, none more than 1 old, and
    the run trains."""
    pytest.importorskip("vllm")
    run, module, _ = build(compose(tool_rl + overlap(1, "model.config.head_dim=32")
                                   + ["train.steps=3", "train.eval_every=0", f"paths.output_dir={tmp_path}"]))
    starting = [p.detach().clone() for p in module.model.parameters()]
    run.trainer.fit(module)
    assert all(row["tools/call_frequency"] > 0 and row["off_policy/staleness_max"] <= 1 for row in module.history)
    assert module.history[2]["off_policy/staleness_max"] == 1
    assert module.history[0]["reward/environment_reward/mean"] >= 0  # CounterEnv's get_reward, from the engine's loop
    for step, batch in enumerate(updated_batches):
        attended = batch.attention_mask[:, -batch.completion_len :].bool()
        tools = attended & (batch.turns == 0)
        assert tools.any() and batch.rollout_logp[tools].eq(0).all() and not batch.loss_mask.bool()[tools].any()
        assert batch.versions[batch.policy_mask.bool()].unique().tolist() == [max(step - 1, 0)]
    assert any(not torch.equal(a, b) for a, b in zip(starting, module.model.parameters()))
    assert not multiprocessing.active_children()
