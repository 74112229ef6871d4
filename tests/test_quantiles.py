"""survey_quantile against R survey 4.1.1 svyquantile (numbers in tests/fixtures/r_quantiles, made
by make_r_quantiles.R there; R is not needed to run these tests) and properties."""

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from sdl_design.survey.design import DesignError, SurveyDesign
from sdl_design.survey.quantiles import _degf, qr_rank, survey_quantile, weighted_quantile

FIX = Path(__file__).parent / "fixtures" / "r_quantiles"
PROBS = [0.1, 0.25, 0.5, 0.75, 0.9]
VARS = ["api00", "api99", "enroll", "acs.k3"]
INTERVAL = {"mean": "woodruff", "quantile": "quantile"}  # R's interval.type -> ours
GROUPS = [
    (d, it, q)
    for d, its in [
        ("taylor_strat", ["mean"]),
        ("taylor_clus", ["mean"]),
        ("jk1_clus", ["mean", "quantile"]),
        ("boot_strat", ["mean", "quantile"]),
    ]
    for it in its
    for q in ["math", "school", "hf7"]
]


def _read(name: str) -> pd.DataFrame:
    return pd.read_csv(FIX / name, engine="python")  # Python's float parsing: exact round trip


@pytest.fixture(scope="module")
def designs() -> dict[str, SurveyDesign]:
    strat, clus, rs = _read("apistrat.csv"), _read("apiclus1.csv"), _read("rscales.csv")

    def rscales(name: str) -> np.ndarray:
        return rs.loc[rs.design == name, "rscale"].to_numpy()

    # w: the weights R uses (1/(1/pw)); rw_*: R's replicate analysis weights
    return {
        "taylor_strat": SurveyDesign(strat, "w", strata="stype"),
        "taylor_clus": SurveyDesign(clus, "w", psu="dnum"),
        "jk1_clus": SurveyDesign(
            clus, "w", psu="dnum", replicate_weights="rw_*", method="jk1",
            rscales=rscales("jk1_clus"),
        ),
        "boot_strat": SurveyDesign(
            strat, "w", strata="stype", replicate_weights="rw_*", method="bootstrap",
            rscales=rscales("boot_strat"),
        ),
    }  # fmt: skip


@pytest.fixture(scope="module")
def expected() -> pd.DataFrame:
    return _read("expected.csv")


def _ours(design: SurveyDesign, interval: str, qrule: str) -> pd.DataFrame:
    """Overall and by stype, in R's layout (variable, domain, prob)."""
    kw = {"qrule": qrule, "interval": INTERVAL[interval]}
    whole = design.quantile(VARS, PROBS, **kw).reset_index().assign(domain="all")
    by = design.quantile(VARS, PROBS, by="stype", **kw).reset_index()
    return pd.concat([whole, by.rename(columns={"stype": "domain"})], ignore_index=True)


@pytest.mark.parametrize(("name", "interval", "qrule"), GROUPS)
def test_matches_r(designs, expected, name, interval, qrule):
    # measured: estimates equal; CI bounds within 2e-12; SEs within 2e-14 relative
    r = expected[
        (expected.design == name) & (expected.interval == interval) & (expected.qrule == qrule)
    ]
    ours = _ours(designs[name], interval, qrule)
    m = r.merge(ours, on=["variable", "domain", "prob"], suffixes=("_r", ""), how="left")
    assert len(m) == len(r) == 70  # 4 variables x 4 domains x 5 probs, less acs.k3 in H
    np.testing.assert_allclose(m.estimate, m.estimate_r, rtol=0, atol=1e-10)
    for c in ("ci_lower", "ci_upper"):  # NaN where R's is NaN (p of the CDF's bound < 0)
        np.testing.assert_allclose(m[c], m[c + "_r"], rtol=0, atol=1e-8)
    np.testing.assert_allclose(m.se, m.se_r, rtol=1e-9, atol=0)
    # acs.k3 is missing for every high school: R cannot estimate it, ours is NaN
    empty = ours[(ours.variable == "acs.k3") & (ours.domain == "H")]
    assert len(empty) == 5 and empty[["estimate", "se", "ci_lower", "ci_upper"]].isna().all().all()


@pytest.mark.parametrize("name", ["taylor_strat", "taylor_clus", "jk1_clus", "boot_strat"])
def test_degrees_of_freedom_match_r(designs, expected, name):
    design = designs[name]
    kind = "replicate" if design.replicate_weights else "taylor"
    r = expected[expected.design == name].drop_duplicates(["variable", "domain"])
    stype = design.df["stype"].to_numpy()
    for row in r.itertuples():
        ok = design.df[row.variable].notna().to_numpy()
        if row.domain != "all":
            ok = ok & (stype == row.domain)
        assert _degf(design, np.flatnonzero(ok), kind, {}) == row.df, row


def test_qrules_match_r():
    r = _read("qrules.csv")
    cases = {
        "ties": ([3, 1, 4, 1, 5, 9, 2, 6, 5, 3], [1, 2, 0, 1.5, 3, 0.5, 2, 1, 1, 2]),
        "plain": ([4, 2, 3, 1], [1, 1, 1, 1]),
        "skewed": ([10, 20, 30, 40, 50], [0.3, 2.7, 1.1, 0.05, 4.6]),
    }
    for (case, qrule), g in r.groupby(["case", "qrule"]):
        x, w = (np.asarray(a, dtype=float) for a in cases[case])
        o = np.argsort(x, kind="stable")
        got = weighted_quantile(x[o], w[o], g.prob.to_numpy(), qrule)
        np.testing.assert_allclose(got, g.value, rtol=0, atol=1e-12, err_msg=f"{case} {qrule}")
    # R's quirk, kept: p below the first weight share gives the second smallest value
    plain = r[(r.case == "plain") & (r.qrule == "math")].set_index("prob").value
    assert plain[0.2] == 2 and plain[0.25] == 1


@pytest.mark.parametrize("n", [200, 201, 57])
def test_srs_median_is_lower_median(n):
    rng = np.random.default_rng(n)
    df = pd.DataFrame({"y": rng.integers(0, 40, n).astype(float), "z": rng.normal(size=n)})
    df["one"] = 1.0
    design = SurveyDesign(df, "one")
    out = survey_quantile(design, ["y", "z"], [0.5, 0.1, 0.3, 0.9, 1.0])
    for v in ("y", "z"):
        got = out.loc[v, "estimate"].to_numpy()
        want = np.quantile(df[v], [0.5, 0.1, 0.3, 0.9, 1.0], method="inverted_cdf")
        np.testing.assert_array_equal(got, want)
        assert got[0] == np.sort(df[v])[(n + 1) // 2 - 1]  # the lower median
        hf7 = survey_quantile(design, v, [0.1, 0.5, 0.9], qrule="hf7").estimate.to_numpy()
        np.testing.assert_allclose(hf7, np.quantile(df[v], [0.1, 0.5, 0.9]), rtol=1e-14)
    lo, hi = out.loc[("y", 0.5), ["ci_lower", "ci_upper"]]
    assert lo <= out.loc[("y", 0.5), "estimate"] <= hi


def test_layout_missing_values_and_taylor_on_replicate_design(designs):
    jk1, clus = designs["jk1_clus"], designs["taylor_clus"]
    out = survey_quantile(jk1, ["acs.k3", "api00"], [0.5, 0.25], by="stype")
    assert out.index.names == ["variable", "prob", "stype"]
    assert list(out.columns) == ["estimate", "se", "ci_lower", "ci_upper"]
    assert out.index[:3].tolist() == [
        ("acs.k3", 0.5, "E"),
        ("acs.k3", 0.5, "H"),
        ("acs.k3", 0.5, "M"),
    ]
    # a variable's missing values drop its records only: api00 as computed alone
    alone = survey_quantile(jk1, "api00", [0.5, 0.25], by="stype")
    pd.testing.assert_frame_equal(out.loc[["api00"]], alone)
    # variance="taylor" on a replicate design is the Taylor design's answer
    pd.testing.assert_frame_equal(
        survey_quantile(jk1, "api00", PROBS, variance="taylor"),
        survey_quantile(clus, "api00", PROBS),
    )
    # df=inf: normal quantiles; a wider alpha narrows the interval
    z = survey_quantile(clus, "api00", 0.5, df=np.inf)
    a = survey_quantile(clus, "api00", 0.5, alpha=0.5)
    assert z.estimate.iloc[0] == a.estimate.iloc[0]
    assert a.ci_upper.iloc[0] - a.ci_lower.iloc[0] <= z.ci_upper.iloc[0] - z.ci_lower.iloc[0]


def test_qr_rank_as_r():
    rng = np.random.default_rng(0)
    A = rng.normal(size=(30, 6))
    assert qr_rank(A) == 6
    B = np.column_stack([A, A[:, :2] @ [1.0, 2.0], np.zeros(30), A[:, 3] * (1 + 1e-7)])
    assert qr_rank(B) == 6  # a combination, a zero column, a near copy (below tol): not counted
    C = np.column_stack([A[:, 0], A[:, 0] + 1e-3 * A[:, 1]])
    assert qr_rank(C) == 2  # relative orthogonal part 1e-3 >= tol


def test_qr_rank_is_the_svd_rank_of_replicate_weights_with_exact_dependencies():
    """300 replicate-weight-like matrices of more records than replicates (positive weights,
    columns copied, combined or zero): the rank by Schur complements of the Gram equals the
    SVD's (numpy.linalg.matrix_rank). (With fewer records than replicates a Gram's rounding
    can count a column the SVD does not: the rank of a Gram is squared-condition accurate.)"""
    rng = np.random.default_rng(7)
    for _ in range(300):
        R = int(rng.integers(2, 80))
        n = R + int(rng.integers(0, 100))
        A = rng.gamma(2.0, 50.0, size=(n, R)) * (rng.random((n, R)) < 0.8)
        for _ in range(int(rng.integers(0, 6))):
            i, j, k = rng.integers(0, R, 3)
            A[:, i] = [A[:, j], 2.0 * A[:, j] + A[:, k], 0.0][int(rng.integers(0, 3))]
        assert qr_rank(A) == np.linalg.matrix_rank(A)


def test_bad_arguments(designs):
    clus = designs["taylor_clus"]
    with pytest.raises(DesignError, match="qrule"):
        survey_quantile(clus, "api00", 0.5, qrule="hf9")
    with pytest.raises(DesignError, match="replicate"):
        survey_quantile(clus, "api00", 0.5, interval="quantile")
    with pytest.raises(DesignError, match="replicate weights"):
        survey_quantile(clus, "api00", 0.5, variance="replicate")
    with pytest.raises(DesignError, match="probs"):
        survey_quantile(clus, "api00", [0.5, 1.5])
    with pytest.raises(DesignError, match="not numeric"):
        survey_quantile(clus, "stype", 0.5)
    with pytest.raises(DesignError, match="not in the data"):
        survey_quantile(clus, "nope", 0.5)


@pytest.mark.parametrize("qrule", ["math", "hf7", "school"])
def test_cell_quantiles_are_quantile_cells_q(qrule):
    """cell_quantiles (the assessment's cuts: records sorted by value once per variable) gives
    quantile_cells' quantiles bit for bit: missing values, records in no cell, empty cells,
    zero weights and tied values."""
    from sdl_design.survey.quantiles import cell_quantiles, quantile_cells

    rng = np.random.default_rng(11)
    n, L = 20_000, 40
    x = np.round(rng.lognormal(3, 1, n), 1)  # ties
    x[rng.random(n) < 0.1] = np.nan
    w = rng.random(n) * 50
    w[rng.random(n) < 0.05] = 0.0
    codes = rng.integers(-1, L - 3, n)  # -1: in no cell; the last 3 cells empty
    probs = np.array([0.1, 0.25, 0.5, 0.75, 0.9])
    by_value = np.argsort(x, kind="stable")
    want = np.stack([c.q for c in quantile_cells(x, w, codes, L, probs, qrule, by_value)])
    o = by_value[~np.isnan(x[by_value])]
    got = cell_quantiles(x[o], w[o], codes[o], L, probs, qrule)
    np.testing.assert_array_equal(got, want)
    assert np.isnan(got[-3:]).all() and np.isfinite(got[:-3]).all()


@pytest.mark.parametrize("zeros", [False, True])
def test_quantile_cells_hold_each_cells_records_quantiles_and_cdf(zeros):
    """quantile_cells (one sort of the values, a radix sort of the cells): each cell holds its
    non-missing records sorted by value, its rows in data order, the qrule's quantiles of them
    alone (weighted_quantile on the cell's records, brute force) and, at each quantile, the
    CDF F(q) = sum of w over x <= q / W (both ways _cdf sums it); with and without zero
    weights (their records play no part in the quantiles and add nothing to F)."""
    from sdl_design.survey.quantiles import _cdf, quantile_cells

    rng = np.random.default_rng(23)
    n, L = 5_000, 7
    x = np.round(rng.normal(50, 10, n), 0)  # ties
    x[rng.random(n) < 0.1] = np.nan
    w = rng.uniform(0.5, 3.0, n)
    if zeros:
        w[rng.random(n) < 0.1] = 0.0
    codes = rng.integers(-1, L - 1, n)  # -1: in no cell; the last cell empty
    probs = np.array([0.25, 0.5, 0.75])
    cells = quantile_cells(x, w, codes, L, probs, "math")
    for c, cell in enumerate(cells):
        rows = np.flatnonzero((codes == c) & ~np.isnan(x))
        np.testing.assert_array_equal(cell.rows, rows)
        np.testing.assert_array_equal(cell.xs, np.sort(x[rows], kind="stable"))
        np.testing.assert_array_equal(cell.order, rows[np.argsort(x[rows], kind="stable")])
        want_q = weighted_quantile(
            np.sort(x[rows]), w[rows][np.argsort(x[rows], kind="stable")], probs, "math"
        )
        np.testing.assert_array_equal(cell.q, want_q)
        if not len(rows):
            assert np.isnan(cell.q).all()
            continue
        F = np.array([w[rows][x[rows] <= q].sum() for q in cell.q]) / w[rows].sum()
        for divide_first in (False, True):
            np.testing.assert_allclose(_cdf(cell, divide_first), F, rtol=1e-13)
