"""MASSC (paper 000): worked example (Tables 1-3), donor search, optimal rates, selection,
replications."""

from __future__ import annotations

import hashlib

import numpy as np
import pandas as pd
import pytest
from helpers import DEFAULT_SPEC, paper000_table1

from sdl_design.spec import KeySpec
from sdl_design.stages.massc.common import MasscError, MasscInfeasible
from sdl_design.stages.massc.donors import find_donors, substitute
from sdl_design.stages.massc.measures import delta_measures, information_loss
from sdl_design.stages.massc.moments import StudyVariables, ZMoments, z_moments
from sdl_design.stages.massc.rates import optimal_phi, optimal_psi
from sdl_design.stages.massc.strata import massc_strata
from sdl_design.stages.massc.treatment import select


def massc_result(df: pd.DataFrame, spec, seed: int, original: pd.DataFrame):
    """MASSC as the release runs it: the stage's passes on df held in memory (one partition),
    the original file in the context, release.seed `seed`."""
    from sdl_design.stage import StageContext
    from sdl_design.stages.massc import MasscStage

    spec = spec.model_copy(deep=True)
    spec.release.seed = seed
    return MasscStage.from_spec(spec).run(df, StageContext(original, spec, "massc"))


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
# declared analysis domains of the default survey in the tests (issue 11's example)
DOMAINS = ["age", "sex", "race", ["age", "sex"]]
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
    from sdl_design.stages.massc.treatment import calibrate_treated

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
    spec.utility.domains = DOMAINS  # declared: substitution may change the other keys
    df = make_survey(2500, seed=7, replicates=False)
    return spec, df


def _digest(df: pd.DataFrame) -> str:
    return hashlib.sha256(
        pd.util.hash_pandas_object(df, index=True).to_numpy().tobytes()
    ).hexdigest()


def test_massc_task_reproducible_and_consistent(survey):
    massc_task_fn = massc_result

    spec, df = survey
    a = massc_task_fn(df, spec, 123, df)
    b = massc_task_fn(df, spec, 123, df)
    assert _digest(a.data) == _digest(b.data)
    c = massc_task_fn(df, spec, 124, df)
    assert _digest(a.data) != _digest(c.data)
    m = a.metrics
    assert len(a.data) == len(df) - m["n_subsampled_out"]
    assert 0 < m["n_substituted"] < 0.25 * len(df) + 4 * np.sqrt(len(df))
    # sampling scale: MASSC's own RMSE of every total within sqrt(bias + variance share) SEs
    st = spec.stages.massc
    assert 0 < m["loss_in_se_treatment"] <= np.sqrt(st.bias_share + st.variance_share) + 1e-9
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
    assert {g.name for g in a.gates} == {"massc.delta"}  # epsilon: a diagnostic


def test_replications_do_not_depend_on_batching(survey, monkeypatch):
    """The stage's replications of the whole treatment (passes, a batch at a time): the same
    bits one replication per batch as four at once, the estimates of the whole-frame reference
    (massc_reference.massc_replications), and the empirical epsilon their RRMSE by hand."""
    from massc_reference import massc_replications

    from sdl_design.stage import StageContext
    from sdl_design.stages.massc import calibration_passes as pcal

    spec, df = survey
    spec = spec.model_copy(deep=True)
    spec.stages.massc.replications = 4
    out = massc_result(df, spec, 9, df)
    monkeypatch.setattr(pcal, "REPLICATIONS_AT_ONCE", 1)
    one = massc_result(df, spec, 9, df)
    for name in ("epsilon_replications", "study_totals"):
        pd.testing.assert_frame_equal(one.tables[name], out.tables[name], check_exact=True)
    spec.release.seed = 9
    seed = StageContext(df, spec, "massc").seed
    whole = massc_replications(df, spec, seed, df, [0, 1, 2, 3])
    assert not np.allclose(whole[0], whole[1])  # replications differ
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
    from sdl_design.rng import stage_rng
    from sdl_design.spec import load_spec
    from sdl_design.stages.massc.stage import massc_config
    from sdl_design.stages.massc.treatment import massc_plan, massc_treat
    from sdl_design.synth import make_survey

    spec = load_spec(DEFAULT_SPEC)
    spec.utility.domains = DOMAINS
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
    assert d1.sum() > 20 and ((kf0 != kf1).sum(axis=1) >= 1).all() and len(keys) == kf0.shape[1]
    # ... but never the declared domains (age group, sex, race in their published coding)
    dom = [k for k in cfg.keys if k.name in ("age", "sex", "race")]
    assert key_frame(b1, dom).equals(key_frame(df, dom))
    # edits tied to the keys still hold after substitution
    assert not ((b1["sex"] == "male") & (b1["pregnant"] == 1)).any()
    assert ((b1["age"] < 18) == (b1["education"] == "child")).all()
    assert not ((b1["age"] < 15) & (b1["marital"] != "never_married")).any()


def test_replicate_targets_are_the_original_replicate_totals(monkeypatch):
    """Replicate r is calibrated to the original file's replicate totals T_r(original), not to
    those of the MASSC input; weights and replicates of the retained records are divided by phi
    first (solver replaced by a recorder)."""
    from sdl_design.stages.massc.treatment import calibrate_treated

    seen = {}

    def control_totals(df, weight, controls):  # one weight -> dict; a list -> list of dicts
        if not isinstance(weight, str):
            return [control_totals(df, w, controls) for w in weight]
        return {c: df.groupby(c)[weight].sum().to_dict() for c in controls}

    def calibrate(df, weight, totals, method="logit", bounds=None, explain=True):
        seen["totals"] = totals
        return df[weight]

    def calibrate_replicates(df, cols, per_rep, method, bounds, policy, factor=None, values=None):
        seen["per_rep"] = per_rep
        W = df[cols].to_numpy() if values is None else values(cols)
        W = W * (1.0 if factor is None else np.asarray(factor)[:, None])
        seen["rep_in"] = pd.DataFrame(W, columns=cols, index=df.index)
        return seen["rep_in"], pd.DataFrame({"replicate": cols, "action": "none"})

    from sdl_design.stages.massc import treatment

    monkeypatch.setattr(treatment, "control_totals", control_totals)
    monkeypatch.setattr(treatment, "calibrate", calibrate)
    monkeypatch.setattr(treatment, "calibrate_replicates", calibrate_replicates)
    monkeypatch.setattr(treatment, "CalibrationError", ValueError)
    monkeypatch.setattr(treatment, "CalibrationInfeasible", ValueError)
    original = pd.DataFrame(
        {"sex": ["f", "m", "f", "m"], "w": [1.0, 2.0, 3.0, 4.0], "r1": [2.0, 0, 6.0, 8.0]}
    )
    b0 = original.assign(sex=["f", "m", "m", "m"], r1=[1.0, 1.0, 1.0, 1.0])  # an earlier stage
    b2 = b0.iloc[[0, 2, 3]]
    factor = np.array([2.0, 1.0, 1.5])
    out, tables, _ = calibrate_treated(
        b2, "w", factor, original, ["sex"], "raking", None, ["r1"], "widen"
    )
    assert seen["totals"] == {"sex": {"f": 4.0, "m": 6.0}}
    # T_r(original): r1 of the original's f records 2 + 6, of its m records 0 + 8
    assert seen["per_rep"] == [{"sex": {"f": 8.0, "m": 8.0}}]
    np.testing.assert_allclose(seen["rep_in"]["r1"], [2.0, 1.0, 1.5])
    np.testing.assert_allclose(out["w"], [2.0, 3.0, 6.0])
    assert list(tables) == ["replicate_calibration", "weight_factors"]
    with pytest.raises(MasscError, match="original file's replicate weights"):
        calibrate_treated(
            b2, "w", factor, original.drop(columns="r1"), ["sex"], "raking", None, ["r1"]
        )


def _control_columns(df: pd.DataFrame, controls) -> tuple[pd.DataFrame, list[str]]:
    """One 0/1 column per category of each control (keys coded as published)."""
    from sdl_design.keys import key_frame

    kf = key_frame(df, controls).astype(str)
    cols = {
        f"{k}={c}": (kf[k] == c).astype(float).to_numpy()
        for k in kf.columns
        for c in sorted(kf[k].unique())
    }
    return df.assign(**cols), list(cols)


@pytest.mark.parametrize("composed", [False, True])
def test_replicate_ses_of_controls_equal_the_original(composed):
    """Each JKn replicate is recalibrated to the original file's replicate totals: the
    replicate SE of every control total (sex, age groups, region) on the treated file equals
    the original's to 1e-8, also when an earlier stage moved the region of 30% of the records
    (then the MASSC input's own replicate SEs of region differ from the original's)."""
    from sdl_design.spec import load_spec
    from sdl_design.survey.design import SurveyDesign
    from sdl_design.synth import make_survey

    spec = load_spec(DEFAULT_SPEC)
    spec.utility.domains = DOMAINS
    original = make_survey(3000, seed=7)
    df = original
    if composed:
        rng = np.random.default_rng(2)
        moved = rng.random(len(original)) < 0.3
        region = original["region"].to_numpy().copy()
        region[moved] = rng.permutation(region[moved])
        df = original.assign(region=region)
    reps = spec.replicate_columns(df)
    out = massc_result(df, spec, 9, original)
    rc = out.tables["replicate_calibration"]
    assert rc["replicate"].tolist() == reps and rc["status"].isin(["ok", "widened", "raked"]).all()
    controls = spec.stages.massc.calibration.controls
    a, cols = _control_columns(original, controls)
    b, _ = _control_columns(out.data, controls)
    c, _ = _control_columns(df, controls)
    se_a = SurveyDesign.from_spec(a, spec.design).total(cols, variance="replicate")
    se_b = SurveyDesign.from_spec(b, spec.design).total(cols, variance="replicate")
    np.testing.assert_allclose(se_b["estimate"], se_a["estimate"], rtol=1e-8)
    np.testing.assert_allclose(se_b["se"], se_a["se"], rtol=1e-8)
    if composed:  # the input's region SEs are not the original's: the targets made the match
        se_c = SurveyDesign.from_spec(c, spec.design).total(cols, variance="replicate")
        region = [k for k in cols if k.startswith("region=")]
        assert np.abs(se_c.loc[region, "se"] / se_a.loc[region, "se"] - 1).max() > 0.01
    study = ["income", "bmi", "diabetes", "hypertension", "insured"]
    sa = SurveyDesign.from_spec(original, spec.design).total(study, variance="replicate")
    sb = SurveyDesign.from_spec(out.data, spec.design).total(study, variance="replicate")
    ratio = (sb["se"] / sa["se"]).to_numpy()
    assert np.all((ratio > 0.85) & (ratio < 1.2))
    # retained records: weights and replicates w/phi before calibration, factors near 1
    assert (out.tables["weight_factors"]["calibration_factor"].between(0.5, 2.0)).all()


def test_formulas_8a_8b_match_replications_of_the_treatment():
    """RRMSE from (8a) + (8b) against the empirical RRMSE of repeated stratified SRSWOR
    substitution and subsampling (w/phi, no calibration) on the default survey."""
    import dataclasses

    from helpers import county_key_spec

    from sdl_design.stages.massc.stage import massc_config
    from sdl_design.stages.massc.treatment import massc_plan, massc_treat
    from sdl_design.synth import make_survey

    spec = county_key_spec()  # county among the keys: enough risk for rates well above 0
    spec.utility.domains = ["smoker"]  # not substituted: partners unrestricted
    df = make_survey(3000, seed=4, replicates=False)
    # the paper's relative budgets and every stratum treated: rates well inside (0, 1)
    cfg = dataclasses.replace(
        massc_config(spec, df), nest=None, loss_scale="relative", negligible_risk=0.0
    )
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
    # 80 replications of a normal total: ratio^2 ~ chi2_80 / 80, (0.77, 1.25) at 0.1% each
    # side; totals of rare categories are heavy-tailed and spread wider (over 16 sets of 80
    # replications: 1st-99th percentiles of the ratios 0.62-1.31, extremes 0.36-1.91)
    q01, q99 = np.quantile(ratio, [0.01, 0.99])
    assert 0.55 < q01 and q99 < 1.45, (q01, q99)
    assert np.all((ratio > 0.3) & (ratio < 2.0))


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
    from sdl_design.spec import Substrata

    massc_task_fn = massc_result

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
    st = s.stages.massc
    assert out.metrics["loss_in_se_treatment"] <= np.sqrt(st.bias_share + st.variance_share)


# ---------------------------------------------------------------- issue 11: composed, domains,
# sampling-scale budgets, treatment follows risk


def _spec(massc: dict | None = None, domains=None, study=("y",), keys=("agecat", "sex", "race")):
    """A small spec for the synthetic files below (design h/p/w, sensitive s)."""
    from sdl_design.spec import parse_spec

    return parse_spec(
        {
            "release": {"name": "t", "year": 2026, "seed": 1},
            "design": {"weight": "w", "strata": "h", "psu": "p"},
            "variables": {
                "keys": list(keys),
                "sensitive": [{"name": "s", "sensitivity": {1: 1.0, 0: 0.0}}],
                "study": list(study),
            },
            "utility": {} if domains is None else {"domains": domains},
            "stages": {
                "massc": {
                    "calibration": {"method": "raking", "controls": ["sex"]},
                    "replications": 0,
                    **(massc or {}),
                }
            },
        }
    )


def _zero_unique_file(n: int = 2560, seed: int = 1) -> pd.DataFrame:
    """32 key cells (4 age groups x 2 sexes x 4 races) of n/32 records each: no sample unique;
    4 strata of 2 PSUs; a binary sensitive variable s; a study variable y."""
    rng = np.random.default_rng(seed)
    cell = np.arange(n) % 32
    df = pd.DataFrame(
        {
            "agecat": np.array(["0-19", "20-39", "40-59", "60+"])[cell // 8],
            "sex": np.array(["male", "female"])[(cell // 4) % 2],
            "race": np.array(["a", "b", "c", "d"])[cell % 4],
            "h": rng.integers(0, 4, n),
            "p": rng.integers(0, 2, n),
            "w": rng.uniform(500, 1500, n),
            "s": (rng.random(n) < 0.2).astype(int),
        }
    )
    df["y"] = rng.gamma(2.0, 10.0, n) + 5 * (df["sex"] == "male")
    return df


def test_zero_unique_file_is_not_treated():
    """A file without sample uniques (32 cells of 80 records): the disclosure cost of its one
    stratum, mean r_k / F_k, is below negligible_risk, so MASSC leaves it alone: psi = 0 and
    phi = 1, nothing substituted, nothing sampled out. Without the rule the optimizer would
    treat it to the edge of its loss budget (the measured 6.6% substituted, 9.2% dropped)."""
    from sdl_design.risk import genmassc_scores

    df = _zero_unique_file()
    spec = _spec(domains=["agecat", "sex"])
    out = massc_result(df, spec, 3, df)
    rates = out.tables["rates"]
    assert rates["stratum"].tolist() == ["O"]
    # a_h by hand: GenMASSC score over the cell size, averaged over the stratum
    F = df.groupby(["agecat", "sex", "race"])["w"].transform("size").to_numpy()
    r = genmassc_scores(df, ["agecat", "sex", "race"], spec.variables.sensitive).to_numpy()
    assert (r / F).mean() < spec.stages.massc.negligible_risk
    assert rates["psi"].tolist() == [0.0] and rates["phi"].tolist() == [1.0]
    assert out.metrics["share_substituted"] == 0.0 and out.metrics["share_retained"] == 1.0
    assert out.metrics["n_strata_no_risk"] == 1.0
    # the same file with the rule off: the budget, not the risk, sets the treatment
    loose = _spec({"negligible_risk": 0.0}, domains=["agecat", "sex"])
    treated = massc_result(df, loose, 3, df).tables["rates"]
    assert treated["psi"].iloc[0] > 0.001 and treated["phi"].iloc[0] < 0.999


def test_treatment_follows_risk_across_strata():
    """Strata whose cost a_h is at most negligible_risk get psi = 0, phi = 1; the others are
    optimized with them fixed; a_h = mean over the stratum of r_k / F_k."""
    from sdl_design.stages.massc.rates import optimal_phi, optimal_psi

    m = _two_strata(5)
    cost = np.array([0.0, 1.0])
    psi = optimal_psi(m, 0.004, psi_max=0.25, cost=cost)
    assert (
        psi.rates[0] == 0.0
        and 0 < psi.rates[1] <= 0.25
        and psi.no_risk.tolist()
        == [
            True,
            False,
        ]
    )
    beta = 0.2 * (m.variance(np.full(2, 0.5)) / m.theta**2).max()
    phi = optimal_phi(m, beta, phi_min=0.5, phi_max=0.99, cost=cost)
    assert phi.rates[0] == 1.0 and 0.5 <= phi.rates[1] <= 0.99
    # the free stratum: the best rate on a grid with the other one fixed at no treatment
    grid = np.linspace(0.5, 0.99, 4901)
    g = ((m.N[1] * (1 / grid[:, None] - 1) * m.S2_zstar[1]) / m.theta**2).max(axis=1)
    assert phi.rates[1] == pytest.approx(grid[g <= beta].min(), abs=1e-3)
    everything = optimal_psi(m, 0.004, cost=np.zeros(2))
    assert everything.rates.tolist() == [0.0, 0.0] and everything.method == "no risk"


def test_missing_study_values_give_finite_rates_and_totals():
    """NaN in a study variable: totals over the non-missing records (never NaN), finite rates
    that equal those of the same file with the missing values set to 0 (not a silent 0.5)."""

    df = _small_survey()
    miss = np.random.default_rng(4).random(len(df)) < 0.1
    with_nan = df.assign(y=df["y"].where(~miss))
    spec = _spec({"negligible_risk": 0.0}, domains=["agecat"])
    a = massc_result(with_nan, spec, 2, with_nan)
    b = massc_result(df.assign(y=df["y"].where(~miss, 0.0)), spec, 2, with_nan)
    st = a.tables["study_totals"].set_index(["variable", "domain", "category"])
    assert st.loc[("y", "", ""), "original_total"] == pytest.approx(
        np.nansum(with_nan["w"] * with_nan["y"]), rel=1e-12
    )
    assert np.isfinite(st["original_total"]).all() and np.isfinite(st["original_se"]).all()
    ra, rb = a.tables["rates"], b.tables["rates"]
    assert np.isfinite(ra[["psi", "phi"]].to_numpy()).all()
    np.testing.assert_array_equal(ra[["psi", "phi"]].to_numpy(), rb[["psi", "phi"]].to_numpy())
    assert (ra["phi"] > spec.stages.massc.phi_min).any()


def _small_survey(n: int = 1200, seed: int = 6) -> pd.DataFrame:
    """Keys with uniques (8 age groups x 2 x 6 races over 1200 records, skewed), design h/p."""
    rng = np.random.default_rng(seed)
    df = pd.DataFrame(
        {
            "agecat": rng.choice(
                [f"a{i}" for i in range(8)], n, p=[0.3, 0.2, 0.15, 0.1] + [0.0625] * 4
            ),
            "sex": rng.choice(["male", "female"], n),
            "race": rng.choice(list("abcdef"), n, p=[0.6, 0.2, 0.1, 0.05, 0.03, 0.02]),
            "h": rng.integers(0, 3, n),
            "p": rng.integers(0, 2, n),
            "w": rng.uniform(100, 900, n),
            "s": (rng.random(n) < 0.3).astype(int),
        }
    )
    df["y"] = rng.gamma(2.0, 10.0, n) + 3 * (df["race"] == "a")
    return df


def test_sampling_scale_budgets_are_multiples_of_the_taylor_variance():
    """alpha_z = bias_share V_z and beta_z = variance_share V_z with V_z the Taylor variance of
    theta_z in the original design; with 2 PSUs per stratum V_z = sum_h (t_h1 - t_h2)^2 of the
    PSU totals t_hi = sum w z. Relative scale: alpha share * epsilon^2 * theta_z^2."""
    import dataclasses

    from sdl_design.stages.massc.treatment import MasscConfig, massc_plan

    df = pd.DataFrame(
        {
            "k": list("ababbaabbaab"),
            "h": [0] * 6 + [1] * 6,
            "p": [0, 0, 0, 1, 1, 1] * 2,
            "w": [1.0, 2.0, 3.0, 2.0, 2.0, 5.0, 1.0, 1.0, 4.0, 3.0, 2.0, 1.0],
            "y": [3.0, 1.0, 0.0, 2.0, 5.0, 1.0, 4.0, 2.0, 2.0, 0.0, 1.0, 6.0],
        }
    )
    cfg = MasscConfig(
        keys=[KeySpec(name="k")],
        sensitive=[],
        study=["y"],
        weight="w",
        substitute_columns=["k"],
        bias_share=0.1,
        variance_share=0.3,
        strata_col="h",
        psu_col="p",
        min_records=1,
    )
    plan = massc_plan(df, cfg, np.random.default_rng(0))
    alpha, beta = plan.budgets(cfg)

    def v(z: np.ndarray) -> float:  # sum_h (t_h1 - t_h2)^2
        t = pd.Series(df["w"] * z).groupby([df["h"], df["p"]]).sum().unstack()
        return float(((t[0] - t[1]) ** 2).sum())

    ones, y, a = np.ones(12), df["y"].to_numpy(), (df["k"] == "a").to_numpy()
    expect = [v(ones), v(ones * a), v(ones * ~a), v(y), v(y * a), v(y * ~a)]
    assert plan.zvars.labels == [
        ("_count", "", ""),
        ("_count", "k", "a"),
        ("_count", "k", "b"),
        ("y", "", ""),
        ("y", "k", "a"),
        ("y", "k", "b"),
    ]
    np.testing.assert_allclose(alpha, 0.1 * np.array(expect), rtol=1e-8)
    np.testing.assert_allclose(beta, 0.3 * np.array(expect), rtol=1e-8)
    rel = dataclasses.replace(cfg, loss_scale="relative", epsilon=0.2, alpha_share=0.25)
    alpha_r, beta_r = massc_plan(df, rel, np.random.default_rng(0)).budgets(rel)
    theta = np.array([(df["w"] * z).sum() for z in (ones, a, ~a, y, y * a, y * ~a)])
    np.testing.assert_allclose(alpha_r, 0.25 * 0.04 * theta**2, rtol=1e-8)
    np.testing.assert_allclose(beta_r, 0.75 * 0.04 * theta**2, rtol=1e-8)


def _psu_file(n: int, n_psu: int, seed: int) -> pd.DataFrame:
    """n records of one population (weights sum to about 300,000) in 6 strata of n_psu PSUs."""
    rng = np.random.default_rng(seed)
    return pd.DataFrame(
        {
            "h": rng.integers(0, 6, n),
            "p": rng.integers(0, n_psu, n),
            "w": rng.uniform(100, 900, n) * 600 / n,
            "y": rng.gamma(2.0, 10.0, n),
            "risky": rng.random(n) < 0.2,
        }
    )


def test_rates_do_not_depend_on_file_size_on_the_sampling_scale():
    """A file 4 times larger (same population, 4 times the PSUs): the sampling variance and the
    treatment variance (8b) both shrink like 1/n, so phi on the sampling scale stays, while on
    the relative scale the budget beta theta^2 does not shrink and phi falls to its lower bound:
    the large-file subsampling of issue 11."""
    from sdl_design.stages.massc.moments import z_moments
    from sdl_design.survey.design import SurveyDesign

    zv = StudyVariables(["_count", "y"], {"": [""]}, [])
    out = {}
    for name, f in (("small", _psu_file(600, 10, 1)), ("big", _psu_file(2400, 40, 2))):
        strata = np.where(f["risky"], "U", "O")
        m = z_moments(f, f, strata, "w", zv, substituted=np.zeros(len(f), dtype=bool))
        m.denom = zv.sampling_variance(f, SurveyDesign(f, "w", "h", "p"))
        samp = optimal_phi(m, 0.05, phi_min=0.5, cost=np.array([0.1, 1.0])).rates
        m.denom = None
        rel = optimal_phi(m, 0.0005, phi_min=0.5, cost=np.array([0.1, 1.0])).rates
        out[name] = samp, rel
    assert (out["small"][0] > 0.7).all() and (out["small"][0] < 0.99).all()
    np.testing.assert_allclose(out["big"][0], out["small"][0], rtol=0.03)
    assert (out["small"][1] > 0.55).all() and (out["big"][1] == 0.5).all()


def test_strata_and_costs_come_from_the_original_keys():
    """MASSC after an earlier stage: strata and disclosure costs use the original key profiles
    of the records (matched by index label), not the perturbed ones; delta and epsilon are
    against the original (epsilon: the earlier stage's deviation is inside the bias). The
    stage refuses records relabelled (a stage keeps the original's records, in its order)."""
    from sdl_design.risk import risk_strata
    from sdl_design.stages.massc.stage import massc_config
    from sdl_design.stages.massc.treatment import massc_plan

    original = _small_survey().set_axis(pd.RangeIndex(100, 1300))
    rng = np.random.default_rng(3)
    moved = rng.random(len(original)) < 0.2
    race = original["race"].to_numpy().copy()
    race[moved] = "b"  # an earlier stage moved 20% of the records to race b
    df = original.assign(race=race)
    spec = _spec(domains=["agecat", "sex"])
    cfg = massc_config(spec, df)
    plan = massc_plan(df.iloc[::-1], cfg, np.random.default_rng(1), original)  # by label
    df_rev = df.iloc[::-1]
    size = original.groupby(["agecat", "sex", "race"])["w"].transform("size").loc[df_rev.index]
    expect = np.array(["U", "D", "T", "O"])[np.minimum(size.to_numpy(), 4) - 1]
    assert (plan.strata == expect).all()
    assert (plan.strata != risk_strata(df_rev, cfg.keys).to_numpy().astype(str)).sum() > 20
    out = massc_result(df, spec, 1, original)
    il = out.tables["epsilon_formula"].set_index(["variable", "domain", "category"])
    w = original["w"]
    truth = (w * original["y"]).groupby(original["race"]).sum()
    for race_c in ("a", "b"):
        row = il.loc[("y", "race", race_c)]
        assert row["truth"] == pytest.approx(truth[race_c], rel=1e-12)
        theta_in = (df["w"] * df["y"])[df["race"] == race_c].sum()
        assert row["theta"] == pytest.approx(theta_in, rel=1e-12)
        # the input's deviation off from the truth enters the squared bias: (off + s)^2 with
        # s^2 <= (8a), so (|off| - sqrt(8a))^2 <= E (theta* - truth)^2 <= (|off| + sqrt(8a))^2 + (8a)
        off, b = abs(theta_in - truth[race_c]), np.sqrt(row["bias_msq_8a"])
        assert off > 0.01 * truth[race_c]
        assert (off - b) ** 2 <= row["bias_msq_original"] <= (off + b) ** 2 + b**2
    with pytest.raises(ValueError, match="not the original's, labelled as in it"):
        massc_result(df.set_axis(df.index + 5000), spec, 1, original)


def test_bias_against_the_truth_matches_monte_carlo():
    """E (theta* - truth)^2 with theta = truth + off: (8a) with off inside the squared bias,
    against repeated stratified SRSWOR substitution."""
    rng = np.random.default_rng(12)
    h = np.repeat([0, 1], [40, 80])
    nu = np.r_[rng.normal(0.5, 1.0, 40), rng.normal(-0.2, 2.0, 80)]
    psi = np.array([0.25, 0.125])
    N = np.bincount(h).astype(float)
    V = np.bincount(h, weights=nu)[:, None]
    S2 = np.array([nu[h == k].var(ddof=1) for k in range(2)])[:, None]
    m = ZMoments([("y", "", "")], ["a", "b"], N, np.array([50.0]), V, S2, S2)
    off = 3.0  # theta of the input minus the truth
    il = information_loss(m, psi, np.ones(2), truth=np.array([50.0 - off]))
    mc = np.array([(off + (nu * select(h, psi[h], rng)).sum()) ** 2 for _ in range(6000)])
    assert il["bias_msq_original"].iloc[0] == pytest.approx(mc.mean(), rel=0.06)
    assert il["rrmse"].iloc[0] == pytest.approx(
        np.sqrt(il["bias_msq_original"].iloc[0]) / 47.0, rel=1e-12
    )


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_donors_never_cross_a_domain_cell(seed):
    """Property: with the declared-domain cell as a donor restriction every donor shares its
    recipient's cell, and exactly the records whose cell holds a single key profile have none."""
    from sdl_design.stages.massc.treatment import domain_cells

    df = _small_file(300, seed)
    keys = ["a", "b", "c"]
    cells = domain_cells(df, ["a", "grp"])
    res = find_donors(df, keys, {"y": {}}, rng=seed, cells=cells)
    has = res.donor >= 0
    assert (cells[has] == cells[res.donor[has]]).all()
    profile = df[keys].astype(str).agg("|".join, axis=1)
    single = profile.groupby(cells).transform("nunique").to_numpy() == 1
    np.testing.assert_array_equal(~has, single)
    assert has.sum() > 200
    # every key restricted: no partner anywhere, found without a search
    none = find_donors(df, keys, {"y": {}}, rng=seed, cells=domain_cells(df, keys))
    assert (none.donor == -1).all()


def test_declared_domains_kept_by_substitution_and_calibration(survey):
    """With declared domains age group, sex, race and age x sex: substitution never changes a
    record's domain cell, and the calibrated weighted count of every domain cell equals the
    original's (cells with fewer than domain_min_records retained records are pooled and
    reported); the count of records without a partner in their cell is reported."""
    from sdl_design.keys import key_frame

    spec, df = survey
    out = massc_result(df, spec, 5, df)
    assert out.metrics["n_substituted"] > 0
    keys = {k.name: k for k in spec.variables.keys}
    dom = [keys["age"], keys["sex"], keys["race"]]
    retained = out.data.index
    assert key_frame(out.data, dom).equals(key_frame(df.loc[retained], dom))
    table = out.tables["calibration_domains"].set_index("domain")
    assert table.index.tolist() == ["age", "sex", "race", "age x sex"]
    kf_o, kf_t = key_frame(df, dom), key_frame(out.data, dom)
    for name, cols in (
        ("age", ["age"]),
        ("sex", ["sex"]),
        ("race", ["race"]),
        ("age x sex", ["age", "sex"]),
    ):
        t_o = df["wt"].groupby([kf_o[c] for c in cols]).sum()
        t_t = out.data["wt"].groupby([kf_t[c] for c in cols]).sum()
        n_t = out.data["wt"].groupby([kf_t[c] for c in cols]).size()
        kept = n_t.index[n_t >= spec.stages.massc.calibration.domain_min_records]
        assert table.loc[name, "cells_kept"] == len(kept)
        if "merged into" in table.loc[name, "status"]:  # small cells joined the largest one
            kept = kept.drop(n_t.loc[kept].idxmax())
        np.testing.assert_allclose(t_t.loc[kept], t_o.loc[kept], rtol=1e-8)
        assert t_t.sum() == pytest.approx(t_o.sum(), rel=1e-8)
    assert out.metrics["calibration_domains_dropped"] == 0
    assert any("declared domains" in n for n in out.notes)
    assert "n_no_donor_domain" in out.metrics


def test_no_donor_in_domain_cell_counted_and_reported():
    """Records whose declared-domain cell holds a single key profile cannot be substituted
    without leaving the cell: they get no partner, and the release counts and says so."""

    df = _zero_unique_file(640)
    # one age group of one sex has a single race: its records have no partner inside the cell
    lonely = (df["agecat"] == "60+") & (df["sex"] == "male")
    df.loc[lonely, "race"] = "a"
    spec = _spec({"negligible_risk": 0.0}, domains=[["agecat", "sex"]])
    out = massc_result(df, spec, 1, df)
    assert out.metrics["n_no_donor_domain"] == lonely.sum() == 80
    assert out.metrics["n_no_donor"] == 80
    assert any("80 records (12.5%) have no partner in their cell" in n for n in out.notes)


def test_minimal_treatment_only_when_delta_allows():
    """The zero-unique file left alone has delta (eq. 3-6) = mean r_k (every record appears as
    'o' and is kept). With a delta target below that, minimal treatment of its negligible-risk
    stratum is not allowed: MASSC treats it, then raises the loss budgets, until delta meets the
    target; the revisions are reported. Without a target nothing is revised."""
    from sdl_design.risk import genmassc_scores

    df = _zero_unique_file()
    spec = _spec(domains=["agecat", "sex"])
    r = genmassc_scores(df, ["agecat", "sex", "race"], spec.variables.sensitive).to_numpy()
    alone = massc_result(df, spec, 3, df)
    assert alone.metrics["delta"] == pytest.approx(r.mean(), rel=1e-12)  # delta_o, untreated
    assert alone.metrics["n_delta_revisions"] == 0
    spec.gates.delta_max = 0.9 * r.mean()
    out = massc_result(df, spec, 3, df)
    m = out.metrics
    assert m["delta"] <= spec.gates.delta_max and m["n_delta_revisions"] >= 1
    rates = out.tables["rates"]
    assert rates["psi"].iloc[0] > 0 and rates["phi"].iloc[0] < 1
    assert m["budget_scale"] == pytest.approx(2.0 ** ((m["n_delta_revisions"] - 1) / 2))
    assert any("treat the strata of negligible risk" in n for n in out.notes)
    spec.gates.delta_max = None
    assert massc_result(df, spec, 3, df).metrics["n_delta_revisions"] == 0


@pytest.mark.parametrize("shift", ["none", "new_value", "dtype"])
def test_original_margins_give_the_calibration_from_both_files(shift):
    """calibrate_treated with OriginalMargins (the original's cells, totals and control totals
    computed once) returns the weights, replicate weights, tables and metrics of the
    calibration that codes both files, bit for bit: with cells pooled, merged and missing from
    either file, and when b2 holds a value the original lacks or a column of another dtype
    (then that domain is coded from both files). Each margin's original totals are
    control_totals of the original's labels, to the last bit."""
    from sdl_design.stages.massc.treatment import (
        OriginalMargins,
        _domain_cells_both,
        _domain_margins,
        calibrate_treated,
        domain_cells,
        margin_name,
    )
    from sdl_design.survey.calibration import control_totals

    rng = np.random.default_rng(5)
    n = 600
    original = pd.DataFrame(
        {
            "age": rng.integers(0, 90, n),
            "sex": rng.choice(["f", "m"], n),
            "reg": rng.choice(["n", "s", "e", "w", "x"], n, p=[0.4, 0.3, 0.2, 0.07, 0.03]),
            "w": rng.uniform(1, 3, n) * 10.0 ** rng.integers(0, 3, n),
        },
        index=rng.permutation(n) + 1000,
    )
    reps = [f"r{i}" for i in range(4)]
    for r in reps:  # a JK-like replicate: zero for a quarter of the records
        original[r] = original["w"] * (rng.random(n) > 0.25) * 4 / 3
    b2 = original.iloc[rng.permutation(n)[:350]].copy()
    b2.loc[b2.index[:40], "reg"] = "n"  # substituted records
    if shift == "new_value":
        b2.loc[b2.index[0], "reg"] = "z"
    if shift == "dtype":
        b2["age"] = b2["age"].astype(float)
    age = KeySpec(name="age", bins=[0, 18, 35, 50, 65, 91])
    domains = [["reg"], [age, "sex"], ["sex", "reg"]]
    controls = ["sex"]
    factor = rng.uniform(1.0, 1.5, len(b2))
    cache = OriginalMargins(original, "w", domains, controls, reps)
    coded = [c.treated_codes(b2, original) is not None for c in cache.domains.values()]
    assert len(coded) == 3 and all(coded) == (shift == "none") and any(coded)
    w = original["w"].to_numpy()
    for dom in domains:  # cells numbered as domain_cells numbers them on both files stacked
        specs = [KeySpec(name=k) if isinstance(k, str) else k for k in dom]
        cols = [k.name for k in specs]
        both = domain_cells(pd.concat([b2[cols], original[cols]], ignore_index=True), specs)
        dc = _domain_cells_both(b2, original, specs, w, cache.domains[margin_name(dom)])
        assert np.array_equal(dc.cb, both[: len(b2)]) and np.array_equal(dc.co(), both[len(b2) :])
        assert dc.t_o.tobytes() == np.bincount(both[len(b2) :], weights=w).tobytes()
    statuses = set()
    for min_records in (5, 25, 60):  # nothing, some, many cells pooled
        args = (b2, "w", factor, original, controls, "linear", None, reps, "widen", domains)
        out0, tab0, met0 = calibrate_treated(*args, min_records)
        out1, tab1, met1 = calibrate_treated(*args, min_records, original_margins=cache)
        assert list(out0.columns) == list(out1.columns)
        for c in out0.columns:
            assert np.array_equal(out0[c].to_numpy(), out1[c].to_numpy()), c
        assert list(tab0) == list(tab1)
        for k in tab0:
            pd.testing.assert_frame_equal(tab0[k], tab1[k], check_exact=True)
        assert met0 == met1
        statuses |= set(tab0["calibration_domains"]["status"])
        margins, _ = _domain_margins(b2, original, domains, "w", min_records, cache=cache)
        for v in margins.values():
            want = control_totals(original.assign(lab=v.original()), "w", ["lab"])["lab"]
            assert v.totals(original["w"].to_numpy()) == want
    assert "kept" in statuses and any("pooled" in s or "merged" in s for s in statuses)


def test_z_moments_in_one_call_equal_the_two_step_moments_over_several_domains():
    """z_moments with the substitution indicators and no earlier moments (one call) equals
    the moments without them followed by S2 of z* given those (two calls), on two domains of
    two study variables: the z* sums of one domain never leak into the next."""
    tilde = substitute(TABLE, DONOR, np.ones(10, dtype=bool), KEYS)
    strata = massc_strata(TABLE, KEYS, NU)
    zv = StudyVariables(
        ["binge", "_count"],
        {"gender": ["M", "F"], "age": ["1", "2", "3"]},
        [KeySpec(name="gender"), KeySpec(name="age")],
    )
    one = z_moments(TABLE, tilde, strata, "w", zv, substituted=SUBSTITUTED)
    base = z_moments(TABLE, tilde, strata, "w", zv)
    two = z_moments(TABLE, tilde, strata, "w", zv, substituted=SUBSTITUTED, base=base)
    np.testing.assert_allclose(one.theta, base.theta, rtol=1e-14)
    np.testing.assert_allclose(one.S2_nu, base.S2_nu, rtol=1e-14, atol=1e-14)
    np.testing.assert_allclose(one.S2_zstar, two.S2_zstar, rtol=1e-14, atol=1e-14)
    # theta of binge among men is the weighted count of male binge drinkers (brute force)
    men = (TABLE["gender"] == "M").to_numpy()
    assert one.theta[0] == pytest.approx(float((TABLE["binge"] * TABLE["w"])[men].sum()))


def test_record_columns_read_into_a_reused_buffer():
    """RecordColumns.values equals df[columns] at the records (labels, in their order) whether
    the columns are one float block (gathered a column at a time) or not, with or without the
    caller's buffer, which it fills and returns; without records left out, the block is read
    in place."""
    from sdl_design.stages.massc.treatment import RecordColumns

    rng = np.random.default_rng(12)
    block = pd.DataFrame(rng.uniform(size=(50, 5)), columns=list("abcde"), index=range(100, 150))
    block.insert(0, "k", np.arange(50))  # an int column before the float block
    mixed = block.assign(c=block["c"].astype(np.float32))  # c in its own block
    labels = pd.Index(rng.permutation(block.index.to_numpy())[:30])
    for src in (block, mixed):
        rc = RecordColumns(src, labels)
        for cols in (["b", "c", "d"], ["e"], ["d", "b"]):
            expect = src.loc[labels, cols].to_numpy(dtype=float)
            np.testing.assert_array_equal(rc.values(cols), expect)
            buf = np.full((30, len(cols)), np.nan, order="F")
            assert rc.values(cols, out=buf) is buf
            np.testing.assert_array_equal(buf, expect)
    whole = RecordColumns(block, block.index).values(["a", "b", "c"])
    assert np.shares_memory(whole, block["a"].to_numpy()) and not whole.flags.writeable


def test_cell_sums_of_several_cellings_at_once():
    """_cell_sums (one stacked indicator for every celling) gives each celling's cell sums of
    each column: equal to a pandas groupby, and bit for bit to one indicator per celling; a
    cell no record falls in sums to 0."""
    from sdl_design.stages.massc.treatment import RecordColumns, _cell_sums
    from sdl_design.survey.design import group_indicator

    rng = np.random.default_rng(13)
    df = pd.DataFrame(rng.uniform(size=(500, 20)), columns=[f"r{i}" for i in range(20)])
    sizes = [3, 7, 40]
    cells = [rng.integers(0, m - 1, len(df)) for m in sizes]  # the last cell of each empty
    got = _cell_sums(cells, sizes, RecordColumns(df, df.index), list(df.columns))
    assert [g.shape for g in got] == [(m, 20) for m in sizes]
    for c, m, g in zip(cells, sizes, got, strict=True):
        by = df.groupby(c).sum().reindex(range(m), fill_value=0.0).to_numpy()
        np.testing.assert_allclose(g, by, rtol=1e-13)
        np.testing.assert_array_equal(g, group_indicator(c, m) @ df.to_numpy())
        assert (g[m - 1] == 0).all()
    assert _cell_sums([], [], RecordColumns(df, df.index), list(df.columns)) == []


def test_percentiles_from_distinct_values_and_counts_are_numpys():
    """percentiles_of_counts (the weight-factor table of the calibration, in memory and by
    partition) from parts' distinct values and counts: np.percentile of all the values, bit
    for bit, with ties, one value, and values split unevenly over parts."""
    from sdl_design.stages.massc.treatment import FACTOR_PERCENTILES, percentiles_of_counts

    rng = np.random.default_rng(8)
    for n, k in ((1, 1), (7, 3), (1000, 40), (12345, 5000)):
        x = np.round(rng.lognormal(0, 0.3, n), 3) if k < n else rng.normal(size=n)
        cuts = np.sort(rng.choice(np.arange(1, n), min(4, n - 1), replace=False)) if n > 1 else []
        parts = [np.unique(p, return_counts=True) for p in np.split(x, cuts)]
        got = percentiles_of_counts(parts)
        assert got.tobytes() == np.percentile(x, FACTOR_PERCENTILES).tobytes(), n


def test_stable_argsort_is_numpys_stable_argsort():
    """_stable_argsort(u) == np.argsort(u, kind="stable"): uniform draws (runs of values that
    agree in all but the index bits sorted by value), exact ties, values a few ulps apart,
    tiny values, and the fallbacks (many ties, NaN, -0.0, negative values)."""
    from sdl_design.stages.massc.treatment import _stable_argsort

    rng = np.random.default_rng(17)
    near = np.r_[rng.random(1000), [0.5, 0.5 + 2**-52, 0.5 + 2**-51, 0.5, 0.5 + 2**-45]]
    cases = [
        rng.random(300_000),
        near,
        rng.permutation(near),
        np.round(rng.random(10_000), 3),
        np.round(rng.random(10_000), 5),
        rng.random(3000) * 1e-300,
        np.zeros(50),
        np.array([0.3]),
        np.zeros(0),
        np.r_[rng.random(10), np.nan],
        np.r_[rng.random(10), -0.0],
        rng.normal(size=1000),
    ]
    for u in cases:
        np.testing.assert_array_equal(_stable_argsort(u), np.argsort(u, kind="stable"))


def test_treated_parts_made_when_asked_are_b1s_values_and_pickle_only_their_records():
    """B(1)'s study values and domain codes of the records `rows`, made a variable at a time,
    are the substituted records' partner values and the others' own (brute force per record);
    a slice of them pickled carries its records alone and the same values."""
    import pickle

    from sdl_design.stages.massc.moments import ZParts

    rng = np.random.default_rng(7)
    n = 500
    y0 = {"a": rng.normal(size=n), "_count": np.ones(n)}
    y1 = {"a": rng.normal(size=n), "_count": np.ones(n)}
    d0 = {"sex": rng.integers(-1, 2, n)}
    d1 = {"sex": rng.integers(-1, 2, n)}
    sel = rng.random(n) < 0.3
    rows = np.sort(rng.choice(n, 300, replace=False))
    t = ZParts(y0, d0, y1, d1).treated(sel, rows)
    for name, (own, partner), got in [
        ("a", (y0["a"], y1["a"]), t.y("a")),
        ("sex", (d0["sex"], d1["sex"]), t.d("sex")),
    ]:
        want = [partner[k] if sel[k] else own[k] for k in rows]
        np.testing.assert_array_equal(got, want, err_msg=name)
    head = t.take(slice(0, 40))
    back = pickle.loads(pickle.dumps(head))
    assert len(back.parts.y0["a"]) == len(back.sel) == 40 and len(t.parts.y0["a"]) == n
    np.testing.assert_array_equal(back.y("a"), t.y("a")[:40])
    np.testing.assert_array_equal(back.d("sex"), t.d("sex")[:40])
