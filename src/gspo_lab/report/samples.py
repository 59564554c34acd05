"""The report's sample tables: for each setting, the completions its first run (lowest seed) gave to the first
prompts of each evaluation set at its first and last evaluation (samples/step_<k>.jsonl, written by every
evaluation during training), so a reader sees how completions changed where a curve moved."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd

from gspo_lab.report.runs import Study

STEP_FILE = re.compile(r"step_(\d+)\.jsonl")
PROMPTS, SAMPLES, CHARS = 2, 4, 80  # per set and setting: prompts shown, samples per prompt, characters per text
TRAJECTORY_CHARS = 400  # a multi-turn completion is shown turn by turn, its tool results marked ⟦tool: ...⟧


def sample_files(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, file) of every samples/step_<k>.jsonl of a run, by step."""
    found = [(int(m.group(1)), p) for p in (run_dir / "samples").glob("step_*.jsonl")
             if (m := STEP_FILE.fullmatch(p.name))]
    return sorted(found)


def shown(text: str | None, limit: int = CHARS) -> str:
    """A completion on one line, cut to `limit` characters, with `|` (a table's cell border) shown as ¦.

    >>> shown("12\\n34|5"), shown("x" * 100, 5)
    ('12⏎34¦5', 'xxxx…')
    """
    text = "" if text is None else text.replace("\n", "⏎").replace("|", "¦")  # one line, no cell border in tables
    return text if len(text) <= limit else text[: limit - 1] + "…"


def table(run_dir: Path) -> pd.DataFrame:
    """One row per (set, prompt, first/last evaluation): the greedy completion and the first SAMPLES samples,
    each marked ✓ (correct) or ✗."""
    files = sample_files(run_dir)
    if not files:
        return pd.DataFrame()
    rows = []
    for step, path in dict.fromkeys([files[0], files[-1]]):
        by_prompt: dict[tuple[str, int], dict] = {}
        for line in path.read_text().splitlines():
            row = json.loads(line)
            entry = by_prompt.setdefault((row["set"], row["index"]), {"prompt": row["prompt"],
                                                                        "reference": row["reference"],
                                                                        "greedy": "", "samples": []})
            text = row.get("trajectory")  # multi-turn: every turn, not only the last
            text = shown(row["completion"]) if text is None else shown(text, TRAJECTORY_CHARS)
            mark = f"{'✓' if row['correct'] else '✗'} {text}"
            if row["mode"] == "greedy":
                entry["greedy"] = mark
            elif len(entry["samples"]) < SAMPLES:
                entry["samples"].append(mark)
        per_set: dict[str, int] = {}
        for (name, index), entry in sorted(by_prompt.items()):
            per_set[name] = per_set.get(name, 0) + 1
            if per_set[name] > PROMPTS:
                continue
            rows.append({"set": name, "prompt": shown(str(entry["prompt"])), "reference": shown(entry["reference"]),
                         "step": step, "greedy": entry["greedy"], "samples": " · ".join(entry["samples"])})
    frame = pd.DataFrame(rows)
    return frame.sort_values(["set", "prompt", "step"], kind="stable", ignore_index=True) if len(frame) else frame


def sample_tables(study: Study) -> list[tuple[str, pd.DataFrame]]:
    """(setting, its first run's sample table) for every setting whose runs kept samples."""
    found = []
    for setting in study.settings():
        runs = study.of(setting)
        frame = table(runs[0].path) if runs else pd.DataFrame()
        if len(frame):
            found.append((f"{setting} (seed {runs[0].seed})", frame))
    return found
