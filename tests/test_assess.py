"""assess.py and glm.py: the released file against the original, each under its own design.

References: closed forms (Karr overlap), SurveyDesign.mean/total (domain estimates), R survey
4.1.1 svyglm (tests/fixtures/svyglm_fixture.csv, made by make_svyglm_fixture.R), brute force
(re-identification), the null distribution of the pMSE (random halves of one file)."""

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
from scipy.stats import norm

from sdl_design.keys import coarsen
from sdl_design.stages.assess.method import (
    assess,
    ci_overlap,
    pmse_ratio,
    published_coding,
    reidentification,
)
from sdl_design.survey.design import SurveyDesign
from sdl_design.survey.glm import (
    FormulaError,
    design_matrix,
    parse_formula,
    svyglm,
    term_levels,
)
from sdl_design.synth import make_survey

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).with_name("fixtures")
Z = norm.ppf(0.975)
MODELS = [
    {"formula": "hypertension ~ C(age) + sex + race", "family": "binomial"},
    {"formula": "bmi ~ C(age) + sex + income", "family": "gaussian"},
]


@pytest.fixture(scope="module")
def spec():
    from helpers import county_key_spec

    return county_key_spec()


@pytest.fixture(scope="module")
def survey() -> pd.DataFrame:
    return make_survey(n_persons=3000, seed=7)


# ------------------------------------------------------------------ SurveyDesign kernels


def test_design_kernels_sparse_covariance_replicate_totals(survey):
    d = SurveyDesign(survey, "wt", "stratum", "psu", replicate_weights="rw_*", method="jkn")
    cols = ["bmi", "income", "diabetes"]
    z = d.linearized_scores(cols)
    v = d.taylor_variance(z)
    np.testing.assert_allclose(d.taylor_variance(sp.csr_matrix(z)), v, rtol=1e-12)
    C = d.taylor_covariance(z)
    np.testing.assert_allclose(np.diag(C), v, rtol=1e-12)
    v01 = d.taylor_variance(z[:, :1] + z[:, 1:2])[0]  # V(a + b) = V(a) + V(b) + 2 C(a, b)
    np.testing.assert_allclose(C[0, 1], (v01 - v[0] - v[1]) / 2, rtol=1e-9)
    y = survey[cols].to_numpy(float)
    ref = d.W.T @ y
    assert d._F is not None  # factors constant within PSUs: the F' (PSU totals) path
    np.testing.assert_allclose(d.replicate_totals(y), ref, rtol=1e-12)
    np.testing.assert_allclose(d.replicate_totals(sp.csr_matrix(y)), ref, rtol=1e-12)
    bent = survey.copy()  # a recalibrated-like replicate weight: the W' z path
    bent["rw_001"] = bent["rw_001"] * (1 + 0.01 * (bent["age"] > 40))
    d2 = SurveyDesign(bent, "wt", "stratum", "psu", replicate_weights="rw_*", method="jkn")
    assert d2._F is None
    np.testing.assert_allclose(d2.replicate_totals(sp.csr_matrix(y)), d2.W.T @ y, rtol=1e-12)


# ------------------------------------------------------------------ Karr et al. overlap


def _interval(lo: float, hi: float) -> tuple[float, float]:
    return (lo + hi) / 2, (hi - lo) / 2 / Z  # estimate and SE of the 95% CI [lo, hi]


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        ((0.0, 4.0), (0.0, 4.0), 1.0),  # identical
        ((1.0, 3.0), (0.0, 4.0), 0.5 * (2 / 2 + 2 / 4)),  # nested
        ((0.0, 1.0), (2.0, 3.0), 0.0),  # disjoint
        ((0.0, 4.0), (2.0, 10.0), 0.5 * (2 / 4 + 2 / 8)),  # partial
        ((0.0, 4.0), (4.0, 6.0), 0.0),  # touching
        ((2.0, 2.0), (0.0, 4.0), 0.5 * (1.0 + 0.0)),  # a point inside an interval
    ],
)
def test_ci_overlap_closed_form(a, b, expected):
    ea, sa = _interval(*a)
    eb, sb = _interval(*b)
    assert ci_overlap(ea, sa, eb, sb) == pytest.approx(expected, abs=1e-12)
    assert ci_overlap(eb, sb, ea, sa) == pytest.approx(expected, abs=1e-12)  # symmetric


def test_ci_overlap_equal_se_and_missing():
    d = np.array([0.0, 0.5, 1.0, 2.0, 5.0])  # J = 1 - d / (2 z s) for equal SEs s
    got = ci_overlap(np.zeros(5), np.ones(5), d, np.ones(5))
    np.testing.assert_allclose(got, np.maximum(1 - d / (2 * Z), 0.0), atol=1e-12)
    assert ci_overlap(1.0, 0.1, np.nan, np.nan) == 0.0  # the released file cannot answer


# ------------------------------------------------------------------ domain estimates


def test_untreated_release_is_exact(survey, spec):
    a = assess(survey, survey.copy(), spec, models=MODELS)
    e = a.domain_estimates
    both = e["estimate_original"].notna()
    assert both.all()  # every cell has records in the file (no all-missing variable here)
    se = e["se_original"].notna()  # not a county's quantile (one PSU: no degrees of freedom)
    assert (e.loc[se, "ci_overlap"] == 1.0).all() and e.loc[~se, "ci_overlap"].isna().all()
    assert (e["std_bias"] == 0.0).all()
    assert (e.loc[se, "se_ratio"] == 1.0).all()
    assert (e["relative_bias"].fillna(0.0) == 0.0).all()
    m = a.model_coefficients
    assert len(m) == 13 + 10
    assert (m["ci_overlap"] == 1.0).all() and (m["std_diff"] == 0.0).all()
    assert (m["se_ratio"] == 1.0).all()
    k = a.metrics
    assert k["overlap_min"] == k["overlap_median"] == 1.0
    assert k["share_abs_std_bias_gt2"] == 0.0
    assert k["se_ratio_p10"] == k["se_ratio_p90"] == k["se_ratio_replicate_p90"] == 1.0
    assert k["model_overlap_min"] == 1.0 and k["pmse"] < 1e-20
    assert k["reid_share"] == 1.0 and k["share_retained"] == 1.0
    # every key and every pair of keys, and overall
    assert e["domain"].nunique() == 1 + 6 + 15
    assert {"all", "age", "age x sex", "region x county"} <= set(e["domain"])


def test_domain_estimates_equal_survey_design(survey, spec):
    """Means, totals and their Taylor and replicate SEs by domain equal SurveyDesign's, with
    missing values of a study variable handled as a domain (never NaN totals)."""
    df = survey.copy()
    df.loc[df.index[::7], "bmi"] = np.nan
    a = assess(df, df, spec, domains=["age", "sex"], pmse=False, reid=False)
    e = a.domain_estimates.set_index(["variable", "statistic", "domain", "level"])
    assert e["estimate_original"].notna().all()  # totals over the non-missing records
    df["agegrp"] = coarsen(df["age"], [0, 18, 25, 35, 45, 55, 65, 75, 91])
    df["bmi_dom"] = np.where(df["bmi"].isna(), "none", df["agegrp"])
    df["bmi0"] = df["bmi"].fillna(0.0)
    d = SurveyDesign.from_spec(df, spec.design)
    for variance, col in (("taylor", "se_taylor_original"), ("replicate", "se_replicate_original")):
        ref = d.mean(["income", "diabetes"], by="agegrp", variance=variance)
        for (var, level), row in ref.iterrows():
            stat = "proportion" if var == "diabetes" else "mean"
            got = e.loc[(var, stat, "age", level)]
            assert got["estimate_original"] == pytest.approx(row["estimate"], rel=1e-10)
            assert got[col] == pytest.approx(row["se"], rel=1e-9)
        tot = d.total(["income"], by="sex", variance=variance)
        for (var, level), row in tot.iterrows():
            got = e.loc[(var, "total", "sex", level)]
            assert got["estimate_original"] == pytest.approx(row["estimate"], rel=1e-10)
            assert got[col] == pytest.approx(row["se"], rel=1e-9)
        bmi = d.mean(["bmi0"], by="bmi_dom", variance=variance).drop("none", level="bmi_dom")
        for (_, level), row in bmi.iterrows():
            got = e.loc[("bmi", "mean", "age", level)]
            assert got["estimate_original"] == pytest.approx(row["estimate"], rel=1e-10)
            assert got[col] == pytest.approx(row["se"], rel=1e-9)
            assert got["n_original"] == ((df["bmi_dom"] == level).sum())
        btot = d.total(["bmi0"], variance=variance)  # the total skips the missing values
        got = e.loc[("bmi", "total", "all", "all")]
        assert got["estimate_original"] == pytest.approx(btot["estimate"].iloc[0], rel=1e-12)
        assert got[col] == pytest.approx(btot["se"].iloc[0], rel=1e-9)


def test_perturbed_single_year_age_loses_age_domains(survey, spec):
    rng = np.random.default_rng(5)
    shuffled = survey.assign(age=rng.permutation(survey["age"].to_numpy()))  # no partition
    a = assess(survey, shuffled, spec, domains=["age", "sex"], pmse=False, reid=False)
    e = a.domain_estimates[a.domain_estimates["reliable"]]
    age = e[e["domain"] == "age"]
    assert age["ci_overlap"].median() < 0.5 and age["ci_overlap"].min() == 0.0
    assert (age["std_bias"].abs() > 2).mean() > 0.3
    untouched = e[e["domain"].isin(["all", "sex"])]
    # nothing else moved: equal estimates up to the order of summation (sums go through
    # PSU x profile pairs, and the profiles include age)
    np.testing.assert_allclose(untouched["ci_overlap"], 1.0, rtol=0, atol=1e-12)
    np.testing.assert_allclose(untouched["std_bias"], 0.0, rtol=0, atol=1e-9)
    assert a.metrics["overlap_median"] < 0.9
    w = a.worst(15)  # sorted by |standardized bias| over the whole table
    ref = e.loc[e["std_bias"].abs().sort_values(ascending=False).index[:15]]
    np.testing.assert_array_equal(w["std_bias"].abs().to_numpy(), ref["std_bias"].abs().to_numpy())
    assert (np.diff(w["std_bias"].abs().to_numpy()) <= 0).all()
    assert w.index.max() > 200  # from all over the table, not its first rows
    assert set(w["domain"]) <= {"age", "age x sex"}


def test_published_coding_orders_bins_and_maps(spec):
    keys = {k.name: k for k in spec.variables.keys}
    a = pd.DataFrame({"age": [90, 5, 30, np.nan], "sex": ["m", "f", "f", None]})
    b = pd.DataFrame({"age": [100, 20], "sex": ["f", "f"]})
    c = published_coding([a, b], "age", keys)
    assert c.categories == ["0-18", "18-25", "25-35", "75-91", "out_of_range", "missing"]
    np.testing.assert_array_equal(c.codes[0], [3, 0, 2, 5])
    assert c.series(1, b.index).tolist() == ["out_of_range", "18-25"]
    assert c.series(0, a.index, missing=False).isna().tolist() == [False, False, False, True]
    s = published_coding([a, b], "sex", keys)
    assert s.categories == ["f", "m", "missing"]
    np.testing.assert_array_equal(s.codes[1], [0, 0])


# ------------------------------------------------------------------ GLMs against R svyglm


def test_formula_parser():
    f = parse_formula("hypertension ~ C(age) + sex + race")
    assert f.response == "hypertension"
    assert [t.name for t in f.terms] == ["age", "sex", "race"]
    assert f.categorical == {"age"}
    for bad in ("y ~ a ** b", "y ~ a:a", "y = a", "~ a", "y ~ C(a", "y ~ a + a", "y ~ log(a)"):
        with pytest.raises(FormulaError):
            parse_formula(bad)


def test_design_matrix_treatment_coding():
    df = pd.DataFrame({"y": [1.0, 2, 3, np.nan], "g": ["b", "a", "c", "a"], "x": [1, 2, 3, 4]})
    f = parse_formula("y ~ g + x")
    lv = term_levels(f, [df])
    X, y, ok, names = design_matrix(df, f, lv)
    assert names == ["Intercept", "g[T.b]", "g[T.c]", "x"]  # reference: first sorted level
    np.testing.assert_array_equal(ok, [True, True, True, False])
    np.testing.assert_array_equal(X[:3], [[1, 1, 0, 1], [1, 0, 0, 2], [1, 0, 1, 3]])
    assert (X[3] == 0).all() and y[3] == 0.0


def test_svyglm_equals_r_survey():
    data = pd.read_csv(FIXTURES / "svyglm_data.csv")
    ref = pd.read_csv(FIXTURES / "svyglm_fixture.csv", skipinitialspace=True)
    rw = SurveyDesign(data, "wt", "stratum", "psu").with_replicates("jkn")  # = as.svrepdesign JKn
    df = pd.concat([data, rw], axis=1)
    des = SurveyDesign(df, "wt", "stratum", "psu", replicate_weights=list(rw.columns), method="jkn")
    models = {
        "gaussian": "bmi ~ C(agegrp) + sex + race + income",
        "binomial": "hypertension ~ age + sex + race + bmi",
    }
    for family, text in models.items():
        f = parse_formula(text)
        X, y, ok, names = design_matrix(df, f, term_levels(f, [df]))
        fit = svyglm(X, y, ok, names, des, family)
        r = ref[ref["model"] == family]
        # R names: (Intercept), agegrp35-65, sexmale; ours: Intercept, agegrp[T.35-65], ...
        ours = [n.replace("[T.", "").replace("]", "") for n in names]
        assert ["(Intercept)", *ours[1:]] == r["term"].tolist()
        assert fit.n_used == r["n_used"].iloc[0] == 427  # 12 missing bmi values dropped
        np.testing.assert_allclose(fit.coef, r["coef"], rtol=1e-6, atol=0)
        np.testing.assert_allclose(fit.se_taylor, r["se_taylor"], rtol=1e-6, atol=0)
        np.testing.assert_allclose(fit.se_replicate, r["se_replicate"], rtol=1e-6, atol=0)


@pytest.mark.parametrize("terms", [6, 40], ids=["khatri-rao", "per-column"])
def test_replicate_refits_are_each_columns_own_fit(terms):
    """irls_columns on a weight matrix: every column's coefficients are irls' on that column
    alone (1e-9), each stopping at its own convergence; a column that separates a term (its
    weight zero on the term's y = 0 rows) diverges to NaN or to large coefficients there,
    and does not hold the others back; a column with a term of no weight is NaN. 40 terms:
    the Gram matrices one product per column (GRAM_KHATRI_RAO_MAX_TERMS)."""
    from sdl_design.survey import glm

    rng = np.random.default_rng(3)
    m, R = 400, 7
    X = np.column_stack([np.ones(m), rng.normal(size=(m, terms - 1))])
    g = rng.integers(0, 3, m)
    X[:, 1] = g == 1  # a dummy the separating column can separate
    y = (rng.random(m) < 1 / (1 + np.exp(-(X @ rng.normal(scale=0.3, size=terms))))).astype(float)
    W = rng.uniform(0.5, 2.0, size=(m, R))
    W[(g == 1) & (y == 0), 5] = 0.0  # column 5: y = 1 wherever the dummy is 1
    W[g == 1, 6] = 0.0  # column 6: the dummy has no weight
    start = glm.irls(X, y, W.mean(axis=1), "binomial")[0]
    B = glm.irls_columns(X, y, W, "binomial", start=start)[0]
    for r in range(5):
        beta, _, converged, _ = glm.irls(X, y, W[:, r], "binomial", start=start)
        assert converged
        np.testing.assert_allclose(B[r], beta, rtol=1e-9, atol=1e-12)
    assert np.isnan(B[6]).all()
    assert np.isnan(B[5, 1]) or abs(B[5, 1]) > 10  # separated: the dummy's coefficient runs off


# ------------------------------------------------------------------ pMSE


def _pmse_frame(df: pd.DataFrame) -> tuple[pd.DataFrame, list[str], list[str]]:
    out = df.assign(age=coarsen(df["age"], [0, 18, 25, 35, 45, 55, 65, 75, 91]))
    cat = ["age", "sex", "race", "marital", "region", "county"]
    num = ["income", "bmi", "diabetes", "hypertension", "smoker", "insured", "hh_size"]
    return out, cat, num


def test_pmse_ratio_random_halves_near_one(survey):
    df, cat, num = _pmse_frame(survey)
    ratios = []
    for seed in range(5):
        half = np.random.default_rng(seed).random(len(df)) < 0.5
        r = pmse_ratio(df[half], df[~half], cat, num)
        c = (~half).mean()
        assert r["pmse_converged"] == 1.0
        assert r["pmse_ratio"] == pytest.approx(
            r["pmse"] * len(df) / ((r["pmse_k"] - 1) * c * (1 - c))
        )
        assert r["pmse_ratio_snoke"] == pytest.approx(r["pmse_ratio"] / (1 - c))
        assert 0.3 <= r["pmse_ratio"] <= 3.0
        ratios.append(r["pmse_ratio"])
    assert 0.6 <= np.mean(ratios) <= 1.6


def test_pmse_ratio_large_for_a_perturbed_file(survey):
    df, cat, num = _pmse_frame(survey)
    half = np.random.default_rng(0).random(len(df)) < 0.5
    bad = df[~half].copy()  # marginals moved (a main-effects model sees only those)
    rng = np.random.default_rng(1)
    bad.loc[rng.random(len(bad)) < 0.3, "race"] = "other"
    bad["bmi"] = bad["bmi"] + 3.0
    bad.loc[rng.random(len(bad)) < 0.2, "hypertension"] = 1
    r = pmse_ratio(df[half], bad, cat, num)
    # null: ratio ~ chi2_{k-1} / (k-1), SD sqrt(2 / (k-1)) ~ 0.14 here; 5 is ~30 SDs out
    assert r["pmse_k"] > 100 and r["pmse_ratio"] > 5.0


def test_weighted_gram_of_fixed_rows_equals_the_dense_product():
    """weighted_gram's path for a CSR storing c entries per row (pmse_matrix's) gives the
    dense X' diag(v) X bit for bit as the CSR slices did; a CSR with a duplicate entry or
    rows of other lengths takes the slices and still sums it."""
    from sdl_design.survey.glm import _fixed_rows, weighted_gram

    rng = np.random.default_rng(3)
    m, p, c = 300_000, 9, 3  # two blocks of rows
    cols = np.column_stack([np.zeros(m, int), 1 + rng.integers(0, 4, m), 5 + rng.integers(0, 4, m)])
    vals = np.column_stack([np.ones(m), rng.integers(0, 2, m), rng.normal(size=m)])
    X = sp.csr_matrix((vals.ravel(), cols.ravel(), np.arange(0, m * c + 1, c)), shape=(m, p))
    v = rng.random(m)
    assert _fixed_rows(X) is not None
    dense = X.toarray()
    step = (1 << 21) // p
    sliced = sum(
        d.T @ (d * w[:, None])
        for d, w in ((dense[a : a + step], v[a : a + step]) for a in range(0, m, step))
    )
    assert np.array_equal(weighted_gram(X, v), sliced)
    dup = sp.csr_matrix(
        (np.array([1.0, 2.0, 3.0, 4.0]), np.array([0, 0, 1, 0]), np.array([0, 2, 4])), shape=(2, 2)
    )  # rows [3, 0] and [4, 3]
    assert _fixed_rows(dup) is None
    assert np.allclose(weighted_gram(dup, np.array([1.0, 1.0])), [[25.0, 12.0], [12.0, 9.0]])
    assert _fixed_rows(sp.csr_matrix((3, 4))) is None


# ------------------------------------------------------------------ re-identification


def _reid_brute(orig: pd.DataFrame, rel: pd.DataFrame) -> dict[str, float]:
    profiles_o = [tuple(r) for r in orig.astype(str).to_numpy()]
    profiles_r = {i: tuple(r) for i, r in zip(rel.index, rel.astype(str).to_numpy(), strict=True)}
    expected, uniques, hits = 0.0, 0, 0
    for label, prof in zip(orig.index, profiles_o, strict=True):
        cell = [j for j, q in profiles_r.items() if q == prof]  # the intruder's matching cell
        unique = sum(p == prof for p in profiles_o) == 1
        uniques += unique
        if label in cell:
            expected += 1.0 / len(cell)
            hits += unique and len(cell) == 1
    return {"expected": expected, "uniques": uniques, "hits": hits}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reidentification_brute_force(seed):
    rng = np.random.default_rng(seed)
    n = 80
    orig = pd.DataFrame(
        {
            "a": rng.choice(list("vwxyz"), n),
            "b": rng.integers(0, 4, n),
            "c": rng.choice(["p", "q", "r"], n, p=[0.6, 0.3, 0.1]),
        },
        index=rng.permutation(np.arange(1000, 1000 + n)),
    )
    rel = orig.sample(frac=0.7, random_state=seed).copy()  # subsampled
    move = rng.random(len(rel)) < 0.3  # perturbed keys
    rel.loc[move, "a"] = rng.choice(list("vwxyz"), move.sum())
    rel = rel.sample(frac=1.0, random_state=seed + 1)  # another order
    got = reidentification(orig, rel)
    ref = _reid_brute(orig, rel)
    assert got["reid_expected_matches"] == pytest.approx(ref["expected"], rel=1e-12)
    assert got["reid_sample_uniques"] == ref["uniques"]
    assert got["reid_unique_matches"] == ref["hits"]
    assert got["reid_share"] == pytest.approx(ref["hits"] / ref["uniques"])
    assert 0 < ref["hits"] < ref["uniques"]  # the case exercises both outcomes


def test_reidentification_small_hand_case():
    orig = pd.DataFrame({"k": ["a", "a", "b", "c", "d"]}, index=[1, 2, 3, 4, 5])
    rel = pd.DataFrame({"k": ["a", "b", "b", "d"]}, index=[1, 3, 4, 5])  # 2 dropped, 4 moved
    got = reidentification(orig, rel)
    # 1: cell a has 1 released record, itself -> 1; 3: cell b has 2 -> 1/2; 4: moved -> 0;
    # 5: d unique -> 1. Uniques of the original: 3, 4, 5; matched uniquely: 5 only.
    assert got["reid_expected_matches"] == pytest.approx(2.5)
    assert got["reid_sample_uniques"] == 3 and got["reid_unique_matches"] == 1
    assert got["reid_share"] == pytest.approx(1 / 3)


def test_assess_retained_share_and_released_design(survey, spec):
    """The released file under its own (published) design: a subsample with relabelled pseudo
    PSUs; the metrics count retained records by index label."""
    rel = survey.sample(frac=0.8, random_state=3).drop(columns=["segment", "household", "name"])
    rel["psu"] = rel.groupby("stratum")["psu"].transform(lambda s: s.rank(method="dense"))
    a = assess(survey, rel, spec, domains=["sex"], models=MODELS[:1])
    assert a.metrics["share_retained"] == pytest.approx(0.8, abs=1e-3)
    assert a.metrics["n_released"] == len(rel)
    d = SurveyDesign(rel, "wt", "stratum", "psu")  # the published file has no segment
    ref = d.mean(["bmi"], by="sex", variance="taylor")
    e = a.domain_estimates.set_index(["variable", "statistic", "domain", "level"])
    for (_, level), row in ref.iterrows():
        assert e.loc[("bmi", "mean", "sex", level), "se_released"] == pytest.approx(row["se"])
    assert a.params["design_released"].startswith(f"{len(rel)} records")
    assert a.params["models"] == [MODELS[0]]
    assert len(a.model_coefficients) == 13
