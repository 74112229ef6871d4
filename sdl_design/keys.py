"""Key variables as the intruder sees them: recoded (coarsened) columns."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from sdl_design.codes import factorize
from sdl_design.spec import KeySpec

# the label of a missing value where a category needs a name (calibration margins, tables)
MISSING = "(missing)"


def bin_labels(bins: Sequence[float]) -> list[str]:
    """The labels of left-closed bins [a, b): 'a-b', in bin order."""
    e = np.asarray(bins, dtype=float)
    return [f"{e[i]:g}-{e[i + 1]:g}" for i in range(len(e) - 1)]


def bin_codes(s: pd.Series, bins: Sequence[float]) -> np.ndarray:
    """Each value's bin (0..len(bins)-2), len(bins)-1 outside the bins, -1 missing. A value that
    is already a bin label (a published, coded column) is its own bin: the coding is
    idempotent, so a published file and its original read the same through every measure."""
    labels = bin_labels(bins)
    codes, uniq = factorize(s, use_na_sentinel=True)  # recode the distinct values only
    u = pd.Series(np.asarray(uniq, dtype=object))
    at = {lab: i for i, lab in enumerate([*labels, "out_of_range"])}
    coded = u.map(lambda v: at.get(v, -1) if isinstance(v, str) else -1).to_numpy(np.int64)
    x = pd.to_numeric(u.where(coded < 0), errors="coerce").to_numpy(dtype=float)
    e = np.asarray(bins, dtype=float)
    b = np.searchsorted(e, x, side="right") - 1
    b = np.where((b >= 0) & (b < len(labels)), b, len(labels))
    b = np.where(np.isnan(x), -1, b)
    rec = np.append(np.where(coded >= 0, coded, b), -1)
    return rec[codes]


def coarsen(
    s: pd.Series, bins: Sequence[float] | None = None, mapping: dict | None = None
) -> pd.Series:
    """Left-closed bins ([a, b) labelled 'a-b') or a category map; unmapped values keep their own
    label, bin labels and mapped values stay what they are (idempotent). A missing value stays
    missing (NaN): the missing-value policy keeps it as a category of its own wherever keys are
    counted, never as 'out_of_range' (values outside the bins)."""
    if bins is not None:
        labels = np.array([*bin_labels(bins), "out_of_range", np.nan], dtype=object)
        lab = labels[bin_codes(s, bins)]  # -1 (missing) -> the last, NaN
        return pd.Series(lab, index=s.index, name=s.name)
    if mapping is not None:
        m = {str(k): v for k, v in mapping.items()}
        coded = {str(v) for v in m.values()} - set(m)
        return s.map(
            lambda v: v if pd.isna(v) or str(v) in coded else m.get(str(v), str(v))
        ).rename(s.name)
    return s


def published_key(s: pd.Series, key: KeySpec | None = None) -> pd.Series:
    """A column in the coding it is published in and the intruder sees (the key's bins or map;
    as it is without a recode, or with publish: detail). Bins give an ordered categorical in
    bin order, a map a categorical of the mapped values in sorted order."""
    if key is None or (key.bins is None and key.map is None):
        return s
    if key.bins is not None:
        cats = [*bin_labels(key.bins), "out_of_range"]
        return pd.Series(
            pd.Categorical.from_codes(bin_codes(s, key.bins), categories=cats, ordered=True),
            index=s.index,
            name=s.name,
        )
    codes, uniq = factorize(s, use_na_sentinel=False)  # recode distinct values only
    rec = coarsen(pd.Series(uniq, dtype=object), mapping=key.map).to_numpy(dtype=object)
    cats = sorted({str(v) for v in rec if not pd.isna(v)})  # a map's values are text
    return pd.Series(pd.Categorical(rec[codes], categories=cats), index=s.index, name=s.name)


def coded_keys(spec_keys: Sequence[KeySpec]) -> list[KeySpec]:
    """The keys published in a coding other than their values (bins or map)."""
    return [k for k in spec_keys if k.bins is not None or k.map is not None]


def publish_coding(df: pd.DataFrame, spec_keys: Sequence[KeySpec]) -> pd.DataFrame:
    """df with every coded key (bins or map) in its published coding (global recoding): the
    public file carries the keys in the coding every risk measure reads; other columns as they
    are (a shallow copy; df untouched). Every label of a coding is a category, used or not (the
    same categories in every partition of a file)."""
    coded = [k for k in coded_keys(spec_keys) if k.name in df.columns]
    if not coded:
        return df
    out = df.copy(deep=False)
    for k in coded:
        out[k.name] = published_key(df[k.name], k)
    return out


def key_frame(df: pd.DataFrame, keys: Sequence[KeySpec | str]) -> pd.DataFrame:
    """The key columns of df with each key's recode applied; a missing value is the category
    MISSING (its own category in every count, equal to itself when files are compared)."""
    cols = {}
    for k in keys:
        k = KeySpec(name=k) if isinstance(k, str) else k
        cols[k.name] = _recoded(df[k.name], k)
    return pd.DataFrame(cols, index=df.index)


def _recoded(s: pd.Series, key: KeySpec) -> pd.Series:
    """One key column recoded, a missing value as the category MISSING."""
    c = coarsen(s, key.bins, key.map)
    return c.astype(object).where(c.notna(), MISSING) if c.isna().any() else c


def key_levels(s: pd.Series, key: KeySpec | str) -> tuple[np.ndarray, np.ndarray]:
    """(codes, levels): each record's recoded label as levels[codes], levels distinct (object,
    MISSING for a missing value); the recode runs on the distinct raw values only, so this is
    key_frame(df, [key]) without a string per record."""
    key = KeySpec(name=key) if isinstance(key, str) else key
    raw, uniq = factorize(s, use_na_sentinel=False)
    rec = _recoded(pd.Series(uniq, dtype=object, name=key.name), key)
    rc, levels = factorize(rec, use_na_sentinel=False)
    return rc.astype(np.int64)[raw], np.asarray(levels, dtype=object)


def key_categorical(s: pd.Series, key: KeySpec | str) -> pd.Series:
    """key_frame(df, [key]) as a categorical column whose categories are the labels in sorted
    order (what a sorted factorization of the labels gives); object labels when they do not
    sort (mixed types)."""
    codes, levels = key_levels(s, key)
    try:
        order = np.argsort(levels, kind="stable")
    except TypeError:
        return pd.Series(levels[codes], index=s.index, name=s.name)
    rank = np.empty(len(order), dtype=np.int64)
    rank[order] = np.arange(len(order))
    cat = pd.Categorical.from_codes(rank[codes], categories=pd.Index(levels[order], dtype=object))
    return pd.Series(cat, index=s.index, name=s.name)


def shared_categories(
    frames: Sequence[pd.DataFrame], columns: Sequence[str] | None = None
) -> list[pd.DataFrame]:
    """The text columns (of `columns`, default all of the first frame's) as categoricals with the
    same sorted categories in every frame that has them: a categorical factorizes, groups and
    concatenates through its codes, while Arrow-backed text factorizes string by string. Values,
    and so every count, label and sorted order, are unchanged; shallow copies, inputs untouched.
    A column of mixed types stays as it is."""
    out = [f.copy(deep=False) for f in frames]
    for c in list(frames[0].columns if columns is None else columns):
        have = [f for f in out if c in f.columns]
        dt = have[0][c].dtype if have else None
        if (
            dt is None
            or isinstance(dt, pd.CategoricalDtype)
            or not pd.api.types.is_string_dtype(dt)
        ):
            continue
        fact = [(f, factorize(f[c])) for f in have]
        vals = pd.unique(np.concatenate([np.asarray(u, dtype=object) for _, (_, u) in fact]))
        try:
            cats = pd.Index(sorted(vals), dtype=object)
        except TypeError:  # mixed types: leave the column as it is
            continue
        for f, (codes, uniq) in fact:  # codes through the few distinct values (-1: missing)
            pos = np.append(cats.get_indexer(np.asarray(uniq, dtype=object)), -1)
            f[c] = pd.Categorical.from_codes(pos[codes], categories=cats)
    return out
