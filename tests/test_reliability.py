"""Reliability: bad settings fail early and clearly, NaN updates are skipped and counted, a reward function
that raises is survived, SIGTERM stops a real run with a checkpoint it resumes from exactly, SIGUSR1 under
SLURM also requeues the job and the requeued job resumes by itself, and checkpoints load without running
pickled code."""

import csv
import os
import pickle
import re
import signal
import subprocess
import sys
import time

import lightning as L
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lightning.pytorch.plugins import MixedPrecision

from gspo_lab.module import TooManySkippedUpdates
from gspo_lab.rewards import RewardContractError
from gspo_lab.train import ConfigError, build, check_precision, plan, resolve_checkpoint, train

TIMING = ("time/", "throughput/")


def rows_of(path):
    with open(path, newline="") as file:
        return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in csv.DictReader(file)]


BAD_VALUES = {
    "rollout.group_size": st.integers(-5, 1),
    "rollout.prompts_per_step": st.integers(-5, 0),
    "rollout.max_new_tokens": st.integers(-5, 0),
    "rollout.temperature": st.sampled_from([0.0, -1.0, -0.5]),
    "rollout.top_p": st.sampled_from([0.0, 1.5, -0.1]),
    "train.minibatches": st.sampled_from([0, 3, 5, 7, 1000]),  # 128 completions: must divide them
    "train.steps": st.integers(-3, 0),
    "objective.clip_low": st.sampled_from([0.0, -0.1, 1.0, 2.5]),
    "objective.clip_high": st.sampled_from([0.0, -0.2]),
    "routing.replay": st.sampled_from(["on", "r1", "R2"]),
    "rollout.engine.precision": st.sampled_from(["fp8", "int8"]),
    "rollout.engine.router_noise": st.sampled_from([-0.1, -2.0]),
    "rollout.engine.weight_bits": st.sampled_from([4, 16]),
    "optimizer.weight_decay": st.sampled_from([-1.0, -0.01]),  # torch refused it at the first step, naming no key
    "optimizer.betas": st.sampled_from([[1.5, 0.999], [0.9, -0.1]]),
    "clip_scale": st.sampled_from([0.0, -1.0, -0.5]),  # ran silently for the objectives that ignore it
    "train.failure_stop_frac": st.sampled_from([0.0, -0.5, 1.01]),
}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), key=st.sampled_from(sorted(BAD_VALUES)))
def test_bad_values_fail_before_anything_heavy_naming_key_value_and_rule(data, key, compose, tmp_path):
    value = data.draw(BAD_VALUES[key])
    with pytest.raises(ConfigError, match=re.escape(f"{key}={value!r}") + ".*(must|is invalid)"):
        plan(compose([f"{key}={value}", f"paths.output_dir={tmp_path}"]))


def test_a_grad_scaler_is_refused_naming_the_precision():
    """float16 mixed precision on a GPU scales gradients by a GradScaler's loss scale; the plugin is built as
    Lightning builds it there (on CPU Lightning turns 16-mixed into bf16-mixed)."""
    scaled = L.Trainer(accelerator="cpu", logger=False,
                       plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))])
    with pytest.raises(ValueError, match=r"trainer.precision='16-mixed' is invalid: its GradScaler scales"):
        check_precision(scaled)
    check_precision(L.Trainer(accelerator="cpu", logger=False, precision="bf16-mixed"))  # no scaler: accepted


def run_cli(args, cwd, env=None):
    env = {**(env or os.environ), "WANDB_MODE": "offline"}
    return subprocess.run([sys.executable, "-m", "gspo_lab.train", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def test_cli_prints_the_rule_on_its_last_line_without_a_traceback(tmp_path):
    result = run_cli(["rollout.group_size=1", f"hydra.run.dir={tmp_path}"], tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "gspo-train: invalid configuration: rollout.group_size=1 is invalid: must be an integer >= 2")
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("group, option", [("algorithm", "ppo"), ("task", "gsm8k"), ("model", "llama70b")])
def test_unknown_choices_list_the_valid_ones(group, option, tmp_path):
    result = run_cli([f"{group}={option}", f"hydra.run.dir={tmp_path}"], tmp_path)
    assert result.returncode != 0
    assert f"Could not find '{group}/{option}'" in result.stderr
    assert f"Available options in '{group}'" in result.stderr


def nan_in_training_forwards(module, times: int | None):
    """A fault: the LM head returns NaN in gradient-carrying forwards (not in generation), `times` times."""
    calls = {"left": times}

    def hook(head, args, output):
        if torch.is_grad_enabled() and (calls["left"] is None or calls["left"] > 0):
            if calls["left"] is not None:
                calls["left"] -= 1
            return output * float("nan")
        return output

    return module.model.get_output_embeddings().register_forward_hook(hook)


def test_a_nan_update_is_skipped_and_counted(compose, rl_overrides, tmp_path):
    run, module, _ = build(compose(rl_overrides))
    nan_in_training_forwards(module, times=1)
    run.trainer.fit(module)
    first, second = module.history[0], module.history[1]
    assert first["train/skipped_updates"] == 1 and second["train/skipped_updates"] == 0
    assert all(torch.isfinite(p).all() for p in module.model.parameters())


def test_consecutive_nan_updates_stop_the_run_with_a_checkpoint(compose, rl_overrides, tmp_path):
    run, module, _ = build(compose(rl_overrides + ["train.max_consecutive_skips=3", "train.steps=5"]))
    before = {k: v.clone() for k, v in module.model.state_dict().items()}
    nan_in_training_forwards(module, times=None)
    with pytest.raises(TooManySkippedUpdates, match="3 consecutive updates were skipped.*checkpoint"):
        run.trainer.fit(module)
    checkpoint = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)
    for key, value in before.items():  # the last good weights, not NaN ones
        assert torch.equal(checkpoint["state_dict"][f"model.{key}"], value), key


def test_periodic_checkpoints_keep_coming_after_a_skipped_update_and_resume_exactly(compose, rl_overrides, tmp_path):
    """Checkpoints count RL steps: a skipped mini-batch leaves Lightning's optimizer-step counter one behind
    (7 optimizer steps after 4 RL steps of 2 mini-batches), which stopped `every_n_train_steps` for good."""
    keep_all = ["train.ckpt_every=1", "callbacks.checkpoint.save_top_k=-1"]

    def fit(name, steps, skips, ckpt_path=None):
        run, module, _ = build(compose(rl_overrides + keep_all + [f"train.steps={steps}",
                                                                  f"paths.output_dir={tmp_path / name}"]))
        nan_in_training_forwards(module, times=skips)
        run.trainer.fit(module, ckpt_path=ckpt_path, weights_only=True)
        return run, module

    run, whole = fit("whole", 4, skips=1)
    assert whole.history[0]["train/skipped_updates"] == 1 and run.trainer.global_step == 7
    written = sorted(path.name for path in (tmp_path / "whole" / "checkpoints").glob("*.ckpt"))
    assert written == ["last.ckpt", "rl_step=1.ckpt", "rl_step=2.ckpt", "rl_step=3.ckpt", "rl_step=4.ckpt"]
    assert torch.load(tmp_path / "whole" / "checkpoints" / "last.ckpt", weights_only=True)["rl_step"] == 4
    # RL steps 3 and 4 again, from the periodic checkpoint of step 2 (the skip was in step 1)
    _, resumed = fit("resumed", 4, skips=0, ckpt_path=str(tmp_path / "whole" / "checkpoints" / "rl_step=2.ckpt"))
    # NaN as text, so rows compare equal where both hold it (the first step's mismatch/*, measured on its NaN forward)
    strip = [{k: "nan" if v != v else v for k, v in row.items() if not k.startswith(TIMING)} for row in whole.history]
    assert [{k: "nan" if v != v else v for k, v in row.items() if not k.startswith(TIMING)}
            for row in resumed.history] == strip
    for (name, a), b in zip(whole.model.named_parameters(), resumed.model.parameters()):
        # bitwise: the same operations on the same shapes in one process, from the same checkpointed state
        assert torch.equal(a, b), name


FLAKY = "reward.functions=[{_target_:gspo_lab.rewards.TaskReward},{_target_:tests.rewards.user_rewards.flaky,weight:0.5}]"


@pytest.mark.parametrize("policy", ["zero", "raise"])
def test_a_reward_function_that_raises(policy, compose, rl_overrides, caplog):
    """A user's reward function with a bug (it raises on completions containing '7'), reached through _target_."""
    run, module, _ = build(compose(rl_overrides + [FLAKY, f"train.on_reward_error={policy}"]))
    torch.manual_seed(0)
    if policy == "raise":
        with pytest.raises(RuntimeError, match=r"reward function flaky raised KeyError\('bug in the reward function'\) "
                                               r"\(RL step 0, prompt \d+, completion \d+\)"):
            run.trainer.fit(module)
        return
    run.trainer.fit(module)
    assert module.history[-2]["reward/errors"] == module.history[-2]["reward/flaky/errors"] > 0
    assert module.history[-2]["reward/arithmetic/errors"] == 0
    assert caplog.text.count("reward function flaky raised") == 1  # the first one; the rest are counted


def test_a_non_finite_reward_stops_the_run_naming_the_function(compose, rl_overrides):
    """NaN or inf used to reach the advantages and end, steps later, in TooManySkippedUpdates advising a lower lr."""
    run, module, _ = build(compose(rl_overrides + ["reward.functions=[{_target_:tests.rewards.user_rewards.non_finite}]"]))
    with pytest.raises(RewardContractError, match=r"reward function non_finite returned nan \(RL step 0, prompt 0, "
                                                  r"completion 0\); a reward must be a finite number"):
        run.trainer.fit(module)


def grading_workers() -> list[int]:
    """The pids of this process's grading workers (gspo_lab.grading.pool)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            command = open(f"/proc/{pid}/cmdline", "rb").read()
        except OSError:  # gone meanwhile
            continue
        if int(stat[1]) == os.getpid() and b"gspo_lab.grading.pool" in command:
            pids.append(int(pid))
    return pids


def test_grading_workers_end_with_a_run_that_raised(compose, rl_overrides):
    """Lightning skips the module's teardown when fit raises: the workers outlived the run, and in a multirun
    (one process) every failed job left its workers behind."""
    assert grading_workers() == []
    functions = "reward.functions=[{_target_:tests.rewards.user_rewards.non_finite}]"
    with pytest.raises(RewardContractError):
        train(compose(rl_overrides + [functions, "reward.num_workers=2"]))
    assert grading_workers() == []


@pytest.fixture(scope="module")
def uninterrupted(fast_rl, tmp_path_factory):
    """uninterrupted(steps) -> the overrides of a run that the signal tests stop mid-way, and the rows it logs
    when nothing stops it (run once per module and step count)."""
    runs = {}

    def run(steps: int) -> tuple[list[str], list[dict]]:
        overrides = fast_rl + [f"train.steps={steps}", f"train.eval_every={steps // 3}", "train.lr=1e-4"]
        if steps not in runs:
            whole = tmp_path_factory.mktemp(f"whole{steps}")
            result = run_cli(overrides + [f"hydra.run.dir={whole}"], whole)
            assert result.returncode == 0, result.stderr[-2000:]
            runs[steps] = rows_of(whole / "metrics.csv")
        return overrides, runs[steps]

    return run


def stop_after_three_steps(args, run_dir, signum, env=None) -> tuple[int, str]:
    """Start gspo-train in `run_dir`, send `signum` once it has logged three RL steps; (exit code, stderr)."""
    env = {**(env or os.environ), "WANDB_MODE": "offline"}
    process = subprocess.Popen([sys.executable, "-m", "gspo_lab.train", *args, f"hydra.run.dir={run_dir}"],
                               cwd=run_dir.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = run_dir / "metrics.csv"
    deadline = time.time() + 240
    while time.time() < deadline and (not metrics.is_file() or len(metrics.read_text().splitlines()) < 4):
        time.sleep(0.05)
    process.send_signal(signum)
    _, stderr = process.communicate(timeout=120)
    return process.returncode, stderr


# the signal goes out once three steps are logged; a run with few steps left can finish before it lands when the
# machine is loaded (seen with 6 steps: all 6 logged), so the rest of the run is long enough to be interrupted
@pytest.mark.parametrize("steps", [20, pytest.param(24, marks=pytest.mark.slow)])
def test_sigterm_stops_a_real_run_and_it_resumes_exactly(steps, uninterrupted, tmp_path):
    overrides, whole = uninterrupted(steps)
    stopped_dir = tmp_path / "stopped"
    returncode, stderr = stop_after_three_steps(overrides, stopped_dir, signal.SIGTERM)
    assert returncode == 128 + signal.SIGTERM, stderr[-2000:]
    assert "stopped by SIGTERM" in stderr and (stopped_dir / "checkpoints" / "last.ckpt").is_file()
    metrics = stopped_dir / "metrics.csv"
    done = len(rows_of(metrics))
    assert 3 <= done < steps  # it really stopped mid-way
    resumed = run_cli(overrides + [f"hydra.run.dir={stopped_dir}", "ckpt_path=last"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    rows = rows_of(metrics)
    assert [int(r["step"]) for r in rows] == list(range(steps + 1))  # no duplicate, no gap (steps + final eval)
    assert rows == whole


def slurm_job(tmp_path, job_id: str) -> dict[str, str]:
    """The environment of a one-task SLURM job (enough for Lightning's SLURMEnvironment.detect()), with a fake
    `scontrol` first on PATH that appends its arguments to tmp_path/scontrol.log."""
    fake = tmp_path / "bin" / "scontrol"
    fake.parent.mkdir()
    fake.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "scontrol.log"}\n')
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    return {**env, "PATH": f"{fake.parent}{os.pathsep}{env['PATH']}", "SLURM_JOB_ID": job_id, "SLURM_NTASKS": "1",
            "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_JOB_NAME": "gspo-train"}


def timings(path) -> list[str]:
    """The wall-clock time of each logged RL step: differs between two runs of the same step."""
    with open(path, newline="") as file:
        return [r["time/update_s"] for r in csv.DictReader(file) if r["time/update_s"]]


@pytest.mark.slow
def test_sigusr1_under_slurm_checkpoints_requeues_and_the_requeued_job_resumes_exactly(uninterrupted, tmp_path):
    overrides, whole = uninterrupted(24)
    job = slurm_job(tmp_path, "4242")
    run_dir = tmp_path / "slurm-4242"  # what the docs ask for: a run dir that survives the requeue
    returncode, stderr = stop_after_three_steps(overrides, run_dir, signal.SIGUSR1, job)
    assert returncode == 128 + signal.SIGUSR1, stderr[-2000:]
    assert "stopped by SIGUSR1" in stderr and "SLURM job requeued" in stderr
    assert (run_dir / "checkpoints" / "last.ckpt").is_file() and (run_dir / "hpc_ckpt_1.ckpt").is_file()
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n"
    before = timings(run_dir / "metrics.csv")
    assert 3 <= len(before) < 24
    requeued = run_cli(overrides + [f"hydra.run.dir={run_dir}"], tmp_path, job)  # the same command, no ckpt_path
    assert requeued.returncode == 0, requeued.stderr[-2000:]
    assert timings(run_dir / "metrics.csv")[: len(before)] == before  # kept: a restart would rewrite them
    assert rows_of(run_dir / "metrics.csv") == whole
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n"  # a finished job is not requeued


def test_ckpt_path_last_without_a_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match=r"ckpt_path='last': no checkpoints/last.ckpt in .*hydra.run.dir"):
        resolve_checkpoint("last", tmp_path)


def test_a_truncated_checkpoint_names_the_file(tmp_path):
    path = tmp_path / "cut.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(1000)}}, path)
    path.write_bytes(path.read_bytes()[:500])
    with pytest.raises(ConfigError, match=r"cut\.ckpt is not a readable checkpoint"):
        resolve_checkpoint(str(path), tmp_path)


class Exploit:
    def __reduce__(self):
        return (os.system, (f"touch {MARKER}",))


MARKER = "/tmp/gspo-lab-pickle-exploit-ran"


def test_a_pickle_with_code_is_refused_without_running_it(tmp_path):
    if os.path.exists(MARKER):
        os.remove(MARKER)
    path = tmp_path / "evil.ckpt"
    path.write_bytes(pickle.dumps({"state_dict": Exploit()}))
    with pytest.raises(ConfigError, match="evil.ckpt is not a readable checkpoint"):
        resolve_checkpoint(str(path), tmp_path)
    assert not os.path.exists(MARKER)


def test_non_finite_weights_are_never_written(compose, rl_overrides):
    _, module, _ = build(compose(rl_overrides))
    with torch.no_grad():
        next(module.model.parameters()).fill_(float("nan"))
    with pytest.raises(FloatingPointError, match="refusing to write a checkpoint with non-finite weights"):
        module.on_save_checkpoint({})


def test_reward_errors_are_counted_across_a_resume(compose, rl_overrides, tmp_path):
    """reward/errors is a running count: a run resumed from a checkpoint must carry it on, not restart at 0."""

    def fit(name, steps, ckpt_path=None):
        run, module, _ = build(compose(rl_overrides + [FLAKY, f"train.steps={steps}", f"paths.output_dir={tmp_path / name}"]))
        run.trainer.fit(module, ckpt_path=ckpt_path, weights_only=True)
        return [row["reward/errors"] for row in module.history if "reward/errors" in row]

    whole = fit("whole", 4)
    fit("part", 2)
    resumed = fit("resumed", 4, str(tmp_path / "part" / "checkpoints" / "last.ckpt"))
    assert whole[1] > 0  # the flaky reward raised in the first two steps
    assert resumed == whole


FSDP_ON_CPU = ["trainer=fsdp", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.precision=32-true"]


@pytest.mark.parametrize("overrides, message", [
    (["rollout.suppress_eos=true", "rollout.mask_truncated=true"],
     r"rollout.mask_truncated=True is invalid: rollout.suppress_eos=true truncates every completion"),
    (["model=tiny_dense", "algorithm=grpo_rr"], r"routing.replay=r2: Qwen3ForCausalLM is a dense model"),
    (["model=tiny_dense", "routing.replay=r3"], r"routing.replay=r3: Qwen3ForCausalLM is a dense model"),
    (FSDP_ON_CPU + ["rollout.engine.precision=bf16"], r"an engine copy of the weights is not supported with trainer=fsdp"),
    (FSDP_ON_CPU + ["model.lora.enabled=true"], r"model.lora.enabled=true is not supported with trainer=fsdp"),
])
def test_settings_that_cannot_work_are_refused_by_the_plan_before_the_cold_start(overrides, message, compose, tmp_path):
    """Each was accepted until the cold start had trained (or, for suppress_eos with mask_truncated, forever: every
    row masked, a loss of 0 every step)."""
    with pytest.raises(ConfigError, match=message):
        plan(compose(overrides + [f"paths.output_dir={tmp_path}"]))
