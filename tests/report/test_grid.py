"""gspo-report --grid ROW,COLUMN on run dirs written by hand: a panel per value of the other keys, each panel with
its own columns, cells the mean over seeds, paired differences against the chosen column on shared seeds, a heatmap
per metric logged, and a key some setting lacks refused by name before anything is written."""

import re

import pytest

from gspo_lab.report.study import main, report
from tests.report.test_study import write_run

# (algorithm, lr, clip_scale) -> final held-out accuracy on seeds 0 and 1 (every run starts at 0.0)
FINAL = {("gspo", "1e-05", "1.0"): (0.25, 0.35), ("gspo", "1e-05", "100.0"): (0.5, 0.6),
         ("gspo", "0.0001", "1.0"): (0.1, 0.2), ("gspo", "0.0001", "100.0"): (0.8, 0.8),
         ("grpo", "1e-05", "0.5"): (0.4, 0.4), ("grpo", "1e-05", "1.0"): (0.5, 0.5),
         ("grpo", "0.0001", "0.5"): (0.7, 0.6), ("grpo", "0.0001", "1.0"): (0.7, 0.7)}


@pytest.fixture
def grid_sweep(tmp_path):
    for number, ((algorithm, lr, clip), finals) in enumerate(FINAL.items()):
        for seed, final in enumerate(finals):
            write_run(tmp_path / "sweep" / f"{number}_{seed}",
                      [f"algorithm={algorithm}", f"train.lr={lr}", f"clip_scale={clip}", f"seed={seed}"], [0.0, final])
    return tmp_path / "sweep"


def section(text: str, heading: str) -> list[str]:
    """The table rows under `heading` (its header line first)."""
    part = text.split(f"## {heading}\n")[1].split("\n## ")[0]
    return [line for line in part.splitlines() if line.startswith("|") and not line.startswith("| ---")]


def test_each_panel_has_its_own_columns_and_cells_are_means_over_seeds(grid_sweep, tmp_path):
    text = report([grid_sweep], tmp_path / "out", grid=("train.lr", "clip_scale"))
    gspo = section(text, "Grid: held-out accuracy (algorithm=gspo)")
    assert gspo[0] == "| train.lr | clip_scale=1.0 | clip_scale=100.0 |"
    assert gspo[1].startswith("| 1e-05 | 0.300 [0.250, 0.350] | 0.550 [0.500, 0.600] |")
    assert gspo[2].startswith("| 0.0001 | 0.150 [0.100, 0.200] | 0.800 [0.800, 0.800] |")
    grpo = section(text, "Grid: held-out accuracy (algorithm=grpo)")
    assert grpo[0] == "| train.lr | clip_scale=0.5 | clip_scale=1.0 |"
    assert grpo[2].startswith("| 0.0001 | 0.650 [0.600, 0.700] | 0.700 [0.700, 0.700] |")


def test_paired_differences_are_taken_against_the_chosen_column_in_every_row(grid_sweep, tmp_path):
    text = report([grid_sweep], tmp_path / "out", grid=("train.lr", "clip_scale"), grid_baseline="1.0")
    gspo = section(text, "Grid: paired Δ held-out accuracy against clip_scale=1.0 (algorithm=gspo)")
    assert gspo[1] == "| 1e-05 |  | +0.250 [+0.250, +0.250] |"  # 0.5 - 0.25 and 0.6 - 0.35
    assert gspo[2] == "| 0.0001 |  | +0.650 [+0.600, +0.700] |"  # 0.7 and 0.6
    grpo = section(text, "Grid: paired Δ held-out accuracy against clip_scale=1.0 (algorithm=grpo)")
    assert grpo[2] == "| 0.0001 | -0.050 [-0.100, +0.000] |  |"  # 0.7 - 0.7 and 0.6 - 0.7


def test_a_heatmap_per_metric_the_runs_logged(grid_sweep, tmp_path):
    report([grid_sweep], tmp_path / "out", grid=("train.lr", "clip_scale"))
    drawn = sorted(p.name for p in (tmp_path / "out").glob("grid_*.png"))
    assert drawn == ["grid_accuracy_gain.png", "grid_clip_frac.png", "grid_held_out_accuracy.png"]  # no ratio logged
    assert "![grid_clip_frac.png](grid_clip_frac.png)" in (tmp_path / "out" / "report.md").read_text()


def test_without_setting_figures_the_report_draws_and_links_the_heatmaps_alone(grid_sweep, tmp_path):
    """--no-setting-figures: no figure with a line per setting, and report.md links none (experiments/clip_lr)."""
    main([str(grid_sweep), "--out", str(tmp_path / "out"), "--grid", "train.lr,clip_scale", "--no-setting-figures"])
    drawn = sorted(p.name for p in (tmp_path / "out").glob("*.png"))
    assert drawn == ["grid_accuracy_gain.png", "grid_clip_frac.png", "grid_held_out_accuracy.png"]
    linked = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", (tmp_path / "out" / "report.md").read_text())
    assert sorted(linked) == drawn


def test_a_grid_key_some_setting_lacks_is_refused_naming_the_keys(grid_sweep, tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        main([str(grid_sweep), "--out", str(tmp_path / "out"), "--grid", "train.lr,objective.clip_high"])
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert "does not set objective.clip_high" in error and "algorithm, clip_scale, train.lr" in error
    assert not (tmp_path / "out").exists()


def test_a_grid_of_one_key_is_refused(grid_sweep, capsys):
    with pytest.raises(SystemExit) as exited:
        main([str(grid_sweep), "--grid", "train.lr"])
    assert exited.value.code == 2 and "expected two keys, ROW,COLUMN" in capsys.readouterr().err


def test_a_grid_baseline_no_column_has_is_refused_naming_the_values(grid_sweep, tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        main([str(grid_sweep), "--out", str(tmp_path / "out"), "--grid", "train.lr,clip_scale", "--grid-baseline", "1"])
    assert exited.value.code == 2
    assert "--grid-baseline='1' is no value of clip_scale; its values: 0.5, 1.0, 100.0" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_grid_baseline_without_a_grid_is_refused(grid_sweep, capsys):
    with pytest.raises(SystemExit) as exited:
        main([str(grid_sweep), "--grid-baseline", "1.0"])
    assert exited.value.code == 2 and "--grid-baseline needs --grid" in capsys.readouterr().err
