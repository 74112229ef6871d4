"""Top- and bottom-coding: thresholds against brute force and numpy, totals, min_count, groups."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from sdl_design.stages.topcode.method import topcode, topcode_frame, weighted_percentile


def _frame(n: int = 400, seed: int = 1) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    return pd.DataFrame(
        {
            "x": np.round(np.exp(rng.normal(10, 1.2, n)), 2),
            "k": rng.integers(0, 60, n),  # integers with many ties
            "w": rng.uniform(0.5, 30.0, n),
            "g": rng.choice(["a", "b", "c"], n, p=[0.5, 0.3, 0.2]),
            "h": rng.integers(0, 2, n),
        }
    )


def _brute_percentile(x: np.ndarray, w: np.ndarray, p: float) -> float:
    """Smallest distinct value v with sum(w[x <= v]) >= p/100 * sum(w), one value at a time."""
    total = w.sum()
    for v in np.unique(x):
        if w[x <= v].sum() >= p / 100 * total:
            return float(v)
    raise AssertionError("no value reaches the percentile")


@pytest.mark.parametrize("col", ["x", "k"])
@pytest.mark.parametrize("p", [0.5, 10, 50, 90, 99, 99.5])
def test_weighted_percentile_brute_force_and_numpy(col, p):
    df = _frame()
    x, w = df[col].to_numpy(float), df["w"].to_numpy()
    q = weighted_percentile(x, w, p)
    assert q == _brute_percentile(x, w, p)
    assert q == np.percentile(x, p, weights=w, method="inverted_cdf")


def test_weighted_percentile_closed_form():
    # F(2) = 0.5 exactly: the smallest value whose CDF reaches 0.5 is 2, not 3 or 2.5
    assert weighted_percentile([4, 1, 3, 2], [1, 1, 1, 1], 50) == 2.0
    # a heavy record carries the percentile: F(1) = 0.1, F(2) = 0.9
    assert weighted_percentile([1, 2, 3], [1, 8, 1], 85) == 2.0
    assert weighted_percentile([1, 2, 3], [1, 8, 1], 95) == 3.0
    assert weighted_percentile([1.0, np.nan, 3.0], None, 60) == 3.0  # missing ignored


def test_percentile_threshold_and_mean_replacement_preserve_total():
    df = _frame(2000, seed=3)
    res = topcode(df, "x", "w", upper={"percentile": 99, "replace": "mean"})
    x, w = df["x"].to_numpy(), df["w"].to_numpy()
    t = _brute_percentile(x, w, 99)
    row = res.table.iloc[0]
    assert row["threshold"] == t
    coded = x >= t
    assert row["n_coded"] == coded.sum() >= 1
    assert row["share_coded"] >= 0.01 - 1e-12  # at least the top 1% by weight
    mean = (w[coded] * x[coded]).sum() / w[coded].sum()
    assert np.allclose(res.values[coded], mean, rtol=1e-12)
    assert (res.values[~coded] == x[~coded]).all()
    before, after = (w * x).sum(), (w * res.values.to_numpy()).sum()
    assert abs(after - before) <= 1e-9 * before
    assert abs(row["total_after"] - row["total_before"]) <= 1e-9 * row["total_before"]
    assert (res.coded.to_numpy() == coded.astype(int)).all()


def test_threshold_replacement_is_coxs_displacing_mask():
    # paper 004: x = f T + r, t = max(r, (T+1) f - 1) mod (T+1) is min(x, T) for integers x >= 0
    rng = np.random.default_rng(7)
    x = rng.integers(0, 500, 300)
    T = 137
    f, r = x // T, x % T
    t_cox = np.maximum(r, (T + 1) * f - 1) % (T + 1)
    res = topcode(pd.DataFrame({"x": x}), "x", upper={"value": T})
    assert (res.values.to_numpy() == t_cox).all()
    assert res.values.dtype == np.int64  # integer column stays integer
    assert res.table.iloc[0]["n_coded"] == (x >= T).sum()


def test_min_count_semantics():
    x = np.array([5, 1, 9, 7, 9, 3, 8, 2], dtype=float)
    df = pd.DataFrame({"x": x, "w": np.arange(1, 9, dtype=float)})
    # the 3rd largest value is 8: records >= 8 are coded together (three: 9, 9, 8)
    r = topcode(df, "x", "w", upper={"min_count": 3, "replace": "mean"})
    assert r.table.iloc[0]["threshold"] == 8.0
    assert r.table.iloc[0]["n_coded"] == 3
    idx = [2, 4, 6]
    wmean = (df.w[idx] * x[idx]).sum() / df.w[idx].sum()
    assert np.allclose(r.values[idx], wmean)
    # the 2nd largest is 9 (tied): both 9s coded, at least min_count
    r = topcode(df, "x", "w", upper={"min_count": 2})
    assert r.table.iloc[0]["threshold"] == 9.0 and r.table.iloc[0]["n_coded"] == 2
    # lower: the 3rd smallest value is 3; 1, 2, 3 coded to 3
    r = topcode(df, "x", "w", lower={"min_count": 3})
    assert r.table.iloc[0]["threshold"] == 3.0
    assert sorted(r.values[[1, 5, 7]]) == [3.0, 3.0, 3.0]
    # fewer records than min_count: the whole group is coded together
    r = topcode(df, "x", "w", upper={"min_count": 20, "replace": "mean"})
    assert r.table.iloc[0]["n_coded"] == len(x)
    assert np.allclose(r.values, (df.w * x).sum() / df.w.sum())


def test_by_group_thresholds_and_totals():
    df = _frame(3000, seed=5)
    res = topcode(df, "x", "w", upper={"percentile": 95, "replace": "mean"}, by=["g", "h"])
    tab = res.table
    assert len(tab) == df.groupby(["g", "h"]).ngroups
    for _, row in tab.iterrows():
        m = (df["g"] == row["g"]) & (df["h"] == row["h"])
        x, w = df.loc[m, "x"].to_numpy(), df.loc[m, "w"].to_numpy()
        assert row["threshold"] == _brute_percentile(x, w, 95)
        assert row["n_coded"] == (x >= row["threshold"]).sum()
        new = res.values[m].to_numpy()
        assert abs((w * new).sum() - (w * x).sum()) <= 1e-9 * (w * x).sum()
    # thresholds differ between groups (it is not one global threshold)
    assert tab["threshold"].nunique() > 1


def test_lower_coding_percentile():
    df = _frame(1000, seed=9)
    res = topcode(df, "x", "w", lower={"percentile": 5})
    t = _brute_percentile(df["x"].to_numpy(), df["w"].to_numpy(), 5)
    x = df["x"].to_numpy()
    assert res.table.iloc[0]["side"] == "lower" and res.table.iloc[0]["threshold"] == t
    assert (res.values.to_numpy() == np.maximum(x, t)).all()
    assert res.table.iloc[0]["share_coded"] >= 0.05 - 1e-12


def test_both_sides_and_missing_values():
    df = _frame(500, seed=11)
    df.loc[[3, 10, 20], "x"] = np.nan
    res = topcode(
        df, "x", "w", upper={"percentile": 98, "replace": "mean"}, lower={"min_count": 10}
    )
    assert res.values[[3, 10, 20]].isna().all()
    ok = df["x"].notna()
    up, lo = res.table.set_index("side").loc[["upper", "lower"], "threshold"]
    x = df.loc[ok, "x"].to_numpy()
    assert up == _brute_percentile(x, df.loc[ok, "w"].to_numpy(), 98)
    assert lo == np.sort(x)[9]
    assert (res.values[ok] >= lo).all()


def test_topcode_frame_and_rules():
    df = _frame(300)
    out, tab = topcode_frame(
        df, {"x": {"upper": {"value": 50000}}, "k": {"lower": {"value": 5}, "by": ["g"]}}, "w"
    )
    assert out["x"].max() == 50000 and out["k"].min() == 5
    assert set(tab["column"]) == {"x", "k"} and tab.columns[0] == "column"
    assert (df["x"] == _frame(300)["x"]).all()  # input untouched


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(column="nope", upper={"value": 1}), "'nope' is not in the data"),
        (dict(column="x", upper={"value": 1}, by=["zone"]), "'zone' is not in the data"),
        (dict(column="x", upper={"percentile": 120}), "percentile"),
        (dict(column="x", upper={"percentile": 0}), "percentile"),
        (dict(column="x", upper={"value": 1, "min_count": 3}), "exactly one"),
        (dict(column="x"), "give upper, lower or both"),
        (dict(column="g", upper={"value": 1}), "not numeric"),
        (dict(column="x", upper={"value": 10}, lower={"value": 20}), "not above the lower"),
    ],
)
def test_bad_input_names_the_column(kwargs, needle):
    df = _frame(50)
    with pytest.raises(ValueError) as e:
        topcode(df, weight="w", **kwargs)
    assert needle in str(e.value)
    assert f"'{kwargs['column']}'" in str(e.value)


def test_bad_weights():
    df = _frame(50)
    df.loc[4, "w"] = 0.0
    with pytest.raises(ValueError, match="weight 'w'.*not positive"):
        topcode(df, "x", "w", upper={"value": 10})
    with pytest.raises(ValueError, match="weight 'wt' is not in the data"):
        topcode(df, "x", "wt", upper={"value": 10})


def test_topcode_task_on_default_spec():
    from conftest import run_stage
    from helpers import DEFAULT_SPEC

    from sdl_design.spec import load_spec
    from sdl_design.stages.topcode import TopcodeStage
    from sdl_design.synth import make_survey

    spec = load_spec(DEFAULT_SPEC)
    df = make_survey(4000, seed=3, replicates=False)
    before = df.copy()
    out = run_stage(TopcodeStage, df, spec)
    assert out.name == "topcode" and "thresholds" in out.tables
    w = df["wt"].to_numpy()
    inc_t = weighted_percentile(df["income"], w, 99.5)
    assert out.params["income"]["upper"]["threshold"] == inc_t
    assert out.metrics["income.n_upper"] == (df["income"] >= inc_t).sum()
    assert abs(out.metrics["income.total_ratio"] - 1) < 1e-9
    assert out.data["bmi"].max() <= 60 and out.metrics["bmi.n_upper"] == (df["bmi"] >= 60).sum()
    # income: the coded records get the weighted mean of the coded records (total preserved)
    coded = (df["income"] >= inc_t).to_numpy()
    mean = np.average(df["income"].to_numpy()[coded], weights=w[coded])
    np.testing.assert_allclose(out.data["income"].to_numpy()[coded], mean, rtol=1e-12)
    assert (out.data["income"].to_numpy()[~coded] == df["income"].to_numpy()[~coded]).all()
    assert out.data["income"].max() < df["income"].max()
    pd.testing.assert_frame_equal(df, before)  # the input frame is not modified


@pytest.mark.parametrize("p", [0.1, 1, 5, 30, 70, 95, 99, 99.9])
@pytest.mark.parametrize("col", ["x", "k"])
def test_partial_sort_percentile_equals_numpy_on_large_groups(col, p):
    """One group: the percentile from a partition and a partial sort is numpy's weighted
    inverted-CDF percentile (ties, heavy weights), and the part it sorts is small."""
    from sdl_design.stages.topcode.method import _percentile_one

    df = _frame(20000, seed=13)
    w = df["w"].to_numpy() * np.where(np.arange(len(df)) % 97 == 0, 50.0, 1.0)  # heavy records
    x = df[col].to_numpy(float)
    want = np.percentile(x, p, weights=w, method="inverted_cdf")
    assert weighted_percentile(x, w, p) == want
    res = topcode(df.assign(w=w), col, "w", upper={"percentile": p})
    assert res.table.iloc[0]["threshold"] == want
    if col == "x" and p not in (30, 70):  # continuous values: no cumulative weight on the edge
        assert _percentile_one(x, w, p / 100) == want


def test_percentile_on_a_cumulative_weight_edge_is_the_full_sorts():
    """Equal weights and q * W a cumulative weight: F(v) = q exactly, the smallest such v
    (the full sort decides, as the partial one cannot tell it from rounding)."""
    from sdl_design.stages.topcode.method import _percentile_one

    x = np.random.default_rng(2).permutation(np.arange(1000.0))
    assert _percentile_one(x, np.ones(1000), 0.995) is None  # F(994) = 0.995 exactly
    assert weighted_percentile(x, None, 99.5) == 994.0
    assert weighted_percentile(x, None, 0.5) == 4.0
    assert weighted_percentile(x, None, 99.55) == 995.0


def test_one_group_totals_and_weights_check():
    df = _frame(5000, seed=17)
    x, w = df["x"].to_numpy(), df["w"].to_numpy()
    res = topcode(df, "x", "w", upper={"value": 60000.0}, lower={"value": 5000.0})
    out = res.values.to_numpy()
    assert (out == np.clip(x, 5000.0, 60000.0)).all()
    for row in res.table.itertuples():
        assert np.isclose(row.total_before, (w * x).sum(), rtol=1e-12)
        assert np.isclose(row.total_after, (w * out).sum(), rtol=1e-12)
        assert np.isclose(row.share_coded, row.weight_coded / w.sum(), rtol=1e-12)
    for bad in (np.inf, np.nan, 0.0):
        df.loc[7, "w"] = bad
        with pytest.raises(ValueError, match="1 records have a weight 'w'"):
            topcode(df, "x", "w", upper={"value": 60000.0})
    df.loc[7, "x"] = np.nan  # a bad weight where the value is missing is not used
    assert topcode(df, "x", "w", upper={"value": 60000.0}).values.isna().sum() == 1


def _seq(v: np.ndarray) -> float:
    """Plain Python: the terms added one after the other from 0.0."""
    s = 0.0
    for t in v.tolist():
        s += t
    return s


def _block_seq(v: np.ndarray, rows: np.ndarray, block: int) -> float:
    """Plain Python: the terms of each block of `block` rows added one after the other, then
    the blocks' sums in block order (blocksum's order, written out)."""
    total = 0.0
    for b in range(int(rows.max()) // block + 1 if len(rows) else 0):
        total += _seq(v[(rows >= b * block) & (rows < (b + 1) * block)])
    return total


def _brute_side(
    x: np.ndarray, w: np.ndarray, side: str, b: dict
) -> tuple[float, np.ndarray, float, float, float]:
    """One side of one group by brute force: threshold, coded records, replacement, sums."""
    ok = ~np.isnan(x)
    xo, wo = x[ok], w[ok]
    if "percentile" in b:
        t = _brute_percentile(xo, wo, b["percentile"])
    elif "value" in b:
        t = float(b["value"])
    else:
        s, k = np.sort(xo), b["min_count"]
        t = float(s[max(len(s) - k, 0)] if side == "upper" else s[min(k - 1, len(s) - 1)])
    coded = ok & ((x >= t) if side == "upper" else (x <= t))
    wc, sc = _seq(w[coded]), _seq(w[coded] * x[coded])
    rep = sc / wc if b.get("replace") == "mean" else t
    return t, coded, rep, wc, sc


@pytest.mark.parametrize("seed", range(8))
def test_one_group_against_brute_force_bit_for_bit(seed: int, monkeypatch) -> None:
    """One group (the partial-sort and block-sum path), against plain Python loops, bit for
    bit: thresholds, coded records and their replacement, every table sum; files of one and
    of many blocks (blocks of 64 rows), ties, missing values, unit and unequal weights, upper
    and lower coding by value, weighted percentile and count."""
    from sdl_design.survey import blocksum

    monkeypatch.setattr(blocksum, "BITS", 6)
    monkeypatch.setattr(blocksum, "BLOCK", 64)
    rng = np.random.default_rng(100 + seed)
    n = [7, 64, 301, 5000][seed % 4]
    x = np.round(np.exp(rng.normal(8, 1, n)), -1) if seed % 2 else rng.integers(0, 40, n) * 1.0
    if seed >= 4:
        x[rng.random(n) < 0.06] = np.nan
    w = np.ones(n) if seed % 3 == 0 else rng.uniform(0.5, 30.0, n)
    df = pd.DataFrame({"x": x, "w": w})
    rows = np.flatnonzero(~np.isnan(x))
    bounds = [
        ({"percentile": p, "replace": r}, {"min_count": 3, "replace": r})
        for p in (0.5, 5, 50, 95, 99.5)
        for r in ("mean", "threshold")
    ] + [({"value": float(np.nanquantile(x, 0.9))}, {"value": float(np.nanquantile(x, 0.1))})]
    for up, lo in bounds:
        for upper, lower in ((up, None), (None, lo), (up, lo)):
            if upper and lower and "percentile" in upper and upper["percentile"] < 90:
                continue
            try:
                res = topcode(df, "x", "w", upper=upper, lower=lower)
            except ValueError as e:  # the two thresholds meet: refused
                assert "not above the lower" in str(e)
                continue
            want = x.copy()
            table = res.table.set_index("side")
            for side, b in (("upper", upper), ("lower", lower)):
                if b is None:
                    continue
                t, coded, rep, wc, sc = _brute_side(x, w, side, b)
                want[coded] = rep
                row = table.loc[side]
                assert row["threshold"] == t and row["n_coded"] == coded.sum()
                assert row["weight_coded"] == wc and row["coded_total_before"] == sc
                assert row["coded_total_after"] == _seq(w[coded] * np.full(coded.sum(), rep))
                assert row["replacement"] == rep or (wc == 0 and np.isnan(row["replacement"]))
                wt = _block_seq(w[rows], rows, 64)
                assert row["share_coded"] == (wc / wt if wt > 0 else 0.0)
            got = res.values.to_numpy(float)
            assert np.array_equal(got, want, equal_nan=True)
            assert (table["total_before"] == _block_seq((w * x)[rows], rows, 64)).all()
            assert (table["total_after"] == _block_seq((w * want)[rows], rows, 64)).all()


@pytest.mark.parametrize("order", ["sorted", "reversed", "periodic", "sample_blind"])
def test_partial_sort_percentile_on_ordered_files(order: str) -> None:
    """The cut from a strided sample of the values can misjudge an ordered file (sorted,
    periodic, or a period equal to the sample's stride, which sees one phase only): the
    percentile is still numpy's weighted inverted-CDF percentile, from the partial sort
    or, when that cannot tell, the full one."""
    from sdl_design.stages.topcode.method import _percentile_one

    rng = np.random.default_rng(23)
    n = 50000
    base = rng.lognormal(10, 1, n)
    x = {
        "sorted": np.sort(base),
        "reversed": np.sort(base)[::-1].copy(),
        "periodic": (np.arange(n) % 4096) * 10.0 + rng.random(n),
        "sample_blind": (np.arange(n) % (n // 4096)) * 1000.0 + rng.random(n),
    }[order]
    w = rng.uniform(0.5, 30.0, n)
    for p in (0.1, 2, 30, 70, 98, 99.5, 99.99):
        want = np.percentile(x, p, weights=w, method="inverted_cdf")
        assert weighted_percentile(x, w, p) == want
        got = _percentile_one(x, w, p / 100)
        assert got is None or got == want
        if p not in (30, 70):  # continuous values: the partial sort decides
            assert got == want
