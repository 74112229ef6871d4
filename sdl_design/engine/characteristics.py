"""The SE table of a file's broad characteristics by partition (sdl_design.utility's
broad_characteristics and domain_mean_se, the same table to 1e-12): the original side of
every stage's SE table, and the side of the records a stage wrote or would write (the swap's
masked records and its baseline's, the released records of the final stage).

Pass 1 sends, per file and partition, what broad_characteristics decides on the whole file:
each numeric column's range, each other column's values (at most MAX_CATEGORIES + 1), the
labels of the first two keys, and which characteristics have missing values. The driver
makes the characteristics (numeric means, category proportions as 0/1 indicators, numeric
means in each key domain and their crossing); the domain means by partition
(sdl_design.engine.partitions.means_pass1/means_pass2) estimate them, and the table is laid out as
domain_mean_se lays it out, then merged as se_ratio_table merges."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from sdl_design.blas import single_blas_thread
from sdl_design.codes import factorize
from sdl_design.engine.partitions import (
    MeansRequest,
    PartitionError,
    combine_pass1,
    domain_means,
    held_frame,
    means_pass1,
    means_pass2,
    ratios,
    read_partition,
)
from sdl_design.keys import key_levels
from sdl_design.spec import KeySpec
from sdl_design.survey.design import resolve_replicates
from sdl_design.utility import (
    broad_characteristics,
    original_domain_se,
    original_se_table,
    se_exclude,
)

if TYPE_CHECKING:
    from sdl_design.spec import ReleaseSpec

MAX_CATEGORIES = 30  # broad_characteristics' max_categories


@dataclass(frozen=True)
class FileChars:
    """One file's side of the SE table: its design (weight, strata, psu, segment, replicate
    weights, method, rho: design_columns' dict without df) and the columns left out."""

    design: dict[str, Any]
    exclude: tuple[str, ...]
    columns: tuple[str, ...]  # the file's

    @property
    def skip(self) -> set[str]:
        d = self.design
        out = set(self.exclude) | {d.get(k) for k in ("weight", "strata", "psu", "segment")}
        return out | set(d.get("replicate_weights") or [])


@dataclass(frozen=True)
class FinalRequest:
    """The SE table of a release: the original and released files' sides, the domain keys
    (the spec's first two)."""

    files: tuple[FileChars, FileChars]
    keys: tuple[KeySpec, ...]


def design_dict(design: Any, columns: Sequence[str]) -> dict[str, Any]:
    """SurveyDesign.from_spec's design columns of a DesignSection on a file's columns."""

    rs = design.replicate_weights
    rw = resolve_replicates(list(columns), rs.columns) if rs else []
    return {
        "weight": design.weight,
        "strata": design.strata,
        "psu": design.psu,
        "segment": design.segment,
        "replicate_weights": list(rw),
        "method": rs.method if rw else None,
        "rho": rs.rho if rw else None,
        "lonely_psu": getattr(design, "lonely_psu", None),  # (records held in memory)
    }


def final_request(
    spec: ReleaseSpec,
    original_columns: Sequence[str],
    released_columns: Sequence[str],
    design_released: Any,
) -> FinalRequest:
    """FinalStage's request: the original side as original_se_table makes it (the spec's
    design, se_exclude), the released side as FinalStage makes it (the public design,
    se_exclude and variables.other.drop)."""

    ex = tuple(se_exclude(spec))
    keys = tuple(KeySpec(name=k) if isinstance(k, str) else k for k in spec.variables.keys[:2])
    return FinalRequest(
        (
            FileChars(design_dict(spec.design, original_columns), ex, tuple(original_columns)),
            FileChars(
                design_dict(design_released, released_columns),
                (*ex, *spec.variables.other.drop),
                tuple(released_columns),
            ),
        ),
        keys,
    )


@dataclass
class FinalPass1:
    """One partition's columns: numeric ranges (min, max; NaN when all missing), other
    columns' values (None: more than MAX_CATEGORIES), the keys' labels, and the columns with
    missing values."""

    columns: list[str]
    numeric: dict[str, tuple[float, float]]
    values: dict[str, list | None]
    labels: dict[str, set[str] | None]
    missing: set[str] = field(default_factory=set)


def final_pass1(part: Any, spec: ReleaseSpec, req: FinalRequest, f: int) -> FinalPass1:
    """Pass 1 of file f (0 original, 1 released) on one partition."""
    skip = req.files[f].skip
    keys = [k.name for k in req.keys]
    cols = [c for c in req.files[f].columns if c not in skip or c in keys]
    df = read_partition(part, cols, spec)
    out = FinalPass1(list(req.files[f].columns), {}, {}, {})
    for c in cols:
        if c in skip:
            continue
        s = df[c]
        if pd.api.types.is_bool_dtype(s) or pd.api.types.is_numeric_dtype(s):
            x = s.to_numpy(dtype=float, na_value=np.nan)
            seen = x[~np.isnan(x)]
            out.numeric[c] = (seen.min(), seen.max()) if len(seen) else (np.nan, np.nan)
            if len(seen) < len(x):
                out.missing.add(c)
            continue
        uniq = pd.unique(s.dropna())
        out.values[c] = list(uniq) if len(uniq) <= MAX_CATEGORIES else None
    for k in req.keys:
        _, levels = key_levels(df[k.name], k)
        lab = {str(v) for v in levels}
        out.labels[k.name] = lab if len(lab) <= MAX_CATEGORIES else None
    return out


@dataclass(frozen=True)
class FinalPlan:
    """One file's characteristics (broad_characteristics' decisions on the whole file): the
    numeric columns, the indicators (name, column, value) in order, the domains, kinds, the
    characteristics with missing values, and the means request that estimates them."""

    numeric: tuple[str, ...]
    indicators: tuple[tuple[str, str, Any], ...]
    domains: tuple[tuple[str, ...], ...]
    kinds: dict[str, str]
    missing: frozenset[str]
    request: MeansRequest


def final_plan(parts: Sequence[FinalPass1], req: FinalRequest, f: int) -> FinalPlan:
    """File f's characteristics from its partitions' pass 1 (broad_characteristics' rules)."""
    cols = parts[0].columns
    numeric = []
    values: dict[str, list | None] = {}
    for c in cols:
        if c in parts[0].numeric:
            lo = np.nanmin([p.numeric[c][0] for p in parts])
            hi = np.nanmax([p.numeric[c][1] for p in parts])
            if np.isfinite(lo) and lo < hi:
                numeric.append(c)
        elif c in parts[0].values:
            seen: dict = {}
            for p in parts:
                v = p.values[c]
                if v is None:
                    seen = {}
                    values[c] = None
                    break
                seen.update(dict.fromkeys(v))
            else:
                values[c] = list(seen) if len(seen) <= MAX_CATEGORIES else None
    indicators = []
    for c, vals in values.items():
        if vals is not None and 2 <= len(vals) <= MAX_CATEGORIES:
            for v in sorted(vals, key=str):
                indicators.append((f"{c}={v}", c, v))
    kept = []
    for k in req.keys:
        labs: set[str] | None = set()
        for p in parts:
            lab = p.labels[k.name]
            if lab is None or labs is None:
                labs = None
                continue
            labs |= lab
        if labs is not None and len(labs) <= MAX_CATEGORIES:
            kept.append(k.name)
    domains = [(k,) for k in kept] + ([(kept[0], kept[1])] if len(kept) >= 2 else [])
    missing = frozenset(c for p in parts for c in p.missing if c in numeric)
    d = req.files[f].design
    reps = tuple(d["replicate_weights"]) if d["method"] else ()
    request = MeansRequest(
        variables=(*numeric, *(name for name, _, _ in indicators)),
        domains=tuple(domains),
        weight=d["weight"],
        strata=d["strata"],
        psu=d["psu"],
        replicate_weights=reps,
        method=d["method"] if reps else None,
        rho=d["rho"] if reps else None,
        keys=tuple(k for k in req.keys if k.name in kept),
    )
    kinds = dict.fromkeys(numeric, "mean") | {name: "proportion" for name, _, _ in indicators}
    return FinalPlan(tuple(numeric), tuple(indicators), tuple(domains), kinds, missing, request)


def _frame(part: Any, spec: ReleaseSpec, plan: FinalPlan, replicates: bool) -> pd.DataFrame:
    """The partition's columns the means read, with the category indicators (0/1; a missing
    value 0, as broad_characteristics codes it)."""
    req = plan.request
    sources = [c for _, c, _ in plan.indicators]
    dom = [c for d in req.domains for c in d]
    design = [c for c in (req.weight, req.strata, req.psu) if c]
    reps = list(req.replicate_weights) if replicates else []
    cols = list(dict.fromkeys([*design, *plan.numeric, *sources, *dom, *reps]))
    df = read_partition(part, cols, spec)
    add = _indicators(df, plan.indicators)
    return pd.concat([df, pd.DataFrame(add, index=df.index)], axis=1) if add else df


def _indicators(df: pd.DataFrame, indicators: Sequence[tuple[str, str, Any]]) -> dict:
    """name -> (df[c] == v) as 0/1 floats: each column factorized once, its distinct values
    compared with v (not every record's text once per category)."""
    coded: dict[str, tuple[np.ndarray, Any]] = {}
    out = {}
    for name, c, v in indicators:
        if c not in coded:
            coded[c] = factorize(df[c])  # (missing: -1, equal to no v)
        codes, uniq = coded[c]
        hit = np.append(pd.Series(uniq, dtype=object).eq(v).to_numpy(dtype=bool), False)
        out[name] = hit[codes].astype(float)
    return out


def final_means1(part: Any, spec: ReleaseSpec, plan: FinalPlan) -> Any:
    """Pass 2 (the means' first pass) on one partition."""
    df = _frame(part, spec, plan, True)
    with single_blas_thread():
        return means_pass1(df, plan.request)


def final_means2(part: Any, spec: ReleaseSpec, plan: FinalPlan, levels: list, R: list) -> Any:
    """Pass 3 (the means' centred PSU totals) on one partition."""
    df = _frame(part, spec, plan, False)
    with single_blas_thread():
        return means_pass2(df, plan.request, levels, R)


def se_table(plan: FinalPlan, first: Sequence[Any], second: Sequence[Any]) -> pd.DataFrame:
    """domain_mean_se's table of one file from its means passes: overall every characteristic
    (kind mean/proportion), in each domain level the numeric ones (domain mean), each call's
    characteristics without missing values first, then those with (level by level)."""
    agg = combine_pass1(first)
    t = domain_means(plan.request, agg, second)
    R = len(plan.request.replicate_weights)
    t = t.rename(columns={"domain": "name"})
    blocks = []
    for d, name in enumerate(["all", *(":".join(x) for x in plan.domains)]):
        g = t[t["name"] == name]
        chars = [*plan.numeric, *(n for n, _, _ in plan.indicators)] if d == 0 else plan.numeric
        for part in (
            [c for c in chars if c not in plan.missing],
            [c for c in chars if c in plan.missing],
        ):
            if not part:
                continue
            rank = {c: i for i, c in enumerate(part)}
            sel = g[g["variable"].isin(rank)].copy()
            lv = {v: i for i, v in enumerate(pd.unique(sel["level"]))}
            sel["_o"] = [
                lv[a] * len(part) + rank[b]
                for a, b in zip(sel["level"], sel["variable"], strict=True)
            ]
            sel = sel.sort_values("_o", kind="stable")
            sel["domain"] = "all" if d == 0 else name + "=" + sel["level"].astype(str)
            sel["kind"] = [plan.kinds[v] for v in sel["variable"]] if d == 0 else "domain mean"
            blocks.append(sel)
    out = pd.concat(blocks, ignore_index=True)
    cols = ["variable", "domain", "kind", "estimate", "se", "deff"] + (["se_rep"] if R else [])
    return out[cols]


def file_se(
    run_map: Any,
    parts: Sequence[Any],
    spec: ReleaseSpec,
    req: FinalRequest,
    f: int,
    name: str,
    plan: FinalPlan | None = None,
) -> pd.DataFrame:
    """File f's side of an SE table (domain_mean_se's table of its broad characteristics in
    its design): over its partitions (pass 1 decides the characteristics unless a plan is
    given, two passes of domain means), or, for records held in memory, domain_mean_se on the
    frame (the same table)."""
    frame = held_frame(parts, spec)
    if frame is not None:
        return frame_se(frame, req.files[f], req.keys)
    if not req.files[f].design["psu"]:
        raise PartitionError("design.psu: the partitioned SEs sum by PSU; give the PSU column")
    if plan is None:
        plan = final_plan(run_map(final_pass1, parts, spec, req, f, what=name), req, f)
    first = run_map(final_means1, parts, spec, plan, what=f"{name}: SEs, pass 1")
    agg = combine_pass1(first)
    second = run_map(
        final_means2, parts, spec, plan, agg.levels, ratios(agg), what=f"{name}: SEs, pass 2"
    )
    return se_table(plan, first, second)


def with_design(plan: FinalPlan, design: dict[str, Any]) -> FinalPlan:
    """The same characteristics read with another design (records whose design labels and
    replicate weights alone changed: the swap's)."""
    reps = tuple(design["replicate_weights"]) if design.get("method") else ()
    request = replace(
        plan.request,
        weight=design["weight"],
        strata=design["strata"],
        psu=design["psu"],
        replicate_weights=reps,
        method=design["method"] if reps else None,
        rho=design.get("rho") if reps else None,
    )
    return replace(plan, request=request)


def frame_se(frame: pd.DataFrame, file: FileChars, keys: Sequence[KeySpec]) -> pd.DataFrame:
    """file_se of records held in memory: broad_characteristics and domain_mean_se in the
    file's design (original_domain_se's call, whichever file it is)."""
    chars = broad_characteristics(frame, design=file.design, exclude=file.exclude, domains=keys)
    return original_domain_se(frame, file.design, chars)


def original_se(run_map: Any, inputs: Sequence[Any], ctx: Any, req: FinalRequest) -> pd.DataFrame:
    """The original file's side of every stage's SE table (req's file 0: the spec's design,
    se_exclude), computed once a release and kept in ctx.shared: original_se_table for the
    file held in memory, file_se over its partitions."""
    ex = req.files[0].exclude
    if held_frame(inputs, ctx.spec) is not None:
        return original_se_table(ctx, ex)
    key = ("original_se_parts", tuple(sorted(set(ex))))
    if key not in ctx.shared:
        ctx.shared[key] = file_se(run_map, inputs, ctx.spec, req, 0, "SEs of the input")
    return ctx.shared[key]
