"""Information-loss and utility measures: TVD, AAD, Cramer's V ratio, RRMSE, SE ratios."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from sdl_design.codes import factorize
from sdl_design.keys import key_levels
from sdl_design.spec import KeySpec
from sdl_design.survey.design import DEFF_CLASSES, SurveyDesign, deff_class, design_columns

if TYPE_CHECKING:
    from sdl_design.spec import KeySpec


def weighted_distribution(
    df: pd.DataFrame, cols: Sequence[str], weight: str | None = None
) -> pd.Series:
    """Weighted (or raw) joint distribution of cols, as proportions indexed by category tuples."""
    w = df[weight] if weight else pd.Series(1.0, index=df.index)
    p = w.groupby([df[c] for c in cols], observed=True, sort=True).sum()
    return p / p.sum()


def tvd(p: pd.Series, q: pd.Series) -> float:
    """Total variation distance 0.5 * sum |p - q| over the union of categories."""
    a, b = p.align(q, fill_value=0.0)
    return 0.5 * float(np.abs(a - b).sum())


def aad(orig: pd.Series, masked: pd.Series) -> float:
    """Average absolute distance per cell between two count tables (Shlomo eq. 12)."""
    a, b = orig.align(masked, fill_value=0.0)
    return float(np.abs(a - b).sum() / len(a)) if len(a) else 0.0


def cramers_v(df: pd.DataFrame, a: str, b: str, weight: str | None = None) -> float:
    """Cramer's V of the (weighted) two-way table of a and b."""
    w = df[weight] if weight else pd.Series(1.0, index=df.index)
    t = w.groupby([df[a], df[b]], observed=True).sum().unstack(fill_value=0.0).to_numpy()
    n = t.sum()
    e = np.outer(t.sum(1), t.sum(0)) / n
    with np.errstate(divide="ignore", invalid="ignore"):
        chi2 = np.nansum(np.where(e > 0, (t - e) ** 2 / e, 0.0))
    k = min(t.shape) - 1
    return float(np.sqrt(chi2 / (n * k))) if k > 0 else 0.0


def rcv(
    orig: pd.DataFrame, masked: pd.DataFrame, a: str, b: str, weight: str | None = None
) -> float:
    """Relative change of Cramer's V in percent (Shlomo eq. 13)."""
    v0 = cramers_v(orig, a, b, weight)
    return 100.0 * (cramers_v(masked, a, b, weight) - v0) / v0 if v0 else 0.0


def rrmse(estimates: np.ndarray, truth: np.ndarray) -> np.ndarray:
    """Relative root mean squared error over replications (rows) for each variable (columns)."""
    est = np.atleast_2d(np.asarray(estimates, dtype=float))
    t = np.asarray(truth, dtype=float)
    return np.sqrt(((est - t) ** 2).mean(axis=0)) / np.abs(t)


# ---------------------------------------------------------------- SE ratios (paper 003, Table 1)


def deff_class_summary(
    ratio: pd.Series | np.ndarray,
    deff: pd.Series | np.ndarray,
    edges: Sequence[float] = DEFF_CLASSES,
) -> pd.DataFrame:
    """Distribution of SE ratios by original design-effect class, as the paper's Table 1.

    Rows: count, mean, 100%, 90%, 75%, 50%, 25%, 10%, 0%, IQR, range; one column per class
    plus 'overall' (characteristics whose deff falls outside the classes count only overall).
    """
    r = pd.Series(np.asarray(ratio, dtype=float))
    cls = deff_class(deff, edges)
    ok = r.notna()
    cols = {str(c): r[ok & (cls == c)] for c in cls.cat.categories}
    cols["overall"] = r[ok]
    rows = ["count", "mean", "100%", "90%", "75%", "50%", "25%", "10%", "0%", "IQR", "range"]
    out = pd.DataFrame(index=rows, columns=list(cols), dtype=float)
    for name, v in cols.items():
        x = v.to_numpy()
        if len(x) == 0:
            out.loc["count", name] = 0.0
            continue
        p = np.percentile(x, [100, 90, 75, 50, 25, 10, 0])
        out[name] = [len(x), x.mean(), *p, p[2] - p[4], p[0] - p[6]]
    return out


def _text_codes(codes: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(codes, labels) with labels that print the same merged: the records' text labels
    labels[codes] as codes into distinct labels."""
    merged, distinct = factorize(labels)
    return merged[codes], np.asarray(distinct, dtype=object)


def _sorted_categorical(codes: np.ndarray, labels: np.ndarray, index: pd.Index) -> pd.Series:
    """labels[codes] as a categorical whose categories are the labels present, sorted (the
    order a sorted factorization of the text gives)."""
    present = np.flatnonzero(np.bincount(codes, minlength=len(labels)))
    order = present[np.argsort(labels[present], kind="stable")]
    rank = np.full(len(labels), -1, dtype=np.int64)
    rank[order] = np.arange(len(order))
    cats = pd.Index(labels[order], dtype=object)
    return pd.Series(pd.Categorical.from_codes(rank[codes], categories=cats), index=index)


@dataclass
class Characteristics:
    """A broad set of characteristics for SE checks: means of numeric/binary variables,
    proportions of every category (0/1 indicator columns), and domain means."""

    extra: pd.DataFrame  # indicator and domain columns to add to the data frame
    overall: list[str]  # estimated on the whole sample
    domain_vars: list[str]  # estimated within each domain
    domains: list[str]  # columns of extra that define domains
    kinds: dict[str, str]  # variable -> "mean" | "proportion"


PREFIX = 20_000  # broad_characteristics: a text column's first records, counted first


def broad_characteristics(
    df: pd.DataFrame,
    design: dict | None = None,
    exclude: Sequence[str] = (),
    max_categories: int = 30,
    domains: Sequence[KeySpec | str] = (),
    cross: bool = True,
) -> Characteristics:
    """Every numeric and binary variable, every category of the categorical ones (up to
    max_categories), and domain means within each domain variable and, with cross, within the
    crossing of the first two.

    design: the dict of `sdl_design.stages.swap.method.design_columns`; its columns (weight, strata, PSU,
    segment, replicate weights) are left out, as are exclude and constant columns.
    domains: columns of df, or KeySpecs (e.g. the spec's keys) whose bins or map coarsen them
    (none by default); a domain variable with more than max_categories categories is left out.
    """

    skip = set(exclude)
    if design:
        skip |= {
            design.get(k) for k in ("weight", "strata", "psu", "segment", "fpc", "ssu", "fpc2")
        }
        skip |= set(design.get("replicate_weights") or [])
    numeric, categorical = [], {}
    for c in df.columns:
        if c in skip:
            continue
        s = df[c]
        if pd.api.types.is_bool_dtype(s) or pd.api.types.is_numeric_dtype(s):
            x = s.to_numpy(dtype=float, na_value=np.nan)  # two distinct values: min < max
            if not np.isnan(x).all() and np.nanmin(x) < np.nanmax(x):
                numeric.append(c)
            continue
        if len(s) > PREFIX and s.iloc[:PREFIX].nunique() > max_categories:
            continue  # more categories in its first records already (an identifier, a name)
        codes, uniq = factorize(s)  # missing: -1
        if 2 <= len(uniq) <= max_categories:
            categorical[c] = (codes, uniq)
    extra: dict[str, pd.Series] = {}
    kinds = dict.fromkeys(numeric, "mean")
    for c, (codes, uniq) in categorical.items():
        for i in sorted(range(len(uniq)), key=lambda i: str(uniq[i])):
            name = f"{c}={uniq[i]}"
            extra[name] = pd.Series((codes == i).astype(float), index=df.index)
            kinds[name] = "proportion"
    names = []
    dom_codes = {}
    for k in domains:  # each record's recoded label as text, held as codes into sorted labels
        k = KeySpec(name=k) if isinstance(k, str) else k
        codes, levels = key_levels(df[k.name], k)
        labels = np.array([str(v) for v in levels], dtype=object)
        if len(np.unique(labels)) <= max_categories:
            dom_codes[k.name] = _text_codes(codes, labels)
    for name, (codes, labels) in dom_codes.items():
        extra[f"_dom_{name}"] = _sorted_categorical(codes, labels, df.index)
        names.append(f"_dom_{name}")
    if cross and len(dom_codes) >= 2:
        (a, (ca, la)), (b, (cb, lb)) = list(dom_codes.items())[:2]
        pair = ca * len(lb) + cb
        labels = (la[:, None] + ":" + lb[None, :]).ravel()
        extra[f"_dom_{a}:{b}"] = _sorted_categorical(*_text_codes(pair, labels), df.index)
        names.append(f"_dom_{a}:{b}")
    return Characteristics(
        extra=pd.DataFrame(extra, index=df.index, copy=False),
        overall=numeric + [k for k, v in kinds.items() if v == "proportion"],
        domain_vars=numeric,
        domains=names,
        kinds=kinds,
    )


def se_ratio_metrics(se: pd.DataFrame, prefix: str = "se_ratio", column: str = "ratio") -> dict:
    """median, p10, p90, min, max of an SE-ratio column (finite values only); mean |log ratio|
    over positive ratios, with the count of zero ratios (SE collapsed to 0) beside it."""
    r = se[column].to_numpy(dtype=float)
    r = r[np.isfinite(r)]
    if len(r) == 0:
        return {}
    q = np.percentile(r, [50, 10, 90])
    return {
        f"{prefix}_median": float(q[0]),
        f"{prefix}_p10": float(q[1]),
        f"{prefix}_p90": float(q[2]),
        f"{prefix}_min": float(r.min()),
        f"{prefix}_max": float(r.max()),
        f"{prefix}_mean_abs_log": float(np.mean(np.abs(np.log(r[r > 0]))))
        if (r > 0).any()
        else float("inf"),
        f"{prefix}_n_zero": float((r <= 0).sum()),
    }


def domain_mean_se(
    df: pd.DataFrame,
    chars: Characteristics,
    weight: str,
    strata: str,
    psu: str,
    replicate_weights: Sequence[str] = (),
    method: str | None = None,
    rho: float | None = None,
    rscales: Sequence[float] | None = None,
    mse: bool = True,
    fpc: dict[str, Any] | None = None,
) -> pd.DataFrame:
    """Estimate, Taylor SE, Taylor deff and (with replicate weights) replicate SE of every
    characteristic: overall means/proportions and domain means (SurveyDesign.mean). rscales:
    the replicate scale factors when known (SurveyDesign derives them otherwise); mse: the
    replicates centred on the full-sample estimate (else on their mean); fpc: SurveyDesign's
    fpc, ssu, fpc2 and lonely_psu keywords (columns of df)."""
    fpc = {k: v for k, v in (fpc or {}).items() if v is not None}

    calls = [(None, chars.overall)] + [(d, chars.domain_vars) for d in chars.domains]
    used = list(dict.fromkeys(c for _, cols in calls for c in cols))
    # the characteristics as one float block (variables x records): every design.mean below
    # reads its columns in place instead of gathering mixed-dtype columns on each call
    Y = np.empty((len(used), len(df)))
    for i, c in enumerate(used):
        col = chars.extra[c] if c in chars.extra else df[c]
        Y[i] = col.to_numpy(dtype=float, na_value=np.nan)
    # a variable with missing values: its mean over the records that have it (the ratio of
    # sum w y 1{y observed} to sum w 1{y observed}, linearized), the other records a domain
    missing = np.isnan(Y).any(axis=1)
    na = [c for c, m in zip(used, missing, strict=True) if m]
    rw = list(replicate_weights) if (replicate_weights and method) else None
    cols = [fpc.get(k) for k in ("fpc", "ssu", "fpc2")]
    need = [c for c in dict.fromkeys([weight, strata, psu, *cols, *(rw or [])]) if c in df.columns]
    parts = [df[need], chars.extra[chars.domains]]
    parts.append(pd.DataFrame(Y.T, index=df.index, columns=used, copy=False))
    if na:
        Ym = Y[missing]  # the variables with missing values, gathered once
        seen = ~np.isnan(Ym)
        names = [f"__y0:{c}" for c in na] + [f"__nn:{c}" for c in na]
        both = np.concatenate([np.where(seen, Ym, 0.0), seen.astype(float)])
        parts.append(pd.DataFrame(both.T, index=df.index, columns=names, copy=False))
    frame = pd.concat(parts, axis=1)
    design = SurveyDesign(
        frame,
        weight=weight,
        strata=strata,
        psu=psu,
        replicate_weights=rw,
        method=method,
        rho=rho,
        rscales=rscales if rw else None,
        mse=mse,
        **fpc,
    )

    def means(cols: list[str], by: str | None, variance: str) -> pd.DataFrame:
        full = [c for c in cols if c not in na]
        part = [c for c in cols if c in na]
        res = [design.mean(full, by=by, variance=variance).reset_index()] if full else []
        if part:
            r = design.ratio(
                [f"__y0:{c}" for c in part], [f"__nn:{c}" for c in part], by=by, variance=variance
            ).reset_index()
            r["variable"] = r["variable"].str.removeprefix("__y0:").str.split("/__nn:").str[0]
            res.append(r)
        return pd.concat(res, ignore_index=True)

    out = []
    for by, cols in calls:
        t = means(cols, by, "taylor")
        t["domain"] = "all" if by is None else by.removeprefix("_dom_") + "=" + t[by].astype(str)
        if rw:
            r = means(cols, by, "replicate")
            t["se_rep"] = r["se"].to_numpy()
        t["kind"] = [
            chars.kinds.get(c, "mean") if by is None else "domain mean" for c in t.variable
        ]
        cols_out = ["variable", "domain", "kind", "estimate", "se", "deff"]
        out.append(t[cols_out + (["se_rep"] if rw else [])])
    return pd.concat(out, ignore_index=True)


def original_domain_se(
    original: pd.DataFrame, design: dict, chars: Characteristics
) -> pd.DataFrame:
    """domain_mean_se of the original file in its design (design: weight, strata, psu and,
    optionally, replicate_weights, method, rho, rscales, mse): the original side of
    se_ratio_table."""
    return domain_mean_se(
        original,
        chars,
        weight=design["weight"],
        strata=design["strata"],
        psu=design["psu"],
        replicate_weights=design.get("replicate_weights") or (),
        method=design.get("method"),
        rho=design.get("rho"),
        rscales=design.get("rscales"),
        mse=design.get("mse", True),
        fpc={k: design.get(k) for k in ("fpc", "ssu", "fpc2", "lonely_psu")},
    )


def original_se_table(
    ctx: Any, exclude: Sequence[str], chars: Characteristics | None = None
) -> pd.DataFrame:
    """original_domain_se of the original file in its design (ctx.design) for its broad
    characteristics (its design columns and `exclude` left out; domains: the first two keys;
    chars: those characteristics when already built), computed once per release and kept in
    ctx.shared (the table only, not the characteristics' indicator columns): the original side
    of every stage's SE table. A stage that leaves out more variables gets them dropped by
    se_ratio_table's match with its masked side, so the smallest exclude serves them all."""

    key = ("original_se", tuple(sorted(set(exclude))))
    if key not in ctx.shared:
        dc = design_columns(ctx.design)
        if chars is None:
            chars = broad_characteristics(
                ctx.original, design=dc, exclude=exclude, domains=ctx.spec.variables.keys[:2]
            )
        ctx.shared[key] = original_domain_se(ctx.original, dc, chars)
    return ctx.shared[key]


def se_exclude(spec: Any) -> list[str]:
    """Variables no SE table characterizes: direct identifiers and the household label."""
    d, v = spec.design, spec.variables
    return [c for c in (*v.direct_identifiers, d.household) if c]


def se_ratio_table(
    original: pd.DataFrame,
    masked: pd.DataFrame,
    design: dict,
    masked_replicates: Sequence[str],
    chars: Characteristics,
    method: str | None = None,
    rho: float | None = None,
    chars_masked: Characteristics | None = None,
    masked_design: dict | None = None,
    original_se: pd.DataFrame | None = None,
    masked_rscales: Sequence[float] | None = None,
) -> pd.DataFrame:
    """One row per characteristic: se_original, se_masked, ratio, deff (original, Taylor) and,
    with replicate weights, se_original_rep, se_masked_rep, ratio_rep. Characteristics with a
    zero original SE (constants in a domain) are left out. masked_design: the masked file's
    own design columns (a pseudo design in new columns), default those of design. original_se:
    original_domain_se of the same original, design and chars when already computed (e.g. for
    several maskings); masked_rscales: the scale factors of masked_replicates when known."""
    md = masked_design or design
    kw_m = {"weight": md["weight"], "strata": md["strata"], "psu": md["psu"]}
    o = original_domain_se(original, design, chars) if original_se is None else original_se
    m = domain_mean_se(
        masked,
        chars_masked or chars,
        **kw_m,
        replicate_weights=masked_replicates,
        method=method,
        rho=rho,
        rscales=masked_rscales,
        fpc={"lonely_psu": md.get("lonely_psu") or design.get("lonely_psu")},
    )
    return se_ratio_merge(o, m)


def se_ratio_merge(o: pd.DataFrame, m: pd.DataFrame) -> pd.DataFrame:
    """se_ratio_table's rows from the original's and the masked file's domain_mean_se
    tables (the characteristics both have; a zero original SE left out)."""
    key = ["variable", "domain", "kind"]
    t = o.merge(m, on=key, how="inner", suffixes=("_o", "_m"), sort=False)
    keep = t["se_o"].to_numpy() > 1e-12 * np.maximum(1.0, np.abs(t["estimate_o"].to_numpy()))
    t = t.loc[keep].reset_index(drop=True)
    out = pd.DataFrame(
        {
            "characteristic": t["variable"] + "|" + t["domain"],
            "variable": t["variable"],
            "domain": t["domain"],
            "kind": t["kind"],
            "estimate": t["estimate_o"],
            "estimate_masked": t["estimate_m"],
            "se_original": t["se_o"],
            "se_masked": t["se_m"],
            "ratio": t["se_m"] / t["se_o"],
            "deff": t["deff_o"],
        }
    )
    if "se_rep_o" in t.columns and "se_rep_m" in t.columns:
        out["se_original_rep"] = t["se_rep_o"]
        out["se_masked_rep"] = t["se_rep_m"]
        out["ratio_rep"] = out["se_masked_rep"] / out["se_original_rep"]
    out["deff_class"] = deff_class(out["deff"]).astype(str).to_numpy()
    return out


def final_tables(out: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """FinalStage's tables from its SE table."""
    return {
        "se_ratios": out,
        "se_ratio_summary": deff_class_summary(out["ratio"], out["deff"]).reset_index(),
    }


def final_measures(
    out: pd.DataFrame, before: float, after: float, keys_changed: float, retained: float
) -> tuple[dict[str, float], list[str]]:
    """FinalStage's metrics and notes: its SE table's ratios (se_ratio_metrics), the shares
    of sample uniques on the keys before and after, of retained records with a changed key
    and of records retained."""
    metrics = se_ratio_metrics(out)
    metrics.update(
        {
            "n_characteristics": float(len(out)),
            "unique_share_before": before,
            "unique_share_after": after,
            "share_keys_changed": keys_changed,
            "share_records_retained": retained,
        }
    )
    notes = [
        f"{len(out)} characteristics: median SE ratio (released / original) "
        f"{metrics.get('se_ratio_median', float('nan')):.3f}, 10th-90th percentile "
        f"{metrics.get('se_ratio_p10', float('nan')):.3f}-"
        f"{metrics.get('se_ratio_p90', float('nan')):.3f}",
        f"sample uniques on the keys: {before:.1%} before, {after:.1%} after; "
        f"{keys_changed:.1%} of retained records have a changed key",
    ]
    if metrics.get("se_ratio_n_zero"):
        zero = out.loc[out["ratio"] <= 0, "characteristic"].head(5).tolist()
        notes.append(
            f"{metrics['se_ratio_n_zero']:.0f} characteristics have SE 0 on the released file "
            f"(e.g. {', '.join(zero)}): the treatment left no variation there"
        )
    return metrics, notes
