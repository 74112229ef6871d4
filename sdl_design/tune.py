"""Tuning the treatment chain: candidate settings, their risk and utility, the Duncan map.

The loop done by hand at NCHS (Park et al., paper 003: "repeated to adjust the swapping rate
... until we were satisfied") and left to "experimentation" by Zhang and Nayak (paper 002,
section 4), as a small design (no Prefect here; flows/tune.py runs it in parallel):

- factors: the settings of the enabled stages that may move, each with levels around the
  spec's own (swap rate and 6a/6b; PRB partition ladder and tuned theta; MASSC epsilon,
  psi_max, phi_min, substrata; top-coding percentiles), only fields the spec model has;
- the spec's own setting first; then one factor at a time around it, the nearest level of
  every factor first, in the direction that lowers risk when the spec's own fails a risk gate
  (else in the direction that spares the data); then refinement around the best candidate
  (a pattern search: the other factors' best one-factor levels added to it, its numeric
  settings moved one level further, bisection between evaluated levels);
- every candidate runs the stage list to the assessment of the would-be public file against
  the original (`evaluate`; MASSC without the replications of the empirical epsilon, no
  figures, report-only stages left out, earlier stage results shared between candidates);
  its risk gates, utility and all other gates are recorded.

Risk (x of the map): the largest share of its limit a risk gate uses, max(value / upper) over
the gates named 'risk: ...', prb.max_identification_risk and massc.delta (1 = at the limit;
a candidate passes every risk gate when each holds; RISK_TERMS names each gate's metric and
the spec field of its limit, and the console and the map say which gate sets the index).
Utility (y): the median Karr CI overlap of the domain estimates minus the share of them more
than 2 original SEs off (overlap_median - share_abs_std_bias_gt2). Recommended: among the
candidates that pass every risk gate, those that pass every gate first, then those no worse
than the spec's own on both overlap_median and share beyond 2 SE, then the highest utility
(then overlap_p5, then fewer changes). Each change's reason starts with what its stage does
(stage_does, in the spec's own units: the swap's segment column, PRB's cells).
"""

from __future__ import annotations

import copy
import json
import math
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import yaml

from sdl_design.blas import single_blas_thread
from sdl_design.plots import figures_off
from sdl_design.plots import risk_utility_map as draw
from sdl_design.spec import ReleaseSpec
from sdl_design.stage import Gate, StageContext, StageResult
from sdl_design.stages import RELEASE_STAGES, build_stages, described

Change = tuple[str, Any]  # (dotted path in the spec YAML, value)
# the directions a search goes first: lower risk, or spare the data (words, not stage names)
TOWARD_RISK, TOWARD_UTILITY = "risk", "utility"

RISK_GATES = ("prb.max_identification_risk", "massc.delta")
EVAL_OVERRIDES: tuple[Change, ...] = (("stages.massc.replications", 0),)  # epsilon only

RISK_COLUMNS = ["risk_index", "prb_max_risk", "massc_delta", "reid_share", "unique_share_published"]
UTILITY_COLUMNS = [
    "utility",
    "overlap_median",
    "overlap_p5",
    "share_abs_std_bias_gt2",
    "model_overlap_min",
    "se_ratio_p10",
    "se_ratio_p90",
    "epsilon_published",
    "pmse_ratio",
    "share_retained",
]


# ---------------------------------------------------------------- dotted paths


def _child(d: dict, key: str) -> Any:
    """d[key]; a top-coding column is written inline in the YAML but sits under 'columns' in
    the model (stages.topcode.income -> stages.topcode.columns.income)."""
    if key in d:
        return d[key]
    if isinstance(d.get("columns"), dict) and key in d["columns"]:
        return d["columns"][key]
    raise KeyError(key)


def get_path(data: dict, path: str) -> Any:
    """The value at a dotted path of a spec mapping (KeyError when absent)."""
    cur: Any = data
    for key in path.split("."):
        if not isinstance(cur, dict):
            raise KeyError(path)
        cur = _child(cur, key)
    return cur


def has_path(data: dict, path: str) -> bool:
    try:
        get_path(data, path)
    except KeyError:
        return False
    return True


def set_path(data: dict, path: str, value: Any) -> None:
    """Set a dotted path of a spec mapping in place (the last key may be new)."""
    *head, last = path.split(".")
    cur = get_path(data, ".".join(head)) if head else data
    if not isinstance(cur, dict):
        raise KeyError(path)
    if last not in cur and isinstance(cur.get("columns"), dict) and last in cur["columns"]:
        cur = cur["columns"]
    cur[last] = copy.deepcopy(value)


def apply_changes(data: dict, changes: Iterable[Change]) -> dict:
    """A deep copy of the mapping with the changes set."""
    out = copy.deepcopy(data)
    for path, value in changes:
        set_path(out, path, value)
    return out


def spec_with(spec: ReleaseSpec, changes: Iterable[Change]) -> ReleaseSpec:
    """The spec with the changes (validated: a bad value raises pydantic's ValidationError)."""
    return ReleaseSpec.model_validate(apply_changes(spec.model_dump(), changes))


def _text(v: Any) -> str:
    """A setting as one flow-style YAML line (also its label in the table)."""
    text = yaml.safe_dump(v, default_flow_style=True, width=10**6, sort_keys=False)
    return text.strip().removesuffix("\n...")


# ---------------------------------------------------------------- factors and candidates


@dataclass
class Factor:
    """A setting that may move: its path, the spec's own value, the levels to try and which way
    lowers disclosure risk (risk_down +1: a higher value, -1: a lower one, 0: not known)."""

    path: str
    own: Any
    levels: list[Any]
    numeric: bool
    why: Callable[[Any, Any], str]  # (own, value) -> the reason for the change
    risk_down: int = 0

    def reason(self, value: Any) -> str:
        return self.why(self.own, value)

    def ordered(self, toward: str | None = None) -> list[Any]:
        """The levels, nearest to the spec's own first; toward 'risk' (or 'utility') puts the
        nearest level in the direction that lowers risk (or spares the data) first, then the
        nearest the other way, then the rest alternating."""
        if not self.numeric:
            return list(self.levels)
        own = float(self.own)
        up = sorted((v for v in self.levels if v > own), key=float)
        down = sorted((v for v in self.levels if v < own), key=float, reverse=True)
        first = {TOWARD_RISK: self.risk_down, TOWARD_UTILITY: -self.risk_down}.get(toward or "", 0)
        a, b = (up, down) if first > 0 else (down, up)
        out = []
        for i in range(max(len(a), len(b))):
            out += [x[i] for x in (a, b) if i < len(x)]
        return out


@dataclass(frozen=True)
class Candidate:
    """Changes to the spec, each with its reason; origin 'spec', 'one-factor' or 'refine'."""

    changes: tuple[Change, ...]
    reasons: tuple[str, ...]
    origin: str = "one-factor"

    @property
    def key(self) -> tuple:
        return tuple(
            sorted((p, json.dumps(v, sort_keys=True, default=str)) for p, v in self.changes)
        )

    @property
    def label(self) -> str:
        if not self.changes:
            return "spec's own"
        return "; ".join(f"{p.removeprefix('stages.')}={_text(v)}" for p, v in self.changes)

    def with_change(self, path: str, value: Any, reason: str) -> Candidate:
        """This candidate with path set to value (replacing its own change of path)."""
        ch = [(p, v) for p, v in self.changes if p != path]
        rs = [r for (p, _), r in zip(self.changes, self.reasons, strict=True) if p != path]
        return Candidate((*ch, (path, value)), (*rs, reason), "refine")


def stage_does(spec: ReleaseSpec, stage: str, column: str = "", side: str = "upper") -> str:
    """What a stage does to the file, in its method's words and the spec's own units (the
    subject of every reason the tuner gives for a change of that stage's settings): the
    stage's own Describes.does."""
    cls = next((c for c in RELEASE_STAGES if c.name == stage), None)
    does = None if cls is None else cls.does(spec, column, side)
    if does is None:
        raise ValueError(f"no description of stage {stage!r}")
    return does


class _Factors:
    """The factors found so far and the spec they vary (add: a factor when its path is in
    the spec model and one of its levels validates)."""

    def __init__(self, spec: ReleaseSpec):
        self.spec, self.data = spec, spec.model_dump()
        self.out: list[Factor] = []

    def add(
        self,
        path: str,
        levels: list,
        numeric: bool,
        why: Callable[[Any, Any], str],
        risk_down: int = 0,
    ) -> None:
        if not has_path(self.data, path):
            return
        own = get_path(self.data, path)
        ok: list = []
        for v in levels:
            if v == own or v in ok:
                continue
            try:
                spec_with(self.spec, [(path, v)])
            except ValueError:  # pydantic ValidationError: outside the field's range
                continue
            ok.append(v)
        if ok:
            self.out.append(Factor(path, own, ok, numeric, why, risk_down))


def factors(spec: ReleaseSpec, original: pd.DataFrame | None = None) -> list[Factor]:
    """The factors of the enabled stages, in release order: only paths the spec model has,
    levels that validate (original: to find the numeric study variables for substrata)."""
    f = _Factors(spec)
    for cls in RELEASE_STAGES:
        if spec.stages.active(cls.name):
            for t in cls.tunables(spec, original):
                f.add(t.path, t.levels, t.numeric, t.why, t.risk_down)
    return f.out


def one_factor_candidates(facs: Sequence[Factor], toward: str | None = None) -> list[Candidate]:
    """One factor at a time: every level of every factor, round-robin over the factors, each
    factor's levels in Factor.ordered(toward) order (a short budget takes the nearest step of
    every factor before going further)."""
    out: list[Candidate] = []
    levels = [f.ordered(toward) for f in facs]
    for depth in range(max((len(x) for x in levels), default=0)):
        for f, lv in zip(facs, levels, strict=True):
            if depth < len(lv):
                out.append(Candidate(((f.path, lv[depth]),), (f.reason(lv[depth]),)))
    return out


# ---------------------------------------------------------------- evaluation


def gate_holds(g: Gate) -> bool:
    v = g.value
    if v is None or not np.isfinite(v):
        return False
    return (g.lower is None or v >= g.lower) and (g.upper is None or v <= g.upper)


def is_risk_gate(name: str) -> bool:
    return name.startswith("risk:") or name in RISK_GATES


class PrefixCache:
    """Stage results by the settings they depend on: a stage reads the spec's sections that are
    not stages and the sections of itself and of the stages before it, so candidates that
    differ only in later stages share the earlier results. Least recently used entries go
    first beyond max_entries or max_bytes (the frames an entry holds, counted per entry);
    thread-safe."""

    def __init__(self, original: pd.DataFrame, max_entries: int = 8, max_bytes: float = 1.5e9):
        self.original, self.max_entries, self.max_bytes = original, max_entries, max_bytes
        self._store: OrderedDict[str, tuple[StageResult, ...]] = OrderedDict()
        self._bytes: dict[str, int] = {}
        self._lock = threading.Lock()
        self._design: Any = None
        self.hits = 0

    def design(self, spec: ReleaseSpec) -> Any:
        with self._lock:
            if self._design is None:
                self._design = StageContext(self.original, spec).design
            return self._design

    def get(self, key: str) -> tuple[StageResult, ...] | None:
        with self._lock:
            r = self._store.get(key)
            if r is not None:
                self._store.move_to_end(key)
                self.hits += 1
            return r

    def put(self, key: str, results: tuple[StageResult, ...]) -> None:
        frames = {
            id(r.data): r.data
            for r in results
            if r.data is not None and r.data is not self.original  # held anyway
        }
        size = sum(int(f.memory_usage(index=True).sum()) for f in frames.values())
        if self.max_entries <= 0 or size > self.max_bytes:
            return
        with self._lock:
            self._store[key], self._bytes[key] = results, size
            self._store.move_to_end(key)
            while len(self._store) > self.max_entries or sum(self._bytes.values()) > self.max_bytes:
                old, _ = self._store.popitem(last=False)
                del self._bytes[old]


def _prefix_keys(spec: ReleaseSpec, names: Sequence[str], skip: Sequence[str] = ()) -> list[str]:
    d = spec.model_dump(mode="json")
    stages = d.pop("stages")
    base = json.dumps([d, sorted(skip)], sort_keys=True)
    return [
        base + json.dumps([(n, stages.get(n)) for n in names[: i + 1]], sort_keys=True)
        for i in range(len(names))
    ]


def run_pipeline(
    spec: ReleaseSpec,
    original: pd.DataFrame,
    cache: PrefixCache | None = None,
    skip: Sequence[str] = (),
) -> tuple[list[StageResult], list[str]]:
    """The spec's stages on the original, without Prefect and without replications (the stages
    named in skip left out, the last never); earlier stage results come from the cache when a
    candidate shares them. Also returns the report-only stages of this run: those that passed
    the frame on as it came and set no gate, no unpublished column and no design masking."""
    stages = build_stages(spec)
    stages = [s for s in stages[:-1] if s.name not in skip] + stages[-1:]
    ctx0 = StageContext(original, spec)
    if cache is not None:
        ctx0.__dict__["design"] = cache.design(spec)
    keys = _prefix_keys(spec, [s.name for s in stages], skip)
    results: list[StageResult] = []
    start = 0
    if cache is not None:
        for i in range(len(stages) - 2, -1, -1):
            hit = cache.get(keys[i])
            if hit is not None:
                results, start = list(hit), i + 1
                break
    df = results[-1].data if results else original
    passthrough = []
    for i in range(start, len(stages)):
        st = stages[i]
        with single_blas_thread():  # the release's bits (sdl_design.blas)
            r = st.run(
                df.copy() if i == start and start > 0 else df, ctx0.for_stage(st.name, results)
            )
        if r.data is df and not (r.gates or r.drop_public or r.masks_design):
            passthrough.append(st.name)
        results.append(r)
        df = r.data
        if cache is not None and i < len(stages) - 2:  # the last two are not shared
            cache.put(keys[i], tuple(results))
    return results, passthrough


def settings_of(spec: ReleaseSpec, paths: Iterable[str]) -> dict[str, str]:
    """The value of each path in the spec, as text ('' when absent)."""
    data = spec.model_dump()
    return {p: (_text(get_path(data, p)) if has_path(data, p) else "") for p in paths}


def evaluate(
    spec: ReleaseSpec,
    original: pd.DataFrame,
    changes: Sequence[Change] = (),
    cache: PrefixCache | None = None,
    paths: Iterable[str] = (),
    skip: Sequence[str] = (),
) -> dict[str, Any]:
    """Run the stage list of the changed spec (MASSC without replications, no figures) to the
    assessment; one row: the settings at `paths`, risk and utility metrics, risk_index,
    utility, the gates (passes_risk: every risk gate holds; passes_all: every gate holds), the
    report-only stages and the seconds taken. skip: report-only stages of the spec's own run
    (they change neither the frame nor a gate). A candidate that fails to run gets its error
    and passes nothing."""
    t0 = time.perf_counter()
    row: dict[str, Any] = {"changes": json.dumps([list(c) for c in changes], default=str)}
    try:
        cand = spec_with(spec, [*changes, *[c for c in EVAL_OVERRIDES if _has(spec, c[0])]])
        row.update(settings_of(cand, paths))
        with figures_off():
            results, passthrough = run_pipeline(cand, original, cache, skip)
    except Exception as e:  # noqa: BLE001 - a candidate that cannot run is a row, not a crash
        row.update(error=f"{type(e).__name__}: {e}", passes_risk=False, passes_all=False)
        row["seconds"] = time.perf_counter() - t0
        return row
    by = {r.name: r for r in results}
    assessed = next((r for c, r in described(results) if c.assesses), None)
    m = dict(assessed.metrics) if assessed is not None else {}
    measured = {  # the stages' own columns (Describes.tune_measures), NaN when one did not run
        col: by[c.name].metrics.get(metric, np.nan) if c.name in by else np.nan
        for c in RELEASE_STAGES
        for col, metric in c.tune_measures.items()
    }
    gates = [g for r in results for g in r.gates]
    risk = [g for g in gates if is_risk_gate(g.name)]
    failed = [g.name for g in gates if not gate_holds(g)]
    ratios = [g.value / g.upper for g in risk if g.upper]
    row.update(
        risk_index=max(ratios) if ratios else m.get("reid_share", np.nan),
        risk_ratios=json.dumps({g.name: g.value / g.upper for g in risk if g.upper}),
        risk_gates=json.dumps({g.name: [g.value, g.upper] for g in risk if g.upper}),
        **measured,
        utility=utility_score(m),
    )
    for c in [*RISK_COLUMNS, *UTILITY_COLUMNS]:
        if c not in row:
            row[c] = float(m.get(c, np.nan))
    row.update(
        passes_risk=all(gate_holds(g) for g in risk),
        passes_all=not failed,
        n_gates=len(gates),
        failed_gates="; ".join(failed),
        report_only=json.dumps(passthrough),
        error="",
        seconds=time.perf_counter() - t0,
    )
    row["assess_metrics"] = json.dumps(m, sort_keys=True)
    return row


def _has(spec: ReleaseSpec, path: str) -> bool:
    section = path.split(".")[1] if path.startswith("stages.") else None
    if section is not None and getattr(spec.stages, section, None) is None:
        return False
    return has_path(spec.model_dump(), path)


def utility_score(m: dict[str, float]) -> float:
    """overlap_median - share_abs_std_bias_gt2 (both on [0, 1]; higher is better)."""
    return float(m.get("overlap_median", np.nan)) - float(m.get("share_abs_std_bias_gt2", np.nan))


# ---------------------------------------------------------------- Pareto front and choice


def pareto_front(risk: Sequence[float], utility: Sequence[float]) -> np.ndarray:
    """True for the points no other point dominates (risk <= and utility >=, one strictly):
    sort by risk, then a running maximum of utility over strictly smaller risks. NaN: False."""
    r = np.asarray(risk, dtype=float)
    u = np.asarray(utility, dtype=float)
    ok = np.isfinite(r) & np.isfinite(u)
    out = np.zeros(len(r), dtype=bool)
    idx = np.flatnonzero(ok)
    if not len(idx):
        return out
    order = idx[np.lexsort((-u[idx], r[idx]))]
    rs, us = r[order], u[order]
    starts = np.r_[0, np.flatnonzero(np.diff(rs)) + 1]  # groups of equal risk
    gmax = np.maximum.reduceat(us, starts)  # best utility in each group
    before = np.r_[-np.inf, np.maximum.accumulate(gmax)[:-1]]  # best at strictly smaller risk
    size = np.diff(np.r_[starts, len(rs)])
    out[order] = (us == np.repeat(gmax, size)) & (us > np.repeat(before, size))
    return out


def _true(v: Any) -> bool:
    """A flag that is set (NaN, None: not set)."""
    return isinstance(v, bool | np.bool_) and bool(v)


def _failed(row: dict) -> bool:
    """The candidate did not run (an error text; '' or NaN when it ran)."""
    e = row.get("error")
    return isinstance(e, str) and e != ""


def _dominates_own(row: dict, own: dict | None) -> bool:
    if own is None:
        return False
    return bool(
        row.get("overlap_median", np.nan) >= own.get("overlap_median", np.nan)
        and row.get("share_abs_std_bias_gt2", np.nan) <= own.get("share_abs_std_bias_gt2", np.nan)
    )


def order_key(row: dict, own: dict | None = None) -> tuple:
    """Smaller is better: candidates passing every risk gate first (those passing every gate,
    then those no worse than the spec's own on overlap median and share beyond 2 SE, then by
    utility, overlap_p5, fewer changes); the others by risk_index, then utility."""
    n = len(json.loads(row.get("changes", "[]")))
    u = row.get("utility", np.nan)
    if _failed(row) or not np.isfinite(u):
        return (2, 0, 0, 0.0, 0.0, n)
    if _true(row.get("passes_risk")):
        p5 = row.get("overlap_p5", np.nan)
        return (
            0,
            int(not _true(row.get("passes_all"))),
            int(not _dominates_own(row, own)),
            -u,
            -p5 if np.isfinite(p5) else 0.0,
            n,
        )
    return (1, 0, 0, float(row.get("risk_index", np.inf)), -u, n)


def recommend(table: pd.DataFrame) -> int | None:
    """Index of the recommended row: the best by order_key among rows that pass every risk gate
    (own: the row with no change); None when none passes."""
    if not len(table):
        return None
    rows = table.to_dict("index")
    own = next((r for r in rows.values() if r.get("changes") == "[]"), None)
    ok = [i for i, r in rows.items() if _true(r.get("passes_risk")) and not _failed(r)]
    return min(ok, key=lambda i: order_key(rows[i], own)) if ok else None


# ---------------------------------------------------------------- refinement


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def _ratios(row: dict) -> dict[str, float]:
    return json.loads(row.get("risk_ratios") or "{}")


def _one_factor_line(
    evaluated: Sequence[tuple[Candidate, dict]], own: dict, own_x: float, path: str, x: float
) -> tuple[float, dict[str, float]] | None:
    """Slopes of utility and of each risk gate's share along one setting, from the two
    evaluated one-factor levels of it (the spec's own, own_x, included) nearest to x; None
    with fewer than two."""
    pts = {own_x: own}
    for c, r in evaluated:
        if len(c.changes) == 1 and c.changes[0][0] == path and _num(c.changes[0][1]) is not None:
            if not _failed(r) and np.isfinite(r.get("utility", np.nan)):
                pts[float(c.changes[0][1])] = r
    if len(pts) < 2:
        return None
    (v1, r1), (v2, r2) = sorted(pts.items(), key=lambda kv: abs(kv[0] - x))[:2]
    g1, g2 = _ratios(r1), _ratios(r2)
    slope_g = {g: (g2.get(g, g1[g]) - g1[g]) / (v2 - v1) for g in g1}
    return (r2["utility"] - r1["utility"]) / (v2 - v1), slope_g


def refine_candidates(
    evaluated: Sequence[tuple[Candidate, dict]], facs: Sequence[Factor]
) -> list[Candidate]:
    """Candidates not evaluated yet around the best so far (order_key), a pattern search:

    - combinations: the best one-factor level of each other factor added to the best;
    - moves: each numeric setting of the best one grid level further from the spec's own;
    - bisection: midpoints between each numeric setting of the best and the nearest evaluated
      values of that setting on either side.

    Combinations and moves are ranked by a first-order prediction (one-factor effects on
    utility and on each risk gate's share of its limit add; a move follows the line through
    the two nearest one-factor levels of its setting): those predicted to beat the best first,
    best predicted first; then the midpoints; then the rest."""
    own = next((r for c, r in evaluated if not c.changes), None)
    ranked = sorted(evaluated, key=lambda cr: order_key(cr[1], own))
    if not ranked or own is None:
        return []
    best, brow = ranked[0]
    fac = {f.path: f for f in facs}
    changed = {p for p, _ in best.changes}
    b_ratio, o_ratio = _ratios(brow), _ratios(own)
    b_u, o_u = brow.get("utility", np.nan), own.get("utility", np.nan)
    b_pass = _true(brow.get("passes_risk"))
    b_max = max(b_ratio.values(), default=np.inf)

    def predicted(du: float, dg: dict[str, float]) -> tuple[tuple, bool]:
        pu = b_u + du
        pmax = max((v + dg.get(g, 0.0) for g, v in b_ratio.items()), default=np.inf)
        ok = pmax <= 1.0
        better = (ok and pu > b_u) if b_pass else pmax < b_max
        return ((0, -pu) if ok else (1, pmax, -pu)), better

    scored = []  # (key, better, candidate)
    done: set[str] = set()
    ofat = [
        (c, r)
        for c, r in evaluated
        if c.origin == "one-factor" and len(c.changes) == 1 and c.changes[0][0] not in changed
        if not _failed(r) and np.isfinite(r.get("utility", np.nan))
    ]
    for c, r in sorted(
        ofat,
        key=lambda cr: predicted(
            cr[1]["utility"] - o_u,
            {g: v - o_ratio.get(g, 0.0) for g, v in _ratios(cr[1]).items()},
        )[0],
    ):
        path, value = c.changes[0]
        if path in done:  # the best level of each factor only
            continue
        done.add(path)
        dg = {g: v - o_ratio.get(g, 0.0) for g, v in _ratios(r).items()}
        key, better = predicted(r["utility"] - o_u, dg)
        scored.append((key, better, best.with_change(path, value, c.reasons[0])))
    mids = []
    for path, v in best.changes:
        x, f = _num(v), fac.get(path)
        if x is None or f is None or not f.numeric:
            continue
        own_x = float(f.own)
        grid = sorted({float(g) for g in f.levels} | {own_x})
        beyond = [g for g in grid if (g > x if x > own_x else g < x)]
        if beyond and x != own_x:
            nxt = min(beyond) if x > own_x else max(beyond)
            line = _one_factor_line(evaluated, own, own_x, path, x)
            du, dg = (
                (0.0, {})
                if line is None
                else (line[0] * (nxt - x), {g: s * (nxt - x) for g, s in line[1].items()})
            )
            key, better = predicted(du, dg)
            move = best.with_change(path, nxt, f.reason(nxt) + " (one level beyond)")
            scored.append((key, better and line is not None, move))
        tried = {own_x} | {
            float(val)
            for c, _ in evaluated
            for p, val in c.changes
            if p == path and _num(val) is not None
        }
        for side in ([t for t in tried if t < x], [t for t in tried if t > x]):
            if side:
                nb = max(side) if side[0] < x else min(side)
                m = round((x + nb) / 2, 6)
                if m not in (x, nb):
                    mids.append(
                        best.with_change(path, m, f.reason(m) + " (between evaluated levels)")
                    )
    scored.sort(key=lambda t: t[0])
    first = [c for _, better, c in scored if better]
    rest = [c for _, better, c in scored if not better]
    seen = {c.key for c, _ in evaluated}
    out = []
    for c in [*first, *mids, *rest]:
        if c.key not in seen:
            seen.add(c.key)
            out.append(c)
    return out


# ---------------------------------------------------------------- the search


@dataclass
class TuneResult:
    """Every candidate and its row (in evaluation order), the factors and the recommended
    index (None when no candidate passes every risk gate)."""

    candidates: list[Candidate]
    table: pd.DataFrame
    factors: list[Factor]
    recommended: int | None
    seconds: float
    extra: dict = field(default_factory=dict)


def search(
    spec: ReleaseSpec,
    original: pd.DataFrame,
    budget: int = 24,
    run_batch: Callable[[list[Candidate], Sequence[str]], list[dict]] | None = None,
    batch: int = 1,
    on_row: Callable[[int, Candidate, dict], None] | None = None,
) -> TuneResult:
    """At most `budget` evaluations: the spec's own setting; one factor at a time (the nearest
    levels in the direction that lowers risk when the spec's own fails a risk gate, else in the
    direction that spares the data), about two thirds of the budget and at least one level of
    every factor when the budget allows; then refinement around the best (refine_candidates),
    recomputed after every batch; one-factor levels left over when refinement runs dry.
    run_batch(candidates, skip) evaluates a list of candidates (default: here, one after the
    other, sharing earlier stage results), `batch` at a time; skip: the report-only stages of
    the spec's own run, left out for the other candidates."""
    t0 = time.perf_counter()
    facs = factors(spec, original)
    paths = [f.path for f in facs]
    cache = PrefixCache(original)
    if run_batch is None:

        def run_batch(cands: list[Candidate], skip: Sequence[str]) -> list[dict]:
            return [evaluate(spec, original, c.changes, cache, paths, skip) for c in cands]

    budget, batch = max(1, int(budget)), max(1, int(batch))
    evaluated: list[tuple[Candidate, dict]] = []

    def run(cands: list[Candidate]) -> None:
        for i in range(0, len(cands), batch):
            part = cands[i : i + batch]
            for c, r in zip(part, run_batch(part, skip), strict=True):
                r = {"candidate": c.label, "origin": c.origin, **r}
                evaluated.append((c, r))
                if on_row is not None:
                    on_row(len(evaluated), c, r)

    own = Candidate((), (), "spec")
    skip: list[str] = []
    run([own])
    skip = json.loads(evaluated[0][1].get("report_only") or "[]")
    toward = TOWARD_UTILITY if _true(evaluated[0][1].get("passes_risk")) else TOWARD_RISK
    ofat = one_factor_candidates(facs, toward)
    n_ofat = min(len(ofat), max(min(len(facs), budget - 2), (2 * (budget - 1) + 2) // 3))
    n_ofat = min(n_ofat, budget - 1)
    run(ofat[:n_ofat])
    while len(evaluated) < budget:
        new = refine_candidates(evaluated, facs)
        if not new:
            new = [c for c in ofat[n_ofat:] if c.key not in {e.key for e, _ in evaluated}]
            if not new:
                break
        run(new[: min(budget - len(evaluated), batch)])
    table = pd.DataFrame([r for _, r in evaluated])
    nan = pd.Series(np.nan, index=table.index)
    table["pareto"] = pareto_front(table.get("risk_index", nan), table.get("utility", nan))
    return TuneResult(
        candidates=[c for c, _ in evaluated],
        table=table,
        factors=facs,
        recommended=recommend(table),
        seconds=time.perf_counter() - t0,
        extra={"toward": toward, "n_one_factor": n_ofat, "skipped": skip, "cache_hits": cache.hits},
    )


# ---------------------------------------------------------------- the recommended YAML


def _strip_comment(line: str) -> str:
    """The line without a trailing comment (a '#' after a blank, outside quotes)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1] in " \t"):
            return line[:i].rstrip()
    return line.rstrip()


def _find(node: yaml.Node, key: str) -> tuple[yaml.Node, yaml.Node] | None:
    """The (key, value) pair of a mapping node; a top-coding column also under 'columns'."""
    if not isinstance(node, yaml.MappingNode):
        return None
    for k, v in node.value:
        if k.value == key:
            return k, v
    cols = next((v for k, v in node.value if k.value == "columns"), None)
    return _find(cols, key) if cols is not None else None


def _locate(root: yaml.Node, path: str) -> tuple[list[str], tuple | None]:
    """The keys of the path the YAML has (from the top) and the (key, value) node pair of the
    deepest one."""
    node, matched, pair = root, [], None
    for key in path.split("."):
        hit = _find(node, key)
        if hit is None:
            break
        pair, node = hit, hit[1]
        matched.append(key)
    return matched, pair


def _last_line(node: yaml.Node) -> int:
    """The last line a value node's text is on."""
    if isinstance(node, yaml.CollectionNode) and not node.flow_style and node.value:
        last = node.value[-1]
        return _last_line(last[1] if isinstance(node, yaml.MappingNode) else last)
    end = node.end_mark
    return end.line - 1 if end.column == 0 and end.line > node.start_mark.line else end.line


def _replace_value(lines: list[str], k: yaml.Node, v: yaml.Node, text: str) -> int:
    """Write text as the value of key node k (its old value v, block or flow, gone); returns
    the line of the key."""
    line = k.start_mark.line
    last = _last_line(v)
    if v.start_mark.line == line and last == line:  # on the key's line: replace the span
        s = lines[line]
        lines[line] = s[: v.start_mark.column] + text + s[v.end_mark.column :]
    else:  # a block value (or a flow one over several lines): the key line carries it
        tail = lines[last][v.end_mark.column :] if v.end_mark.line == last else ""
        lines[line] = lines[line][: k.end_mark.column] + ": " + text + tail
        del lines[line + 1 : last + 1]
    return line


_MARK = "@@tune{}@@"


def _mark(lines: list[str], line: int, i: int) -> None:
    s = lines[line]
    if "@@tune" in s:
        lines[line] = s.rstrip() + " " + _MARK.format(i)
    else:
        lines[line] = _strip_comment(s) + "  # " + _MARK.format(i)


def recommended_yaml(
    spec_text: str, changes: Sequence[Change], reasons: Sequence[str], header: str = ""
) -> str:
    """The spec's YAML with each changed setting rewritten in place (flow style) and a trailing
    comment on its line saying why (the old comment of that line gives way); every other line
    kept as it is. A setting the YAML does not have yet is added as the first entry of its
    (block) section, or its nearest (flow) section is rewritten. header: comment lines on top.
    The result is checked: it loads to the original mapping with the changes."""
    data = yaml.safe_load(spec_text)
    want = apply_changes(data, changes)
    lines = spec_text.split("\n")
    notes: list[str] = []
    for (path, value), why in zip(changes, reasons, strict=True):
        text = "\n".join(lines)
        root = yaml.compose(text)
        keys = path.split(".")
        matched, pair = _locate(root, path)
        if len(matched) == len(keys):  # written: replace the value
            line = _replace_value(lines, pair[0], pair[1], _text(value))
            notes.append(f"tuned (was {_text(get_path(data, path))}): {why}")
        elif (
            len(keys) == len(matched) + 1
            and isinstance(pair[1], yaml.MappingNode)
            and not pair[1].flow_style
            and pair[1].value
        ):  # a new entry of a block section: its first line
            first = pair[1].value[0][0]
            line = first.start_mark.line
            lines.insert(line, " " * first.start_mark.column + f"{keys[-1]}: {_text(value)}")
            notes.append(f"tuned (added): {why}")
        elif matched:  # a flow section: rewrite it whole
            now = apply_changes(yaml.safe_load(text), [(path, value)])
            line = _replace_value(lines, pair[0], pair[1], _text(get_path(now, ".".join(matched))))
            notes.append(f"tuned: {why}")
        else:
            raise ValueError(f"{path}: the YAML has no section to write it in")
        _mark(lines, line, len(notes) - 1)
    for j, s in enumerate(lines):
        if "@@tune" in s:
            ids = [int(x) for x in re.findall(r"@@tune(\d+)@@", s)]
            head = s[: s.index("# @@tune")].rstrip()
            lines[j] = head + "  # " + "; ".join(notes[i] for i in ids)
    out = "\n".join(lines)
    if header:
        out = "".join(f"# {h}\n" for h in header.splitlines()) + out
    if yaml.safe_load(out) != want:
        raise ValueError("the rewritten YAML does not load to the changed spec")
    return out


def redact_seed(spec_text: str) -> str:
    """The spec's YAML with release.seed's value removed (null, and a comment that says to set
    it): a recommended spec is shared, and the seed orders and draws every treatment."""
    matched, pair = _locate(yaml.compose(spec_text), "release.seed")
    if len(matched) < 2 or pair is None:
        return spec_text
    lines = spec_text.split("\n")
    line = _replace_value(lines, pair[0], pair[1], "null")
    lines[line] = (
        lines[line].split("#")[0].rstrip()
        + "  # set your release seed here: it is confidential, never in a shared file"
    )
    return "\n".join(lines)


# ---------------------------------------------------------------- what the numbers are


@dataclass(frozen=True)
class RiskTerm:
    """A risk gate in words: short (a progress line), what it measures (the metric it reads)
    and the spec field of its limit."""

    short: str
    what: str
    limit: str


RISK_TERMS = {
    "prb.max_identification_risk": RiskTerm(
        "PRB identification risk",
        "PRB's largest exact identification risk of a record (prb.max_identification_risk, "
        "eq. 2.2 of Zhang and Nayak)",
        "stages.prb.xi",
    ),
    "massc.delta": RiskTerm(
        "MASSC delta",
        "MASSC's post-treatment risk delta of the treated keys (massc.delta, Singh eq. 5-6)",
        "gates.delta_max",
    ),
    "risk: share of original sample uniques re-identified (worst exact-match attack)": RiskTerm(
        "re-identified uniques",
        "the share of the original's sample uniques re-identified by the worst exact-match "
        "attack on the published file (reid_share_worst)",
        "gates.xi",
    ),
    "risk: delta (MASSC) of the published file against the original keys": RiskTerm(
        "published delta",
        "MASSC's delta of the published file against the original keys (delta_published)",
        "gates.delta_max",
    ),
    "risk: share of original PSUs given away by replicate-weight zero patterns": RiskTerm(
        "PSUs given away",
        "the share of original PSUs given away by replicate-weight zero patterns (psu_recoverable)",
        "gates.max_psu_recoverable",
    ),
    "risk: share of published records unique on the intruder's key": RiskTerm(
        "unique share",
        "the share of published records unique on the intruder's key (unique_share_published)",
        "gates.max_unique_share",
    ),
}

RISK_AXIS = (
    "risk index = the largest value / limit over the risk gates (at most 1: every risk gate "
    "holds; 1: a gate at its limit)"
)
UTILITY_AXIS = (
    "utility = the median CI overlap (Karr) of the domain estimates minus the share of them "
    "more than 2 original SEs off (1: no damage; the damage is 1 - utility)"
)


def risk_term(name: str) -> RiskTerm:
    """The words of a risk gate (a gate not in RISK_TERMS: its own name)."""
    return RISK_TERMS.get(name) or RiskTerm(name.removeprefix("risk: "), name, "its limit")


def risk_gates(row: Mapping[str, Any]) -> list[tuple[str, float, float]]:
    """The risk gates of a candidate's row as (name, value, limit), the largest share of its
    limit first (the one that sets risk_index)."""
    text = row.get("risk_gates")
    gates = json.loads(text) if isinstance(text, str) and text else {}
    out = [(n, float(v), float(u)) for n, (v, u) in gates.items() if u]
    return sorted(out, key=lambda g: -g[1] / g[2])


def binding_text(row: Mapping[str, Any]) -> str:
    """The risk gate that sets a row's risk index, briefly: 'PRB identification risk 0.391 /
    stages.prb.xi 0.395' ('' when the row has none)."""
    gates = risk_gates(row)
    if not gates:
        return ""
    name, v, u = gates[0]
    term = risk_term(name)
    return f"{term.short} {v:.4f} / {term.limit} {u:.4g}"


def axis_lines(own: Mapping[str, Any] | None = None) -> list[str]:
    """What the two numbers of a candidate are, for the console: the risk index with every
    risk gate of the spec's own row (its value, its limit and their ratio), and utility."""
    lines = [RISK_AXIS + "; for the spec's own setting:"]
    for name, v, u in risk_gates({} if own is None else own):
        term = risk_term(name)
        lines.append(f"  {v / u:.4f} = {term.what}: {v:.4f} of its limit {term.limit} = {u:.4g}")
    if len(lines) == 1:  # no risk gate with a limit: evaluate falls back on the share itself
        lines[0] = (
            "risk index = the share of the original's sample uniques re-identified "
            "(reid_share): no risk gate has a limit"
        )
    return [*lines, UTILITY_AXIS]


def map_note(table: pd.DataFrame) -> str:
    """The line under the map: which risk gate sets the risk index, for how many candidates."""
    counts: dict[str, int] = {}
    for _, row in table.iterrows():
        gates = risk_gates(row)
        if gates:
            counts[gates[0][0]] = counts.get(gates[0][0], 0) + 1
    parts = [
        f"{risk_term(n).short} / {risk_term(n).limit} ({k} of {len(table)})"
        for n, k in sorted(counts.items(), key=lambda kv: -kv[1])
    ]
    return "Risk index = the largest value / limit over the risk gates; set by " + (
        ", ".join(parts) if parts else "no gate with a limit"
    )


def _change_text(path: str, value: Any, own: Any) -> str:
    """One change, short: a section shows only the settings that differ from the spec's own,
    a list that only grows shows what it adds."""
    name = path.removeprefix("stages.")
    if isinstance(value, dict) and isinstance(own, dict):
        return "; ".join(
            _change_text(f"{name}.{k}", v, own.get(k))
            for k, v in value.items()
            if k not in own or v != own[k]
        )
    if isinstance(value, list) and isinstance(own, list) and all(x in value for x in own):
        added = [x for x in value if x not in own]
        if added and len(value) == len(own) + len(added):
            return f"{name} + {_text(added)}"
    return f"{name}={_text(value)}"


def short_labels(table: pd.DataFrame, n: int = 56) -> list[str]:
    """Each candidate's changes in at most n characters (the map's table)."""
    own = table[table["changes"] == "[]"]
    out = []
    for _, row in table.iterrows():
        changes = json.loads(row["changes"])
        if not changes:
            out.append("spec's own")
            continue
        parts = []
        for path, value in changes:
            text = own[path].iloc[0] if len(own) and path in own.columns else None
            try:
                before = yaml.safe_load(text) if isinstance(text, str) else None
            except yaml.YAMLError:
                before = None
            parts.append(_change_text(path, value, before))
        label = "; ".join(parts)
        out.append(label if len(label) <= n else label[: n - 1] + "…")
    return out


# ---------------------------------------------------------------- the Duncan map


def risk_utility_map(
    table: pd.DataFrame, recommended: int | None = None, title: str = "", dpi: int = 110
) -> bytes:
    """PNG of the Duncan risk-utility map (sdl_design.plots.risk_utility_map): risk_index
    against utility, each candidate numbered as its row in candidates.csv (from 1) and listed
    by number beside the map, the gate that sets the risk index said under it."""

    return draw(table, short_labels(table), recommended, title, map_note(table), dpi)


def change_reasons(result: TuneResult, index: int) -> list[str]:
    """The reasons of the recommended candidate's changes, each with what the change did alone
    (its one-factor row against the spec's own) when it was run alone."""
    t = result.table
    cand = result.candidates[index]
    own = t[t["changes"] == "[]"]
    out = []
    for (path, value), why in zip(cand.changes, cand.reasons, strict=True):
        alone = t[t["changes"] == json.dumps([[path, value]], default=str)]
        if len(own) and len(alone):
            a, o = alone.iloc[0], own.iloc[0]
            why += (
                f"; alone: overlap median {o['overlap_median']:.3f} -> {a['overlap_median']:.3f}, "
                f"risk index {o['risk_index']:.3f} -> {a['risk_index']:.3f}"
            )
        out.append(why)
    return out


def finite(x: Any) -> bool:
    try:
        return math.isfinite(float(x))
    except (TypeError, ValueError):
        return False
