"""The entropy law's fit and prediction (gspo_lab.report.entropy_law), on values worked out by hand, and its
script on run dirs written here."""

import csv
import math
import subprocess
import sys
from pathlib import Path

import numpy
import pytest

from gspo_lab.report.entropy_law import fit_and_predict, fit_law, run_law

SCRIPT = Path(__file__).parents[2] / "scripts" / "entropy_law.py"


def test_a_law_is_recovered_and_predicts_the_rest_exactly():
    """R = -0.2·e^H + 1 at H = 1.0, 0.9, ..., 0.3: the fit on the first half finds a = 0.2, b = 1 with R² 1, the
    second half is predicted without error, and the constant (the first half's mean) misses by its distance."""
    entropy = [1.0 - 0.1 * i for i in range(8)]
    reward = [1 - 0.2 * math.exp(h) for h in entropy]
    fit = fit_and_predict(entropy, reward, 0.5)
    assert (fit.fitted, fit.predicted) == (4, 4)
    assert fit.a == pytest.approx(0.2, abs=1e-12) and fit.b == pytest.approx(1.0, abs=1e-12)
    assert fit.r2 == pytest.approx(1.0, abs=1e-12) and fit.mae_law == pytest.approx(0.0, abs=1e-12)
    constant = sum(reward[:4]) / 4
    assert fit.mae_constant == pytest.approx(sum(abs(r - constant) for r in reward[4:]) / 4, abs=1e-15)
    assert fit.skill == pytest.approx(1.0, abs=1e-10)
    line = numpy.polyfit(range(4), reward[:4], 1)  # the trend: reward against step on the first half
    assert fit.mae_trend == pytest.approx(numpy.mean(numpy.abs(numpy.polyval(line, range(4, 8)) - reward[4:])))
    assert fit.skill_trend == pytest.approx(1.0, abs=1e-9)


def test_a_reward_that_only_follows_time_is_better_predicted_by_the_trend():
    """Reward 0, 0.1, 0.2 on the first three steps (the trend: 0.1 per step), then 0.3, 0.4, 0.5, while the entropy
    falls then comes back: the law (fitted on e^H against R) misses, the trend is exact (to rounding), and its skill
    against the trend is below 0."""
    fit = fit_and_predict([1.0, 0.9, 0.8, 0.9, 1.0, 0.9], [0.0, 0.1, 0.2, 0.3, 0.4, 0.5], 0.5)
    assert fit.mae_trend == pytest.approx(0.0, abs=1e-12)
    assert fit.mae_constant == pytest.approx((0.2 + 0.3 + 0.4) / 3)  # against the first half's mean 0.1
    assert fit.mae_law > 0.1 and fit.skill_trend < 0
    nearly = fit_and_predict([1.0, 0.9, 0.8, 0.9, 1.0, 0.9], [0.0, 0.1, 0.2, 0.3, 0.4, 0.6], 0.5)
    assert nearly.mae_trend == pytest.approx(0.1 / 3) and nearly.skill_trend < 0


def test_the_least_squares_fit_of_three_points_by_hand():
    """x = e^H = 1, 2, 3 with R = 1, 0, 0.5: slope Σ(x-2)(R-0.5)/Σ(x-2)² = (-0.5 + 0) / 2 = -0.25, so a = 0.25 and
    b = 0.5 + 0.25·2 = 1; fitted 0.75, 0.5, 0.25, residual 0.0625 + 0.25 + 0.0625 = 0.375 of a total 0.5: R² 0.25."""
    a, b, r2 = fit_law([0.0, math.log(2), math.log(3)], [1.0, 0.0, 0.5])
    assert (a, b, r2) == pytest.approx((0.25, 1.0, 0.25), abs=1e-12)


def test_a_law_that_predicts_worse_than_a_constant_has_negative_skill():
    """Reward rising with entropy in the first half (a < 0), then falling back: the law extrapolates the rise."""
    fit = fit_and_predict([0.0, 0.5, 1.0, 1.5], [0.0, 0.5, 0.5, 0.0], 0.5)  # fit on (0, 0), (0.5, 0.5)
    slope = 0.5 / (math.exp(0.5) - 1)
    assert fit.a == pytest.approx(-slope)
    law = [0.5 + slope * (math.exp(h) - math.exp(0.5)) for h in (1.0, 1.5)]  # through (e^0.5, 0.5)
    assert fit.mae_law == pytest.approx((abs(0.5 - law[0]) + abs(0.0 - law[1])) / 2)
    assert fit.mae_constant == pytest.approx(0.25) and fit.skill < 0


@pytest.mark.parametrize("entropy, reward, fraction, message", [
    ([0.5, 0.5, 0.5], [0.1, 0.2, 0.3], 0.5, "two steps with different entropies"),
    ([0.5, 0.4], [0.1, 0.2], 0.5, "leave none to predict"),
    ([0.5, 0.4, 0.3], [0.1, 0.2, 0.3], 1.0, "0 < fraction < 1"),
])
def test_what_cannot_be_fitted_is_refused(entropy, reward, fraction, message):
    with pytest.raises(ValueError, match=message):
        fit_and_predict(entropy, reward, fraction)


def write_run(folder, seed: int, a: float) -> None:
    """A finished run dir whose six steps follow R = -a·e^H + 1, with an evaluation row logging neither."""
    folder.mkdir(parents=True)
    (folder / ".hydra").mkdir()
    (folder / ".hydra" / "overrides.yaml").write_text(f"- algorithm=grpo\n- seed={seed}\n")
    (folder / "run_info.json").write_text("{}")
    with (folder / "metrics.csv").open("w", newline="") as file:
        writer = csv.DictWriter(file, ["step", "entropy", "reward/mean", "eval/accuracy"])
        writer.writeheader()
        for step in range(6):
            h = 1.0 - 0.1 * step
            writer.writerow({"step": step, "entropy": h, "reward/mean": 1 - a * math.exp(h), "eval/accuracy": ""})
        writer.writerow({"step": 6, "entropy": "", "reward/mean": "", "eval/accuracy": 0.5})


def test_the_script_fits_every_run_of_a_folder(tmp_path):
    for seed, a in ((0, 0.2), (1, 0.3)):
        write_run(tmp_path / f"{seed}_run", seed, a)
    assert run_law(tmp_path / "1_run").a == pytest.approx(0.3)
    out = tmp_path / "law.md"
    result = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), "--out", str(out)],
                            capture_output=True, text=True, check=True)
    assert result.stdout == out.read_text()
    assert "| all runs alike | 0 | 0.2 | 1 | 1.00 | 3 / 3 | 0.000 |" in result.stdout
    assert "| all runs alike | 2 | 1.00 | 1.00 | 2 |" in result.stdout
