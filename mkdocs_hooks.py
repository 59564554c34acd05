"""MkDocs hook (mkdocs.yml `hooks:`): the studies under experiments/ (each README, its figures and reports) become
the site's studies/ section as they stand in the repository, so the site shows them without a second copy and
their relative links hold."""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File, Files

EXPERIMENTS = Path(__file__).resolve().parent / "experiments"
SHOWN = {".md", ".png", ".svg", ".html"}


def on_files(files: Files, config) -> Files:
    for path in sorted(EXPERIMENTS.rglob("*")):
        if path.is_file() and path.suffix in SHOWN:
            files.append(File.generated(config, f"studies/{path.relative_to(EXPERIMENTS).as_posix()}",
                                        abs_src_path=str(path)))
    return files
