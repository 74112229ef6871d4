"""The public file's summary from its parts (sdl_design.public_summary): the codebook of a frame
split in parts, merged (small value sets on the driver, the others counted by hash bucket),
is codebook(frame) row for row, and its distinct counts are polars' and pandas' own on the
whole frame; the PSU rows of the parts give SurveyDesign's JKn scale factors of the whole."""

from __future__ import annotations

import numpy as np
import pandas as pd
import polars as pl
import pytest

from flows.public_docs import codebook, replicate_scales
from sdl_design import public_summary as ps
from sdl_design.survey.design import SurveyDesign


def _frame(n: int = 900) -> pd.DataFrame:
    rng = np.random.default_rng(7)
    x = rng.normal(size=n).round(2)  # ~400 distinct values
    x[::17] = np.nan
    x[5], x[6] = 0.0, -0.0  # one value for polars
    cats = pd.Categorical(
        rng.choice(["a", "b", "=c", None], size=n), categories=["=c", "a", "b", "unused"]
    )
    names = np.array([f"name{i % 310}" for i in range(n)], dtype=object)  # 310 > 60 values
    names[::50] = None
    return pd.DataFrame(
        {
            "x": x,
            "k": rng.integers(0, 7, size=n),
            "big": rng.integers(-(10**12), 10**12, size=n),  # every value distinct
            "flag": rng.random(n) < 0.3,
            "cat": cats,
            "name": names,
            "nothing": np.full(n, np.nan),
            "ni": pd.array(np.where(np.arange(n) % 9 == 0, None, np.arange(n) % 13), dtype="Int64"),
        }
    )


@pytest.mark.parametrize("bits", [0, 2])
def test_codebook_from_parts_is_the_whole_frames(tmp_path, bits):
    df = _frame()
    bounds = [0, 250, 251, 700, len(df)]  # a part of one record
    small = 8  # x, big, name and ni (13 values) go to the buckets in most parts; k, flag, cat stay small
    parts = [
        ps.summarize_part(df.iloc[a:b], str(tmp_path), f"p{i}", bits, small)
        for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True))
    ]
    assert {"x", "big", "name"} <= set().union(*(p.bucketed for p in parts))
    assert "k" not in set().union(*(p.bucketed for p in parts))
    summary, buckets = ps.merge_parts(parts, list(df.columns), bits)
    assert len(buckets) == 1 << bits
    ps.add_bucket_counts(summary, [ps.distinct_in_bucket(b, str(tmp_path)) for b in buckets])
    got, want = codebook(summary), codebook(df)
    pd.testing.assert_frame_equal(got, want, check_exact=True)
    # independently: polars' distinct non-missing values (NaN missing, 0.0 == -0.0), pandas'
    # of the text columns, the values of the categorical, the missing counts
    d = want.set_index("variable")
    for c in ("x", "k", "big", "flag", "nothing", "ni"):
        s = pl.from_pandas(df[c], nan_to_null=True).drop_nulls()
        assert d.loc[c, "n_distinct"] == s.n_unique(), c
        assert d.loc[c, "n_missing"] == int(df[c].isna().sum()), c
    assert np.signbit(df["x"]).any() and d.loc["x", "n_distinct"] == len(set(df["x"].dropna()))
    assert d.loc["big", "n_distinct"] == len(df) and d.loc["big", "min"] == df["big"].min()
    assert d.loc["name", "n_distinct"] == 310 and d.loc["name", "values"] == ""
    assert d.loc["cat", "n_distinct"] == 3 and d.loc["cat", "values"] == "=c; a; b"
    assert d.loc["cat", "n_missing"] == int(df["cat"].isna().sum()) > 0
    assert d.loc["nothing", "n_distinct"] == 0 and pd.isna(d.loc["nothing", "min"])


def test_one_part_that_is_the_whole_file_keeps_no_values(tmp_path):
    """A file of one row group (small None): its part's own counts are the file's, the
    codebook is codebook(frame) row for row, and no value is kept or written."""
    df = _frame()
    part = ps.summarize_part(df, str(tmp_path), "p0", 2, None)
    assert part.whole and not part.small and not part.bucketed
    assert not any(tmp_path.iterdir())
    summary, buckets = ps.merge_parts([part], list(df.columns), 2)
    assert buckets == []
    pd.testing.assert_frame_equal(codebook(summary), codebook(df), check_exact=True)
    assert summary.stats["big"].n_distinct == len(df)  # every value distinct
    assert summary.stats["name"].n_distinct == 310


def test_bucketed_counts_need_every_parts_values(tmp_path):
    """A value held by a small part and a bucketed part is counted once (the small set is
    routed to the value's bucket): 3 parts of the same 40 values, the middle one bucketed."""
    v = np.arange(40, dtype=float)
    frames = [pd.DataFrame({"v": v[:8]}), pd.DataFrame({"v": v}), pd.DataFrame({"v": v[30:]})]
    parts = [ps.summarize_part(f, str(tmp_path), f"p{i}", 3, 10) for i, f in enumerate(frames)]
    assert [p.bucketed for p in parts] == [set(), {"v"}, set()]
    summary, buckets = ps.merge_parts(parts, ["v"], 3)
    counts = [ps.distinct_in_bucket(b, str(tmp_path)) for b in buckets]
    assert sum(c.get("v", 0) for c in counts) == 40
    assert sum(len(b.extra.get("v", [])) for b in buckets) == 18  # 8 + 10 small values
    ps.add_bucket_counts(summary, counts)
    assert summary.stats["v"].n_distinct == 40


def _jkn_frame() -> pd.DataFrame:
    rng = np.random.default_rng(3)
    n = 600
    df = pd.DataFrame(
        {
            "st": rng.choice(["s1", "s2", "s3"], size=n, p=[0.5, 0.3, 0.2]),
            "psu": rng.integers(1, 6, size=n),
            "w": rng.uniform(1, 3, size=n),
        }
    )
    df.loc[df["st"] == "s3", "psu"] = rng.integers(1, 3, size=int((df["st"] == "s3").sum()))
    reps = SurveyDesign(df, "w", "st", "psu").with_replicates("jkn")
    return pd.concat([df, reps], axis=1).sample(frac=1.0, random_state=1).reset_index(drop=True)


@pytest.mark.parametrize("psu", ["psu", None])
def test_psu_rows_of_parts_give_the_whole_files_jkn_scales(psu):
    """JKn's c_r = (n_h - 1)/n_h of the deleted PSU's stratum: strata of 5, 5 and 2 PSUs (0.8
    and 0.5), from the PSU rows of 3 parts as from the whole frame; without a PSU column the
    records are the PSUs (a row per stratum: its records, the replicates deleting one)."""
    df = _jkn_frame()
    reps = [c for c in df.columns if c.startswith("rw_")]
    key = ps.PsuKey("w", "st", psu, tuple(reps), per_record=psu is None)
    if psu is None:  # each record its own PSU: delete-one-record replicates of 30 records
        df = df.iloc[:30, :3].reset_index(drop=True)
        df = pd.concat([df, SurveyDesign(df, "w", "st").with_replicates("jkn")], axis=1)
        reps = list(df.columns[3:])
        key = ps.PsuKey("w", "st", None, tuple(reps), per_record=True)
    rows = ps.merge_psus(
        [ps.psu_rows(df.iloc[a:b], key) for a, b in ((0, 7), (7, 19), (19, None))], key
    )
    want = replicate_scales(df, "w", reps, "jkn", None, "st", psu)
    got = replicate_scales(rows, "w", reps, "jkn", None, "st", psu)
    assert got.tobytes() == want.tobytes()
    if psu:
        assert len(rows) == 12 and sorted(set(want.round(12))) == [0.5, 0.8]
    else:  # one row per stratum: its records, and whether a replicate deletes one of them
        n_h = df["st"].value_counts()
        assert len(rows) == 3 and sorted(rows["__records"]) == sorted(n_h)
        assert set(want.round(12)) == {round((k - 1) / k, 12) for k in n_h}


def test_n_distinct_counts_as_pandas_unique():
    """n_distinct: the number of pd.unique's values (NaN once, -0.0 equal to 0.0, infinities)
    for floats, integers, booleans and text."""
    rng = np.random.default_rng(3)
    x = np.round(rng.uniform(0, 5, 20_000), 2)
    x[rng.random(len(x)) < 0.05] = np.nan
    cases = [
        np.array([0.0, -0.0, np.nan, np.nan, 1.0, np.inf, -np.inf]),
        x,
        rng.integers(-50, 50, 10_000),
        rng.random(100) < 0.5,
        np.array(["b", "a", None, "b", np.nan], dtype=object),
        np.zeros(0),
    ]
    for values in cases:
        assert ps.n_distinct(values) == len(pd.unique(values))
