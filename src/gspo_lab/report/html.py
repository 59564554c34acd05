"""report.html: the report as one self-contained page (tables from pandas, figures embedded as base64 PNG),
so it can be mailed or attached to a review without the folder around it."""

from __future__ import annotations

import base64
import html
from pathlib import Path

import pandas as pd

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1150px; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 13px; }
th, td { border: 1px solid #ccc; padding: 3px 8px; text-align: left; }
th { background: #f0f0f0; }
tr:nth-child(even) td { background: #fafafa; }
img { max-width: 100%; border: 1px solid #eee; margin: 0.5em 0; }
p.note { color: #555; font-size: 13px; }
"""


def table(frame: pd.DataFrame) -> str:
    return frame.to_html(index=False, border=0, escape=True, na_rep="")


def figure(path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return f'<figure><img alt="{html.escape(path.name)}" src="data:image/png;base64,{data}"></figure>'


def page(title: str, blocks: list[tuple[str, str]]) -> str:
    """`blocks` are (heading, inner HTML) pairs; a heading of "" adds the block without one."""
    body = []
    for heading, inner in blocks:
        if heading:
            body.append(f"<h2>{html.escape(heading)}</h2>")
        body.append(inner)
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f"<style>{STYLE}</style></head>\n<body><h1>{html.escape(title)}</h1>\n" + "\n".join(body)
            + "\n</body></html>\n")


def paragraphs(lines: list[str]) -> str:
    return "".join(f'<p class="note">{html.escape(line)}</p>' for line in lines if line)
