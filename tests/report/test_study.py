"""gspo-report on run dirs written by hand: the baseline it compares against, the settings table's intervals
and collapse counts, what it says instead of an interval for one seed or no shared seed, P(improvement) paired
on shared seeds, intervals labelled as the nominal 95% they are, collapses beyond the evaluation's noise, and a
report.html that needs no other file."""

import json
import re

import pandas as pd
import pytest
import yaml
from matplotlib.axes import Axes

from gspo_lab.report.study import FIGURES, MixedEvalEngines, UnknownBaseline, load_run, main, report


def write_run(run_dir, overrides: list[str], accuracy: list[float], eval_size: int | None = None) -> None:
    """A finished run as gspo-train leaves it: overrides, run_info.json, summary.json and metrics.csv, whose
    held-out accuracy (and, for simplicity, sampled reward) follows `accuracy`, one evaluation per step; with
    `eval_size`, the config.yaml that records it."""
    (run_dir / ".hydra").mkdir(parents=True)
    if eval_size is not None:
        (run_dir / "config.yaml").write_text(yaml.safe_dump({"task": {"eval_size": eval_size}}))
    (run_dir / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    (run_dir / "run_info.json").write_text(json.dumps({"git_sha": "unknown"}))
    summary = {"reward/mean_last": accuracy[-1], "eval/accuracy_before": accuracy[0],
               "eval/accuracy_after": accuracy[-1], "clip/frac_mean": 0.01}
    (run_dir / "summary.json").write_text(json.dumps(summary))
    rows = "".join(f"{step},{value},{value},0.01,0.002\n" for step, value in enumerate(accuracy))
    (run_dir / "metrics.csv").write_text("step,reward/mean,eval/accuracy,clip/frac,routing/changed_frac\n" + rows)


@pytest.fixture
def sweep(tmp_path):
    """grpo and gspo on seeds 0 and 1 (gspo 0.25 more accurate on each), grpo_rr on seed 5 only. grpo's seed-1
    run peaks at 0.75 and ends at 0.6: more than 0.1 below its best, so it collapsed."""
    runs = {("algorithm=grpo", 0): [0.0, 0.5], ("algorithm=grpo", 1): [0.0, 0.75, 0.6],
            ("algorithm=gspo", 0): [0.0, 0.75], ("algorithm=gspo", 1): [0.0, 0.85],
            ("algorithm=grpo_rr", 5): [0.0, 0.4]}
    for number, ((setting, seed), accuracy) in enumerate(runs.items()):
        write_run(tmp_path / "sweep" / str(number), [setting, f"seed={seed}"], accuracy)
    return tmp_path / "sweep"


def row(text: str, setting: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(f"| {setting} |"))


def test_the_named_baseline_is_the_one_compared_against(sweep, tmp_path):
    text = report([sweep], tmp_path / "out", "algorithm=gspo")
    assert "Paired differences against `algorithm=gspo`" in text
    # grpo minus gspo is -0.25 on both seeds; grpo never beats gspo, so P(grpo > gspo) is 0 in every resample
    paired = text.split("## Paired comparisons")[1]
    assert row(paired, "algorithm=grpo") == ("| algorithm=grpo | 2 | -0.250 [-0.250, -0.250] | 0.000 [0.000, 0.000] "
                                             "| shared seeds (paired) | -0.250 [-0.250, -0.250] |")


def test_without_a_baseline_the_first_setting_is_compared_against(sweep, tmp_path):
    text = report([sweep], tmp_path / "out")
    assert "Paired differences against `algorithm=grpo`" in text
    assert row(text.split("## Paired comparisons")[1], "algorithm=gspo").startswith("| algorithm=gspo | 2 | 0.250 ")


def test_one_seed_and_no_shared_seed_say_n_a_with_the_reason(sweep, tmp_path):
    text = report([sweep], tmp_path / "out", "algorithm=gspo")
    settings, paired, statistics = (text.split(f"## {name}")[1] for name in ("Settings", "Paired", "Statistics"))
    assert row(settings, "algorithm=grpo_rr").startswith("| algorithm=grpo_rr | 1 | 0 | 0 | 0.400 [n/a (1 seed)] |")
    # no shared seed: P(improvement) over all run pairs, 0.4 against 0.75 and 0.85: 0; one run, so no interval
    assert row(paired, "algorithm=grpo_rr") == ("| algorithm=grpo_rr | 0 | n/a (no shared seed) | 0.000 [n/a (1 seed)] "
                                                "| all run pairs (unpaired) | n/a (no shared seed) |")
    assert "| held-out accuracy | algorithm=grpo_rr | 1 | 0.400 | n/a (1 seed) | 0.400 | n/a (1 seed) |" in statistics


def test_settings_rows_give_seeds_collapsed_runs_and_intervals(sweep, tmp_path):
    text = report([sweep], tmp_path / "out")
    # grpo: accuracies 0.5 and 0.6; two seeds resample to means 0.5, 0.55, 0.6, so the interval is [0.5, 0.6]
    assert row(text, "algorithm=grpo").startswith("| algorithm=grpo | 2 | 1 | 0 | 0.550 [0.500, 0.600] |")
    assert row(text, "algorithm=gspo").startswith("| algorithm=gspo | 2 | 0 | 0 | 0.800 [0.750, 0.850] |")
    lenient = report([sweep], tmp_path / "lenient", collapse_drop=0.2)  # a 0.15 drop is no collapse at 0.2
    assert row(lenient, "algorithm=grpo").startswith("| algorithm=grpo | 2 | 0 |")


def test_p_improvement_on_shared_seeds_counts_the_seeds_the_setting_wins(tmp_path):
    """gspo is grpo + 0.01 on each of seeds 0-4: it wins on every seed, so P(improvement) is 1 [1, 1] beside Δ
    +0.010 [0.010, 0.010]. Over all 25 run pairs, as gspo-report used to count, it was 0.600."""
    for seed, accuracy in enumerate([0.30, 0.35, 0.40, 0.45, 0.50]):
        write_run(tmp_path / "sweep" / f"grpo{seed}", ["algorithm=grpo", f"seed={seed}"], [0.0, accuracy])
        write_run(tmp_path / "sweep" / f"gspo{seed}", ["algorithm=gspo", f"seed={seed}"], [0.0, accuracy + 0.01])
    text = report([tmp_path / "sweep"], tmp_path / "out", "algorithm=grpo")
    assert row(text.split("## Paired comparisons")[1], "algorithm=gspo").startswith(
        "| algorithm=gspo | 5 | 0.010 [0.010, 0.010] | 1.000 [1.000, 1.000] | shared seeds (paired) |")
    pairs = pd.read_csv(tmp_path / "out" / "paired.csv").set_index("setting")
    assert pairs.loc["algorithm=gspo", "P(improvement) over"] == "shared seeds (paired)"


def test_p_improvement_without_a_shared_seed_counts_all_run_pairs_and_says_so(tmp_path):
    """grpo on seeds 0, 1 (0.3, 0.5), gspo on seeds 5, 6 (0.4, 0.6): of the 4 pairs gspo wins 0.4 > 0.3, 0.6 > 0.3
    and 0.6 > 0.5: 0.75. Each side resampled on its own: both gspo runs 0.4 and both grpo runs 0.5 (1/16 of
    resamples) gives 0, both gspo runs 0.6 (1/4) gives 1, so the interval is [0, 1]."""
    for seed, accuracy in [(0, 0.3), (1, 0.5)]:
        write_run(tmp_path / "sweep" / f"grpo{seed}", ["algorithm=grpo", f"seed={seed}"], [0.0, accuracy])
    for seed, accuracy in [(5, 0.4), (6, 0.6)]:
        write_run(tmp_path / "sweep" / f"gspo{seed}", ["algorithm=gspo", f"seed={seed}"], [0.0, accuracy])
    text = report([tmp_path / "sweep"], tmp_path / "out", "algorithm=grpo")
    assert row(text.split("## Paired comparisons")[1], "algorithm=gspo") == (
        "| algorithm=gspo | 0 | n/a (no shared seed) | 0.750 [0.000, 1.000] | all run pairs (unpaired) "
        "| n/a (no shared seed) |")


def test_intervals_are_labelled_nominal_with_their_coverage_for_these_seeds(tmp_path):
    """Five seeds: every interval heading says nominal 95%, and the report gives the 85% a nominal 95% interval
    of the mean holds with 5 normal scores (stats.percentile_coverage, checked in test_stats.py); with 2 seeds 60%."""
    for seed in range(5):
        write_run(tmp_path / "sweep" / f"grpo{seed}", ["algorithm=grpo", f"seed={seed}"], [0.0, 0.1 * seed])
    for seed in range(2):
        write_run(tmp_path / "sweep" / f"gspo{seed}", ["algorithm=gspo", f"seed={seed}"], [0.0, 0.1 * seed])
    report([tmp_path / "sweep"], tmp_path / "out")
    for name in ("report.md", "report.html"):
        text = (tmp_path / "out" / name).read_text()
        assert "nominal 95% percentile-bootstrap intervals" in text and "60% with 2 seeds, 85% with 5 seeds" in text
        assert "nominal 95% CI (mean)" in text and not re.search(r"(?<!nominal )95% CI", text)


@pytest.mark.parametrize(("accuracy", "eval_size", "collapsed"), [
    # one prompt of 400 is 0.0025: a flat run with ±1 prompt of noise ends 0.0025 below its start, 0.005 below
    # its best, against 2 sqrt((0.3025 * 0.6975 + 0.2975 * 0.7025) / 400) = 0.065 of noise
    ([0.3, 0.3025, 0.2975, 0.3025, 0.2975], 400, False),
    ([0.3, 0.3025, 0.2975, 0.3025, 0.2975], None, False),  # no eval size: 0.1 from the start as from the best
    ([0.3, 0.6, 0.4], 400, True),  # 0.2 below its best: more than 0.1 and than 2 sqrt((0.24 + 0.24) / 400) = 0.069
    # 0.09 below its start and best: above 2 sqrt((0.2275 + 0.1924) / 400) = 0.065 of noise, below 0.1
    ([0.35, 0.35, 0.26], 400, True),
    ([0.35, 0.35, 0.26], None, False),  # the same with no eval size: within --collapse-drop 0.1
    # 32 prompts: a 4-prompt drop from the best (0.125) is within 2 sqrt((0.234 + 0.25) / 32) = 0.246 of noise;
    # a 12-prompt drop (0.375) is beyond 2 sqrt((0.109 + 0.25) / 32) = 0.212
    ([0.5, 0.625, 0.5], 32, False),
    ([0.5, 0.875, 0.5], 32, True),
])
def test_a_run_collapsed_only_by_more_than_the_evaluations_noise(tmp_path, accuracy, eval_size, collapsed):
    write_run(tmp_path / "run", ["algorithm=gspo", "seed=0"], accuracy, eval_size)
    run = load_run(tmp_path / "run")
    assert run.eval_size == eval_size and run.collapsed(0.1) is collapsed


def test_the_report_states_the_collapse_rule_and_the_runs_without_an_eval_size(tmp_path):
    write_run(tmp_path / "sweep" / "0", ["algorithm=gspo", "seed=0"], [0.3, 0.3025, 0.2975], eval_size=400)
    write_run(tmp_path / "sweep" / "1", ["algorithm=gspo", "seed=1"], [0.3, 0.3025, 0.2975])
    text = report([tmp_path / "sweep"], tmp_path / "out")
    assert row(text, "all runs alike").startswith("| all runs alike | 2 | 0 |")  # both ended one prompt down
    assert "by more than --collapse-drop (0.1) and more than the noise" in text
    assert "2 binomial standard errors of the difference" in text and "(1 of 2 runs)" in text


def test_reward_collapse_compares_the_last_and_first_ten_steps_mean_reward(tmp_path):
    """25 steps: the first 10 at 1.0, five at 0.0, the last 10 at 0.45 (below half of 1.0: collapsed) or 0.5 (not
    below: no). A 4-step run compares 2 with 2: 0.345 is below half of 0.7, 0.35 is not."""
    for number, last in enumerate([0.45, 0.5]):
        rewards = [1.0] * 10 + [0.0] * 5 + [last] * 10
        write_run(tmp_path / "sweep" / str(number), ["algorithm=gspo", f"seed={number}"], rewards)
    for number, end in enumerate([0.29, 0.3]):
        write_run(tmp_path / "sweep" / str(number + 2), ["algorithm=grpo", f"seed={number}"], [0.8, 0.6, 0.4, end])
    text = report([tmp_path / "sweep"], tmp_path / "out")
    assert "first 10" in text
    assert row(text, "algorithm=gspo").startswith("| algorithm=gspo | 2 | 2 | 1 |")  # both end below their start
    assert row(text, "algorithm=grpo").startswith("| algorithm=grpo | 2 | 2 | 1 |")


def test_figures_mark_collapsed_runs_with_an_x(sweep, tmp_path, monkeypatch):
    marks = []
    plot = Axes.plot

    def spy(self, *args, **kwargs):
        if kwargs.get("marker") == "x" and args:
            marks.append((self, args))
        return plot(self, *args, **kwargs)

    monkeypatch.setattr(Axes, "plot", spy)
    report([sweep], tmp_path / "out")
    held_out = [point for axes, point in marks if axes.get_ylabel().startswith("held-out")]  # labelled last
    assert held_out == [(2, 0.6)]  # grpo seed 1's last evaluation


def test_report_html_is_one_self_contained_file(sweep, tmp_path):
    out = tmp_path / "out"
    report([sweep], out)
    page = (out / "report.html").read_text()
    drawn = [name for name in FIGURES if (out / name).is_file()]
    assert len(drawn) == 5 and page.count('src="data:image/png;base64,') == len(drawn)
    assert not re.search(r'(src|href)="(?!data:)', page)  # nothing fetched from elsewhere
    assert page.count("<table") == 3 and "n/a (no shared seed)" in page


def test_csv_tables_and_a_reproducible_report(sweep, tmp_path):
    report([sweep], tmp_path / "a", bootstrap_seed=5)
    report([sweep], tmp_path / "b", bootstrap_seed=5)
    assert (tmp_path / "a" / "report.md").read_text() == (tmp_path / "b" / "report.md").read_text()
    stats = pd.read_csv(tmp_path / "a" / "statistics.csv")
    accuracy = stats[stats.metric == "held-out accuracy"].set_index("setting")
    assert accuracy.loc["algorithm=gspo", "seeds"] == 2 and accuracy.loc["algorithm=gspo", "mean"] == pytest.approx(0.8)
    assert set(stats.metric) == {"held-out accuracy", "accuracy gain", "final reward", "clip/frac",
                                 "routing/changed_frac"}  # routing logged, mismatch not


def test_seq_ratio_spread_is_the_mean_over_steps_of_max_minus_min(tmp_path):
    """Two runs with ratio/seq/max, ratio/seq/min per step (1.2, 0.9) then (1.5, 0.5): spreads 0.3 and 1.0, mean 0.65;
    the other run (1.1, 1.0) twice: 0.1. Their mean over seeds is 0.375."""
    for seed, steps in enumerate([[(1.2, 0.9), (1.5, 0.5)], [(1.1, 1.0), (1.1, 1.0)]]):
        run = tmp_path / "sweep" / str(seed)
        write_run(run, ["algorithm=gspo", f"seed={seed}"], [0.1, 0.2])
        rows = "".join(f"{step},{high},{low}\n" for step, (high, low) in enumerate(steps))
        (run / "metrics.csv").write_text("step,ratio/seq/max,ratio/seq/min\n" + rows)
    report([tmp_path / "sweep"], tmp_path / "out")
    stats = pd.read_csv(tmp_path / "out" / "statistics.csv").set_index("metric")
    assert stats.loc["seq ratio spread", "mean"] == pytest.approx(0.375)


def test_a_baseline_that_matches_no_setting_is_refused_naming_the_settings(sweep, tmp_path):
    with pytest.raises(UnknownBaseline, match=r"--baseline='algorithm=gsop' matches no setting; the settings are: "
                                              r"'algorithm=grpo', 'algorithm=grpo_rr', 'algorithm=gspo'"):
        report([sweep], tmp_path / "out", "algorithm=gsop")


def test_a_setting_whose_runs_evaluated_on_different_engines_is_refused_unless_told(tmp_path):
    """Seed 1 of gspo evaluated on vLLM's bfloat16 engine (summary.json), seed 0 on the trainer (a run from before
    the engine was recorded: its config says hf): one column would mix two measurements."""
    for number, seed in enumerate((0, 1)):
        write_run(tmp_path / "sweep" / str(number), ["algorithm=gspo", f"seed={seed}"], [0.0, 0.5])
    summary = tmp_path / "sweep" / "1" / "summary.json"
    summary.write_text(json.dumps({**json.loads(summary.read_text()), "eval/engine": "vllm bfloat16"}))
    with pytest.raises(MixedEvalEngines, match=r"the runs of setting 'all runs alike' evaluated on different engines "
                                               r"\(0: transformers float32, 1: vllm bfloat16\)"):
        report([tmp_path / "sweep"], tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert "all runs alike" in report([tmp_path / "sweep"], tmp_path / "out", mixed_eval_engines=True)


def test_cli_refuses_a_typo_baseline_in_one_line_and_writes_nothing(sweep, tmp_path, capsys):
    with pytest.raises(SystemExit) as stopped:
        main([str(sweep), "--out", str(tmp_path / "report"), "--baseline", "algorithm=gsop"])
    assert stopped.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith("gspo-report: --baseline='algorithm=gsop' matches no setting") and error.count("\n") == 1
    assert not (tmp_path / "report").exists()
