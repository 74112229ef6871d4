"""Monitoring flow: variance bias and disclosure risk across releases, year on year, with drift
flags, an HTML report and Prefect artifacts. The statistics are small pure functions."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
from prefect import flow

from flows import registry as reg
from flows.html import artifact_key, img
from flows.html import table as html_table
from flows.manifest import Manifest

# the metric each monitored quantity is (as the stages emit it, the gated one) and its label
METRICS = {
    "delta": "massc.delta",
    "epsilon": "assess.epsilon_published",
    "id_risk": "assess.reid_share",
    "unique_share": "assess.unique_share_published",
    "overlap_median": "assess.overlap_median",
    "beyond_2se": "assess.share_abs_std_bias_gt2",
}
LABELS = {
    "delta": "delta",
    "epsilon": "epsilon",
    "id_risk": "identification risk",
    "unique_share": "sample-unique share",
    "overlap_median": "median CI overlap",
    "beyond_2se": "share of estimates beyond 2 SE",
}
# the spec's gates field (recorded in each release's manifest) giving each quantity's threshold
THRESHOLD_FIELDS = {
    "delta": "delta_max",
    "epsilon": "epsilon_max",
    "id_risk": "xi",
    "unique_share": "max_unique_share",
    "overlap_median": "utility.overlap_median_min",
    "beyond_2se": "utility.share_beyond_2se_max",
}
LOWER_BOUNDS = {"overlap_median"}  # flagged below the threshold; the others above it
SE_SOURCES = ("final", "swap")  # preferred SE-ratio table of a release, in order
# share of records (or segments) each stage treated: column 'treated:<label>'
TREATED = {
    "swap": "swap.share_swapped",  # share of segments moved to another PSU
    "prb": "prb.share_changed",
    "massc": "massc.share_substituted",
}
# top-coding: "topcode.<column>.share_upper" / "share_lower" (weighted share coded)
TOPCODED = re.compile(r"^topcode\.(?P<column>.+)\.share_(?P<side>upper|lower)$")


class DriftDetected(RuntimeError):
    """Raised by monitor_flow(gate_on_drift=True) when a drift flag is up; `.summary` has them."""

    def __init__(self, summary: MonitorSummary):
        self.summary = summary
        super().__init__(
            f"{len(summary.flags)} drift flag(s): "
            + "; ".join(f"{f['survey']} {f['year']}: {f['detail']}" for f in summary.flags)
        )


@dataclass
class MonitorSummary:
    """What the monitoring flow found; `status` is 1 when a flag is up (the CLI's exit code)."""

    releases: pd.DataFrame  # one row per survey and year (the release monitored)
    flags: list[dict] = field(default_factory=list)
    report: Path | None = None
    notes: list[str] = field(default_factory=list)  # e.g. quantities without a threshold

    @property
    def status(self) -> int:
        return 1 if self.flags else 0

    def __str__(self) -> str:
        lines = [f"monitored {len(self.releases)} release(s); {len(self.flags)} drift flag(s)"]
        for r in self.releases.itertuples():
            lines.append(
                f"  {r.survey} {r.year} {r.release_id} [{r.status}] "
                f"median SE ratio {_fmt(r.se_ratio_median)}, delta {_fmt(r.delta)}, "
                f"epsilon {_fmt(r.epsilon)}, id risk {_fmt(r.id_risk)}, "
                f"unique share {_fmt(r.unique_share)}"
            )
        for n in self.notes:
            lines.append(f"  NOTE {n}")
        for f in self.flags:
            lines.append(f"  DRIFT {f['survey']} {f['year']} {f['kind']}: {f['detail']}")
        if self.report:
            lines.append(f"  report: {self.report}")
        return "\n".join(lines)


def _fmt(x) -> str:
    return "n/a" if x is None or (isinstance(x, float) and not np.isfinite(x)) else f"{x:.3f}"


# ---------------------------------------------------------------- pure statistics


def pick_releases(rel: pd.DataFrame) -> pd.DataFrame:
    """One release per survey and year: the published one when there is one, else the latest
    recorded (a rejected release is monitored too: that is where drift shows first)."""
    if rel.empty:
        return rel
    current = rel["status"].eq("published")
    if "replaced_by" in rel.columns:  # a newer published release of the year replaced it
        current &= rel["replaced_by"].isna()
    r = rel.assign(_pub=current.astype(int))
    r = r.sort_values(["name", "year", "_pub", "updated"], ascending=[True, True, False, False])
    return r.drop_duplicates(["name", "year"]).drop(columns="_pub").reset_index(drop=True)


def preferred_se(se: pd.DataFrame) -> pd.DataFrame:
    """Per release, the SE ratios of the first source present in SE_SOURCES (else any)."""
    if se.empty:
        return se
    rank = {s: i for i, s in enumerate(SE_SOURCES)}
    r = se["source"].map(rank).fillna(len(rank))
    best = r.groupby(se["release_id"]).transform("min")
    return se[r == best].reset_index(drop=True)


def ratio_distribution(se: pd.DataFrame) -> pd.DataFrame:
    """Quantiles of SE ratios per survey, year and design-effect class ('all' = every class)."""
    cols = ["name", "year", "deff_class", "n", "p10", "p25", "median", "p75", "p90", "min", "max"]
    if se.empty:
        return pd.DataFrame(columns=cols)
    s = se[np.isfinite(se["ratio"].astype(float))]
    both = pd.concat([s, s.assign(deff_class="all")], ignore_index=True)
    both["deff_class"] = both["deff_class"].fillna("n/a")
    g = both.groupby(["name", "year", "deff_class"], sort=True)["ratio"]
    out = g.quantile([0.1, 0.25, 0.5, 0.75, 0.9]).unstack()
    out.columns = ["p10", "p25", "median", "p75", "p90"]
    out.insert(0, "n", g.size())
    out["min"], out["max"] = g.min(), g.max()
    return out.reset_index()[cols]


def _threshold(manifest: Manifest | None, key: str) -> float | None:
    """The release's own threshold of a quantity (its spec's gate), None when not recorded."""
    v = manifest.parameters.gates if manifest is not None else None
    for part in THRESHOLD_FIELDS[key].split("."):
        v = v.get(part) if isinstance(v, dict) else getattr(v, part, None)
    return None if v is None else float(v)


def treated_shares(m: pd.Series) -> dict[str, float]:
    """Share treated by each stage from a release's metrics (metric -> value): 'treated:<stage>'
    and, for top-coding, 'treated:topcode <column> (<side>)'."""
    out = {f"treated:{k}": float(m[n]) for k, n in TREATED.items() if n in m and pd.notna(m[n])}
    for metric, v in m.items():
        hit = TOPCODED.match(str(metric))
        if hit and pd.notna(v):
            out[f"treated:topcode {hit['column']} ({hit['side']})"] = float(v)
    return out


def release_table(rel: pd.DataFrame, metrics: pd.DataFrame, se: pd.DataFrame) -> pd.DataFrame:
    """Per survey and year: median SE ratio, delta, epsilon, identification risk and sample-unique
    share with their thresholds (the release's own spec gates, from its manifest; NaN when it
    recorded none), and the share of records treated by each stage (columns 'treated:...')."""
    rows = []
    for r in rel.itertuples():
        m = metrics[metrics["release_id"] == r.release_id].set_index("metric")["value"]
        row = {
            "survey": r.name,
            "year": int(r.year),
            "release_id": r.release_id,
            "status": r.status,
        }
        s = se[se["release_id"] == r.release_id]["ratio"].astype(float)
        s = s[np.isfinite(s)]
        if len(s):
            row["se_ratio_median"] = float(s.median())
            row["se_source"] = str(se.loc[se["release_id"] == r.release_id, "source"].iloc[0])
        else:
            key = next(
                (f"{src}.se_ratio_median" for src in SE_SOURCES if f"{src}.se_ratio_median" in m),
                None,
            )
            row["se_ratio_median"] = float(m[key]) if key else np.nan
            row["se_source"] = key.split(".")[0] if key else None
        manifest = getattr(r, "manifest", None)
        for key, name in METRICS.items():
            row[key] = float(m[name]) if name in m.index and pd.notna(m[name]) else np.nan
            t = _threshold(manifest, key)
            row[f"{key}_max"] = np.nan if t is None else t
        row.update(treated_shares(m))
        rows.append(row)
    return pd.DataFrame(rows)


def unchecked(table: pd.DataFrame) -> list[str]:
    """Sentences naming, per survey, the quantities measured but never flagged because the
    releases recorded no threshold for them."""
    out = []
    for survey, t in table.groupby("survey", sort=True) if len(table) else []:
        for key, label in LABELS.items():
            open_ = t[np.isfinite(t[key]) & ~np.isfinite(t[f"{key}_max"])]
            if len(open_):
                years = ", ".join(str(y) for y in open_["year"])
                out.append(
                    f"{survey}: no {label} threshold recorded by the release(s) of {years}: "
                    f"{label} not flagged there"
                )
    return out


def ratio_changes(se: pd.DataFrame) -> pd.DataFrame:
    """Year-on-year change of each characteristic's SE ratio within a survey, between consecutive
    monitored years, on the same source (the first of SE_SOURCES both years have) and the
    characteristics present in both."""
    cols = [
        "survey",
        "year",
        "prev_year",
        "source",
        "characteristic",
        "ratio_prev",
        "ratio",
        "change",
    ]
    if se.empty:
        return pd.DataFrame(columns=cols)
    se = se if "source" in se.columns else se.assign(source="swap")
    out = []
    for name, g in se.groupby("name", sort=True):
        years = sorted(g["year"].unique())
        for prev, cur in zip(years[:-1], years[1:], strict=True):
            both = set(g.loc[g["year"] == prev, "source"]) & set(g.loc[g["year"] == cur, "source"])
            order = [s for s in SE_SOURCES if s in both] + sorted(both - set(SE_SOURCES))
            if not order:
                continue
            src = g[g["source"] == order[0]]
            a = src[src["year"] == prev].set_index("characteristic")["ratio"]
            b = src[src["year"] == cur].set_index("characteristic")["ratio"]
            j = pd.concat({"ratio_prev": a, "ratio": b}, axis=1, join="inner").dropna()
            j["change"] = j["ratio"] - j["ratio_prev"]
            j = j.reset_index().assign(
                survey=name, year=int(cur), prev_year=int(prev), source=order[0]
            )
            out.append(j)
    if not out:
        return pd.DataFrame(columns=cols)
    return pd.concat(out, ignore_index=True)[cols]


def drift_flags(
    table: pd.DataFrame,
    changes: pd.DataFrame,
    band: tuple[float, float] = (0.9, 1.1),
    max_change: float = 0.1,
) -> list[dict]:
    """Flags: median SE ratio outside band; characteristics whose ratio moved more than
    max_change since the previous year; delta, epsilon or identification risk above threshold."""
    lo, hi = band
    flags = []

    def flag(r, kind, value, limit, detail):
        flags.append(
            {
                "survey": r.survey,
                "year": int(r.year),
                "release_id": r.release_id,
                "kind": kind,
                "value": float(value),
                "limit": str(limit),
                "detail": detail,
            }
        )

    for r in table.itertuples():
        med = r.se_ratio_median
        if np.isfinite(med) and not lo <= med <= hi:
            flag(
                r,
                "se_ratio_median",
                med,
                f"[{lo}, {hi}]",
                f"median SE ratio {med:.3f} outside [{lo}, {hi}]",
            )
        for key, label in LABELS.items():
            if key not in table.columns:
                continue
            v, t = getattr(r, key), getattr(r, f"{key}_max")
            if not (np.isfinite(v) and np.isfinite(t)):
                continue
            if key in LOWER_BOUNDS and v < t:
                flag(r, key, v, f">= {t:g}", f"{label} {v:.4f} below threshold {t:g}")
            elif key not in LOWER_BOUNDS and v > t:
                flag(r, key, v, f"<= {t:g}", f"{label} {v:.4f} above threshold {t:g}")
        if len(changes):
            c = changes[(changes["survey"] == r.survey) & (changes["year"] == r.year)]
            big = c[c["change"].abs() > max_change]
            if len(big):
                w = big.loc[big["change"].abs().idxmax()]
                flag(
                    r,
                    "se_ratio_change",
                    float(big["change"].abs().max()),
                    f"<= {max_change:g}",
                    f"{len(big)} of {len(c)} characteristics' SE ratios changed by more than "
                    f"{max_change:g} since {int(w.prev_year)} (largest: {w.characteristic} "
                    f"{w.ratio_prev:.3f} -> {w.ratio:.3f})",
                )
    return flags


# ---------------------------------------------------------------- plots and report


def boxplot_by_year(se: pd.DataFrame, survey: str) -> bytes:
    """PNG: a survey's SE ratios by design-effect class, one box per year."""
    from sdl_design.plots import se_ratio_boxplot

    s = se[se["name"] == survey]
    groups = {str(y): g for y, g in s.groupby("year", sort=True)}
    title = f"{survey}: SE ratios by design-effect class and year"
    return se_ratio_boxplot(groups, title, legend="year", dpi=90)


def _plain_y(ax, values: np.ndarray) -> None:
    """Plain y tick labels (no offset such as '1e-11+1.499999999e-1'); a flat series (equal up
    to rounding) gets a window of +-5% around its value, so that its ticks read as numbers."""
    from matplotlib.ticker import MaxNLocator, ScalarFormatter

    fmt = ScalarFormatter(useOffset=False)
    fmt.set_scientific(False)
    ax.yaxis.set_major_formatter(fmt)
    ax.yaxis.set_major_locator(MaxNLocator(nbins=5))
    v = values[np.isfinite(values)]
    if len(v):
        lo, hi = float(v.min()), float(v.max())
        if hi - lo <= 1e-6 * max(abs(hi), 1e-12):
            pad = max(0.05 * abs(hi), 1e-3)
            ax.set_ylim(lo - pad, hi + pad)


def trend_plot(table: pd.DataFrame, survey: str) -> bytes:
    """PNG: median SE ratio and each monitored quantity by year, thresholds dashed."""
    from sdl_design.plots import png, pyplot, tight

    plt = pyplot()
    t = table[table["survey"] == survey].sort_values("year")
    panels = [("se_ratio_median", "median SE ratio"), *LABELS.items()]
    fig, axes = plt.subplots(1, len(panels), figsize=(3 * len(panels), 3.2))
    for ax, (key, label) in zip(axes, panels, strict=True):
        ax.plot(t["year"], t[key], "o-")
        if f"{key}_max" in t and t[f"{key}_max"].notna().any():
            ax.plot(t["year"], t[f"{key}_max"], "r--", lw=1, label="threshold")
        ax.set_title(label)
        ax.set_xticks(t["year"].tolist())
        _plain_y(ax, t[[c for c in (key, f"{key}_max") if c in t]].to_numpy(dtype=float))
    tight(fig)
    return png(fig, dpi=90)


def _table(df: pd.DataFrame | None) -> str:
    return html_table(df, empty="none")


CSS = (
    "body{font-family:sans-serif;margin:2em;max-width:1200px}table.t{border-collapse:collapse;"
    "font-size:13px}table.t td,table.t th{border:1px solid #ccc;padding:3px 6px;text-align:right}"
    ".flag{color:#b00;font-weight:bold}.ok{color:#070}img{max-width:100%}"
)


def render_monitor_html(
    table: pd.DataFrame,
    dist: pd.DataFrame,
    changes: pd.DataFrame,
    flags: list[dict],
    se: pd.DataFrame,
    params: dict,
    notes: Sequence[str] = (),
) -> str:
    from html import escape

    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'>",
        f"<title>PUF release monitoring</title><style>{CSS}</style></head><body>",
        "<h1>PUF release monitoring</h1>",
        f"<p>Drift band for the median SE ratio {params['band']}, largest allowed year-on-year change of a "
        f"characteristic's SE ratio {params['max_change']}; delta, epsilon, identification risk and "
        "sample-unique share against each release's own gates.</p>",
        "<h2 id='flags'>Drift flags</h2>",
    ]
    if flags:
        parts.append(
            "<ul>"
            + "".join(
                f"<li class='flag'>{escape(f['survey'])} {f['year']}: {escape(f['detail'])}</li>"
                for f in flags
            )
            + "</ul>"
        )
    else:
        parts.append("<p class='ok'>No drift flag.</p>")
    if notes:
        parts.append("<ul>" + "".join(f"<li>{escape(n)}</li>" for n in notes) + "</ul>")
    parts += ["<h2 id='releases'>Releases monitored</h2>", _table(table)]
    for survey in sorted(table["survey"].unique()) if len(table) else []:
        parts.append(f"<h2 id='survey-{escape(survey)}'>{escape(survey)}</h2>")
        parts.append("<h3>SE ratios by design-effect class</h3>")
        if len(se) and (se["name"] == survey).any():
            parts.append(img(boxplot_by_year(se, survey), f"SE ratio box plots {survey}"))
        parts.append(_table(dist[dist["name"] == survey]))
        parts.append("<h3>Risk and variance bias by year</h3>")
        parts.append(img(trend_plot(table, survey), f"trends {survey}"))
        treated = [c for c in table.columns if c.startswith("treated:")]
        if treated:
            parts.append("<h3>Share of records treated by stage</h3>")
            t = table.loc[table["survey"] == survey, ["year", *treated]]
            parts.append(_table(t.rename(columns=lambda c: c.removeprefix("treated:"))))
        c = changes[changes["survey"] == survey] if len(changes) else changes
        if len(c):
            parts.append("<h3>Largest year-on-year changes of SE ratios</h3>")
            top = c.reindex(c["change"].abs().sort_values(ascending=False).index).head(20)
            parts.append(_table(top))
    parts.append("</body></html>")
    return "\n".join(parts)


def post_monitor_artifacts(table: pd.DataFrame, flags: list[dict], survey: str | None) -> None:
    """Markdown summary and a table artifact (plain Python values: no numpy scalars)."""
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    key = artifact_key(f"puf-monitor-{survey or 'all'}", default="all")
    md = [
        f"# PUF monitoring ({survey or 'all surveys'})",
        "",
        f"{len(table)} release(s) monitored, **{len(flags)} drift flag(s)**",
        "",
    ]
    md += [f"- **{f['survey']} {f['year']}** {f['kind']}: {f['detail']}" for f in flags]
    create_markdown_artifact(key=key, markdown="\n".join(md), description="drift flags")
    rows = table.astype(object).where(table.notna(), None).to_dict(orient="records")
    rows = [{k: (v.item() if isinstance(v, np.generic) else v) for k, v in r.items()} for r in rows]
    create_table_artifact(key=f"{key}-releases", table=rows, description="releases monitored")


# ---------------------------------------------------------------- the flow


def _default_out_dir(url: str) -> Path:
    if url.startswith("sqlite"):
        db = sa_database(url)
        if db:
            return Path(db).parent / "monitoring"
    return Path("releases") / "monitoring"


def sa_database(url: str) -> str | None:
    import sqlalchemy as sa

    return sa.engine.make_url(url).database


def monitor(
    survey: str | None = None,
    url: str | None = None,
    out_dir: str | Path | None = None,
    band: tuple[float, float] = (0.9, 1.1),
    max_change: float = 0.1,
) -> MonitorSummary:
    """The monitoring computation and report, without Prefect (the flow adds artifacts).
    Each release is held to its own spec's gates (recorded in its manifest)."""
    lo, hi = band
    if not lo < hi:
        raise ValueError(f"band {band}: give (low, high) with low < high, e.g. (0.9, 1.1)")
    if max_change <= 0:
        raise ValueError(f"max_change {max_change}: must be > 0, e.g. 0.1")
    url = reg._resolve(url)
    rel = pick_releases(reg.load_releases(url, survey))
    ids = set(rel["release_id"]) if len(rel) else set()
    metrics = reg.load_metrics(url, survey)
    metrics = metrics[metrics["release_id"].isin(ids)]
    se_all = reg.load_se_ratios(url, survey)
    se_all = se_all[se_all["release_id"].isin(ids)]
    se = preferred_se(se_all)
    table = release_table(rel, metrics, se)
    dist = ratio_distribution(se)
    changes = ratio_changes(se_all)
    flags = drift_flags(table, changes, band, max_change) if len(table) else []
    out = Path(out_dir) if out_dir else _default_out_dir(url)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"monitor-{artifact_key(survey or 'all', default='all')}.html"
    params = {"band": list(band), "max_change": max_change}
    notes = unchecked(table)
    path.write_text(render_monitor_html(table, dist, changes, flags, se, params, notes))
    return MonitorSummary(releases=table, flags=flags, report=path, notes=notes)


@flow(name="puf-monitor", log_prints=True)
def monitor_flow(
    survey: str | None = None,
    url: str | None = None,
    out_dir: str | None = None,
    gate_on_drift: bool = False,
    band: tuple[float, float] = (0.9, 1.1),
    max_change: float = 0.1,
) -> MonitorSummary:
    """Monitor the registry's releases (one survey or all): HTML report, Prefect artifacts and
    drift flags. With gate_on_drift, raises DriftDetected (the run fails) when a flag is up."""
    summary = monitor(survey, url, out_dir, tuple(band), max_change)
    post_monitor_artifacts(summary.releases, summary.flags, survey)
    print(str(summary))
    if gate_on_drift and summary.flags:
        raise DriftDetected(summary)
    return summary
