"""Copies what `gspo-report` reads from a multirun's run dirs (overrides, config, run info, summary, metrics.csv and the
first and last evaluation's samples; no checkpoints, no weights) into a study folder, so the study's report and
figures can be regenerated from committed data:

    python scripts/study_data.py MULTIRUN_DIR experiments/<study>/runs
    gspo-report experiments/<study>/runs --out experiments/<study> [--baseline ...]   # tests/test_docs.py checks it

Columns that hold wall-clock times (`time/*`, `throughput/*`) are left out of metrics.csv: they are not results, and
no table or figure of the report uses them. Numbers keep 6 significant digits (the report shows 3), which halves the
files, and the copy is gzipped (metrics.csv.gz, with no time stamp, so the same run gives the same bytes), which
leaves a third (the 750 committed runs: 20.4 MiB of csv, 6.7 gzipped): the device tool carries the working tree,
studies included, within 64 MiB. gspo-report and the
studies' scripts read either (gspo_lab.report.run.open_metrics); the committed report is the one regenerated from
these copies, so the two agree exactly.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import io
import shutil
import sys
from pathlib import Path

from gspo_lab.report.run import has_metrics, open_metrics
from gspo_lab.report.runs import run_dirs
from gspo_lab.report.samples import sample_files

COPIED = (".hydra/overrides.yaml", "config.yaml", "run_info.json", "summary.json", "failed.txt")
CLOCK = ("time/", "throughput/")


def significant(cell: str, digits: int = 6) -> str:
    """A metrics.csv cell with at most `digits` significant digits; empty cells and text as they are.

    >>> significant("0.357179656624794"), significant("3e-05"), significant("150"), significant("")
    ('0.35718', '3e-05', '150', '')
    """
    try:
        return f"{float(cell):.{digits}g}"
    except ValueError:
        return cell


def export_run(run: Path, out: Path) -> None:
    """One run dir's report inputs into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    for name in COPIED:
        if (run / name).is_file():
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(run / name, out / name)
    if has_metrics(run):
        with open_metrics(run) as source, gzip.GzipFile(out / "metrics.csv.gz", "wb", mtime=0) as packed, \
                io.TextIOWrapper(packed, newline="") as target:
            reader = csv.DictReader(source)
            kept = [name for name in reader.fieldnames or [] if not name.startswith(CLOCK)]
            writer = csv.DictWriter(target, fieldnames=kept, extrasaction="ignore", lineterminator="\n")
            writer.writeheader()
            writer.writerows({name: significant(value) for name, value in row.items()} for row in reader)
    found = sample_files(run)
    for _, path in {found[0], found[-1]} if found else ():
        (out / "samples").mkdir(exist_ok=True)
        shutil.copy2(path, out / "samples" / path.name)


def job_number(relative: Path) -> str:
    """The Hydra job number a multirun folder name starts with ("8_algorithm=gspo,..." -> "8").

    >>> job_number(Path("8_algorithm=gspo,model.path=/work/data/model,model=hf"))
    '8'
    """
    number = relative.parts[0].split("_", 1)[0]
    if not number.isdigit():
        raise SystemExit(f"study_data --by-number: {relative} does not start with a job number")
    return number


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("multirun", type=Path, help="a multirun dir (or any folder of run dirs)")
    parser.add_argument("out", type=Path, help="where the copies go, one folder per run, named as in the multirun")
    parser.add_argument("--by-number", action="store_true", help="name each copy by its Hydra job number only (the "
                        "leading digits of its folder): for overrides whose values hold a '/', which Hydra's folder "
                        "names turn into nested folders")
    args = parser.parse_args(argv)
    runs = run_dirs(args.multirun)
    if not runs:
        print(f"study_data: no run dir (run_info.json or failed.txt) under {args.multirun}", file=sys.stderr)
        return 2
    names = [job_number(run.relative_to(args.multirun)) if args.by_number else run.relative_to(args.multirun)
             for run in runs]
    if len(set(names)) != len(names):
        print(f"study_data: two runs under {args.multirun} share a job number; copy without --by-number",
              file=sys.stderr)
        return 2
    for run, name in zip(runs, names):
        export_run(run, args.out / name)
    print(f"study_data: {len(runs)} runs into {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
