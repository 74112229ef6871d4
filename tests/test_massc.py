"""MASSC (paper 000): worked example (Tables 1-3), donor search, optimal rates, selection,
replications."""

from __future__ import annotations

import hashlib

import numpy as np
import pandas as pd
import pytest
from helpers import DEFAULT_SPEC, paper000_table1

from sdl_design.massc import (
    MasscError,
    MasscInfeasible,
    StudyVariables,
    ZMoments,
    delta_measures,
    find_donors,
    information_loss,
    massc_strata,
    optimal_phi,
    optimal_psi,
    select,
    substitute,
    z_moments,
)
from sdl_design.spec import KeySpec

# ---------------------------------------------------------------- paper 000, Tables 1-3

TABLE = paper000_table1().assign(w=1.0)
TABLE["binge"] = (TABLE["alc"] == "Y").astype(float)
KEYS = ["age", "gender"]
ALC = {"alc": {"Y": 1.0, "N": 0.0}}
# Table 3 'Sub' column (record 8: any of 1, 2, 3 gives the same z~; record 1, 5: any of 7, 9, 10)
PARTNER = {4: 6, 6: 4, 8: 2, 2: 8, 3: 8, 1: 7, 5: 7, 9: 8, 7: 8, 10: 8}
DONOR = np.array([PARTNER[k] - 1 for k in TABLE.index])
SUBSTITUTED = TABLE.index.isin([5, 6, 10])
RETAINED = ~TABLE.index.isin([3, 4])
NU = {"D": "NU", "T": "NU", "O": "NU"}
# z = 1 if male and binge drinking: binge within the domain gender = M
ZVARS = StudyVariables(["binge"], {"gender": ["M"]}, [KeySpec(name="gender")])


def _example_moments() -> tuple[ZMoments, np.ndarray, np.ndarray]:
    strata = massc_strata(TABLE, KEYS, NU)
    assert strata.tolist() == ["NU", "NU", "NU", "U", "NU", "U", "NU", "U", "NU", "NU"]
    tilde = substitute(TABLE, DONOR, np.ones(10, dtype=bool), KEYS)
    m = z_moments(TABLE, tilde, strata, "w", ZVARS, substituted=SUBSTITUTED)
    assert m.strata == ["NU", "U"]
    return m, np.array([2 / 7, 1 / 3]), np.array([6 / 7, 2 / 3])


def test_worked_example_information_loss():
    m, psi, phi = _example_moments()
    np.testing.assert_allclose(m.N, [7, 3])
    np.testing.assert_allclose(m.theta / 10, [0.40])
    np.testing.assert_allclose(m.S2_nu[:, 0], [5 / 21, 4 / 3], atol=1e-14)
    np.testing.assert_allclose(m.S2_zstar[:, 0], [5 / 21, 0.0], atol=1e-14)
    # (8a): 8/9 + 50/147 + (5/21)^2 = 1.2857 (the text prints 1.67, see papers/README.md)
    np.testing.assert_allclose(m.bias_msq(psi), [8 / 9 + 50 / 147 + (5 / 21) ** 2], atol=1e-14)
    np.testing.assert_allclose(m.bias_msq(psi), [1.2857], atol=5e-5)
    np.testing.assert_allclose(m.variance(phi), [5 / 18], atol=1e-14)
    il = information_loss(m, psi, phi)
    np.testing.assert_allclose(il["rrmse"], [np.sqrt(9 / 7 + 5 / 18) / 4], atol=1e-14)


def test_worked_example_delta():
    b1 = substitute(TABLE, DONOR, SUBSTITUTED, KEYS)
    # records 5, 6, 10 take the profiles of their partners (3M, 1M, 2M); SVs are kept
    assert b1.loc[[5, 6, 10], "gender"].tolist() == ["M", "M", "M"]
    assert b1.loc[[5, 6, 10], "age"].tolist() == [3, 1, 2]
    assert b1["alc"].equals(TABLE["alc"])
    assert TABLE.loc[[5, 6, 10], "gender"].tolist() == ["F", "F", "M"]  # input untouched
    for basis in ("original", "max"):
        d = delta_measures(TABLE, b1, SUBSTITUTED, RETAINED, KEYS, ALC, risk_basis=basis)
        t = d.by_appearance.set_index("appearance")["delta_bar"]
        np.testing.assert_allclose(t[["u", "d", "t", "o"]], [0.10, 0.10, 8 / 90, 0.0], atol=1e-14)
        assert d.delta == pytest.approx(0.10)
        # the text's per-record values (Table 3): only 8, 2, 9, 7 contribute
        np.testing.assert_allclose(d.delta_k, [0, 1, 0, 0, 0, 0, 4 / 9, 1, 4 / 9, 0], atol=1e-14)
    # r(2) recomputed in B(2): the 3M cluster there is {5*, 9, 7} = (N, Y, N): r = 2/3 * 1/3
    d = delta_measures(TABLE, b1, SUBSTITUTED, RETAINED, KEYS, ALC, risk_basis="treated")
    t = d.by_appearance.set_index("appearance")["delta_bar"]
    assert t["t"] == pytest.approx(2 * (2 / 9) / 10)
    # eq. 4: the profile 2M (record 8 alone in B(0)) has delta_p = 1
    assert d.profiles["delta_p"].max() == pytest.approx(1.0)


def test_worked_example_poststratification():
    from sdl_design.massc import calibrate_treated

    phi_rec = np.where(massc_strata(TABLE, KEYS, NU) == "U", 2 / 3, 6 / 7)
    b1 = substitute(TABLE, DONOR, SUBSTITUTED, KEYS)
    b2 = b1[RETAINED]
    out, tables, _ = calibrate_treated(
        b2, "w", 1 / phi_rec[RETAINED], TABLE, ["gender"], method="poststratify"
    )
    w = out["w"]
    np.testing.assert_allclose(w[b2["gender"] == "F"], 2.5, atol=1e-10)
    np.testing.assert_allclose(w.loc[[6, 8]], 45 / 46, atol=1e-10)  # 0.978
    np.testing.assert_allclose(w.loc[[5, 9, 7, 10]], 105 / 138, atol=1e-10)  # 0.761
    # the calibrated estimate of theta_z / N: 0.35 in the text
    z = ((b2["gender"] == "M") & (b2["alc"] == "Y")).to_numpy()
    assert (w[z].sum() / 10) == pytest.approx(0.348, abs=1e-3)


# ---------------------------------------------------------------- selection


def test_select_exact_inclusion_rates_and_sizes():
    rng = np.random.default_rng(5)
    groups = np.repeat([0, 1, 2], [7, 5, 8])
    pi = np.r_[np.full(7, 0.3), np.full(5, 0.6), rng.uniform(0.1, 0.9, 8)]
    reps = 4000
    hits = np.zeros(20)
    for _ in range(reps):
        s = select(groups, pi, rng)
        hits += s
        for g in range(3):
            tot = pi[groups == g].sum()
            assert np.floor(tot) - 1e-9 <= s[groups == g].sum() <= np.ceil(tot) + 1e-9
    se = np.sqrt(pi * (1 - pi) / reps)
    assert np.all(np.abs(hits / reps - pi) < 4.5 * se)


def test_bias_formula_8a_matches_monte_carlo():
    """E_psi (theta* - theta)^2 of eq. 8a against repeated stratified SRSWOR substitution."""
    rng = np.random.default_rng(11)
    h = np.repeat([0, 1], [40, 80])
    nu = np.r_[rng.normal(0.5, 1.0, 40), rng.normal(-0.2, 2.0, 80)]
    psi = np.array([0.25, 0.125])  # integer sample sizes 10 and 10
    N = np.bincount(h).astype(float)
    V = np.bincount(h, weights=nu)[:, None]
    S2 = np.array([nu[h == k].var(ddof=1) for k in range(2)])[:, None]
    m = ZMoments([("y", "", "")], ["a", "b"], N, np.array([50.0]), V, S2)
    mc = []
    for _ in range(6000):
        d1 = select(h, psi[h], rng)
        mc.append((nu * d1).sum())
    mc = np.array(mc)
    assert np.mean(mc**2) == pytest.approx(m.bias_msq(psi)[0], rel=0.06)


# ---------------------------------------------------------------- optimal rates


def _two_strata(seed: int = 2) -> ZMoments:
    rng = np.random.default_rng(seed)
    N = np.array([300.0, 900.0])
    q = 3
    theta = rng.uniform(200, 400, q)
    V = rng.normal(0, 40, (2, q))
    S2 = rng.uniform(0.5, 3.0, (2, q))
    return ZMoments([(f"z{i}", "", "") for i in range(q)], ["U", "NU"], N, theta, V, S2, S2 * 3)


def test_optimal_psi_matches_grid_and_meets_constraints():
    m = _two_strata()
    cost = np.array([2.0, 1.0])
    alpha = 0.004
    res = optimal_psi(m, alpha, psi_max=0.25, cost=cost)
    assert np.all((res.rates > 0) & (res.rates <= 0.25))
    assert (m.bias_msq(res.rates) / m.theta**2).max() <= alpha * (1 + 1e-8)
    grid = np.linspace(0.001, 0.25, 500)
    a, b = np.meshgrid(grid, grid, indexing="ij")
    P = np.stack([a.ravel(), b.ravel()], axis=1)
    g = (((m.N * P * (1 - P)) @ m.S2_nu + (P @ m.V) ** 2) / m.theta**2).max(axis=1)  # (8a)
    assert np.allclose(g[7], (m.bias_msq(P[7]) / m.theta**2).max())
    f = (cost * m.N * (1 - P) / P).sum(axis=1) / m.N.sum()
    f_grid = f[g <= alpha].min()
    assert res.objective <= f_grid * (1 + 1e-9)
    assert res.objective == pytest.approx(f_grid, rel=5e-3)
    # a loose bound is met at the upper corner: psi = psi_max
    assert np.allclose(optimal_psi(m, 10.0, psi_max=0.2).rates, 0.2)


def test_optimal_phi_matches_grid_and_meets_constraints():
    m = _two_strata(4)
    beta = 0.2 * (m.variance(np.full(2, 0.5)) / m.theta**2).max()  # binding, feasible below 0.99
    res = optimal_phi(m, beta, phi_min=0.5, phi_max=0.99)
    assert np.all((res.rates >= 0.5) & (res.rates <= 0.99))
    assert (m.variance(res.rates) / m.theta**2).max() <= beta * (1 + 1e-8)
    grid = np.linspace(0.5, 0.99, 500)
    a, b = np.meshgrid(grid, grid, indexing="ij")
    P = np.stack([a.ravel(), b.ravel()], axis=1)
    g = (((m.N * (1 / P - 1)) @ m.S2_zstar) / m.theta**2).max(axis=1)  # (8b)
    assert np.allclose(g[7], (m.variance(P[7]) / m.theta**2).max())
    f = (m.N * P / (1 - P)).sum(axis=1) / m.N.sum()
    f_grid = f[g <= beta].min()
    assert res.objective <= f_grid * (1 + 1e-9)
    assert res.objective == pytest.approx(f_grid, rel=5e-3)


def test_infeasible_rates_say_which_constraint_and_by_how_much():
    m = _two_strata(4)
    with pytest.raises(MasscInfeasible, match=r"\(8b\) variance.*excess"):
        optimal_phi(m, 1e-9, phi_min=0.5, phi_max=0.9)
    with pytest.raises(MasscInfeasible, match=r"\(8a\) bias"):
        optimal_psi(m, 1e-12, psi_max=0.25, psi_min=0.05)


# ---------------------------------------------------------------- donor search


def _small_file(n: int = 400, seed: int = 3) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    return pd.DataFrame(
        {
            "a": rng.choice(["a0", "a1", "a2"], n, p=[0.6, 0.3, 0.1]),
            "b": rng.choice(["b0", "b1"], n, p=[0.8, 0.2]),
            "c": rng.choice(["c0", "c1", "c2", "c3"], n, p=[0.4, 0.3, 0.2, 0.1]),
            "y": rng.choice(["y0", "y1", "y2"], n, p=[0.5, 0.3, 0.2]),
            "s": rng.choice([0, 1], n, p=[0.7, 0.3]),
            "grp": rng.choice(["g0", "g1"], n),
        }
    )


def _brute_force(df, keys, sens, imp, restr):
    """Distance of every record to its nearest valid donor, by enumeration of record pairs."""
    n = len(df)
    grp = df[restr].astype(str).agg("|".join, axis=1) if restr else pd.Series("", index=df.index)
    cost = {}
    for g, sub in df.groupby(grp.to_numpy()):
        for v in keys + sens:
            p = sub[v].value_counts(normalize=True).to_numpy()
            cost[g, v] = imp.get(v, 1.0) / (1 - (p**2).sum())
    vals = {v: df[v].to_numpy() for v in keys + sens}
    g_arr = grp.to_numpy()
    best = np.full(n, np.inf)
    for i in range(n):
        for j in range(n):
            if g_arr[i] != g_arr[j] or all(vals[v][i] == vals[v][j] for v in keys):
                continue
            d = sum(cost[g_arr[i], v] for v in keys + sens if vals[v][i] != vals[v][j])
            best[i] = min(best[i], d)
    return best, cost, g_arr


@pytest.mark.parametrize("restr", [[], ["grp"]])
def test_donor_search_equals_brute_force(restr):
    df = _small_file(250)
    keys, sens = ["a", "b", "c"], ["y", "s"]
    imp = {"a": 3.0, "y": 0.5}
    res = find_donors(df, keys, {v: {} for v in sens}, imp, restr, rng=1)
    best, cost, g_arr = _brute_force(df, keys, sens, imp, restr)
    np.testing.assert_allclose(res.distance, best, rtol=1e-12)
    ok = res.donor >= 0
    assert ok.all()
    for i, j in enumerate(res.donor):
        assert i != j and g_arr[i] == g_arr[j]
        diff = [v for v in keys + sens if df[v].iat[i] != df[v].iat[j]]
        assert any(v in keys for v in diff)  # at least one key changed
        assert sum(cost[g_arr[i], v] for v in diff) == pytest.approx(best[i])


def test_donor_search_reports_records_without_donor():
    df = pd.DataFrame({"k": ["x", "x", "y", "z"], "grp": [1, 1, 1, 2], "y": [0, 1, 0, 1]})
    res = find_donors(df, ["k"], {"y": {}}, restrictions=["grp"], rng=0)
    assert res.donor[3] == -1 and np.isinf(res.distance[3])  # alone in its donor set
    assert res.donor[2] in (0, 1) and res.donor[0] == 2 and res.donor[1] == 2


# ---------------------------------------------------------------- stage on the default survey


@pytest.fixture(scope="module")
def survey():
    from sdl_design.spec import load_spec
    from sdl_design.synth import make_survey

    spec = load_spec(DEFAULT_SPEC)
    df = make_survey(2500, seed=7, replicates=False)
    return spec, df


def _digest(df: pd.DataFrame) -> str:
    return hashlib.sha256(
        pd.util.hash_pandas_object(df, index=True).to_numpy().tobytes()
    ).hexdigest()


def test_massc_task_reproducible_and_consistent(survey):
    from sdl_design.massc.stage import massc_result as massc_task_fn

    spec, df = survey
    a = massc_task_fn(df, spec, 123, df)
    b = massc_task_fn(df, spec, 123, df)
    assert _digest(a.data) == _digest(b.data)
    c = massc_task_fn(df, spec, 124, df)
    assert _digest(a.data) != _digest(c.data)
    m = a.metrics
    assert len(a.data) == len(df) - m["n_subsampled_out"]
    assert 0 < m["n_substituted"] < 0.25 * len(df) + 4 * np.sqrt(len(df))
    assert m["epsilon_formula"] <= spec.stages.massc.epsilon + 1e-9
    rates = a.tables["rates"]
    assert (rates["psi"] <= 0.25 + 1e-12).all() and (rates["phi"] >= 0.5 - 1e-12).all()
    # edits tied to the keys hold: the PRB set moved with the keys
    d = a.data
    assert not ((d["sex"] == "male") & (d["pregnant"] == 1)).any()
    assert ((d["age"] < 18) == (d["education"] == "child")).all()
    assert not ((d["age"] < 15) & (d["marital"] != "never_married")).any()
    # calibrated sex margin equals the original one
    for s in ("female", "male"):
        assert d.loc[d["sex"] == s, "wt"].sum() == pytest.approx(
            df.loc[df["sex"] == s, "wt"].sum(), rel=1e-8
        )
    assert {g.name for g in a.gates} == {"massc.delta"}  # epsilon: gated on the published file


def test_replications_do_not_depend_on_chunking(survey):
    from sdl_design.massc.stage import massc_epsilon, massc_replications
    from sdl_design.massc.stage import massc_result as massc_task_fn

    spec, df = survey
    whole = massc_replications(df, spec, 9, df, [0, 1, 2, 3])
    halves = np.vstack([massc_replications(df, spec, 9, df, c) for c in ([0, 1], [2, 3])])
    assert whole.tobytes() == halves.tobytes()
    assert not np.allclose(whole[0], whole[1])  # replications differ
    out = massc_task_fn(df, spec, 9, df)
    out = massc_epsilon(out, [halves[:2], halves[2:]], spec)
    # truth: the original file's totals (three of them recomputed with pandas)
    st = out.tables["study_totals"].set_index(["variable", "domain", "category"])
    truth = st["original_total"].to_numpy()
    w = df["wt"].to_numpy()
    assert st.loc[("_count", "", ""), "original_total"] == pytest.approx(w.sum(), rel=1e-12)
    assert st.loc[("income", "", ""), "original_total"] == pytest.approx(
        w @ df["income"], rel=1e-12
    )
    female = (df["sex"] == "female").to_numpy()
    assert st.loc[("_count", "sex", "female"), "original_total"] == pytest.approx(w[female].sum())
    # empirical epsilon: max over totals of the RRMSE over the 4 replications, by hand
    ok = truth != 0
    rr = np.sqrt(((whole[:, ok] - truth[ok]) ** 2).mean(axis=0)) / np.abs(truth[ok])
    assert out.metrics["epsilon_empirical"] == pytest.approx(rr.max(), rel=1e-12)
    assert out.metrics["epsilon"] == pytest.approx(max(rr.max(), out.metrics["epsilon_formula"]))
    tab = out.tables["epsilon_replications"]
    np.testing.assert_allclose(tab["rrmse"].to_numpy()[ok], rr, rtol=1e-12)
    np.testing.assert_allclose(tab["mean_estimate"], whole.mean(axis=0), rtol=1e-12)


def test_plan_and_treatment_reproducible_and_edits_hold():
    from sdl_design.massc import massc_plan, massc_treat
    from sdl_design.massc.stage import massc_config
    from sdl_design.rng import stage_rng
    from sdl_design.spec import load_spec
    from sdl_design.synth import make_survey

    spec = load_spec(DEFAULT_SPEC)
    df = make_survey(3000, seed=8, replicates=False)
    cfg = massc_config(spec, df)
    runs = []
    for seed in (5, 5, 6):
        rng = stage_rng(seed, "massc")
        plan = massc_plan(df, cfg, rng)
        tr = massc_treat(df, plan, cfg, rng)
        runs.append((plan, tr))
    (p1, t1), (p2, t2), (_, t3) = runs
    assert np.array_equal(p1.donors.donor, p2.donors.donor)
    assert _digest(t1.b1[t1.retained]) == _digest(t2.b1[t2.retained])
    assert not np.array_equal(t1.retained, t3.retained)
    # rates within bounds and constraints of eq. 9/10 met
    assert np.all((p1.psi.rates > 0) & (p1.psi.rates <= 0.25))
    assert np.all((t1.phi.rates >= 0.5) & (t1.phi.rates < 1))
    assert p1.psi.constraint <= cfg.alpha and t1.phi.constraint <= cfg.beta
    # substituted records: at least one key changed, their key-related variables are the donor's
    b1, d1 = t1.b1, t1.substituted
    donor = p1.donors.donor[d1]
    keys = [k.name for k in cfg.keys]
    for c in cfg.substitute_columns:
        assert (b1[c].to_numpy()[d1] == df[c].to_numpy()[donor]).all()
    for c in set(df.columns) - set(cfg.substitute_columns):
        assert b1[c].equals(df[c])  # sensitive and other variables never move
    from sdl_design.keys import key_frame

    kf0 = key_frame(df, cfg.keys).to_numpy()[d1]
    kf1 = key_frame(b1, cfg.keys).to_numpy()[d1]
    assert ((kf0 != kf1).sum(axis=1) >= 1).all() and len(keys) == kf0.shape[1]
    # edits tied to the keys still hold after substitution
    assert not ((b1["sex"] == "male") & (b1["pregnant"] == 1)).any()
    assert ((b1["age"] < 18) == (b1["education"] == "child")).all()
    assert not ((b1["age"] < 15) & (b1["marital"] != "never_married")).any()


@pytest.mark.flow
def test_replications_same_in_chunks_as_direct(survey, request):
    """The flow's fan-out (replicate_stage mapped over chunks on the thread pool) gives the same
    estimates as one chunk run directly: each replication's seed depends only on its index.
    (Dask against the thread pool: tests/test_release_flow.py.)"""
    request.getfixturevalue("prefect_server")  # only once the data and modules are there
    from prefect import flow

    from flows.release import _replications
    from sdl_design.massc.stage import MasscStage, massc_replications
    from sdl_design.stage import StageContext

    spec, df = survey
    spec = spec.model_copy(deep=True)
    spec.release.seed = 9
    spec.stages.massc.replications = 3
    stage = MasscStage.from_spec(spec)

    @flow
    def reps() -> list:
        return _replications(stage, df, StageContext(df, spec, "massc"), "thread", None)

    chunks = reps()
    assert [len(c) for c in chunks] == [2, 1]
    direct = massc_replications(df, spec, 9, df, [0, 1, 2])
    assert np.vstack(chunks).tobytes() == direct.tobytes()


def test_replicate_controls_follow_the_massc_input_centred_on_original(monkeypatch):
    """Replicate r is calibrated to T_r(B0) + T(original) - T(B0); weights and replicates of the
    retained records are divided by phi first (solver replaced by a recorder)."""
    import sys
    import types

    from sdl_design.massc import calibrate_treated

    seen = {}

    def control_totals(df, weight, controls):  # one weight -> dict; a list -> list of dicts
        if not isinstance(weight, str):
            return [control_totals(df, w, controls) for w in weight]
        return {c: df.groupby(c)[weight].sum().to_dict() for c in controls}

    def calibrate(df, weight, totals, method="logit", bounds=None):
        seen["totals"] = totals
        return df[weight]

    def calibrate_replicates(df, cols, per_rep, method, bounds, policy):
        seen["per_rep"] = per_rep
        seen["rep_in"] = df[cols].copy()
        return df[cols], pd.DataFrame({"replicate": cols, "action": "none"})

    fake = types.ModuleType("sdl_design.calibration")
    fake.control_totals, fake.calibrate = control_totals, calibrate
    fake.calibrate_replicates = calibrate_replicates
    monkeypatch.setitem(sys.modules, "sdl_design.calibration", fake)
    original = pd.DataFrame(
        {"sex": ["f", "m", "f", "m"], "w": [1.0, 2.0, 3.0, 4.0], "r1": [2.0, 0, 6.0, 8.0]}
    )
    b0 = original.assign(sex=["f", "m", "m", "m"])  # an earlier stage moved record 2
    b2 = b0.iloc[[0, 2, 3]]
    factor = np.array([2.0, 1.0, 1.5])
    out, tables, _ = calibrate_treated(
        b2, "w", factor, original, ["sex"], "raking", None, ["r1"], "widen", b0=b0
    )
    assert seen["totals"] == {"sex": {"f": 4.0, "m": 6.0}}
    # T_r(B0) = {f: 2, m: 14}; + T(original) {f: 4, m: 6} - T(B0) {f: 1, m: 9}
    assert seen["per_rep"] == [{"sex": {"f": 5.0, "m": 11.0}}]
    np.testing.assert_allclose(seen["rep_in"]["r1"], [4.0, 6.0, 12.0])
    np.testing.assert_allclose(out["w"], [2.0, 3.0, 6.0])
    assert list(tables) == ["replicate_calibration", "weight_factors"]


def test_replicate_recalibration_on_default_survey():
    """Each JKn replicate is recalibrated to its own replicate's original controls: the
    replicate SE of a control total equals the original one, other SEs stay close."""
    from sdl_design.design import SurveyDesign
    from sdl_design.massc.stage import massc_result as massc_task_fn
    from sdl_design.spec import load_spec
    from sdl_design.synth import make_survey

    spec = load_spec(DEFAULT_SPEC)
    df = make_survey(3000, seed=7)
    reps = spec.replicate_columns(df)
    out = massc_task_fn(df, spec, 9, df)
    rc = out.tables["replicate_calibration"]
    assert rc["replicate"].tolist() == reps and rc["status"].isin(["ok", "widened", "raked"]).all()
    treated = out.data.assign(male=(out.data["sex"] == "male").astype(float))
    before = df.assign(male=(df["sex"] == "male").astype(float))
    cols = ["male", "income", "bmi", "diabetes", "hypertension", "insured"]
    a = SurveyDesign.from_spec(before, spec.design).total(cols, variance="replicate")
    b = SurveyDesign.from_spec(treated, spec.design).total(cols, variance="replicate")
    assert b.loc["male", "estimate"] == pytest.approx(a.loc["male", "estimate"], rel=1e-9)
    assert b.loc["male", "se"] == pytest.approx(a.loc["male", "se"], rel=1e-6)
    ratio = (b["se"] / a["se"]).to_numpy()
    assert np.all((ratio > 0.85) & (ratio < 1.2))
    # retained records: weights and replicates w/phi before calibration, factors near 1
    assert (out.tables["weight_factors"]["calibration_factor"].between(0.5, 2.0)).all()


def test_formulas_8a_8b_match_replications_of_the_treatment():
    """RRMSE from (8a) + (8b) against the empirical RRMSE of repeated stratified SRSWOR
    substitution and subsampling (w/phi, no calibration) on the default survey."""
    import dataclasses

    from helpers import county_key_spec

    from sdl_design.massc import massc_plan, massc_treat
    from sdl_design.massc.stage import massc_config
    from sdl_design.synth import make_survey

    spec = county_key_spec()  # county among the keys: enough risk for rates well above 0
    df = make_survey(3000, seed=4, replicates=False)
    cfg = dataclasses.replace(massc_config(spec, df), nest=None)
    rng = np.random.default_rng(1)
    plan = massc_plan(df, cfg, rng)
    tr = massc_treat(df, plan, cfg, rng)
    il = information_loss(tr.moments, plan.psi.rates, tr.phi.rates)
    truth = plan.zvars.totals(df, df["wt"].to_numpy())
    est = []
    for r in range(80):
        t = massc_treat(df, plan, cfg, np.random.default_rng(100 + r), phi=tr.phi.rates)
        b2 = t.b1[t.retained]
        est.append(plan.zvars.totals(b2, b2["wt"].to_numpy() * t.factor[t.retained]))
    emp = np.sqrt(((np.array(est) - truth) ** 2).mean(axis=0)) / np.abs(truth)
    ok = np.isfinite(il["rrmse"].to_numpy()) & (il["rrmse"].to_numpy() > 0.01)
    ratio = emp[ok] / il["rrmse"].to_numpy()[ok]
    assert ok.sum() > 50
    assert 0.9 < np.median(ratio) < 1.1, (np.median(ratio), ratio.min(), ratio.max())
    assert np.all((ratio > 0.5) & (ratio < 1.6))


def test_substrata_recover_separated_groups():
    """Two well-separated groups of the study variable inside each risk stratum come out as the
    two substrata (numbered by increasing centroid), merge applied first; same rng, same labels."""
    rng = np.random.default_rng(3)
    n = 400
    df = pd.DataFrame(
        {
            "a": rng.integers(0, 40, n),  # many uniques and doubles
            "b": rng.integers(0, 3, n),
            "grp": rng.integers(0, 2, n),
        }
    )
    df["y"] = np.where(df["grp"] == 1, 100.0, 0.0) + rng.normal(0, 1, n)
    base = massc_strata(df, ["a", "b"], NU)
    s = massc_strata(df, ["a", "b"], NU, ["y"], k=2, min_records=10, rng=np.random.default_rng(1))
    for label in base.unique():
        rows = base == label
        if rows.sum() < 20:
            assert set(s[rows]) == {label}
            continue
        expected = np.where(df.loc[rows, "grp"] == 1, f"{label}:2", f"{label}:1")
        assert (s[rows].to_numpy() == expected).all()
    again = massc_strata(
        df, ["a", "b"], NU, ["y"], k=2, min_records=10, rng=np.random.default_rng(1)
    )
    assert again.equals(s)
    with pytest.raises(MasscError, match="substrata.variables"):
        massc_strata(df, ["a", "b"], NU, ["nope"], rng=np.random.default_rng(1))


def test_spec_substrata_give_rates_per_substratum(survey):
    from sdl_design.massc.stage import massc_result as massc_task_fn
    from sdl_design.spec import Substrata

    spec, df = survey
    s = spec.model_copy(deep=True)
    s.stages.massc.strata_merge = {"T": "TO", "O": "TO"}
    s.stages.massc.substrata = Substrata(variables=["income"], k=2, min_records=100)
    out = massc_task_fn(df, s, 123, df)
    labels = out.tables["rates"]["stratum"].tolist()
    assert (
        labels == sorted(labels) and "TO:1" in labels and not any(x.startswith("O") for x in labels)
    )
    assert {x.split(":")[0] for x in labels} == {"U", "D", "TO"}
    assert out.metrics["epsilon_formula"] <= s.stages.massc.epsilon + 1e-9
