"""report.html: the report as one self-contained page (tables from pandas, figures embedded as base64 PNG),
so it can be mailed or attached to a review without the folder around it."""

from __future__ import annotations

import base64
import html
import re
from pathlib import Path

import pandas as pd

CODE = re.compile(r"`([^`]*)`")
STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1150px; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 13px; }
th, td { border: 1px solid #ccc; padding: 3px 8px; text-align: left; }
th { background: #f0f0f0; }
tr:nth-child(even) td { background: #fafafa; }
img { max-width: 100%; border: 1px solid #eee; margin: 0.5em 0; }
p.note { color: #555; font-size: 13px; }
figcaption { color: #555; font-size: 12px; }
"""


def table(frame: pd.DataFrame) -> str:
    return frame.to_html(index=False, border=0, escape=True, na_rep="")


def figure(path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    name = html.escape(path.name)
    return f'<figure><img alt="{name}" src="data:image/png;base64,{data}"><figcaption>{name}</figcaption></figure>'


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
    """report.md's lines of text as paragraphs, `code` spans as <code>."""
    texts = (CODE.sub(r"<code>\1</code>", html.escape(line)) for line in lines if line)
    return "".join(f'<p class="note">{text}</p>' for text in texts)
