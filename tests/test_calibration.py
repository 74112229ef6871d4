"""Calibration (MASSC Step IV): closed forms, IPF, svy, bounds, infeasibility, replicates."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from sdl_design.keys import key_frame
from sdl_design.spec import KeySpec
from sdl_design.survey.calibration import (
    CalibrationError,
    CalibrationInfeasible,
    calibrate,
    calibrate_replicates,
    control_totals,
)


def _sample(n: int = 400, seed: int = 1) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    return pd.DataFrame(
        {
            "w": rng.uniform(1.0, 4.0, n),
            "sex": rng.choice(["female", "male"], n),
            "region": rng.choice(["ne", "mw", "s", "w"], n, p=[0.2, 0.3, 0.3, 0.2]),
            "age": rng.integers(0, 90, n),
            "income": rng.gamma(2.0, 10.0, n),
        }
    )


def _totals(df: pd.DataFrame) -> dict:
    """Population totals off the sample's estimates by a few percent."""
    return {
        "sex": {"female": 520.0, "male": 480.0},
        "region": {"ne": 190.0, "mw": 310.0, "s": 300.0, "w": 200.0},
    }


def _achieved(df, w, totals):
    out = {}
    for col, t in totals.items():
        if isinstance(t, dict):
            out[col] = {c: w[df[col] == c].sum() for c in t}
        else:
            out[col] = float(np.dot(w, df[col]))
    return out


def _assert_met(df, w, totals, rel=1e-8):
    got = _achieved(df, np.asarray(w), totals)
    for col, t in totals.items():
        if isinstance(t, dict):
            for c, v in t.items():
                assert got[col][c] == pytest.approx(v, rel=rel), (col, c)
        else:
            assert got[col] == pytest.approx(t, rel=rel), col


def _scaled(df: pd.DataFrame) -> pd.DataFrame:
    """Weights scaled so the sample's total is near the population's 1000."""
    return df.assign(w=df["w"] * 1000.0 / df["w"].sum())


# ---------------------------------------------------------------- linear = closed-form GREG


@pytest.mark.parametrize("numeric", [False, True])
def test_linear_equals_closed_form_greg(numeric):
    df = _scaled(_sample())
    totals = _totals(df)
    if numeric:
        totals["income"] = 1.05 * float(np.dot(df["w"], df["income"]))
    g = calibrate(df, "w", totals, method="linear")
    # closed form w (1 + x'(X'WX)^{-1}(T - That)); one region category dropped (it is implied
    # by the sex margin, whose categories sum to the same N)
    cols = [df["sex"] == "female", df["sex"] == "male"]
    cols += [df["region"] == c for c in ("ne", "mw", "s")]
    T = [520.0, 480.0, 190.0, 310.0, 300.0]
    if numeric:
        cols.append(df["income"])
        T.append(totals["income"])
    X = np.column_stack([np.asarray(c, dtype=float) for c in cols])
    w = df["w"].to_numpy()
    lam = np.linalg.solve(X.T @ (X * w[:, None]), np.array(T) - X.T @ w)
    np.testing.assert_allclose(g.to_numpy(), w * (1.0 + X @ lam), rtol=1e-10)
    _assert_met(df, g, totals)
    assert g.index.equals(df.index) and g.name == "w"


# ---------------------------------------------------------------- raking = IPF


def test_raking_equals_ipf():
    df = _scaled(_sample(seed=2))
    totals = _totals(df)
    g = calibrate(df, "w", totals, method="raking")
    w = df["w"].to_numpy().copy()
    for _ in range(500):  # iterative proportional fitting
        for col, t in totals.items():
            for c, v in t.items():
                m = (df[col] == c).to_numpy()
                w[m] *= v / w[m].sum()
    np.testing.assert_allclose(g.to_numpy(), w, rtol=1e-10)
    _assert_met(df, g, totals)


# ---------------------------------------------------------------- logit within bounds


def test_logit_meets_totals_within_bounds_and_is_gem():
    df = _scaled(_sample(seed=3))
    totals = _totals(df)
    totals["income"] = 1.08 * float(np.dot(df["w"], df["income"]))
    L, U = 0.8, 1.3
    g = calibrate(df, "w", totals, method="logit", bounds=(L, U))
    _assert_met(df, g, totals)
    ratio = (g / df["w"]).to_numpy()
    assert ratio.min() > L and ratio.max() < U
    # the GEM with centre 1: u = F^{-1}(g) = log[(g - L)(U - 1) / ((1 - L)(U - g))] / A is
    # linear in the auxiliary vector x (one region column dropped: implied by the sex margin)
    A = (U - L) / ((1 - L) * (U - 1))
    u = np.log((ratio - L) * (U - 1) / ((1 - L) * (U - ratio))) / A
    X = np.column_stack(
        [(df["sex"] == "female"), (df["sex"] == "male")]
        + [(df["region"] == c) for c in ("ne", "mw", "s")]
        + [df["income"]]
    ).astype(float)
    lam, *_ = np.linalg.lstsq(X, u, rcond=None)
    np.testing.assert_allclose(X @ lam, u, atol=1e-8)
    # wide bounds: logit approaches raking, narrow ones bind
    wide = calibrate(df.drop(columns="income"), "w", _totals(df), "logit", (1e-6, 1e6))
    rk = calibrate(df, "w", _totals(df), "raking")
    np.testing.assert_allclose(wide, rk, rtol=1e-4)


def test_logit_requires_bounds():
    df = _sample()
    with pytest.raises(CalibrationError, match="bounds"):
        calibrate(df, "w", _totals(df), method="logit")
    with pytest.raises(CalibrationError, match="0 < L < 1 < U"):
        calibrate(df, "w", _totals(df), method="logit", bounds=(1.2, 2.0))


# ---------------------------------------------------------------- svy as second opinion


def test_agrees_with_svy_linear_and_raking():
    import polars as pl
    import svy

    df = _scaled(_sample(seed=4))
    totals = _totals(df)
    inc = 1.05 * float(np.dot(df["w"], df["income"]))
    frame = pl.from_pandas(df).with_columns(pl.col("w").cast(pl.Float64))
    s = svy.Sample(frame, svy.Design(wgt="w"))
    lin = s.weighting.calibrate(
        controls={svy.Cat("sex"): totals["sex"], "income": inc}, wgt_name="cw"
    )
    ours = calibrate(df, "w", {"sex": totals["sex"], "income": inc}, method="linear")
    np.testing.assert_allclose(lin.data["cw"].to_numpy(), ours.to_numpy(), rtol=1e-9)
    rk = s.weighting.rake(controls=totals, wgt_name="rw", tol=1e-13, max_iter=2000)
    ours = calibrate(df, "w", totals, method="raking")
    np.testing.assert_allclose(rk.data["rw"].to_numpy(), ours.to_numpy(), rtol=1e-9)


# ---------------------------------------------------------------- post-stratification


def test_poststratify_closed_form():
    df = _sample(seed=5)
    N = {"ne": 190.0, "mw": 310.0, "s": 300.0, "w": 200.0}
    g = calibrate(df, "w", {"region": N}, method="poststratify")
    Nhat = df.groupby("region")["w"].sum()
    expect = df["w"] * df["region"].map(lambda c: N[c] / Nhat[c])
    np.testing.assert_allclose(g, expect, rtol=1e-13)
    with pytest.raises(CalibrationError, match="one categorical margin"):
        calibrate(df, "w", _totals(df), method="poststratify")


# ---------------------------------------------------------------- errors


def test_infeasible_bounds_name_the_control():
    df = _scaled(_sample(seed=6))
    totals = {"sex": {"female": 700.0, "male": 300.0}}  # needs g well outside (0.8, 1.25)
    with pytest.raises(CalibrationInfeasible, match=r"control 'sex=(female|male)'.*off by"):
        calibrate(df, "w", totals, method="logit", bounds=(0.8, 1.25))
    # raking and linear check bounds but do not enforce them
    with pytest.raises(CalibrationInfeasible, match="outside the bounds"):
        calibrate(df, "w", totals, method="raking", bounds=(0.8, 1.25))
    # feasible with wider bounds
    g = calibrate(df, "w", totals, method="logit", bounds=(0.3, 3.0))
    _assert_met(df, g, totals)
    # a numeric control (records, not profiles): income needs g near 1.5 on average
    t = {"sex": {"female": 500.0, "male": 500.0}, "income": 1.5 * np.dot(df["w"], df["income"])}
    with pytest.raises(CalibrationInfeasible, match=r"control 'income'.*off by"):
        calibrate(df, "w", t, method="logit", bounds=(0.8, 1.25))


def test_bad_input_errors():
    df = _sample()
    with pytest.raises(CalibrationError, match="not in the data"):
        calibrate(df, "w", {"county": {"a": 1.0}}, method="raking")
    with pytest.raises(CalibrationError, match=r"data categories \['w'\] have no control total"):
        calibrate(df, "w", {"region": {"ne": 1.0, "mw": 1.0, "s": 1.0}}, method="raking")
    with pytest.raises(CalibrationError, match=r"categories \['x'\] have totals"):
        t = {"region": {"ne": 1.0, "mw": 1.0, "s": 1.0, "w": 1.0, "x": 5.0}}
        calibrate(df, "w", t, method="raking")
    # a zero total for a category absent from the data is harmless
    t = {"region": {"ne": 190.0, "mw": 310.0, "s": 300.0, "w": 200.0, "x": 0.0}}
    _assert_met(df, calibrate(df, "w", t, method="raking"), {"region": t["region"]})
    with pytest.raises(CalibrationError, match="margins sum to different population totals"):
        t = {"sex": {"female": 500.0, "male": 500.0}, "region": {"ne": 1.0, "mw": 1.0}}
        calibrate(df, "w", t | {"region": t["region"] | {"s": 1.0, "w": 1.0}}, "raking")
    with pytest.raises(CalibrationError, match="method 'ipf' unknown"):
        calibrate(df, "w", _totals(df), method="ipf")


def test_control_totals_with_recoded_keys():
    df = _sample()
    t = control_totals(df, "w", ["sex", KeySpec(name="age", bins=[0, 18, 65, 91]), "income"])
    assert t["sex"]["female"] == pytest.approx(df.loc[df["sex"] == "female", "w"].sum())
    young = df.loc[df["age"] < 18, "w"].sum()
    assert t["age"]["0-18"] == pytest.approx(young)
    assert sum(t["age"].values()) == pytest.approx(df["w"].sum())
    assert t["income"] == pytest.approx(float(np.dot(df["w"], df["income"])))
    # calibrating on the recoded key: the caller passes a frame with the recoded column
    rng = np.random.default_rng(0)
    pert = df.assign(w=df["w"] * rng.uniform(0.8, 1.25, len(df)))
    pert["age"] = key_frame(pert, [KeySpec(name="age", bins=[0, 18, 65, 91])])["age"]
    g = calibrate(pert, "w", t, "logit", (0.5, 2.0))
    _assert_met(pert, g, t)


# ---------------------------------------------------------------- replicate weights


def _jkn(df: pd.DataFrame) -> tuple[pd.DataFrame, list[str], np.ndarray]:
    """JKn by hand: replicate (h, j) zeroes PSU j of stratum h and scales the other PSUs of h
    by n_h / (n_h - 1); returns the frame, replicate columns and factors (n_h - 1) / n_h."""
    out, cols, fac = df.copy(), [], []
    for h, sub in df.groupby("stratum"):
        psus = sorted(sub["psu"].unique())
        n_h = len(psus)
        for j in psus:
            c = f"rw_{h}_{j}"
            r = df["w"].to_numpy().copy()
            in_h = (df["stratum"] == h).to_numpy()
            r[in_h] *= n_h / (n_h - 1)
            r[in_h & (df["psu"] == j).to_numpy()] = 0.0
            out[c] = r
            cols.append(c)
            fac.append((n_h - 1) / n_h)
    return out, cols, np.array(fac)


def _design_sample(seed: int = 7) -> pd.DataFrame:
    df = _sample(n=600, seed=seed)
    rng = np.random.default_rng(seed)
    df["stratum"] = rng.integers(0, 6, len(df))
    df["psu"] = np.where(
        df["stratum"] < 3, rng.integers(1, 3, len(df)), rng.integers(1, 4, len(df))
    )
    return df


def _jkn_se(est_full: float, est_reps: np.ndarray, fac: np.ndarray) -> float:
    return float(np.sqrt(np.sum(fac * (est_reps - est_full) ** 2)))


@pytest.mark.parametrize("method", ["logit", "raking", "linear"])
def test_replicate_recalibration_zero_se_of_controls(method):
    original, reps, fac = _jkn(_design_sample())
    controls = ["sex", "region", "income"]
    T = control_totals(original, "w", controls)
    rng = np.random.default_rng(1)
    treated = original.copy()
    f = rng.uniform(0.85, 1.2, len(original))  # e.g. 1/phi and substitution changes
    treated["w"] *= f
    for c in reps:
        treated[c] *= f
    bounds = (0.5, 2.0) if method == "logit" else None
    w = calibrate(treated, "w", T, method, bounds)
    cal, report = calibrate_replicates(treated, reps, [T] * len(reps), method, bounds)
    assert (report["status"] == "ok").all() and list(report["replicate"]) == reps
    assert cal.index.equals(treated.index) and list(cal.columns) == reps
    for c in reps:  # zero replicate weights stay zero
        assert (cal[c][treated[c] == 0] == 0).all()
        _assert_met(treated, cal[c], T)
    x = {f"{col}={cat}": (treated[col] == cat) for col in ("sex", "region") for cat in T[col]}
    x["income"] = treated["income"]
    for name, v in x.items():  # population controls: replicate SE of the totals is 0
        v = v.to_numpy(dtype=float)
        est = np.array([np.dot(cal[c], v) for c in reps])
        full = np.dot(w, v)
        assert _jkn_se(full, est, fac) <= 1e-8 * full, name
    # an uncalibrated variable keeps a positive SE
    v = treated["age"].to_numpy(dtype=float)
    est = np.array([np.dot(cal[c], v) for c in reps])
    assert _jkn_se(np.dot(w, v), est, fac) > 1e-3 * np.dot(w, v)


@pytest.mark.parametrize("controls", [[], ["sex", "region"]])
def test_replicates_come_back_as_one_block_in_their_places(controls):
    """The recalibrated replicate weights are one float block of the returned frame, in the
    source frame's column order, so a design reads them in place (no 70-column copy per
    design at 1M records); the values equal each replicate calibrated alone."""
    from sdl_design.stages.massc.treatment import calibrate_treated
    from sdl_design.survey.design import SurveyDesign, block_view

    original, reps, _ = _jkn(_design_sample(seed=11))
    original = original[["w", *reps, "sex", "region", "income", "stratum", "psu"]].copy()
    f = np.random.default_rng(3).uniform(0.8, 1.25, len(original))
    T = control_totals(original, "w", ["sex"])
    cal, _ = calibrate_replicates(original, reps, [T] * len(reps), "raking", factor=f)
    assert block_view(cal, reps) is not None and list(cal.columns) == reps
    alone = calibrate_replicates(original[["sex", reps[1]]], [reps[1]], [T], "raking", factor=f)[0]
    # (alone: Newton starts cold, not from the previous replicate's multipliers)
    np.testing.assert_allclose(cal[reps[1]].to_numpy(), alone[reps[1]].to_numpy(), rtol=1e-10)
    out, _, _ = calibrate_treated(
        original, "w", f, original, controls, "raking", None, reps, "widen"
    )
    assert list(out.columns) == list(original.columns)
    assert block_view(out, reps) is not None
    d = SurveyDesign(out, "w", strata="stratum", psu="psu", replicate_weights=reps, method="jkn")
    assert np.shares_memory(d.W, out[reps[0]].to_numpy())  # read in place
    if not controls:  # divided by phi only
        expect = original[reps].to_numpy() * f[:, None]
        np.testing.assert_array_equal(out[reps].to_numpy(), expect)


def test_replicates_to_their_own_controls_reproduce_original_se():
    """Replicate r calibrated to the original's replicate-r controls: the SE of a calibrated
    control total in the treated file equals the original file's SE."""
    original, reps, fac = _jkn(_design_sample(seed=8))
    controls = ["sex", "region"]
    T = control_totals(original, "w", controls)
    per = dict(zip(reps, control_totals(original, reps, controls), strict=True))
    assert per[reps[2]] == control_totals(original, reps[2], controls)
    treated = original.copy()
    f = np.random.default_rng(2).uniform(0.85, 1.2, len(original))
    for c in ["w", *reps]:
        treated[c] *= f
    w = calibrate(treated, "w", T, "logit", (0.5, 2.0))
    cal, report = calibrate_replicates(treated, reps, per, "logit", (0.5, 2.0))
    m = (treated["region"] == "s").to_numpy()
    se_treated = _jkn_se(w[m].sum(), np.array([cal[c][m].sum() for c in reps]), fac)
    se_orig = _jkn_se(original["w"][m].sum(), np.array([original[c][m].sum() for c in reps]), fac)
    assert se_orig > 0
    assert se_treated == pytest.approx(se_orig, rel=1e-7)


@pytest.mark.parametrize("policy", ["widen", "rake"])
def test_infeasible_replicate_policy(policy):
    original, reps, _ = _jkn(_design_sample(seed=9))
    per = [control_totals(original, c, ["sex", "region"]) for c in reps]
    bad = reps[3]
    t = per[3]["region"]
    shift = 0.8 * t["ne"]  # region 'ne' needs g around 1.8; with (0.8, 1.25): infeasible
    per[3] = {
        "sex": per[3]["sex"],
        "region": t | {"ne": t["ne"] + shift, "mw": t["mw"] - shift},
    }
    bounds = (0.8, 1.25)
    with pytest.raises(CalibrationInfeasible, match="region=ne"):
        calibrate(original, bad, per[3], "logit", bounds)
    cal, report = calibrate_replicates(original, reps, per, "logit", bounds, policy=policy)
    rep = report.set_index("replicate")
    assert rep.loc[bad, "status"] == ("widened" if policy == "widen" else "raked")
    assert (rep.drop(index=bad)["status"] == "ok").all()
    _assert_met(original, cal[bad], per[3])
    g = (cal[bad] / original[bad])[original[bad] > 0]
    if policy == "widen":
        lo, hi = rep.loc[bad, "lower"], rep.loc[bad, "upper"]
        assert lo < 0.8 and hi > 1.25
        assert g.min() > lo and g.max() < hi and g.max() > 1.25
        # the previous widening step (bounds / 1.25) was not enough
        with pytest.raises(CalibrationInfeasible):
            calibrate(original, bad, per[3], "logit", (lo * 1.25, hi / 1.25))
    else:
        assert np.isnan(rep.loc[bad, "lower"])
    assert rep.loc[bad, "g_max"] == pytest.approx(g.max())


def test_default_survey_replicate_ses_stay_close():
    """On the default survey (JKn replicates), perturbed weights calibrated with their
    replicates to the original's controls: SEs of calibrated totals equal the original's, SEs
    of other variables stay close."""
    from sdl_design.synth import make_survey

    df = make_survey(2000, seed=3)
    reps = [c for c in df.columns if c.startswith("rw_")]
    n_h = df.groupby("stratum")["psu"].nunique()
    fac = np.array(
        [(n_h[h] - 1) / n_h[h] for h in (df.loc[df[c] == 0, "stratum"].iloc[0] for c in reps)]
    )
    controls = ["sex", KeySpec(name="age", bins=[0, 18, 35, 65, 91]), "region"]
    T = control_totals(df, "wt", controls)
    per = control_totals(df, reps, controls)
    treated = df.copy()
    treated["age"] = key_frame(df, controls)["age"]
    f = np.random.default_rng(0).uniform(0.7, 1.4, len(df))
    for c in ["wt", *reps]:
        treated[c] = treated[c] * f
    w = calibrate(treated, "wt", T, "logit", (0.5, 2.0)).to_numpy()
    cal, report = calibrate_replicates(treated, reps, per, "logit", (0.5, 2.0))
    assert (report["status"] == "ok").all()
    R0, R1 = df[reps].to_numpy(), cal[reps].to_numpy()
    w0 = df["wt"].to_numpy()
    se = {}
    for v in ("income", "bmi", "diabetes", "female"):
        x = (df["sex"] == "female").to_numpy(float) if v == "female" else df[v].to_numpy(float)
        se[v] = (_jkn_se(w0 @ x, x @ R0, fac), _jkn_se(w @ x, x @ R1, fac))
    assert se["female"][1] == pytest.approx(se["female"][0], rel=1e-7)
    for v in ("income", "bmi", "diabetes"):
        assert 0.8 < se[v][1] / se[v][0] < 1.25, (v, se[v])


def test_sparse_design_equals_dense(monkeypatch):
    """Many categories: X held as CSR (sparse Gram) gives the weights of the dense path, for
    raking and logit, full weight and replicates (a crossing of 3 margins, 120+ categories)."""
    import sdl_design.survey.calibration as cal

    rng = np.random.default_rng(4)
    n = 3000
    df = pd.DataFrame(
        {
            "a": rng.integers(0, 40, n).astype(str),
            "b": rng.integers(0, 60, n).astype(str),
            "c": rng.integers(0, 30, n).astype(str),
            "w": rng.uniform(1, 3, n),
        }
    )
    df["r1"] = df["w"] * rng.uniform(0.5, 1.5, n)
    df["r2"] = df["w"] * rng.uniform(0.5, 1.5, n)
    base = df.assign(w=df["w"] * rng.uniform(0.8, 1.25, n))
    totals = control_totals(base, "w", ["a", "b", "c"])
    per = control_totals(base, ["r1", "r2"], ["a", "b", "c"])
    out = {}
    for at in (10_000, 10):  # dense, then sparse
        monkeypatch.setattr(cal, "_SPARSE_AT", at)
        d = cal._design(df, totals)
        assert cal.scipy.sparse.issparse(d.Xc) == (at == 10)
        out[at] = (
            calibrate(df, "w", totals, "raking").to_numpy(),
            calibrate(df, "w", totals, "logit", (0.3, 3.0)).to_numpy(),
            calibrate_replicates(df, ["r1", "r2"], per, "logit", (0.3, 3.0))[0].to_numpy(),
        )
    for dense, sparse in zip(out[10_000], out[10], strict=True):
        np.testing.assert_allclose(sparse, dense, rtol=1e-9)
    _assert_met(df, pd.Series(out[10][1], index=df.index), totals)


def test_widen_fails_fast_when_raking_cannot_reach_the_totals():
    """Contradictory totals (two margins that split the records the same way, with different
    totals): no positive weights reach them, so the widen policy stops after raking fails
    instead of trying 40 bounds."""
    import sdl_design.survey.calibration as cal

    df = pd.DataFrame({"x": ["p", "p", "q", "q"], "y": ["u", "u", "v", "v"], "r": 1.0})
    per = [{"x": {"p": 2.0, "q": 2.0}, "y": {"u": 1.0, "v": 3.0}}]
    calls = []
    solve = cal._solve

    def counting(*a, **k):
        calls.append(a[3])
        return solve(*a, **k)

    cal._solve = counting
    try:
        with pytest.raises(CalibrationInfeasible, match="'r'"):
            calibrate_replicates(df, ["r"], per, "logit", (0.5, 2.0), policy="widen")
    finally:
        cal._solve = solve
    assert calls == ["logit", "raking"]


def test_profile_sums_equal_a_groupby_of_the_profiles():
    """_Design.aggregate (the weights' sums within each control profile, by bincount) equals the
    profile sums counted by pandas, for one weight and for replicate weights read row-major or
    column-major, exactly as the profile indicator's product adds them (in record order)."""
    import scipy.sparse

    from sdl_design.survey.calibration import _design

    df = _sample(n=3000, seed=4)
    d = _design(df, control_totals(df, "w", ["sex", "region"]))
    assert d.on_profiles
    rng = np.random.default_rng(6)
    W = rng.uniform(0.5, 3.0, (len(df), 5))
    n, K = len(d.inverse), d.Xc.shape[0]
    S = scipy.sparse.csr_matrix((np.ones(n), (d.inverse, np.arange(n))), shape=(K, n))
    by = pd.DataFrame(W).groupby(d.inverse).sum().reindex(range(K), fill_value=0.0)
    for M in (np.ascontiguousarray(W), np.asfortranarray(W)):
        got = d.aggregate(M)
        np.testing.assert_allclose(got, by.to_numpy(), rtol=1e-13)
        np.testing.assert_array_equal(got, np.asarray(S @ np.ascontiguousarray(W)))
    np.testing.assert_array_equal(d.aggregate(W[:, 0]), S @ W[:, 0])
