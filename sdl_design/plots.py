"""Report figures as PNG bytes (matplotlib, no display)."""

from __future__ import annotations

import io
from collections.abc import Mapping

import numpy as np


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def png(fig, dpi: int = 100) -> bytes:
    """The figure as PNG bytes; the figure is closed."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    pyplot().close(fig)
    return buf.getvalue()


def histogram(
    values: np.ndarray | Mapping[str, np.ndarray],
    xlabel: str,
    title: str,
    vline: float | None = None,
    vlabel: str | None = None,
    bins: int = 30,
) -> bytes:
    """PNG histogram of values (stacked by group when a mapping), with an optional threshold line."""
    plt = pyplot()
    groups = dict(values) if isinstance(values, Mapping) else {"": np.asarray(values)}
    groups = {k: np.asarray(v, dtype=float) for k, v in groups.items()}
    groups = {k: v[np.isfinite(v)] for k, v in groups.items() if np.isfinite(v).any()}
    fig, ax = plt.subplots(figsize=(7, 3.8))
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
    fig.tight_layout()
    return png(fig)
