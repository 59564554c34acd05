"""MkDocs hook (mkdocs.yml `hooks:`): the studies under experiments/ (each README, its figures and reports) become
the site's studies/ section as they stand in the repository, so the site shows them without a second copy and
their relative links hold."""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File, Files

EXPERIMENTS = Path(__file__).resolve().parent / "experiments"
# pages and figures, and the tables and scripts the pages link; not the runs/ a report reads (1,000s of files)
SHOWN = {".md", ".png", ".svg", ".html", ".csv", ".py", ".sh"}


def on_files(files: Files, config) -> Files:
    for path in sorted(EXPERIMENTS.rglob("*")):
        relative = path.relative_to(EXPERIMENTS)
        if path.is_file() and path.suffix in SHOWN and "runs" not in relative.parts:
            files.append(File.generated(config, f"studies/{relative.as_posix()}", abs_src_path=str(path)))
    return files
