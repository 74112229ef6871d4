"""Monitoring flow: variance bias and disclosure risk across releases, year on year, with drift
flags, an HTML report and Prefect artifacts. The statistics are small pure functions."""

from __future__ import annotations

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
from sdl_design.plots import png, pyplot, se_ratio_boxplot, tight
from sdl_design.stages import RELEASE_STAGES

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
# the stages whose SE-ratio tables the registry keeps, the latest in the release first (the
# final stage's measures the whole release; the masking stage's, the design after it)
SE_SOURCES = tuple(c.name for c in reversed(RELEASE_STAGES) if c.keeps_se_ratios)


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
    unpublished: pd.DataFrame = field(default_factory=pd.DataFrame)  # runs that published nothing
    band: tuple[float, float] = (0.9, 1.1)

    @property
    def status(self) -> int:
        return 1 if self.flags else 0

    def __str__(self) -> str:
        return self.render()

    def render(self, wide: bool = False, width: int = reg.WIDTH) -> str:
        """Terminal text: drift flags first, then one table per survey of its published
        releases (only its own columns), the runs that published nothing apart, the notes.
        Lines fit in width unless wide (every column, values whole)."""
        t, runs = self.releases, self.unpublished
        surveys = sorted(
            set(t["survey"] if len(t) else []) | set(runs["name"] if len(runs) else [])
        )
        n_pub = int((t["status"] == "published").sum()) if len(t) else 0
        lines = reg.wrap(
            f"monitored {len(t)} release(s), {n_pub} published, of {len(surveys)} survey(s); "
            f"{len(self.flags)} drift flag(s); {len(runs)} run(s) not published",
            width,
        )
        lines += flag_lines(self.flags, width) if self.flags else ["no drift flag"]
        for survey in surveys:
            lines += ["", *survey_lines(t, survey, self.band, wide, width)]
        lines += ["", *reg.unpublished_text(runs, wide, width)]
        for n in self.notes:
            lines += reg.wrap(f"NOTE {n}", width, "  ")
        if self.report:
            lines.append(f"report: {self.report}")
        return "\n".join(lines)


def flag_lines(flags: list[dict], width: int = reg.WIDTH) -> list[str]:
    """The drift flags as wrapped lines, under a header; a flag on a release that was not
    published says its status."""
    lines = [f"DRIFT FLAGS ({len(flags)})"]
    for f in flags:
        st = f.get("status")
        where = f"{f['survey']} {f['year']}" + (f" ({st})" if st and st != "published" else "")
        lines += reg.wrap(f"DRIFT {where} {f['kind']}: {f['detail']}", width, "  ")
    return lines


def survey_lines(
    table: pd.DataFrame,
    survey: str,
    band: tuple[float, float],
    wide: bool = False,
    width: int = reg.WIDTH,
) -> list[str]:
    """A survey's section of the terminal text: its published releases with only its own
    columns (narrow: the monitored quantities, then the share treated by stage; wide: every
    column of the release table), and the gates they were held to."""
    t = published_rows(table, survey)
    if not len(t):
        return reg.wrap(f"{survey}: no published release (its runs are listed below)", width)
    lines = reg.wrap(f"{survey}: {len(t)} published release(s)", width)
    if wide:
        lines += reg.text_table(wide_view(table, survey), True, width)
    else:
        main, treated = survey_views(table, survey)
        lines += reg.text_table(main, False, width, floors={"release": 28}, keep=2)
        if len(treated.columns) > 1:
            lines.append("  share treated by stage:")
            lines += reg.text_table(treated, False, width, floors={"year": 4}, keep=1)
    lines += reg.wrap(gates_text(table, survey, band), width, "  ")
    return lines


# ---------------------------------------------------------------- pure statistics


def pick_releases(rel: pd.DataFrame, measured: set[str] | None = None) -> pd.DataFrame:
    """One release per survey and year: the published one when there is one, else the latest
    recorded, one with metrics (release ids in `measured`) first (a rejected release is
    monitored too: that is where drift shows first)."""
    if rel.empty:
        return rel
    current = rel["status"].eq("published")
    if "replaced_by" in rel.columns:  # a newer published release of the year replaced it
        current &= rel["replaced_by"].isna()
    has = rel["release_id"].isin(measured) if measured is not None else True
    r = rel.assign(_pub=current.astype(int), _has=pd.Series(has, index=rel.index).astype(int))
    r = r.sort_values(
        ["name", "year", "_pub", "_has", "updated"], ascending=[True, True, False, False, False]
    )
    return r.drop_duplicates(["name", "year"]).drop(columns=["_pub", "_has"]).reset_index(drop=True)


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
    """Share treated by each stage from a release's metrics ('<stage>.<metric>' -> value), as
    each stage reads its own metrics: 'treated:<label>' (e.g. 'treated:prb',
    'treated:topcode income (upper)')."""
    out: dict[str, float] = {}
    for cls in RELEASE_STAGES:
        prefix = f"{cls.name}."
        own = {k[len(prefix) :]: v for k, v in m.items() if str(k).startswith(prefix)}
        own = {k: float(v) for k, v in own.items() if pd.notna(v)}
        out.update({f"treated:{k}": v for k, v in cls.treated_shares(own).items()})
    return out


# short column headers of the monitored quantities (terminal and report tables)
SHORT = {
    "se_ratio_median": "median SE ratio",
    "delta": "delta",
    "epsilon": "epsilon",
    "id_risk": "id risk",
    "unique_share": "unique share",
    "overlap_median": "CI overlap",
    "beyond_2se": "beyond 2 SE",
}


def published_rows(table: pd.DataFrame, survey: str) -> pd.DataFrame:
    """A survey's published releases (the trend), oldest year first."""
    if not len(table):
        return table
    t = table[(table["survey"] == survey) & (table["status"] == "published")]
    return t.sort_values("year").reset_index(drop=True)


def _present(t: pd.DataFrame, cols: Sequence[str]) -> list[str]:
    """The columns of cols that t has with at least one value."""
    return [c for c in cols if c in t.columns and t[c].notna().any()]


def survey_views(table: pd.DataFrame, survey: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """A survey's published releases as two tables with only the columns that survey has: the
    monitored quantities (year, release, median SE ratio, delta...) and the share of records
    treated by each of its stages (year and one column per stage)."""
    t = published_rows(table, survey)
    keys = _present(t, list(SHORT))
    main = t[["year", "release_id", *keys]].rename(
        columns={"release_id": "release", **{k: SHORT[k] for k in keys}}
    )
    treated = _present(t, [c for c in t.columns if str(c).startswith("treated:")])
    tr = t[["year", *treated]].rename(columns=lambda c: str(c).removeprefix("treated:"))
    return main.reset_index(drop=True), tr.reset_index(drop=True)


def wide_view(table: pd.DataFrame, survey: str) -> pd.DataFrame:
    """Every column of a survey's published releases that has a value there (thresholds, SE
    source and treated shares included)."""
    t = published_rows(table, survey)
    cols = [c for c in t.columns if c not in ("survey", "status") and t[c].notna().any()]
    # a threshold without its quantity (a gate of a stage the survey does not run) is not its own
    return t[[c for c in cols if not (c.endswith("_max") and c.removesuffix("_max") not in cols)]]


def gates_text(table: pd.DataFrame, survey: str, band: tuple[float, float]) -> str:
    """The drift band and the gates a survey's published releases were held to; a threshold that
    changed between years is given with its years."""
    t = published_rows(table, survey)
    parts = []
    for key, label in LABELS.items():
        col = f"{key}_max"
        if not _present(t, [key]) or not _present(t, [col]):  # the survey measures it, gated
            continue
        op = ">=" if key in LOWER_BOUNDS else "<="
        by = [(v, g["year"].tolist()) for v, g in t[t[col].notna()].groupby(col, sort=False)]
        if len(by) == 1:
            parts.append(f"{label} {op} {by[0][0]:g}")
        else:
            years = ", ".join(f"{op} {v:g} ({', '.join(map(str, ys))})" for v, ys in by)
            parts.append(f"{label} {years}")
    band_text = f"drift band: median SE ratio in [{band[0]:g}, {band[1]:g}]"
    return f"{band_text}; gates: " + ("; ".join(parts) or "none recorded")


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
    # (registries older than the source column kept the masking stage's table only)
    se = se if "source" in se.columns else se.assign(source=SE_SOURCES[-1])
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
                "status": getattr(r, "status", None),
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
    """PNG: a survey's median SE ratio and each quantity it measured, by year of its published
    releases, thresholds dashed; at most four panels a row."""

    plt = pyplot()
    t = published_rows(table, survey)
    panels = [("se_ratio_median", "median SE ratio"), *LABELS.items()]
    panels = [(k, lab) for k, lab in panels if _present(t, [k])] or panels[:1]
    ncol = min(4, len(panels))
    nrow = -(-len(panels) // ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(3.2 * ncol, 2.7 * nrow), squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    for ax, (key, label) in zip(axes.flat, panels, strict=False):
        ax.plot(t["year"], t[key], "o-")
        if f"{key}_max" in t and t[f"{key}_max"].notna().any():
            ax.plot(t["year"], t[f"{key}_max"], "r--", lw=1, label="threshold")
        ax.set_title(label, fontsize=10)
        ax.set_xticks(t["year"].tolist())
        ax.tick_params(labelsize=8)
        _plain_y(ax, t[[c for c in (key, f"{key}_max") if c in t]].to_numpy(dtype=float))
    tight(fig)
    return png(fig, dpi=90)


def _table(df: pd.DataFrame | None, cls: str = "") -> str:
    """An HTML table in a container that scrolls sideways: nothing is cut off."""
    names = " ".join(["scroll", *([cls] if cls else [])])
    return f"<div class='{names}' style='overflow-x:auto'>{html_table(df, empty='none')}</div>"


CSS = (
    "body{font-family:sans-serif;margin:1.5em auto;padding:0 1em;max-width:1200px}"
    "h1{margin:0 0 .3em}h2{margin-top:1.4em;border-bottom:1px solid #ddd}"
    ".scroll{overflow-x:auto;max-width:100%;margin:.3em 0}"
    "table.t{border-collapse:collapse;font-size:13px}"
    "table.t td,table.t th{border:1px solid #ccc;padding:3px 6px;text-align:right;"
    "white-space:nowrap}table.t th{background:#f4f4f4}"
    ".runs table.t td:last-child{white-space:normal;min-width:22em;font-size:12px}"
    ".rel table.t td:nth-child(2),.rel table.t th:nth-child(2),.runs table.t td,.runs table.t th"
    "{text-align:left}"
    ".flags{border:2px solid #b00;background:#fff4f4;padding:.2em 1em;margin:.6em 0}"
    ".noflag{border:2px solid #070;background:#f4fff4;padding:.2em 1em;margin:.6em 0}"
    ".flags h2,.noflag h2{margin:.4em 0;border:0;font-size:1.2em}.flags ul{margin:.3em 0}"
    ".flag{color:#b00;font-weight:bold}.ok{color:#070}.note{color:#555;font-size:13px}"
    "img{max-width:100%}nav a{margin-right:1em}"
)


def _flags_html(flags: list[dict], notes: Sequence[str]) -> list[str]:
    """The drift flags box (first on the page) and the notes on quantities never flagged."""
    from html import escape

    if flags:
        items = []
        for f in flags:
            st = f.get("status")
            tag = f" ({escape(st)}, not published)" if st and st != "published" else ""
            items.append(
                f"<li class='flag'>{escape(f['survey'])} {f['year']}{tag}: "
                f"{escape(f['detail'])}</li>"
            )
        parts = [
            f"<div class='flags'><h2 id='flags'>Drift flags ({len(flags)})</h2>"
            f"<ul>{''.join(items)}</ul></div>"
        ]
    else:
        parts = ["<div class='noflag'><h2 id='flags'>Drift flags</h2>"]
        parts.append("<p class='ok'>No drift flag.</p></div>")
    if notes:
        parts.append(
            "<ul class='note'>" + "".join(f"<li>{escape(n)}</li>" for n in notes) + "</ul>"
        )
    return parts


def _survey_html(
    survey: str,
    table: pd.DataFrame,
    dist: pd.DataFrame,
    changes: pd.DataFrame,
    se: pd.DataFrame,
    band: tuple[float, float],
) -> list[str]:
    """A survey's section: its published releases and the share treated by its own stages
    (only its columns), the gates, then the plots, the SE-ratio distribution and changes."""
    from html import escape

    sid = artifact_key(survey, default="survey")
    parts = [f"<h2 id='survey-{escape(sid)}'>{escape(survey)}</h2>"]
    main, treated = survey_views(table, survey)
    if not len(main):
        parts.append("<p class='note'>No published release; its runs are listed below.</p>")
        return parts
    parts += [f"<h3>Published releases ({len(main)})</h3>", _table(main, f"rel releases-{sid}")]
    parts.append(f"<p class='note'>{escape(gates_text(table, survey, band))}</p>")
    if len(treated.columns) > 1:
        parts += ["<h3>Share of records treated by stage</h3>", _table(treated, f"treated-{sid}")]
    parts.append("<h3>Risk and variance bias by year</h3>")
    parts.append(img(trend_plot(table, survey), f"trends {survey}"))
    parts.append("<h3>SE ratios by design-effect class</h3>")
    if len(se) and (se["name"] == survey).any():
        parts.append(img(boxplot_by_year(se, survey), f"SE ratio box plots {survey}"))
    parts.append(_table(dist[dist["name"] == survey].drop(columns="name")))
    c = changes[changes["survey"] == survey] if len(changes) else changes
    if len(c):
        parts.append("<h3>Largest year-on-year changes of SE ratios</h3>")
        top = c.reindex(c["change"].abs().sort_values(ascending=False).index).head(20)
        of = table[table["survey"] == survey].set_index("year")["status"]
        top = top.drop(columns="survey").assign(status=top["year"].map(of))  # rejected: said
        parts.append(_table(top))
    return parts


def _runs_html(runs: pd.DataFrame) -> str:
    """The runs that published nothing as a table (scrolling sideways), each reason with its
    own line breaks."""
    from html import escape

    if not len(runs):
        return "<p class='note'>none</p>"
    head = ["survey", "year", "release", "attempt", "state", "updated", "reason"]
    rows = []
    for r in runs.itertuples():
        reason = "" if r.reason is None or pd.isna(r.reason) else str(r.reason)
        lines = [escape(" ".join(x.split())) for x in reason.splitlines() if x.strip()]
        cells = [
            r.name,
            str(r.year),
            r.release_id,
            r.attempt_id,
            r.state,
            reg.short_time(r.updated),
        ]
        tds = "".join(f"<td>{escape(reg.one_line(c))}</td>" for c in cells)
        rows.append(f"<tr>{tds}<td>{'<br>'.join(lines) or '-'}</td></tr>")
    ths = "".join(f"<th>{h}</th>" for h in head)
    return (
        "<div class='scroll runs' style='overflow-x:auto'><table class='t'>"
        f"<thead><tr>{ths}</tr></thead><tbody>{''.join(rows)}</tbody></table></div>"
    )


def render_monitor_html(
    table: pd.DataFrame,
    dist: pd.DataFrame,
    changes: pd.DataFrame,
    flags: list[dict],
    se: pd.DataFrame,
    params: dict,
    notes: Sequence[str] = (),
    unpublished: pd.DataFrame | None = None,
) -> str:
    """The monitoring page: drift flags first, then one section per survey (its published
    releases, only its own columns, and its plots), then the runs that published nothing with
    their reasons. Every table scrolls sideways in its container."""
    from html import escape

    runs = unpublished if unpublished is not None else pd.DataFrame()
    surveys = sorted(
        set(table["survey"] if len(table) else []) | set(runs["name"] if len(runs) else [])
    )
    n_pub = int((table["status"] == "published").sum()) if len(table) else 0
    lo, hi = params["band"]
    nav = "".join(
        f"<a href='#survey-{escape(artifact_key(s, default='survey'))}'>{escape(s)}</a>"
        for s in surveys
    )
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'>",
        "<meta name='viewport' content='width=device-width, initial-scale=1'>",
        f"<title>PUF release monitoring</title><style>{CSS}</style></head><body>",
        "<h1>PUF release monitoring</h1>",
        f"<p id='summary'>{n_pub} published release(s) of {len(surveys)} survey(s); "
        f"<b>{len(flags)} drift flag(s)</b>; {len(runs)} run(s) not published.</p>",
        *_flags_html(flags, notes),
        f"<nav>{nav}<a href='#unpublished'>runs not published</a></nav>",
        f"<p class='note'>Drift band of the median SE ratio [{lo:g}, {hi:g}]; largest allowed "
        f"year-on-year change of a characteristic's SE ratio {params['max_change']:g}; delta, "
        "epsilon, identification risk, sample-unique share and utility against each release's "
        "own gates. Trends and tables show published releases only.</p>",
        "<section id='releases'>",
    ]
    for survey in surveys:
        parts += _survey_html(survey, table, dist, changes, se, (lo, hi))
    parts.append("</section>")
    parts.append(f"<h2 id='unpublished'>Runs that published nothing ({len(runs)})</h2>")
    parts.append(
        "<p class='note'>Failed, rejected, rolled back or unfinished runs, with their reasons; "
        "not part of the trends above.</p>"
    )
    parts.append(_runs_html(runs))
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
    every = reg.load_releases(url, survey)
    metrics = reg.load_metrics(url, survey)
    rel = pick_releases(every, set(metrics["release_id"]))
    ids = set(rel["release_id"]) if len(rel) else set()
    metrics = metrics[metrics["release_id"].isin(ids)]
    se_all = reg.load_se_ratios(url, survey)
    se_all = se_all[se_all["release_id"].isin(ids)]
    se = preferred_se(se_all)
    table = release_table(rel, metrics, se)
    pub = set(table.loc[table["status"] == "published", "release_id"]) if len(table) else set()
    se_pub = se[se["release_id"].isin(pub)] if len(se) else se  # the trend: published only
    dist = ratio_distribution(se_pub)
    changes = ratio_changes(se_all)
    flags = drift_flags(table, changes, band, max_change) if len(table) else []
    runs = reg.unpublished(every, reg.list_attempts(url, survey))
    out = Path(out_dir) if out_dir else _default_out_dir(url)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"monitor-{artifact_key(survey or 'all', default='all')}.html"
    params = {"band": list(band), "max_change": max_change}
    notes = unchecked(table)
    html = render_monitor_html(table, dist, changes, flags, se_pub, params, notes, runs)
    path.write_text(html)
    return MonitorSummary(
        releases=table,
        flags=flags,
        report=path,
        notes=notes,
        unpublished=runs,
        band=(float(lo), float(hi)),
    )


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
