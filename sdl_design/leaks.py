"""What the columns and rows of a public file could give away besides their values (issue 15
items 5-8, issue 13 item 3): unclassified columns, a published column that determines a dropped
design label, a column tied by an edit rule to a post-randomized one but left untouched,
replicate weights a pattern misses, replicate zero patterns that name the original PSU, the
confidential file's record order and unused categorical levels."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from sdl_design.codes import factorize
from sdl_design.messages import short_list as _short

if TYPE_CHECKING:
    from sdl_design.spec import ReleaseSpec

# a published column determines a dropped label when at least this share of the records in
# its repeated values is predicted by the modal label of their value (H(label | column) ~ 0) ...
DETERMINING_PURITY = 0.95
# ... and the repeated values hold at least this share of the records (a column of distinct
# values, such as an income, identifies each record trivially and is no relabel of a label)
DETERMINING_COVERAGE = 0.5


def label_purity(column: pd.Series, label: pd.Series) -> tuple[float, float]:
    """(purity, coverage) of `label` given `column`: among the records whose column value occurs
    at least twice, the share whose label is the modal label of their value; and the share of
    records in such repeated values. Purity 1 with full coverage: a relabel of the label."""
    c = factorize(column, use_na_sentinel=False)[0]
    return _purity(c, factorize(label, use_na_sentinel=False)[0])


def _purity(c: np.ndarray, lab: np.ndarray) -> tuple[float, float]:
    """label_purity on codes 0.. of the column (c) and of the label (lab)."""
    if len(c) == 0:
        return 0.0, 0.0
    repeated = np.bincount(c)[c] >= 2
    if not repeated.any():
        return 0.0, 0.0
    n_lab = int(lab.max()) + 1
    key = c[repeated].astype(np.int64) * n_lab + lab[repeated]
    # (value, label) pairs: counted directly when their range is small, else hashed
    if int(key.max()) < 4 * len(key) + 100_000:
        counts = np.bincount(key)
        pair = np.flatnonzero(counts)
        counts = counts[pair]
    else:
        codes, pair = factorize(key)
        counts = np.bincount(codes)
    best = np.zeros(int(c.max()) + 1, dtype=np.int64)
    np.maximum.at(best, pair // n_lab, counts)
    return float(best.sum() / repeated.sum()), float(repeated.mean())


def _dropped_labels(spec: ReleaseSpec, df: pd.DataFrame) -> dict[str, pd.Series]:
    """The original design labels the public file does not carry as they are: strata and PSU
    (PSU within stratum) unless the spec publishes them unmasked, segment and household."""
    d = spec.design
    swap = spec.stages.active("swap") is not None
    out: dict[str, pd.Series] = {}
    if d.strata and d.strata in df.columns and (swap or not d.publish_design_labels):
        out[f"design.strata '{d.strata}'"] = df[d.strata]
    if d.psu and d.psu in df.columns and (swap or not d.publish_design_labels):
        psu = factorize(df[d.psu], use_na_sentinel=False)[0].astype(np.int64)
        if d.strata and d.strata in df.columns:  # PSU within stratum
            h = factorize(df[d.strata], use_na_sentinel=False)[0]
            psu = factorize(h * (int(psu.max(initial=0)) + 1) + psu)[0]
        out[f"design.psu '{d.psu}'"] = pd.Series(psu, index=df.index)
    for f in ("segment", "household"):
        c = getattr(d, f)
        if c and c in df.columns:
            out[f"design.{f} '{c}'"] = df[c]
    return out


def determining_columns(spec: ReleaseSpec, df: pd.DataFrame) -> list[tuple[str, str, float]]:
    """(column, label, purity) for each published non-design column that determines a dropped
    design label (label_purity >= DETERMINING_PURITY with coverage >= DETERMINING_COVERAGE)."""
    cls = spec.classification(list(df.columns))
    published = [c for c, k in cls.items() if k in ("key", "study", "sensitive", "keep")]
    out = []
    codes = {c: factorize(df[c], use_na_sentinel=False)[0] for c in published}
    # per column: records in repeated values and the number of repeated values. Each repeated
    # value's modal label holds at most the largest label's records, so purity <= values x
    # largest label / records: a bound that rules out most (column, household) pairs uncounted
    repeats = {}
    for c, k in codes.items():
        n_v = np.bincount(k) if len(k) else np.zeros(0, dtype=np.int64)
        rep = n_v >= 2
        repeats[c] = (int(n_v[rep].sum()), int(rep.sum()))
    for label, values in _dropped_labels(spec, df).items():
        lab = factorize(values, use_na_sentinel=False)[0]
        if lab.max(initial=0) < 1:  # one label: nothing to determine
            continue
        largest = int(np.bincount(lab).max())
        for c in published:
            n_rep, n_values = repeats[c]
            if n_rep == 0 or n_values * largest < DETERMINING_PURITY * n_rep:
                continue  # purity below the threshold (or no repeated values: purity 0)
            purity, coverage = _purity(codes[c], lab)
            if purity >= DETERMINING_PURITY and coverage >= DETERMINING_COVERAGE:
                out.append((c, label, purity))
    return out


def untreated_edit_ties(spec: ReleaseSpec) -> list[tuple[int, str, list[str]]]:
    """(rule index, column, treated columns) for each published column that an edit rule ties to
    a column PRB post-randomizes while PRB leaves it as it is (not in stages.prb.variables).
    MASSC substitution moves every column tied to a key with it; PRB moves only its set C."""
    prb = spec.stages.active("prb")
    if prb is None:
        return []
    treated = set(prb.variables)
    cls = spec.classification(spec.columns_named())
    published = {c for c, k in cls.items() if k in ("key", "study", "sensitive", "keep")}
    out = []
    for i, rule in enumerate(spec.edits):
        cols = list(dict.fromkeys(rule.columns()))
        hit = [c for c in cols if c in treated]
        if hit:
            out += [(i, c, hit) for c in cols if c not in treated and c in published]
    return out


def _digit_mask(name: str) -> str:
    return re.sub(r"\d+", "#", name)


def missed_replicates(spec: ReleaseSpec, columns: list[str]) -> list[str]:
    """Columns named like the replicate weights the pattern matches (same name with the digits
    masked: rw_### for rw_001) that the pattern does not match: published untouched they would
    undo the masking for their PSU."""
    rw = spec.design.replicate_weights
    if rw is None or not isinstance(rw.columns, str):
        return []
    matched = set(rw.resolve(columns))
    shapes = {_digit_mask(c) for c in matched}
    never = set(spec.variables.other.drop) | set(spec.variables.direct_identifiers)
    return [
        c for c in columns if c not in matched and c not in never and _digit_mask(str(c)) in shapes
    ]


def column_problems(spec: ReleaseSpec, df: pd.DataFrame) -> list[str]:
    """Every column leak of the data under the spec, each 'field: what and the fix'."""

    problems: list[str] = []
    columns = [str(c) for c in df.columns]
    missed = missed_replicates(spec, columns)
    if missed:
        problems.append(
            f"design.replicate_weights.columns: pattern '{spec.design.replicate_weights.columns}' "
            f"misses {len(missed)} columns named like the replicate weights it matches "
            f"({_short(missed)}); published untouched they undo the masking for their PSU: widen "
            "the pattern (or list every replicate column), or add them to variables.other.drop"
        )
    cls = spec.classification(columns)
    unclassified = [c for c in columns if c not in cls and c not in missed]
    if unclassified:
        problems.append(
            f"variables: {len(unclassified)} columns are not classified ({_short(unclassified)}); "
            "name each as a key, study or sensitive variable, a design column or a direct "
            "identifier, or add it to variables.other.keep (published as it is) or "
            "variables.other.drop (never published)"
        )
    for c, label, purity in determining_columns(spec, df):
        problems.append(
            f"variables: published column '{c}' determines the dropped {label} "
            f"({purity:.1%} of records' labels follow from its value); it would publish the "
            f"label it stands for: move '{c}' to variables.other.drop"
        )
    for i, c, hit in untreated_edit_ties(spec):
        problems.append(
            f"edits[{i}]: published column '{c}' is tied to {hit}, which PRB post-randomizes, but "
            f"PRB leaves '{c}' as it is (records would break the rule, and show the original "
            f"values): add '{c}' to stages.prb.variables, or to variables.other.drop"
        )
    return problems


# ---------------------------------------------------------------- the public file's rows


def sortable(s: pd.Series) -> np.ndarray:
    """A column's values as integer ranks in the order the public file is sorted in: numbers by
    value, a categorical by its categories' order, text by its sorted values; missing last."""
    if isinstance(s.dtype, pd.CategoricalDtype):
        c = s.cat.codes.to_numpy().astype(np.int64)
        return np.where(c < 0, len(s.cat.categories), c)
    if pd.api.types.is_bool_dtype(s) or pd.api.types.is_numeric_dtype(s):
        x = s.to_numpy(dtype=float, na_value=np.nan)
        return np.unique(x, return_inverse=True)[1].astype(np.int64)  # NaN last
    try:
        c, u = factorize(s, sort=True)
    except TypeError:  # mixed types: as text
        c, u = factorize(s.astype(str).where(s.notna()), sort=True)
    return np.where(c < 0, len(u), c).astype(np.int64)


ORDER_BYTES = 256 * 2**20  # the tied records' values of several columns, fetched at once

# values_at(columns, rows): each column's values at the records rows (ascending positions),
# or the whole column: {column: (values, at_rows)}
ValuesAt = Callable[[Sequence[str], np.ndarray], dict[str, tuple[pd.Series, bool]]]


def publish_order(
    columns: Sequence[str],
    column: Callable[[str], pd.Series],
    n: int,
    values_at: ValuesAt | None = None,
) -> np.ndarray:
    """The public file's order: its records sorted by their published values, column by column
    in the order given (the design labels first, then the file's columns), so that the order is
    a function of what is published and nothing else; records equal on every column in input
    order. column(c): the whole column c (read only while records are still tied). values_at:
    once at most a quarter of the records are still tied, the next columns' values at those
    records alone (ORDER_BYTES of them at a time; a text column whole: its ranks are the whole
    column's). Returns the records' positions, row by row."""
    order = np.arange(n)  # the records in the order of the columns so far
    slots = np.arange(n)  # the places in `order` of the records still tied with another
    group = np.zeros(n, dtype=np.int64)  # their tied group, non-decreasing along slots
    i = 0
    while i < len(columns) and len(slots):
        if values_at is None or 4 * len(slots) > n:
            batch, rows = list(columns[i : i + 1]), None
            got = {columns[i]: (column(columns[i]), False)}
        else:
            batch = list(columns[i : i + max(1, ORDER_BYTES // (8 * len(slots)))])
            rows = np.sort(order[slots])
            got = values_at(batch, rows)
        for c in batch:
            if not len(slots):
                break
            s, at_rows = got.pop(c)
            tied = order[slots]
            if at_rows:  # numeric or categorical: the tied records' values alone
                v = sortable(s.iloc[np.searchsorted(rows, tied)])
            elif isinstance(s.dtype, pd.CategoricalDtype) or pd.api.types.is_numeric_dtype(s):
                v = sortable(s.iloc[tied])  # the same order among them as among all
            else:  # text: sorted as the whole column sorts (mixed types as text)
                v = sortable(s)[tied]
            slots, group = refined_slots(order, slots, group, v)
        i += len(batch)
    return order


def refined_slots(
    order: np.ndarray, slots: np.ndarray, group: np.ndarray, v: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The tied records (in places `slots` of `order`, in groups `group`) sorted in place by
    their values v within their group (stably: equal values keep their order), and the places
    and groups of those still tied with another afterwards."""
    key = group * (int(v.max(initial=0)) + 1) + v  # one integer per pair (group, v)
    at = np.argsort(key, kind="stable")
    order[slots] = order[slots[at]]
    key = key[at]
    new = np.r_[True, key[1:] != key[:-1]]  # the first record of a (group, v)
    run = np.cumsum(new) - 1
    keep = np.bincount(run)[run] > 1
    return slots[keep], run[keep]


def sorted_rows(df: pd.DataFrame, first: Sequence[str] = ()) -> tuple[pd.DataFrame, np.ndarray]:
    """The records sorted by their published values (publish_order: the columns `first`, then
    every column in file order), index reset; and each row's position in df."""
    cols = [*[c for c in first if c in df.columns], *[c for c in df.columns if c not in first]]
    order = publish_order(cols, lambda c: df[c], len(df))
    return df.iloc[order].reset_index(drop=True), order


def drop_unused_levels(df: pd.DataFrame) -> pd.DataFrame:
    """Categorical columns without the levels no record has (a level with no record is a value
    of the confidential file, e.g. a category suppressed by the treatment)."""
    cats = [c for c in df.columns if isinstance(df[c].dtype, pd.CategoricalDtype)]
    if not cats:
        return df
    out = df.copy()
    for c in cats:
        out[c] = out[c].cat.remove_unused_categories()
    return out


def zero_words(df: pd.DataFrame, columns: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Each record's set of zero columns as 64-bit words (n x ceil(R / 64), bit j of word a:
    column 64 a + j is 0), the columns read one at a time; and which records have a zero."""
    n = len(df)
    words = np.zeros((n, max(1, -(-len(columns) // 64))), dtype=np.uint64)
    for a in range(0, len(columns), 64):
        word = words[:, a // 64]
        for j, c in enumerate(columns[a : a + 64]):
            word |= (df[c].to_numpy(dtype=float) == 0).astype(np.uint64) << np.uint64(j)
    return words, (words != 0).any(axis=1)


def zero_patterns(df: pd.DataFrame, columns: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Codes 0..m-1 of the distinct sets of zero columns among the records with at least one
    zero, and which records have one: the columns read one at a time into 64-bit words, the
    words hashed (pd.factorize), never an n x R float copy or a sort of the rows."""
    words, has_zero = zero_words(df, columns)
    words = [words[:, a] for a in range(words.shape[1])]
    code = np.zeros(int(has_zero.sum()), dtype=np.int64)
    for w in words:  # codes of (pattern so far, next word) pairs, renumbered densely
        w_codes, w_levels = factorize(w[has_zero])
        code = factorize(code * len(w_levels) + w_codes)[0]
    return code, has_zero


def psu_recoverable(
    released: pd.DataFrame,
    original_psu: pd.Series,
    replicate_columns: list[str],
    purity: float = 0.9,
    coverage: float = 0.5,
) -> float:
    """Share of the original PSUs (among those with released records) that the released
    replicate weights give away: a PSU is recoverable when some group of released records
    sharing one nonempty set of zero replicates is at least `purity` that PSU and holds at
    least `coverage` of the PSU's released records. `original_psu` is aligned on released's
    index (the original PSU of each released record)."""
    if not replicate_columns or len(released) == 0:
        return 0.0
    pattern, has_zero = zero_patterns(released, replicate_columns)
    psu, _ = factorize(original_psu.reindex(released.index), use_na_sentinel=False)
    n_psu = int(psu.max()) + 1
    if not has_zero.any():
        return 0.0
    p = psu[has_zero]
    n_pat = int(pattern.max()) + 1
    cell = pattern.astype(np.int64) * n_psu + p
    pair, counts = np.unique(cell, return_counts=True)
    g, q = pair // n_psu, pair % n_psu
    size_g = np.bincount(pattern, minlength=n_pat)[g]
    size_q = np.bincount(psu, minlength=n_psu)[q]
    return recoverable_share(counts, size_g, q, size_q, len(np.unique(psu)), purity, coverage)


def recoverable_share(
    counts: np.ndarray,
    size_g: np.ndarray,
    q: np.ndarray,
    size_q: np.ndarray,
    n_psu: int,
    purity: float = 0.9,
    coverage: float = 0.5,
) -> float:
    """psu_recoverable from its (zero pattern, PSU) pairs: their records (counts), the records
    of the pattern (size_g) and of the PSU (q, size_q); n_psu the PSUs with released records."""
    hit = (counts >= purity * size_g) & (counts >= coverage * size_q)
    return float(len(np.unique(q[hit])) / n_psu) if n_psu else 0.0
