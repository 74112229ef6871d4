"""Report figures as PNG bytes (matplotlib, no display)."""

from __future__ import annotations

import functools
import io
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

import numpy as np
import pandas as pd

_local = threading.local()


@contextmanager
def figures_off() -> Iterator[None]:
    """Within it (in this thread) the stages' figures are not drawn: histogram and
    se_ratio_boxplot give b"", estimate_plots {} (runs that keep only numbers: tuning)."""
    before = getattr(_local, "off", False)
    _local.off = True
    try:
        yield
    finally:
        _local.off = before


def _drawn(empty: Callable[[], object]):
    """The figure function, or empty() inside figures_off."""

    def wrap(fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            return empty() if getattr(_local, "off", False) else fn(*args, **kwargs)

        return inner

    return wrap


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def subplots(nrows: int = 1, ncols: int = 1, **kwargs):
    """(figure, axes) of a Figure pyplot does not track: safe when stages run in threads."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=kwargs.pop("figsize", None))
    return fig, fig.subplots(nrows, ncols, **kwargs)


def tight(fig) -> None:
    """Tight layout, computed once: fig.tight_layout() leaves its engine on the figure, and
    savefig then lays out twice more and draws twice (a dry run first); same PNG bytes."""
    from matplotlib.layout_engine import TightLayoutEngine

    TightLayoutEngine().execute(fig)


def png(fig, dpi: int = 100) -> bytes:
    """The figure as PNG bytes; the figure is closed."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    pyplot().close(fig)
    return buf.getvalue()


@_drawn(bytes)
def histogram(
    values: np.ndarray | Mapping[str, np.ndarray],
    xlabel: str,
    title: str,
    vline: float | None = None,
    vlabel: str | None = None,
    bins: int = 30,
) -> bytes:
    """PNG histogram of values (stacked by group when a mapping), with an optional threshold line."""
    groups = dict(values) if isinstance(values, Mapping) else {"": np.asarray(values)}
    groups = {k: np.asarray(v, dtype=float) for k, v in groups.items()}
    groups = {k: v[np.isfinite(v)] for k, v in groups.items() if np.isfinite(v).any()}
    fig, ax = subplots(figsize=(7, 3.8))
    if groups:
        allv = np.concatenate(list(groups.values()))
        lo, hi = float(allv.min()), float(allv.max())
        if vline is not None:  # keep the threshold in view
            lo, hi = min(lo, vline), max(hi, vline)
        edges = np.linspace(lo, hi if hi > lo else lo + 1.0, bins + 1)
        grouped = any(groups)
        kw = {"label": list(groups)} if grouped else {}
        ax.hist(list(groups.values()), bins=edges, stacked=True, **kw)
        if grouped:
            ax.legend(loc="best")
    if vline is not None:
        ax.axvline(vline, color="crimson", ls="--", lw=1.2, label=vlabel)
        if vlabel:
            ax.legend(loc="best")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("records")
    ax.set_title(title)
    tight(fig)
    return png(fig)


@_drawn(bytes)
def se_ratio_boxplot(
    groups: Mapping[str, pd.DataFrame],
    title: str = "Standard error ratios by original design effect",
    legend: str | None = None,
    column: str = "ratio",
    dpi: int = 100,
) -> bytes:
    """PNG of side-by-side box plots of SE ratios by original design-effect class, one box per
    group in each class (the swap paper's Figure 2). groups: label -> frame with the column and
    deff_class (or deff, classed by `sdl_design.utility.deff_class`)."""
    from matplotlib import colormaps

    from sdl_design.utility import DEFF_CLASSES, deff_class

    classes = [f"({a:g},{b:g}]" for a, b in zip(DEFF_CLASSES[:-1], DEFF_CLASSES[1:], strict=True)]
    fig, ax = subplots(figsize=(8, 4.5))
    width = 0.8 / max(1, len(groups))
    cmap = colormaps["tab10"]
    for k, (label, g) in enumerate(groups.items()):
        cls = g["deff_class"] if "deff_class" in g else deff_class(g["deff"].to_numpy())
        cls = np.asarray(pd.Series(cls).astype(str))
        r = g[column].to_numpy(dtype=float)
        data = [r[(cls == c) & np.isfinite(r)] for c in classes]
        keep = [i for i, d in enumerate(data) if len(d)]
        if not keep:
            continue
        pos = np.arange(len(classes)) + (k - (len(groups) - 1) / 2) * width
        bp = ax.boxplot(
            [data[i] for i in keep],
            positions=pos[keep],
            widths=width * 0.9,
            patch_artist=True,
            manage_ticks=False,
        )
        for b in bp["boxes"]:
            b.set_facecolor(cmap(k % 10))
        ax.plot([], [], "s", color=cmap(k % 10), label=str(label))
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xticks(np.arange(len(classes)), classes)
    ax.set_xlabel("original design effect")
    ax.set_ylabel("SE ratio (released / original)")
    ax.set_title(title)
    ax.legend(title=legend, loc="best")
    tight(fig)
    return png(fig, dpi=dpi)


def _interval_plot(rows, title: str, xlabel: str) -> bytes:
    """Original and released estimates with 95% CIs, one row per label (forest plot)."""
    n = len(rows)
    fig, ax = subplots(figsize=(7.5, 1.2 + 0.26 * n))
    y = np.arange(n)[::-1]
    for off, col, lab, c in (
        (0.15, "original", "original", "#3182bd"),
        (-0.15, "released", "published", "#e6550d"),
    ):
        est = rows[f"estimate_{col}"].to_numpy(dtype=float)
        half = 1.96 * rows[f"se_{col}"].to_numpy(dtype=float)
        ax.errorbar(est, y + off, xerr=half, fmt="o", ms=3, lw=1, color=c, label=lab)
    labels = _forest_margins(fig, rows["label"].astype(str).tolist(), 7)
    ax.set_yticks(y, labels, fontsize=7)
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=10)
    ax.legend(loc="best", fontsize=8)
    return png(fig)


def _forest_margins(fig, labels: list[str], fontsize: float, most: float = 0.6) -> list[str]:
    """Set a forest plot's margins from its widest row label, measured once per distinct label
    (tight layout measures every artist: twice the time of drawing the plot). The labels take
    at most `most` of the width: a longer one is shortened with '...'. Returns the labels."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.font_manager import FontProperties

    renderer = FigureCanvasAgg(fig).get_renderer()
    prop = FontProperties(size=fontsize)
    w, h = fig.get_size_inches()
    room = (most * w - 0.2) * fig.dpi  # pixels for the labels

    def width(s: str) -> float:
        return renderer.get_text_width_height_descent(s, prop, ismath=False)[0]

    widths = {s: width(s) for s in set(labels)}
    for s, x in list(widths.items()):
        cut = s
        while x > room and len(cut) > 1:  # shortened until it fits
            cut = cut[: max(1, int(len(cut) * room / x) - 1)]
            x = width(cut + "...")
        if cut != s:
            widths[s] = x
            labels = [cut + "..." if v == s else v for v in labels]
    left = max(widths.values(), default=0.0) / fig.dpi + 0.2  # inches: labels, ticks, a pad
    fig.subplots_adjust(left=left / w, right=1 - 0.25 / w, bottom=0.6 / h, top=1 - 0.4 / h)
    return labels


@_drawn(dict)
def estimate_plots(est, coefs, max_rows: int = 40) -> dict[str, bytes]:
    """Released vs original estimates with 95% CIs: one plot per study variable (its means or
    proportions overall and by each single domain; the max_rows largest |standardized bias| when
    there are more) and one coefficient plot per model."""
    figs: dict[str, bytes] = {}
    single = est[(est["statistic"] != "total") & ~est["domain"].str.contains(" x ")]
    single = single[single["reliable"]] if "reliable" in single else single
    for v, t in single.groupby("variable", sort=False):
        if len(t) > max_rows:
            t = t.loc[t["std_bias"].abs().sort_values(ascending=False).index[:max_rows]]
        t = t.assign(label=t["domain"] + " = " + t["level"].astype(str))
        kind = t["statistic"].iloc[0]
        figs[f"estimates_{v}"] = _interval_plot(t, f"{kind} of {v}: published vs original", kind)
    for i, (model, t) in enumerate(coefs.groupby("model", sort=False)):
        t = t.rename(
            columns={"coef_original": "estimate_original", "coef_released": "estimate_released"}
        )
        t = t.assign(label=t["term"]).dropna(subset=["estimate_original", "estimate_released"])
        if len(t):
            figs[f"model_{i + 1}"] = _interval_plot(t, model, "coefficient")
    return figs
