"""In a grading worker, a checker grading model output cannot write files or start processes, and one that tried is
a counted failure even where it swallowed the refusal; reading is allowed, and a user's reward function in the same
pool is left alone."""

from gspo_lab.grading import GradingPool
from tests.grading.side_effects import read_guarded, run_guarded, write_guarded, write_plain, write_swallowed


def test_a_checker_in_a_worker_cannot_write_or_start_a_process(tmp_path):
    (tmp_path / "data").write_text("read me")
    paths = {name: str(tmp_path / name) for name in ("guarded", "swallowed", "run", "plain")}
    pool = GradingPool(num_workers=1, timeout_s=30.0)
    try:
        guarded, swallowed, run, read, plain = pool([
            (write_guarded, (paths["guarded"],), {}), (write_swallowed, (paths["swallowed"],), {}),
            (run_guarded, (paths["run"],), {}), (read_guarded, (str(tmp_path / "data"),), {}),
            (write_plain, (paths["plain"],), {})])
    finally:
        pool.close()
    for outcome, event in ((guarded, "open"), (swallowed, "open"), (run, "subprocess.Popen")):
        assert outcome.failure == "error" and f"the checker tried {event}" in outcome.detail, outcome
    assert (read.failure, read.value) == (None, "read me")
    assert (plain.failure, plain.value) == (None, True)
    assert [name for name, path in paths.items() if (tmp_path / name).exists()] == ["plain"]
