"""The release attacks its own public file: the intruder's key, exact and nearest-neighbour
matching against the original record by record, and the measures a disclosure board knows
from sdcMicro (k-anonymity, l-diversity, Benedetti-Franconi individual risk)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
from pandas.api.types import union_categoricals

from sdl_design.codes import factorize
from sdl_design.keys import bin_codes, coarsen
from sdl_design.spec import KeySpec, ReleaseSpec
from sdl_design.survey.design import dense_codes

# pairs (original record, published record in its key cell) the nearest-neighbour attack
# compares at most; past this it attacks the records of the smallest cells and says how many
NN_PAIRS_MAX = 20_000_000
NN_PAIRS_BLOCK = 1 << 21  # the pairs held at once


@dataclass
class IntruderKey:
    """What the intruder is assumed to know of a published record (the report lists it)."""

    keys: list[KeySpec]  # the declared keys, in their published coding
    known: list[str]  # other published columns an intruder may know (household size, ...)
    design: list[str]  # published design labels (pseudo strata, PSUs); empty when not known
    unknown: dict[str, str] = field(default_factory=dict)  # published, not in the key: why
    continuous: list[str] = field(default_factory=list)  # known: nearest-neighbour attack
    # published continuous columns an intruder is not assumed to know (sensitive or declared
    # unknown, and the weight): the informed intruder's nearest-neighbour attack, reported,
    # not gated
    informed: list[str] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)  # published design labels, known or not

    @property
    def columns(self) -> list[str]:
        return [k.name for k in self.keys] + self.known

    def describe(self) -> list[str]:
        """One line per part of the key, for the report and the public README."""
        coded = [
            f"{k.name} ({'bins' if k.bins is not None else 'map' if k.map else 'as published'})"
            for k in self.keys
        ]
        out = [f"declared keys: {', '.join(coded)}"]
        if self.known:
            out.append(f"other published columns an intruder may know: {', '.join(self.known)}")
        if self.design:
            out.append(f"published design labels: {', '.join(self.design)}")
        out += [f"not in the key: {c} ({why})" for c, why in self.unknown.items()]
        if self.continuous:
            out.append(
                f"continuous, matched by nearest neighbour within a key match: "
                f"{', '.join(self.continuous)}"
            )
        return out


def intruder_key(
    spec: ReleaseSpec,
    published: pd.DataFrame,
    design_labels: Sequence[str] = (),
    weights: Sequence[str] = (),
    original_labels: bool = False,
) -> IntruderKey:
    """The intruder's key of a published file: the declared keys at their published values,
    every other published column with at most intruder.max_levels values (any text column),
    and the published design labels, except what spec.intruder declares unknown (with why).
    Weights (weights: the weight and replicate weights) are never in it; sensitive variables
    are what the intruder seeks; numeric columns with more values are matched by nearest
    neighbour. original_labels: the published design labels are the original ones (places an
    intruder knows), in the key whatever intruder.design_labels_unknown says."""
    d, v, it = spec.design, spec.variables, spec.intruder
    skip = {d.weight, *weights, *design_labels, *v.key_names}
    sensitive = {s.name for s in v.sensitive}
    known, unknown, continuous, informed = [], {}, [], []
    for c in published.columns:
        c = str(c)
        if c in skip or c.startswith("__"):
            continue
        s = published[c]
        numeric = pd.api.types.is_numeric_dtype(s) and not pd.api.types.is_bool_dtype(s)
        few = s.nunique(dropna=False) <= it.max_levels
        if c in it.unknown or c in sensitive:
            unknown[c] = it.unknown.get(c) or "sensitive: what the intruder seeks"
            if numeric and not few:
                informed.append(c)
        elif not numeric or few:
            known.append(c)
        else:
            continuous.append(c)
    design = [c for c in design_labels if c in published.columns]
    if design and it.design_labels_unknown and not original_labels:
        for c in design:
            unknown[c] = it.design_labels_unknown
        design = []
    labels = [c for c in design_labels if c in published.columns]
    if d.weight in published.columns:  # an insider holding the original weights
        informed.append(d.weight)
    return IntruderKey(list(v.keys), known, design, unknown, continuous, informed, labels)


# ---------------------------------------------------------------- profiles


def compact_columns(df: pd.DataFrame) -> pd.DataFrame:
    """The columns the attacks read, held small with the same values: text as categories (1-2
    byte codes), integers in the smallest integer type holding them. At 15M records the two
    files' 17 columns took 4.9 GB as read (text 13-16 bytes a record, integers 8)."""
    out = {}
    for c in df.columns:
        s = df[c]
        if s.dtype == object or isinstance(s.dtype, pd.StringDtype):
            cat = pd.Categorical(s)  # categories as objects: every partition's of one type
            cats = pd.Index(np.asarray(cat.categories, dtype=object), dtype=object)
            s = pd.Series(pd.Categorical.from_codes(cat.codes, cats), index=s.index, name=c)
        elif isinstance(s.dtype, np.dtype) and s.dtype.kind in "iu" and len(s):
            bound = max(-int(s.min()), int(s.max()) + 1)
            s = s.astype(np.min_scalar_type(-bound))  # a signed type holding -bound..bound-1
        out[c] = s
    return pd.DataFrame(out, index=df.index)


def concat_columns(frames: Sequence[pd.DataFrame]) -> pd.DataFrame:
    """Partitions' compact_columns end to end (index 0..n-1): a text column's categories
    united (pd.concat would turn categories that differ into one object per record)."""
    out = {}
    for c in frames[0].columns:
        pieces = [f[c] for f in frames]
        if all(isinstance(p.dtype, pd.CategoricalDtype) for p in pieces):
            try:
                out[c] = pd.Series(union_categoricals([p.array for p in pieces], ignore_order=True))
                continue
            except TypeError:  # categories of different types: one object column
                pieces = [p.astype(object) for p in pieces]
        out[c] = pd.concat(pieces, ignore_index=True)
    return pd.DataFrame(out, columns=frames[0].columns)


def _category_codes(original: pd.Series, released: pd.Series, key: KeySpec | None) -> tuple:
    """_codes of two categorical columns from their categories alone (a key's map applied to
    them): None when their categories are of different types."""
    try:
        both = union_categoricals([original.array, released.array], ignore_order=True)
    except TypeError:
        return None
    values = pd.Series([*both.categories.astype(object), np.nan], dtype=object)
    if key is not None and key.map:
        values = coarsen(values, None, key.map)
    table = factorize(values, use_na_sentinel=False)[0]  # the last: a missing value's code
    c = table[both.codes]  # code -1 (missing) reads the last
    return c[: len(original)], c[len(original) :]


def _codes(original: pd.Series, released: pd.Series, key: KeySpec | None) -> tuple:
    """Both files' values of one column as codes into one category list (a key in its
    published coding; a missing value a category of its own)."""
    if key is not None and key.bins is not None:
        return bin_codes(original, key.bins), bin_codes(released, key.bins)
    categorical = [isinstance(s.dtype, pd.CategoricalDtype) for s in (original, released)]
    if all(categorical):
        got = _category_codes(original, released, key)
        if got is not None:
            return got
    both = pd.concat([original, released], ignore_index=True)
    if key is not None and key.map:
        both = coarsen(both.astype(object), None, key.map)
    if isinstance(both.dtype, pd.CategoricalDtype):
        both = both.astype(object)
    try:
        c = factorize(both, use_na_sentinel=False)[0]
    except TypeError:
        c = factorize(both.astype(str).where(both.notna()), use_na_sentinel=False)[0]
    return c[: len(original)], c[len(original) :]


def profiles(
    original: pd.DataFrame,
    released: pd.DataFrame,
    columns: Sequence[str],
    keys: Mapping[str, KeySpec] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Each record's key profile (one integer, equal across files when every column's value is
    equal in the published coding) for the original and the released file."""
    keys = keys or {}
    if not columns:
        return np.zeros(len(original), dtype=np.int64), np.zeros(len(released), dtype=np.int64)
    return combine(*(_codes(original[c], released[c], keys.get(c)) for c in columns))


def design_profiles(
    original_labels: pd.DataFrame, released_labels: pd.DataFrame, link: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The published design labels as the intruder who knows the map from geography to them
    reads them: each original design cell (its strata and PSU labels) takes the published
    labels most of its published records carry (the map a few known respondents give away);
    a cell with no published record matches nothing. Returns (original, released) codes."""
    by = {"sort": True, "dropna": False, "observed": True}
    oc = original_labels.groupby(list(original_labels.columns), **by).ngroup()
    oc = oc.to_numpy(dtype=np.int64)
    rc = released_labels.groupby(list(released_labels.columns), **by).ngroup()
    rc = rc.to_numpy(dtype=np.int64)
    n_rc = int(rc.max(initial=-1)) + 1
    pair = oc[link] * n_rc + rc  # (original cell, published cell) of each published record
    u, n = np.unique(pair, return_counts=True)
    cell, pub = u // n_rc, u % n_rc
    order = np.lexsort((-n, cell))  # per original cell, its most frequent published cell first
    first = order[np.r_[True, cell[order][1:] != cell[order][:-1]]]
    mapped = np.full(int(oc.max(initial=-1)) + 1, -1, dtype=np.int64)
    mapped[cell[first]] = pub[first]
    return mapped[oc], rc


def combine(*pairs: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Profiles of several parts of a key (codes, -1 missing or unmatched) combined into one
    (original, released): equal exactly where every part is equal."""
    po = np.zeros(len(pairs[0][0]), dtype=np.int64)
    pr = np.zeros(len(pairs[0][1]), dtype=np.int64)
    for a, b in pairs:
        m = int(max(a.max(initial=-1), b.max(initial=-1))) + 2  # -1 -> 0
        both = dense_codes(np.concatenate([po * m + a + 1, pr * m + b + 1]))[1]
        po, pr = both[: len(po)], both[len(po) :]
    return po, pr


# ---------------------------------------------------------------- attacks


def exact_match(po: np.ndarray, pr: np.ndarray, link: np.ndarray) -> dict[str, float]:
    """The exact-match attack: the intruder takes each sample unique of the original (its
    profile once in the original file) and claims the published record when exactly one has
    its profile. link[r]: the original record (position) of published record r. Returns the
    share of the sample uniques re-identified correctly, the precision of the claims, their
    counts and the share of published records unique on the key."""
    G = int(max(po.max(initial=-1), pr.max(initial=-1))) + 1
    n_o = np.bincount(po, minlength=G)
    F = np.bincount(pr, minlength=G)
    holder = np.full(G, -1, dtype=np.int64)
    holder[pr] = np.arange(len(pr))  # for F == 1: the one published record of the profile
    uniques = np.flatnonzero(n_o[po] == 1)
    claimed = uniques[F[po[uniques]] == 1]
    correct = link[holder[po[claimed]]] == claimed
    n_u, n_c, n_ok = len(uniques), len(claimed), int(correct.sum())
    return {
        "sample_uniques": float(n_u),
        "claimed": float(n_c),
        "correct": float(n_ok),
        "share": n_ok / n_u if n_u else 0.0,
        "precision": n_ok / n_c if n_c else 0.0,
        "unique_share_published": float((F[pr] == 1).mean()) if len(pr) else 0.0,
    }


def nearest_neighbour(
    po: np.ndarray,
    pr: np.ndarray,
    link: np.ndarray,
    xo: np.ndarray,
    xr: np.ndarray,
    max_pairs: int = NN_PAIRS_MAX,
) -> dict[str, float]:
    """The nearest-neighbour attack: each original record whose key profile some published
    record has is linked to the published record of that profile nearest on the continuous
    values (standardized by the original's SD; a missing value is far). Returns the share of
    the original records linked correctly, the precision of the links and the share of the
    original records attacked (all, unless the pairs exceed max_pairs: the smallest cells)."""
    if xo.shape[1] == 0 or len(po) == 0:
        return {"share": 0.0, "precision": 0.0, "attacked": 0.0}
    mu, sd = standardizing(xo)
    zo_t, zr_t = standardized_t(xo, mu, sd, 1e6), standardized_t(xr, mu, sd, -1e6)
    return nearest_links(po, pr, link, zo_t, zr_t, max_pairs)


def standardizing(xo: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The original's column means and SDs (an SD of 0 or NaN read as 1)."""
    sd = np.nanstd(xo, axis=0)
    sd[~(sd > 0)] = 1.0
    return np.nanmean(xo, axis=0), sd


def standardized_t(x: np.ndarray, mu: np.ndarray, sd: np.ndarray, far: float) -> np.ndarray:
    """(x - mu) / sd a column at a time into rows (columns x records; a missing value far)."""
    z = np.empty((x.shape[1], x.shape[0]))
    for j in range(x.shape[1]):
        np.subtract(x[:, j], mu[j], out=z[j])
        z[j] /= sd[j]
    return np.nan_to_num(z, nan=far, copy=False)


def nearest_links(
    po: np.ndarray,
    pr: np.ndarray,
    link: np.ndarray,
    zo_t: np.ndarray,
    zr_t: np.ndarray,
    max_pairs: int = NN_PAIRS_MAX,
) -> dict[str, float]:
    """nearest_neighbour on standardized values held as rows (standardized_t)."""
    n = len(po)
    if n == 0:
        return {"share": 0.0, "precision": 0.0, "attacked": 0.0}
    G = int(max(po.max(initial=-1), pr.max(initial=-1))) + 1
    F = np.bincount(pr, minlength=G)
    rord = np.argsort(pr, kind="stable")
    start = np.r_[0, np.cumsum(F)[:-1]]
    cand = np.flatnonzero(F[po] > 0)
    size = F[po[cand]]
    if size.sum() > max_pairs:  # the records of the smallest cells first
        keep = np.argsort(size, kind="stable")
        keep = keep[np.cumsum(size[keep]) <= max_pairs]
        cand = np.sort(cand[keep])
        size = F[po[cand]]
    # the pairs a block of original records at a time (each record's pairs in one block): at
    # 20M pairs the whole set's arrays took 1.1 GB at once
    bounds = _pair_blocks(size, NN_PAIRS_BLOCK)
    n_linked = n_att = 0
    for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
        linked = _nearest_links(cand[a:b], size[a:b], po, start, rord, link, zo_t, zr_t)
        n_linked, n_att = n_linked + int(linked.sum()), n_att + len(linked)
    return {
        "share": n_linked / n,
        "precision": n_linked / n_att if n_att else 0.0,
        "attacked": n_att / n,
    }


def _pair_blocks(size: np.ndarray, most: int) -> np.ndarray:
    """Bounds of consecutive blocks of original records (size: each one's pairs) holding at
    most `most` pairs each (a record with more: a block alone)."""
    bounds, a, n = [0], 0, len(size)
    ends = np.cumsum(size)
    while a < n:
        base = ends[a - 1] if a else 0
        b = max(a + 1, int(np.searchsorted(ends, base + most, side="right")))
        bounds.append(min(b, n))
        a = bounds[-1]
    return np.array(bounds)


def _nearest_links(
    cand: np.ndarray,
    size: np.ndarray,
    po: np.ndarray,
    start: np.ndarray,
    rord: np.ndarray,
    link: np.ndarray,
    zo_t: np.ndarray,
    zr_t: np.ndarray,
) -> np.ndarray:
    """For original records cand (each with size published records of its profile) whether
    the nearest of those (ties: the first row) is its own published record."""
    i = np.repeat(cand, size)  # the pairs, grouped by original record (cand ascending)
    lo = np.cumsum(size) - size  # each group's first pair
    r = rord[np.repeat(start[po[cand]] - lo, size) + np.arange(len(i))]  # rows ascending
    dist, d = np.zeros(len(i)), np.empty(len(i))
    for j in range(len(zo_t)):  # a column at a time: no pairs x columns temporaries
        np.take(zo_t[j], i, out=d)
        d -= np.take(zr_t[j], r)
        np.multiply(d, d, out=d)
        dist += d
    # per original record the nearest published record (ties: the first row): a segmented
    # argmin over the groups, linear in the pairs
    best = np.minimum.reduceat(dist, lo) if len(i) else dist
    hit = np.flatnonzero(dist == np.repeat(best, size))
    first = hit[np.r_[True, i[hit][1:] != i[hit][:-1]]] if len(hit) else hit
    return link[r[first]] == i[first]


# ---------------------------------------------------------------- sdcMicro's measures


def individual_risk(f: np.ndarray, F_hat: np.ndarray) -> np.ndarray:
    """Benedetti-Franconi individual risk of a record in a key cell with sample frequency f and
    estimated population frequency F_hat (sum of the weights): with p = f / F_hat, the exact
    forms for f = 1, 2 and p / (f - (1 - p)) beyond (as sdcMicro's measure_risk)."""
    f = np.asarray(f, dtype=float)
    p = np.clip(f / np.maximum(np.asarray(F_hat, dtype=float), f), 1e-300, 1.0)
    q = 1.0 - p
    with np.errstate(divide="ignore", invalid="ignore"):
        r1 = np.where(q > 1e-12, p / q * np.log(1.0 / p), 1.0)
        r2 = np.where(q > 1e-12, p / q**2 * (p * np.log(p) + q), 0.5)
    rk = p / (f - q)
    return np.where(f == 1, r1, np.where(f == 2, r2, rk))


def board_measures(
    pr: np.ndarray, w: np.ndarray, sensitive: Mapping[str, np.ndarray | pd.Series]
) -> tuple[dict[str, float], pd.DataFrame]:
    """k-anonymity counts, l-diversity of each sensitive variable and Benedetti-Franconi
    individual and global risk of the published file on the intruder's key (pr: each
    published record's profile, w its weight). Returns metrics and the k-anonymity table."""
    G = int(pr.max(initial=-1)) + 1
    f = np.bincount(pr, minlength=G)
    Fh = np.bincount(pr, weights=w, minlength=G)
    r = individual_risk(f[pr], Fh[pr])
    n = len(pr)
    out = {
        "global_risk_expected": float(r.sum()),
        "global_risk_rate": float(r.mean()) if n else 0.0,
        "individual_risk_max": float(r.max(initial=0.0)),
        "records_risk_gt_0_1": float((r > 0.1).sum()),
    }
    rows = []
    for k in (2, 3, 5):
        below = int((f[pr] < k).sum())
        out[f"records_violating_{k}_anonymity"] = float(below)
        rows.append({"k": k, "records below k": below, "share": below / n if n else 0.0})
    for name, y in sensitive.items():
        y = y if isinstance(y, pd.Series) else pd.Series(y)
        yc = factorize(y, use_na_sentinel=False)[0].astype(np.int64)
        K = int(yc.max(initial=0)) + 1
        pairs = pd.unique(pr * K + yc)  # the distinct (profile, value) pairs, by hashing
        ell = np.bincount(pairs // K, minlength=G)
        out[f"l_diversity_1_share_{name}"] = float((ell[pr] <= 1).mean()) if n else 0.0
    return out, pd.DataFrame(rows)


# ---------------------------------------------------------------- the battery


def _nearest_of(
    original: pd.DataFrame,
    released: pd.DataFrame,
    cols: list[str],
    p: tuple[np.ndarray, np.ndarray],
    link: np.ndarray,
) -> dict[str, float]:
    """nearest_neighbour on columns cols of both files, each file's values held once as
    read and once standardized (at 15M records 3 columns are 360 MB an array)."""
    xo = original[cols].apply(pd.to_numeric, errors="coerce").to_numpy(dtype=float)
    mu, sd = standardizing(xo)
    zo_t = standardized_t(xo, mu, sd, 1e6)
    del xo
    xr = released[cols].apply(pd.to_numeric, errors="coerce").to_numpy(dtype=float)
    zr_t = standardized_t(xr, mu, sd, -1e6)
    del xr
    return nearest_links(*p, link, zo_t, zr_t)


def attack_battery(
    original: pd.DataFrame,
    released: pd.DataFrame,
    link: np.ndarray,
    key: IntruderKey,
    original_design: Sequence[str] = (),
    weight: str | None = None,
    sensitive: Sequence[str] = (),
) -> tuple[dict[str, float], pd.DataFrame]:
    """Every attack on the published file against the original: exact match on the declared
    keys, on the intruder's key, on it with the design labels (original_design: the original
    file's strata/PSU columns), nearest neighbour within the key, and the board's measures.
    link[r]: the original record (position) of published record r. Returns the metrics (the
    gate reads reid_share_worst) and a table of the attacks."""
    ks = {k.name: k for k in key.keys}
    p_keys = profiles(original, released, [k.name for k in key.keys], ks)
    p_full = combine(p_keys, profiles(original, released, key.known)) if key.known else p_keys
    rows = {
        "declared keys": exact_match(*p_keys, link),
        "intruder's key": exact_match(*p_full, link),
    }
    if key.labels and original_design and all(c in original.columns for c in original_design):
        p_des = design_profiles(original[list(original_design)], released[key.labels], link)
        rows["intruder's key and design labels"] = exact_match(*combine(p_full, p_des), link)
    m: dict[str, float] = {}
    for name, suffix in (
        ("declared keys", "_keys"),
        ("intruder's key", ""),
        ("intruder's key and design labels", "_design"),
    ):
        if name in rows:
            r = rows[name]
            m[f"reid_share{suffix}"] = r["share"]
            m[f"reid_precision{suffix}"] = r["precision"]
            m[f"reid_sample_uniques{suffix}"] = r["sample_uniques"]
            m[f"unique_share_published{suffix}"] = r["unique_share_published"]
    m["reid_unique_matches"] = rows["intruder's key"]["correct"]
    gated = [m["reid_share_keys"], m["reid_share"]]
    if key.design and "reid_share_design" in m:
        gated.append(m["reid_share_design"])
    for cols, name, suffix in (
        (key.continuous, "nearest neighbour within the intruder's key", "nn"),
        (key.informed, "informed: nearest neighbour on every continuous column", "nn_informed"),
    ):
        cols = [c for c in cols if c in original.columns]
        if not cols:
            continue
        nn = _nearest_of(original, released, cols, p_full, link)
        rows[f"{name} ({', '.join(cols)})"] = nn
        m |= {f"{suffix}_share": nn["share"], f"{suffix}_precision": nn["precision"]}
        if suffix == "nn":
            gated.append(nn["share"])
    m["reid_share_worst"] = max(gated)
    if weight is not None and weight in released.columns:
        sens = {c: released[c] for c in sensitive if c in released.columns}
        board, _ = board_measures(p_full[1], released[weight].to_numpy(dtype=float), sens)
        m |= board
    table = pd.DataFrame([{"attack": a, **{k: v for k, v in r.items()}} for a, r in rows.items()])
    return m, table
