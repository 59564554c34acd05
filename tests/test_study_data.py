"""scripts/study_data.py copies what gspo-report reads from a multirun: clocks left out of metrics.csv, 6 significant
digits, gzipped (gspo-report reads it so), and with --by-number one folder per Hydra job number where an override's
'/' nested Hydra's folder names."""

import gzip
import sys
from pathlib import Path

from gspo_lab.report.run import read_metrics

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import study_data  # noqa: E402


def write_run(run: Path) -> None:
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "overrides.yaml").write_text("- model.path=/data/model\n- seed=0\n")
    (run / "run_info.json").write_text("{}")
    (run / "metrics.csv").write_text("step,reward/mean,time/generate_s\n0,0.123456789,1.5\n")


def test_by_number_names_each_copy_by_its_job_number(tmp_path):
    multirun = tmp_path / "multirun"
    for number in (3, 12):  # Hydra's names: the '/' of model.path=/data/model nests the folder
        write_run(multirun / f"{number}_model.path=" / "data" / "model,seed=0")
    assert study_data.main([str(multirun), str(tmp_path / "out"), "--by-number"]) == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["12", "3"]
    assert (tmp_path / "out" / "3" / ".hydra" / "overrides.yaml").read_text().startswith("- model.path=/data/model")
    packed = tmp_path / "out" / "3" / "metrics.csv.gz"
    assert gzip.decompress(packed.read_bytes()).decode() == "step,reward/mean\n0,0.123457\n"
    assert not (tmp_path / "out" / "3" / "metrics.csv").exists()
    first = packed.read_bytes()
    study_data.main([str(multirun), str(tmp_path / "again"), "--by-number"])
    assert (tmp_path / "again" / "3" / "metrics.csv.gz").read_bytes() == first  # no time stamp in the gzip header
    assert read_metrics(tmp_path / "out" / "3") == [{"step": 0.0, "reward/mean": 0.123457}]
    study_data.main([str(tmp_path / "out"), str(tmp_path / "copied"), "--by-number"])  # a study's runs copied again
    assert read_metrics(tmp_path / "copied" / "3") == read_metrics(tmp_path / "out" / "3")


def test_by_number_refuses_two_runs_of_one_number(tmp_path, capsys):
    write_run(tmp_path / "a" / "3_x")
    write_run(tmp_path / "a" / "3_y")
    assert study_data.main([str(tmp_path / "a"), str(tmp_path / "out"), "--by-number"]) == 2
    assert "share a job number" in capsys.readouterr().err and not (tmp_path / "out").exists()
