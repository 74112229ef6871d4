"""Report figures as PNG bytes (matplotlib, no display)."""

from __future__ import annotations

import functools
import io
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from sdl_design.survey.design import DEFF_CLASSES, deff_class

_local = threading.local()
FIGURES_ENV = "PUF_FIGURES"  # "off": no stage draws its figures (quick runs, the test suite)


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


def with_figure_mode(fn: Callable) -> Callable:
    """fn for another thread: inside figures_off there when this thread is inside it."""
    off = getattr(_local, "off", False)

    def run(*args: Any, **kwargs: Any) -> Any:
        if not off:
            return fn(*args, **kwargs)
        with figures_off():
            return fn(*args, **kwargs)

    return run


def _drawn(empty: Callable[[], object]):
    """The figure function, or empty() inside figures_off."""

    def wrap(fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            off = getattr(_local, "off", False) or os.environ.get(FIGURES_ENV) == "off"
            return empty() if off else fn(*args, **kwargs)

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
    counts: np.ndarray | None = None,
) -> bytes:
    """PNG histogram of values (stacked by group when a mapping), with an optional threshold
    line; counts: how many records hold each of the values (distinct values with their counts:
    the same histogram as the records' values)."""
    if counts is not None and isinstance(values, Mapping):
        raise ValueError("histogram: counts go with one array of values, not groups")
    groups = dict(values) if isinstance(values, Mapping) else {"": np.asarray(values)}
    groups = {k: np.asarray(v, dtype=float) for k, v in groups.items()}
    weights = None if counts is None else np.asarray(counts, dtype=float)
    if weights is not None:
        ok = np.isfinite(groups[""])
        weights = weights[ok]
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
        if weights is not None:
            kw["weights"] = [weights]
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
    means = est["statistic"].isin(["mean", "proportion"])  # (not the totals nor quantiles)
    single = est[means & ~est["domain"].str.contains(" x ")]
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


# ---------------------------------------------------------------- the tuning map (puf tune)

MAP_COLORS = {"all": "#31a354", "risk": "#3182bd", "fails": "#e6550d"}
_LABEL_DIRECTIONS = ((1, 1), (1, -1), (-1, 1), (-1, -1), (1, 0), (-1, 0), (0, 1), (0, -1))


@dataclass(frozen=True)
class PointLabel:
    """The label of one or more points at (nearly) one place: its text, the numbers it names,
    the place (anchor) and its text box (x0, y0, x1, y1), in points from the figure's lower
    left corner."""

    text: str
    members: tuple[int, ...]
    anchor: tuple[float, float]
    box: tuple[float, float, float, float]
    leader: bool = False  # away from its point (not in the nearest ring): draw a line to it

    @property
    def offset(self) -> tuple[float, float]:
        """The box centre from the anchor, in points (for annotate's 'offset points')."""
        x0, y0, x1, y1 = self.box
        return (x0 + x1) / 2 - self.anchor[0], (y0 + y1) / 2 - self.anchor[1]


def number_ranges(numbers: Iterable[int]) -> list[str]:
    """Sorted numbers as parts, a run of three or more as a range: [1, 4, 5, 6, 9] ->
    ['1', '4–6', '9']."""
    xs = sorted(set(numbers))
    parts, i = [], 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        if j - i >= 2:
            parts.append(f"{xs[i]}–{xs[j]}")
        else:
            parts += [str(x) for x in xs[i : j + 1]]
        i = j + 1
    return parts


def _wrap(parts: Sequence[str], width: int) -> str:
    """Comma-separated parts, on lines of at most width characters (a part is never split)."""
    lines: list[str] = []
    for p in parts:
        if lines and len(lines[-1]) + 2 + len(p) <= width:
            lines[-1] += ", " + p
        else:
            lines[-1:] = [lines[-1] + ","] if lines else []
            lines.append(p)
    return "\n".join(lines)


def _overlap(a: Sequence[float], b: Sequence[float], pad: float = 1.0) -> float:
    """The area two boxes (x0, y0, x1, y1) share, each grown by pad."""
    w = min(a[2], b[2]) - max(a[0], b[0]) + 2 * pad
    h = min(a[3], b[3]) - max(a[1], b[1]) + 2 * pad
    return w * h if w > 0 and h > 0 else 0.0


def _group_points(xy: np.ndarray, numbers: Sequence[int], merge: float) -> list[list[int]]:
    """Indices of the points at one place: a point joins the first group whose first point is
    within merge points of it (both coordinates), in the order given."""
    groups: list[list[int]] = []
    for i in range(len(numbers)):
        for g in groups:
            if np.all(np.abs(xy[i] - xy[g[0]]) <= merge):
                g.append(i)
                break
        else:
            groups.append([i])
    return groups


def place_labels(
    xy: Sequence[Sequence[float]],
    numbers: Sequence[int],
    radius: float | Sequence[float] = 4.0,
    fontsize: float = 7.0,
    bounds: Sequence[float] | None = None,
    merge: float = 3.0,
) -> list[PointLabel]:
    """Labels for numbered points that never overprint: points within `merge` points of each
    other share one label naming all their numbers ('1, 4–8'); each label's box is put at the
    first of growing distances, in eight directions, where it overlaps no other label, no point
    (a box of its radius) and stays within bounds (x0, y0, x1, y1); failing that, where it
    overlaps least. xy: the points in points (display units), deterministic for given input."""
    pts = np.asarray(xy, dtype=float).reshape(-1, 2)
    rad = np.broadcast_to(np.asarray(radius, dtype=float), (len(pts),))
    taken = [(x - r, y - r, x + r, y + r) for (x, y), r in zip(pts, rad, strict=True)]
    char_w, line_h = 0.64 * fontsize, 1.25 * fontsize
    out: list[PointLabel] = []
    for g in _group_points(pts, numbers, merge):
        text = _wrap(number_ranges(numbers[i] for i in g), 16)
        lines = text.split("\n")
        w, h = max(map(len, lines)) * char_w + 2, len(lines) * line_h
        ax_, ay_ = pts[g[0]]
        r0 = float(max(rad[i] for i in g)) + 3.0  # clear of its point with the padding
        best: tuple[float, tuple, int] | None = None
        for step in range(14):
            r = r0 + step * fontsize
            for dx, dy in _LABEL_DIRECTIONS:
                x0 = ax_ + r if dx > 0 else ax_ - r - w if dx < 0 else ax_ - w / 2
                y0 = ay_ + r if dy > 0 else ay_ - r - h if dy < 0 else ay_ - h / 2
                box = (x0, y0, x0 + w, y0 + h)
                cost = sum(_overlap(box, t) for t in taken)
                if bounds is not None and not (
                    box[0] >= bounds[0]
                    and box[1] >= bounds[1]
                    and box[2] <= bounds[2]
                    and box[3] <= bounds[3]
                ):
                    cost += w * h
                if best is None or cost < best[0]:
                    best = (cost, box, step)
                if cost == 0:
                    break
            if best[0] == 0:
                break
        taken.append(best[1])
        members = tuple(numbers[i] for i in g)
        out.append(PointLabel(text, members, (ax_, ay_), best[1], best[2] > 0))
    return out


def _map_groups(t: pd.DataFrame) -> list[tuple[pd.Series, str, dict]]:
    """The point groups of the map: (mask, colour key, scatter style), by the gates passed."""
    risk_ok = t["passes_risk"].astype(bool)
    all_ok = t["passes_all"].astype(bool) & risk_ok
    return [
        (all_ok, "all", {"color": MAP_COLORS["all"], "label": "passes every gate"}),
        (
            risk_ok & ~all_ok,
            "risk",
            {"color": MAP_COLORS["risk"], "label": "passes every risk gate (a utility gate fails)"},
        ),
        (
            ~risk_ok,
            "fails",
            {"facecolors": "none", "edgecolors": MAP_COLORS["fails"], "label": "fails a risk gate"},
        ),
    ]


def _map_draw(ax: Any, t: pd.DataFrame, recommended: int | None) -> None:
    """The points by the gates they pass, the Pareto staircase, the risk limit and the region
    beyond it, the spec's own setting (star) and the recommended candidate (diamond)."""
    for mask, _, style in _map_groups(t):
        if mask.any():
            ax.scatter(t.loc[mask, "risk_index"], t.loc[mask, "utility"], s=40, zorder=3, **style)
    front = t[t["pareto"].astype(bool)].sort_values("risk_index")
    if len(front):
        ax.step(
            front["risk_index"],
            front["utility"],
            where="post",
            color="#636363",
            lw=1.3,
            zorder=2,
            label="Pareto front (none safer and more useful)",
        )
    own = t[t["changes"] == "[]"]
    if len(own):
        ax.scatter(
            own["risk_index"],
            own["utility"],
            marker="*",
            s=280,
            color="black",
            zorder=4,
            label="spec's own setting",
        )
    if recommended is not None and recommended in t.index:
        r = t.loc[recommended]
        ax.scatter(
            [r["risk_index"]],
            [r["utility"]],
            marker="D",
            s=120,
            facecolors="none",
            edgecolors="purple",
            lw=2,
            zorder=5,
            label="recommended",
        )
    ax.margins(0.12)
    x0, x1 = ax.get_xlim()
    right = max(x1, 1.0 + 0.04 * (x1 - x0))
    ax.axvspan(1.0, right, color="#fee0d2", alpha=0.5, zorder=0)
    ax.axvline(1.0, color="crimson", ls="--", lw=1, label="risk limit (a risk gate at its bound)")
    ax.set_xlim(min(x0, 0.99), right)
    ax.set_ylim(*ax.get_ylim())  # fixed: the labels are placed in these coordinates


def _map_labels(ax: Any, t: pd.DataFrame, recommended: int | None, fontsize: float) -> None:
    """Each point's candidate number (its row in candidates.csv, from 1), placed by
    place_labels so that no two labels and no label and point overprint."""
    fig = ax.figure
    scale = 72.0 / fig.dpi  # display pixels -> points
    xy = ax.transData.transform(t[["risk_index", "utility"]].to_numpy(float)) * scale
    own = (t["changes"] == "[]").to_numpy()
    radius = np.where(own, 8.5, 3.5)
    if recommended is not None and recommended in t.index:
        radius[t.index.get_loc(recommended)] = max(radius[t.index.get_loc(recommended)], 6.5)
    bounds = np.asarray(ax.bbox.extents) * scale
    numbers = [int(i) + 1 for i in t.index]
    for lab in place_labels(xy, numbers, radius, fontsize, bounds):
        row = t.index[numbers.index(lab.members[0])]
        dx, dy = lab.offset
        ax.annotate(
            lab.text,
            (t.loc[row, "risk_index"], t.loc[row, "utility"]),
            xytext=(dx, dy),
            textcoords="offset points",
            ha="center",
            va="center",
            fontsize=fontsize,
            color="#252525",
            zorder=6,
            arrowprops={"arrowstyle": "-", "color": "#969696", "lw": 0.6} if lab.leader else None,
        )


def _map_table(
    fig: Any,
    t: pd.DataFrame,
    labels: Sequence[str],
    recommended: int | None,
    top: float,
    pitch: float,
) -> None:
    """The candidates keyed by their number, beside the map: number, risk, utility and the
    changes, coloured as their points; the recommended row bold."""
    colour = {}
    for mask, key, _ in _map_groups(t):
        colour.update(dict.fromkeys(t.index[mask], MAP_COLORS[key]))
    kw = {"family": "monospace", "fontsize": 7, "transform": fig.transFigure, "va": "top"}
    x = 0.615
    head = f"{'#':>2}    {'risk':>6}  {'utility':>7}  candidate (★ spec's own, ◆ recommended)"
    fig.text(x, top, head, weight="bold", **kw)
    for k, (i, label) in enumerate(zip(t.index, labels, strict=True)):
        r = t.loc[i]
        tag = ("★" if r["changes"] == "[]" else " ") + ("◆" if i == recommended else " ")
        fig.text(
            x,
            top - (k + 1) * pitch,
            f"{i + 1:>2} {tag} {r['risk_index']:6.4f}  {r['utility']:7.4f}  {label}",
            color="purple" if i == recommended else colour.get(i, "#252525"),
            weight="bold" if i == recommended else "normal",
            **kw,
        )


def risk_utility_map(
    table: pd.DataFrame,
    labels: Sequence[str],
    recommended: int | None = None,
    title: str = "",
    note: str = "",
    dpi: int = 110,
) -> bytes:
    """PNG of the Duncan risk-utility map of `puf tune`: risk_index (x) against utility (y),
    one point per candidate coloured by the gates it passes, labelled by its number (its row
    in candidates.csv, from 1; points at one place share a label) and listed by number in a
    table beside the map (labels: each row's short text); the Pareto front, the risk limit,
    the spec's own setting and the recommended one marked; note: a line under the map."""
    from matplotlib.figure import Figure

    ok = np.isfinite(table["risk_index"].astype(float)) & np.isfinite(
        table["utility"].astype(float)
    )
    t = table[ok]
    labels = [lab for lab, keep in zip(labels, ok, strict=True) if keep]
    pitch_in, fontsize = 7 * 1.45 / 72, 7.0
    height = max(5.8, 3.2 + (len(t) + 1) * pitch_in)
    fig = Figure(figsize=(12.5, height))
    bottom, top = 0.95 / height, 1 - 0.45 / height
    ax = fig.add_axes((0.065, bottom, 0.525, top - bottom))
    _map_draw(ax, t, recommended)
    _map_labels(ax, t, recommended, fontsize)
    ax.set_xlabel("risk index: the largest value / limit of a risk gate (1 = a gate at its limit)")
    ax.set_ylabel("utility: median CI overlap − share beyond 2 SE (1 = no damage)")
    ax.set_title(title or "Risk-utility map of the candidate settings", fontsize=11)
    ax.grid(alpha=0.3)
    fig.legend(
        *ax.get_legend_handles_labels(),
        loc="upper left",
        bbox_to_anchor=(0.61, top + 0.02),
        fontsize=8,
        frameon=False,
    )
    _map_table(fig, t, labels, recommended, top - 1.45 / height, pitch_in / height)
    if note:
        fig.text(0.065, 0.012, note, fontsize=7.5, color="#525252", va="bottom", wrap=True)
    return png(fig, dpi=dpi)
