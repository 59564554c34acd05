"""gspo-report's --baseline: the named setting is the one paired differences are taken against, no name means
the first setting, and a name that matches no setting is refused with the valid ones listed."""

import json

import pytest
import yaml

from gspo_lab.report.study import discover, main, table

SETTINGS = ["algorithm=grpo", "algorithm=gspo"]  # sorted: grpo is the first setting


def write_run(run_dir, overrides: list[str], accuracy: float) -> None:
    """A finished run as gspo-train leaves it: overrides, run_info.json, summary.json and two metrics rows."""
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    (run_dir / "run_info.json").write_text(json.dumps({"git_sha": "unknown"}))
    summary = {"reward/mean_last": accuracy, "eval/accuracy_before": 0.0, "eval/accuracy_after": accuracy,
               "clip/frac_mean": 0.01, "routing/changed_frac": 0.1}
    (run_dir / "summary.json").write_text(json.dumps(summary))
    (run_dir / "metrics.csv").write_text(f"step,reward/mean,eval/accuracy\n0,0.0,0.0\n1,{accuracy},{accuracy}\n")


@pytest.fixture
def sweep(tmp_path):
    """Two settings x two seeds; gspo is 0.25 more accurate than grpo on each seed."""
    for number, (setting, seed) in enumerate((s, seed) for s in SETTINGS for seed in (0, 1)):
        accuracy = 0.5 + 0.25 * (setting == "algorithm=gspo") + 0.1 * seed
        write_run(tmp_path / "sweep" / str(number), [setting, f"seed={seed}"], accuracy)
    return tmp_path / "sweep"


def test_the_named_baseline_is_the_one_compared_against(sweep):
    text = table(discover([sweep]), "algorithm=gspo")
    assert "Paired differences against `algorithm=gspo`" in text
    assert "| algorithm=grpo | 2 | -0.250 ± 0.000 |" in text  # grpo minus gspo, on seeds 0 and 1


def test_without_a_baseline_the_first_setting_is_compared_against(sweep):
    text = table(discover([sweep]), None)
    assert "Paired differences against `algorithm=grpo`" in text
    assert "| algorithm=gspo | 2 | 0.250 ± 0.000 |" in text


def test_a_baseline_that_matches_no_setting_is_refused_naming_the_settings(sweep):
    with pytest.raises(ValueError, match=r"--baseline='algorithm=gsop' matches no setting; the settings are: "
                                         r"'algorithm=grpo', 'algorithm=gspo'"):
        table(discover([sweep]), "algorithm=gsop")


def test_cli_refuses_a_typo_baseline_in_one_line_and_writes_nothing(sweep, tmp_path, capsys):
    with pytest.raises(SystemExit) as stopped:
        main([str(sweep), "--out", str(tmp_path / "report"), "--baseline", "algorithm=gsop"])
    assert stopped.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith("gspo-report: --baseline='algorithm=gsop' matches no setting") and error.count("\n") == 1
    assert not (tmp_path / "report").exists()
