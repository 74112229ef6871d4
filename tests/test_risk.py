"""Risk strata, GenMASSC scores (paper 000, eq. 1-2, Table 1(b)) and log-linear risk (paper 001)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pandas as pd
import pytest
from helpers import paper000_table1

from sdl_design.engine.partitions import profile_rows
from sdl_design.risk import (
    RiskInputError,
    cell_sizes,
    fit_poisson_loglinear,
    genmassc_scores,
    loglinear_risk,
    risk_profile,
    risk_strata,
    risk_summary,
)
from sdl_design.spec import KeySpec, SensitiveSpec, parse_spec

# ---------------------------------------------------------------- paper 000, Table 1(b)

TABLE_1B = paper000_table1()
ALC = {"alc": {"Y": 1.0, "N": 0.0}}
SCORES_1B = [0, 1, 1, 1, 0, 1, 4 / 9, 1, 4 / 9, 4 / 9]
STRATA_1B = ["D", "D", "D", "U", "D", "U", "T", "U", "T", "T"]


def test_table_1b_scores_and_strata():
    keys = ["age", "gender"]
    r = genmassc_scores(TABLE_1B, keys, ALC)
    assert r.index.equals(TABLE_1B.index)
    np.testing.assert_allclose(r.to_numpy(), SCORES_1B, rtol=0, atol=1e-15)
    s = risk_strata(TABLE_1B, keys)
    assert s.tolist() == STRATA_1B
    assert cell_sizes(TABLE_1B, keys).tolist() == [2, 2, 2, 1, 2, 1, 3, 1, 3, 3]


def test_table_1b_with_keys_recoded_from_years():
    """Age in years, recoded by the key's bins to the paper's four groups: same strata and scores."""
    years = {1: [13, 16], 2: [17, 20], 3: [21, 24], 4: [25, 29]}
    rng = np.random.default_rng(3)
    df = TABLE_1B.assign(age=[int(rng.integers(*years[a], endpoint=True)) for a in TABLE_1B.age])
    keys = [KeySpec(name="age", bins=[12, 17, 21, 25, 30]), "gender"]
    sens = [SensitiveSpec(name="alc", sensitivity={"Y": 1.0, "N": 0.0})]
    np.testing.assert_allclose(genmassc_scores(df, keys, sens).to_numpy(), SCORES_1B, atol=1e-15)
    assert risk_strata(df, keys).tolist() == STRATA_1B
    # unrecoded years split the clusters: the bins are really applied
    assert (risk_strata(df, ["age", "gender"]) == "U").sum() > 3


def test_table_1b_profile_summary():
    prof = risk_profile(TABLE_1B, ["age", "gender"], ALC, loglinear=False)
    st = prof.by_stratum.set_index("stratum")
    assert st["n_records"].tolist() == [3, 4, 3, 0]
    assert st["n_profiles"].tolist() == [3, 2, 1, 0]
    assert st.loc["D", "mean_score"] == pytest.approx(0.5)
    assert st.loc["T", "max_score"] == pytest.approx(4 / 9)
    sz = prof.by_profile_size.set_index("profile_size")
    assert sz["n_records"].tolist() == [3, 4, 3]
    m = prof.metrics
    assert (m["n_unique"], m["n_double"], m["n_triple"], m["n_other"]) == (3, 4, 3, 0)
    assert m["unique_share"] == pytest.approx(0.3)
    assert m["mean_score"] == pytest.approx(sum(SCORES_1B) / 10)


def test_cell_sizes_match_groupby_and_summary_adds_up():
    rng = np.random.default_rng(1)
    n = 5000
    df = pd.DataFrame(
        {
            "a": rng.integers(0, 30, n),
            "b": rng.choice(["x", "y", None], n),
            "c": rng.integers(0, 40, n).astype(float),
        }
    )
    keys = ["a", "b", KeySpec(name="c", bins=[0, 10, 20, 41])]
    ref = (
        df.assign(c=pd.cut(df["c"], [0, 10, 20, 41], right=False), b=df["b"].fillna("NA"))
        .groupby(["a", "b", "c"], observed=True)["a"]
        .transform("size")
    )
    sizes = cell_sizes(df, keys)
    assert sizes.tolist() == ref.tolist()
    want = np.array(["U", "D", "T", "O"])[np.minimum(ref.to_numpy(), 4) - 1]
    assert risk_strata(df, keys).tolist() == want.tolist()
    prof = risk_profile(df, keys, loglinear=False)
    bs = prof.by_profile_size
    assert (bs["n_records"] == bs["profile_size"] * bs["n_profiles"]).all()
    assert bs["n_records"].sum() == n == prof.by_stratum["n_records"].sum()


# ---------------------------------------------------------------- eq. (1) and the Gini index


def _brute_eta(values: list, lam) -> float:
    m = len(values)
    if m < 2:
        return 0.0
    tot = sum(lam(a, b) for a, b in itertools.combinations(values, 2))
    return 0.5 * tot / math.comb(m, 2)  # eq. 1 term by term


def test_eq1_is_half_gini_with_unit_distances():
    """With lambda = 1 off the diagonal, eta = m/(2(m-1)) (1 - sum p_hat^2) per cluster (half the
    Gini index, small-sample form) and its expectation over multinomial clusters is (1-sum p^2)/2."""
    rng = np.random.default_rng(7)
    n = 400
    df = pd.DataFrame({"k": rng.integers(0, 60, n), "y": rng.choice(list("abcd"), n)})
    all_one = {"y": {c: 1.0 for c in "abcd"}}  # zeta = 1 so r = 1 - eta
    eta = 1.0 - genmassc_scores(df, ["k"], all_one)
    for _, grp in df.groupby("k"):
        vals = grp["y"].tolist()
        m = len(vals)
        brute = _brute_eta(vals, lambda a, b: float(a != b))
        p = grp["y"].value_counts(normalize=True).to_numpy()
        closed = 0.0 if m == 1 else m / (2 * (m - 1)) * (1 - np.sum(p**2))
        assert eta[grp.index].to_numpy() == pytest.approx(np.full(m, brute), abs=1e-12)
        assert brute == pytest.approx(closed, abs=1e-12)

    # exact expectation: every ordered cluster of m = 3 draws is one key profile
    p = {"a": 0.5, "b": 0.3, "c": 0.2}
    seqs = list(itertools.product("abc", repeat=3))
    df = pd.DataFrame([(i, v) for i, sq in enumerate(seqs) for v in sq], columns=["k", "y"]).astype(
        {"k": int}
    )
    eta = 1.0 - genmassc_scores(df, ["k"], {"y": dict.fromkeys("abc", 1.0)})
    eta_k = eta.groupby(df["k"]).first()
    prob = np.array([np.prod([p[v] for v in sq]) for sq in seqs])
    assert float(prob @ eta_k.to_numpy()) == pytest.approx(
        0.5 * (1 - sum(x**2 for x in p.values())), abs=1e-12
    )


def test_eq1_general_distances_and_max_over_variables():
    """A custom Lambda matches eq. 1 term by term; r is the max over sensitive variables."""
    lam = pd.DataFrame(
        [[0, 0.5, 1], [0.5, 0, 0.25], [1, 0.25, 0]], index=[0, 1, 2], columns=[0, 1, 2]
    )
    rng = np.random.default_rng(11)
    n = 300
    df = pd.DataFrame(
        {"k": rng.integers(0, 40, n), "y": rng.integers(0, 3, n), "z": rng.integers(0, 2, n)}
    )
    sy = {0: 0.2, 1: 0.6, 2: 1.0}
    sz = {0: 0.0, 1: 0.9}
    r = genmassc_scores(df, ["k"], {"y": sy, "z": sz}, distances={"y": lam})
    for _, grp in df.groupby("k"):
        ey = _brute_eta(grp["y"].tolist(), lambda a, b: lam.loc[a, b])
        ez = _brute_eta(grp["z"].tolist(), lambda a, b: float(a != b))
        ry = (1 - ey) * grp["y"].map(sy).mean()
        rz = (1 - ez) * grp["z"].map(sz).mean()
        np.testing.assert_allclose(r[grp.index], max(ry, rz), atol=1e-12)


def test_continuous_sensitive_variable_by_bins():
    df = pd.DataFrame({"k": [1, 1, 2, 2, 2], "income": [0.0, 150_000.0, 30_000.0, 35_000.0, 5e5]})
    sens = [
        SensitiveSpec(
            name="income",
            bins=[0, 1, 50_000, 1e12],
            sensitivity={"0-1": 0.5, "1-50000": 0.1, "50000-1e+12": 1.0},
        )
    ]
    r = genmassc_scores(df, ["k"], sens)
    # cluster 1: two different bins, eta = 1/2, zeta = 0.75; cluster 2: eta = 1/2 * 2/3 = 1/3
    np.testing.assert_allclose(r.to_numpy(), [0.375] * 2 + [2 / 3 * 1.2 / 3] * 3, atol=1e-12)


# ---------------------------------------------------------------- log-linear model (paper 001)


def _population(rng, levels, beta_sd=0.8, mean_lambda=0.6):
    """F_k ~ Poisson(lambda_k) on a full table with main-effects log lambda; one row per person."""
    grids = np.indices(levels).reshape(len(levels), -1)
    eta = sum(rng.normal(0, beta_sd, n)[g] for n, g in zip(levels, grids, strict=True))
    lam = np.exp(eta)
    lam *= mean_lambda / lam.mean()
    F = rng.poisson(lam)
    cells = np.repeat(np.arange(len(F)), F)
    pop = pd.DataFrame(grids.T[cells], columns=[f"x{j}" for j in range(len(levels))])
    pop["cell"] = cells
    return pop, F, lam


def _truth(sample: pd.DataFrame, F: np.ndarray):
    f = np.bincount(sample["cell"], minlength=len(F))
    su = np.flatnonzero(f == 1)
    return float((F[su] == 1).sum()), float((1.0 / F[su]).sum()), su


def _assert_close_to_oracle(res, nu: np.ndarray, t1: float, t2: float) -> None:
    """tau1, tau2 within 12% / 8% of eq. 4 at the true lambda (nu = lambda (1 - pi) of each
    sample unique), and within 3 model SDs (plus that margin) of the realised counts t1, t2."""
    o1, o2 = np.exp(-nu).sum(), (-np.expm1(-nu) / nu).sum()
    sd1, sd2 = _model_sd(nu)
    assert res.tau1 == pytest.approx(o1, rel=0.12)
    assert res.tau2 == pytest.approx(o2, rel=0.08)
    assert abs(res.tau1 - t1) < 3 * sd1 + 0.12 * o1
    assert abs(res.tau2 - t2) < 3 * sd2 + 0.08 * o2


def _model_sd(nu: np.ndarray) -> tuple[float, float]:
    """SD of tau1 and tau2 given the sample under F = 1 + Poisson(nu) for each sample unique."""
    p1 = np.exp(-nu)
    x = np.arange(200)[:, None]
    logpmf = (
        -nu
        + x * np.log(np.maximum(nu, 1e-300))
        - np.array([math.lgamma(v + 1) for v in x[:, 0]])[:, None]
    )
    pmf = np.exp(logpmf)
    e1 = (pmf / (1 + x)).sum(0)
    e2 = (pmf / (1 + x) ** 2).sum(0)
    return float(np.sqrt(np.sum(p1 * (1 - p1)))), float(np.sqrt(np.sum(e2 - e1**2)))


LEVELS = [6, 5, 4, 8, 2, 3]  # 5,760 cells
KEYS = [f"x{j}" for j in range(len(LEVELS))]


def test_loglinear_bernoulli_sample_close_to_truth():
    rng = np.random.default_rng(2009)
    pop, F, lam = _population(rng, LEVELS)
    pi = 0.1
    s = pop[rng.random(len(pop)) < pi]
    t1, t2, su = _truth(s, F)
    res = loglinear_risk(s, KEYS, pi=pi)
    assert res.method == "ML" and res.fit.converged
    assert res.n_unique == len(su) and res.p_unique.notna().sum() == len(su)
    _assert_close_to_oracle(res, lam[su] * (1 - pi), t1, t2)  # eq. 4 with the true lambda
    assert t1 > 30  # enough population uniques for the check to mean something
    # per record values are the eq. 4 functions of the fitted lambda
    u = res.p_unique.notna()
    nu_hat = res.lam[u] * (1 - pi)
    np.testing.assert_allclose(res.p_unique[u], np.exp(-nu_hat), rtol=1e-12)
    np.testing.assert_allclose(res.e_inv_f[u], (1 - np.exp(-nu_hat)) / nu_hat, rtol=1e-12)
    assert res.tau1 == pytest.approx(res.p_unique.sum())


def test_pseudo_ml_unequal_weights_close_to_truth():
    """Sampling fraction by stratum (a key, as the paper advises); weights 1/pi; eq. 7."""
    rng = np.random.default_rng(2008)
    pop, F, lam = _population(rng, LEVELS)
    pi_by = np.array([0.04, 0.08, 0.12, 0.2, 0.3, 0.06])
    pi_rec = pi_by[pop["x0"].to_numpy()]
    s = pop[rng.random(len(pop)) < pi_rec].copy()
    s["w"] = 1.0 / pi_by[s["x0"].to_numpy()]
    t1, t2, su = _truth(s, F)
    res = loglinear_risk(s, KEYS, weight="w")
    assert res.method == "pseudo-ML" and res.fit.converged
    _assert_close_to_oracle(res, lam[su] * (1 - pi_by[su // np.prod(LEVELS[1:])]), t1, t2)
    # per record pi_hat = 1/w in eq. 4
    u = res.p_unique.notna()
    nu_hat = res.lam[u] * (1 - 1 / s.loc[u, "w"])
    np.testing.assert_allclose(res.p_unique[u], np.exp(-nu_hat), rtol=1e-12)


def test_pseudo_ml_equal_weights_equals_ml_and_closed_form():
    """Constant weights 1/pi: eq. 7 gives the same lambda as eq. 3 with offset log pi; with main
    effects both equal the independence fit N_hat prod_j (F_hat_j / N_hat) over the full table."""
    rng = np.random.default_rng(5)
    pop, F, lam = _population(rng, [5, 4, 3, 6])
    keys = ["x0", "x1", "x2", "x3"]
    pi = 0.2
    s = pop[rng.random(len(pop)) < pi].assign(w=1 / pi)
    ml = loglinear_risk(s, keys, pi=pi)
    pml = loglinear_risk(s, keys, weight="w")
    np.testing.assert_allclose(pml.lam, ml.lam, rtol=1e-8)
    np.testing.assert_allclose(pml.p_unique, ml.p_unique, rtol=1e-8)
    assert pml.tau1 == pytest.approx(ml.tau1, rel=1e-8)
    # unequal weights: the closed form independence fit
    s = s.assign(w=rng.uniform(1, 9, len(s)))
    res = loglinear_risk(s, keys, weight="w")
    n_hat = s["w"].sum()
    closed = n_hat * np.prod(
        [s[k].map(s.groupby(k)["w"].sum() / n_hat).to_numpy() for k in keys], axis=0
    )
    np.testing.assert_allclose(res.lam, closed, rtol=1e-8)


def test_interactions_fit_two_way_margins_and_structural_zeros():
    """The MLE reproduces every fitted margin; cells in an empty two-way margin get 0 (nested
    keys, e.g. county within region, stay solvable)."""
    rng = np.random.default_rng(9)
    sizes = [4, 6, 3]
    codes = list(np.indices(sizes).reshape(3, -1))
    region_of_county = np.array([0, 0, 1, 2, 3, 3])  # key 1 nested in key 0
    y = rng.poisson(3.0, len(codes[0])).astype(float)
    y[region_of_county[codes[1]] != codes[0]] = 0.0
    pairs = [(0, 1), (0, 2), (1, 2)]
    fit = fit_poisson_loglinear(y, codes, sizes, pairs)
    assert fit.converged
    for a, b in pairs:
        idx = codes[a] * sizes[b] + codes[b]
        obs = np.bincount(idx, weights=y, minlength=sizes[a] * sizes[b])
        np.testing.assert_allclose(
            np.bincount(idx, weights=fit.mu, minlength=len(obs)), obs, atol=1e-6
        )
    assert np.all(fit.mu[region_of_county[codes[1]] != codes[0]] == 0)

    df = pd.DataFrame({"k0": rng.integers(0, 5, 3000), "k1": rng.integers(0, 4, 3000)})
    df["k2"] = df["k0"] * 2 + rng.integers(0, 2, 3000)  # nested
    res = loglinear_risk(df, ["k0", "k1", "k2"], pi=0.5, interactions=[("k0", "k2")])
    assert res.fit.converged and np.isfinite(res.tau2)


def test_census_without_weight_every_sample_unique_is_unique():
    res = loglinear_risk(TABLE_1B, ["age", "gender"])
    assert res.tau1 == 3 and res.tau2 == 3
    assert res.p_unique.notna().tolist() == [s == "U" for s in STRATA_1B]


def _dense_irls(y, codes, sizes, pairs, offset):
    """Brute-force ML fit, independent of the module: dense reference-coded design of the cells in
    no empty two-way margin (unused columns dropped), Newton on the Poisson log-likelihood with
    step halving and a least-squares step (no ridge), to the rounding floor of the score."""
    keep = np.ones(len(y), dtype=bool)
    for a, b in pairs:
        idx = codes[a] * sizes[b] + codes[b]
        keep &= np.bincount(idx, weights=y, minlength=sizes[a] * sizes[b])[idx] > 0
    cols = [np.ones(len(y))]
    cols += [codes[j] == lv for j in range(len(sizes)) for lv in range(1, sizes[j])]
    cols += [
        (codes[a] == i) & (codes[b] == j)
        for a, b in pairs
        for i in range(1, sizes[a])
        for j in range(1, sizes[b])
    ]
    x = np.column_stack(cols).astype(float)[keep]
    x = x[:, x.sum(0) > 0]
    yk, off = y[keep], np.broadcast_to(offset, y.shape)[keep]
    beta = np.linalg.lstsq(x, np.log(yk + 0.5) - off, rcond=None)[0]

    def loglik(b):
        eta = off + x @ b
        return float(yk @ eta - np.exp(eta).sum())

    for _ in range(100):
        mu = np.exp(off + x @ beta)
        step = np.linalg.lstsq(x.T @ (mu[:, None] * x), x.T @ (yk - mu), rcond=None)[0]
        for _ in range(40):
            if loglik(beta + step) >= loglik(beta) - 1e-12 * abs(loglik(beta)):
                break
            step /= 2
        beta = beta + step
        if np.max(np.abs(step)) < 1e-13:
            break
    mu = np.zeros(len(y))
    mu[keep] = np.exp(off + x @ beta)
    return mu, int(keep.sum()), x.shape[1]


def _risk_by_hand(s, keys, sizes, lam_cell, weight=None, pi=None):
    """eq. 4 for each sample unique from each cell's lambda: (tau1, tau2, p, e) by record."""
    cell = np.ravel_multi_index([s[k].to_numpy() for k in keys], sizes)
    unique = np.bincount(cell, minlength=len(lam_cell))[cell] == 1
    one_minus_pi = 1 - (1 / s[weight].to_numpy() if weight else pi)
    nu = lam_cell[cell] * one_minus_pi
    p, e = np.where(unique, np.exp(-nu), np.nan), np.where(unique, -np.expm1(-nu) / nu, np.nan)
    return np.nansum(p), np.nansum(e), p, e


@pytest.mark.parametrize(
    "pairs, weight, pi",
    [
        ([], "w", None),
        ([], None, 0.1),
        ([(0, 2), (1, 3)], "w", None),
        ([(0, 2)], None, 0.1),
        (list(itertools.combinations(range(4), 2)), "w", None),
    ],
)
def test_loglinear_fit_equals_brute_force_irls(pairs, weight, pi):
    """The fitted lambda, tau1, tau2 and each unique's P(F=1|f=1), E(1/F|f=1) (eq. 1-7) equal a
    dense Newton fit of the reference-coded design to 1e-9: zero cells, empty two-way margins
    (k0 = 3 with k2 = 4 never sampled: their cells out of the fit, lambda 0), the ML offset log(pi);
    main effects also equal the closed form N_hat prod_j (F_hat_j / N_hat)."""
    rng = np.random.default_rng(37)
    sizes = [4, 3, 5, 6]  # 360 cells
    keys = [f"k{j}" for j in range(4)]
    probs = [rng.dirichlet(np.full(n, 1.5)) for n in sizes]
    s = pd.DataFrame(
        {k: rng.choice(n, 1500, p=q) for k, n, q in zip(keys, sizes, probs, strict=True)}
    )
    s["k2"] = np.where(rng.random(len(s)) < 0.5, s["k0"], s["k2"])  # a k0-k2 association
    s = s[~((s["k0"] == 3) & (s["k2"] == 4))].reset_index(drop=True)
    s[keys] = s[keys].apply(lambda c: pd.factorize(c)[0])  # codes as the fit orders levels
    s["w"] = rng.lognormal(2.0, 0.5, len(s))
    named = [(keys[a], keys[b]) for a, b in pairs]
    res = loglinear_risk(s, keys, weight=weight, pi=pi, interactions=named)

    codes = list(np.indices(sizes).reshape(4, -1))
    cell = np.ravel_multi_index([s[k].to_numpy() for k in keys], sizes)
    y = np.bincount(cell, weights=s[weight] if weight else None, minlength=360).astype(float)
    mu, n_cells, n_params = _dense_irls(y, codes, sizes, pairs, 0.0 if weight else np.log(pi))
    lam_cell = mu if weight else mu / pi
    tau1, tau2, p, e = _risk_by_hand(s, keys, sizes, lam_cell, weight, pi)
    assert (y == 0).sum() > 100 and res.fit.converged
    assert res.tau1 == pytest.approx(tau1, rel=1e-9) and res.tau2 == pytest.approx(tau2, rel=1e-9)
    np.testing.assert_allclose(res.p_unique, p, rtol=1e-9)
    np.testing.assert_allclose(res.e_inv_f, e, rtol=1e-9)
    np.testing.assert_allclose(res.lam, lam_cell[cell], rtol=1e-9)
    np.testing.assert_allclose(res.fit.mu, mu, rtol=1e-9, atol=1e-12 * mu.max())
    assert (res.info["model_cells"], res.info["n_params"]) == (n_cells, n_params)
    for a, b in pairs:  # cells of an empty two-way margin: out of the fit, lambda 0
        idx = codes[a] * sizes[b] + codes[b]
        empty = np.bincount(idx, weights=y, minlength=sizes[a] * sizes[b])[idx] == 0
        assert np.all(res.fit.mu[empty] == 0) and (empty.any() or (a, b) != (0, 2))
    if not pairs:
        n_hat = y.sum()
        margins = [
            np.bincount(c, weights=y, minlength=n) / n_hat
            for c, n in zip(codes, sizes, strict=True)
        ]
        closed = n_hat * np.prod([m[c] for m, c in zip(margins, codes, strict=True)], axis=0)
        np.testing.assert_allclose(lam_cell, closed / (1 if weight else pi), rtol=1e-9)


def test_fit_of_some_cells_with_an_offset_equals_brute_force_irls():
    """fit_poisson_loglinear on rows that cover part of the table, with a row offset: the
    same fit as the dense Newton fit of those rows (cells with no row are out of the fit)."""
    rng = np.random.default_rng(11)
    sizes = [4, 5, 3]
    codes = np.indices(sizes).reshape(3, -1)
    rows = np.flatnonzero(rng.random(60) < 0.8)
    cc = [c[rows] for c in codes]
    y = rng.poisson(4.0, len(rows)).astype(float)
    off = rng.normal(0.0, 0.3, len(rows))
    for pairs in ([], [(0, 1)], [(0, 1), (1, 2), (0, 2)]):
        fit = fit_poisson_loglinear(y, cc, sizes, pairs, off)
        mu, n_cells, n_params = _dense_irls(y, cc, sizes, pairs, off)
        assert fit.converged and (fit.n_cells, fit.n_params) == (n_cells, n_params)
        np.testing.assert_allclose(fit.mu, mu, rtol=1e-9)
        assert fit.deviance == pytest.approx(
            2 * np.sum(np.where(y > 0, y * np.log(np.where(y > 0, y, 1) / mu), 0) - (y - mu))
        )


# ---------------------------------------------------------------- bad input


def test_bad_input_clear_errors():
    keys = ["age", "gender"]
    with pytest.raises(RiskInputError, match=r"keys: column\(s\) \['sex'\] are not in the data"):
        risk_strata(TABLE_1B, ["age", "sex"])
    with pytest.raises(RiskInputError, match="no records"):
        risk_strata(TABLE_1B.iloc[:0], keys)
    with pytest.raises(RiskInputError, match="no records"):
        genmassc_scores(TABLE_1B.iloc[:0], keys, ALC)
    with pytest.raises(RiskInputError, match=r"sensitive\['alc'\].*\['N'\].*no sensitivity score"):
        genmassc_scores(TABLE_1B, keys, {"alc": {"Y": 1.0}})
    with pytest.raises(RiskInputError, match=r"sensitive: column\(s\) \['drink'\]"):
        genmassc_scores(TABLE_1B, keys, {"drink": {"Y": 1.0}})
    with pytest.raises(RiskInputError, match="out_of_range"):
        genmassc_scores(
            TABLE_1B.assign(v=[1.0] * 9 + [99.0]),
            keys,
            [SensitiveSpec(name="v", bins=[0, 10], sensitivity={"0-10": 1.0})],
        )
    with pytest.raises(RiskInputError, match="'nan'"):
        genmassc_scores(TABLE_1B.assign(alc=["Y"] * 9 + [None]), keys, ALC)
    with pytest.raises(RiskInputError, match=r"distances\['alc'\].*('Y' and 'N'|'N' and 'Y')"):
        genmassc_scores(TABLE_1B, keys, ALC, distances={"alc": {"Y": {"Y": 0}}})
    with pytest.raises(RiskInputError, match="weight: 1 records"):
        loglinear_risk(TABLE_1B.assign(w=[1.0] * 9 + [0.0]), keys, weight="w")
    with pytest.raises(RiskInputError, match=r"weight: column\(s\) \['wt'\]"):
        loglinear_risk(TABLE_1B, keys, weight="wt")
    with pytest.raises(RiskInputError, match="max_cells"):
        loglinear_risk(TABLE_1B, keys, pi=0.5, max_cells=5)


# ---------------------------------------------------------------- the Prefect task


def _small_spec(**gates):
    return parse_spec(
        {
            "release": {"name": "t", "year": 2026, "seed": 1},
            "design": {"weight": "wt", "strata": "stratum", "psu": "psu"},
            "variables": {
                "direct_identifiers": ["person_id"],
                "keys": [{"name": "age", "bins": [0, 18, 45, 65, 91]}, "sex", "region", "county"],
                "sensitive": [
                    {"name": "diabetes", "sensitivity": {1: 1.0, 0: 0.0}},
                    {
                        "name": "income",
                        "bins": [0, 1, 50000, 1.0e12],
                        "sensitivity": {"0-1": 0.5, "1-50000": 0.1, "50000-1e+12": 1.0},
                    },
                ],
                "study": ["income", "diabetes"],
            },
            "gates": gates,
        }
    )


def _small_frame(n=600, seed=4):
    rng = np.random.default_rng(seed)
    return pd.DataFrame(
        {
            "person_id": [f"p{i}" for i in range(n)],
            "stratum": rng.integers(1, 4, n),
            "psu": rng.integers(1, 3, n),
            "wt": rng.uniform(50, 150, n),
            "age": rng.integers(0, 91, n),
            "sex": rng.choice(["female", "male"], n),
            "region": rng.choice(["northeast", "midwest", "south", "west", "x1", "x2"], n),
            "county": rng.integers(0, 12, n),
            "diabetes": rng.integers(0, 2, n),
            "income": np.where(rng.random(n) < 0.1, 0.0, rng.lognormal(10, 1, n)),
        }
    )


def test_risk_task_runs_on_small_frame():
    from conftest import run_stage

    from sdl_design.stages.risk import RiskStage

    df = _small_frame()
    spec = _small_spec(max_unique_share=0.5)
    out = run_stage(RiskStage, df, spec, 1)
    assert out.name == "risk" and out.data is df
    keys = spec.variables.keys
    strata = risk_strata(df, keys)
    m = out.metrics
    assert m["n_unique"] == (strata == "U").sum() > 0
    assert m["unique_share"] == pytest.approx((strata == "U").mean())
    assert m["n_double"] == (strata == "D").sum()
    # each record's measures: its key profile's row of the profiles table
    prof = out.tables["profiles"]
    assert prof["count"].sum() == len(df)
    rec = prof.iloc[profile_rows(df, keys, prof)].reset_index(drop=True)
    assert rec["stratum"].tolist() == strata.astype(str).tolist()
    # r_k: the larger of the one-variable scores of diabetes and of income in its bins (eq. 1-2)
    r_each = np.column_stack(
        [genmassc_scores(df, keys, [s]).to_numpy() for s in spec.variables.sensitive]
    )
    np.testing.assert_allclose(rec["risk_score"], r_each.max(axis=1), atol=1e-12)
    assert m["max_score"] == pytest.approx(r_each.max())
    assert m["mean_score"] == pytest.approx(r_each.max(axis=1).mean())
    # tau1, tau2: the pseudo-ML log-linear fit on the design weight (paper 001 eq. 7), fitted alone
    ll = loglinear_risk(df, keys, weight="wt")
    assert ll.method == "pseudo-ML"
    assert m["tau1"] == pytest.approx(ll.tau1, rel=1e-9)
    assert m["tau2"] == pytest.approx(ll.tau2, rel=1e-9)
    np.testing.assert_allclose(rec["p_unique"], ll.p_unique.to_numpy(), rtol=1e-9)
    # the tables by stratum and by profile size are risk_summary's on the records
    want = risk_summary(risk_profile(df, keys, spec.variables.sensitive, weight="wt").records)
    for name in ("by_stratum", "by_profile_size"):
        pd.testing.assert_frame_equal(out.tables[name], want[name], rtol=1e-12, check_dtype=False)
    assert m["tau2"] >= m["tau1"] - 1e-12  # E(1/F) >= P(F = 1)
    assert out.tables["by_stratum"]["n_records"].sum() == len(df)
    # the input's risk is a diagnostic: max_unique_share is gated on the published file
    assert out.gates == []


def test_risk_stage_is_one_kernel_on_one_partition_or_many():
    """run (the frame's profile table: one partition) and run_partitions (the scan's table,
    three partitions' combined) give the same metrics, tables and figure."""
    from types import SimpleNamespace

    from conftest import run_stage

    from sdl_design.engine.partitions import combine_profiles, profile_counts
    from sdl_design.stage import StageContext
    from sdl_design.stages.risk import RiskStage

    df = _small_frame()
    spec = _small_spec(max_unique_share=0.5)
    whole = run_stage(RiskStage, df, spec, 1)
    stage = RiskStage.from_spec(spec)
    v = spec.variables
    chunks = np.array_split(np.arange(len(df)), 3)
    profiles = combine_profiles(
        [profile_counts(df.iloc[c], v.keys, spec.design.weight, v.sensitive) for c in chunks]
    )
    records = SimpleNamespace(run=SimpleNamespace(scan={"profiles": profiles}))
    parts = stage.run_partitions(records, StageContext(df, spec, "risk"))
    assert parts.data is None and whole.data is df
    assert set(parts.metrics) == set(whole.metrics)
    for k, x in whole.metrics.items():
        assert parts.metrics[k] == pytest.approx(x, rel=1e-12, abs=1e-15), k
    assert list(parts.tables) == list(whole.tables) == ["profiles", "by_stratum", "by_profile_size"]
    for name, t in whole.tables.items():
        pd.testing.assert_frame_equal(parts.tables[name], t, rtol=1e-12)
    assert parts.notes == whole.notes and parts.params == whole.params
    assert set(parts.figures) == set(whole.figures) == {"score_hist"}


def test_profile_measures_refuse_a_table_over_the_log_linear_bound(monkeypatch):
    from sdl_design.engine import partitions as P

    df = _small_frame()
    spec = _small_spec()
    profiles = P.profile_counts(df, spec.variables.keys, "wt")
    monkeypatch.setattr(P, "MAX_CELLS", 5)
    with pytest.raises(RiskInputError, match="more than max_cells=5; coarsen keys"):
        P.profile_measures(profiles, spec.variables.keys)
    assert P.profile_measures(profiles, spec.variables.keys, loglinear=False).method is None
