"""HTML pieces shared by the release report and the monitoring report; Prefect artifact keys."""

from __future__ import annotations

import base64
import json
import re
from html import escape
from typing import Any

import numpy as np
import pandas as pd


def value(v: Any) -> str:
    """A value as report text: floats to 6 significant digits, containers as JSON."""
    if isinstance(v, float | np.floating):
        return f"{float(v):.6g}"
    if isinstance(v, dict | list | tuple):
        return json.dumps(v, default=str)
    return str(v)


# every table sits in this container: a wide table scrolls inside it, the page never does
SCROLL_CLASS = "scroll"
SCROLL = f"<div class='{SCROLL_CLASS}' style='overflow-x:auto;max-width:100%'>"


def scroll(html: str) -> str:
    """HTML (a table) inside the scroll container (overflow-x: auto, max-width: 100%)."""
    return f"{SCROLL}{html}</div>"


def fold(summary: str, body: str, open_: bool = False, cls: str = "") -> str:
    """body folded under a <details> (of class cls) whose <summary> is the escaped summary."""
    if not body:
        return ""
    attr = (" open" if open_ else "") + (f" class='{escape(cls)}'" if cls else "")
    return f"<details{attr}><summary>{escape(summary)}</summary>\n{body}\n</details>"


def table(
    df: pd.DataFrame | None,
    caption: str = "",
    where: str = "",
    max_rows: int | None = None,
    empty: str | None = None,
    folded: bool = False,
) -> str:
    """A frame as an HTML table (class 't') in the scroll container, at most max_rows rows with
    a note saying where the rest is; `empty` (default '<caption>: empty.') when there is no
    row; folded: under a <details> whose summary is the caption and the row count."""
    if df is None or len(df) == 0:
        text = empty or f"{caption or 'table'}: empty."
        return f"<p class='note'>{escape(text)}</p>"
    head = df if max_rows is None else df.head(max_rows)
    if isinstance(head.index, pd.MultiIndex) or head.index.name is not None:
        head = head.reset_index()
    html = scroll(
        head.to_html(
            index=False, border=0, classes="t", na_rep="", float_format=lambda x: f"{x:.4g}"
        )
    )
    more = ""
    if max_rows is not None and len(df) > max_rows:
        more = (
            f"<p class='note'>first {max_rows} of {len(df)} rows; all rows in {escape(where)}</p>"
        )
    if folded:
        n = f"{len(df)} row" + ("s" if len(df) != 1 else "")
        return fold(f"{caption or 'table'} ({n})", html + more)
    cap = f"<p><b>{escape(caption)}</b></p>" if caption else ""
    return cap + html + more


def png_b64(png: bytes) -> str:
    """PNG bytes as base64 text (for a data: URL or a JSON artifact)."""
    return base64.b64encode(png).decode()


def img(png: bytes, alt: str, fid: str = "") -> str:
    """An embedded PNG (self-contained report: nothing fetched); fid: the figure's id."""
    ident = f" id='{escape(fid)}'" if fid else ""
    return (
        f"<figure{ident}><img alt='{escape(alt)}' style='max-width:100%;height:auto' "
        f"src='data:image/png;base64,{png_b64(png)}'></figure>"
    )


def artifact_key(text: str, default: str = "release") -> str:
    """A valid Prefect artifact key (lowercase letters, digits, dashes)."""
    return re.sub(r"[^a-z0-9-]+", "-", str(text).lower()).strip("-")[:100] or default
