"""Grading functions with side effects, importable by the grading workers (tests/grading/test_guard.py)."""

from pathlib import Path

from gspo_lab.grading.guard import guarded


def write_guarded(path: str) -> bool:
    """A checker that writes a file while grading model output."""
    with guarded():
        Path(path).write_text("x")
    return True


def write_swallowed(path: str) -> bool:
    """The same, swallowing the refusal as reasoning-gym's verifiers swallow what eval() raises."""
    with guarded():
        try:
            Path(path).write_text("x")
        except Exception:  # noqa: BLE001 - as the verifier does
            pass
    return True


def run_guarded(path: str) -> bool:
    """A checker that starts a process."""
    import subprocess

    with guarded():
        subprocess.run(["touch", path], check=False)
    return True


def read_guarded(path: str) -> str:
    """A checker that reads a file: allowed."""
    with guarded():
        return Path(path).read_text()


def write_plain(path: str) -> bool:
    """A user's reward function that logs to a file: not a checker, left alone."""
    Path(path).write_text("x")
    return True
