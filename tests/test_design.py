"""SurveyDesign: Taylor and replicate SEs against svy 0.35, hand computations and identities."""

import numpy as np
import pandas as pd
import polars as pl
import pytest
import svy

from sdl_design.survey.design import DesignError, SurveyDesign, hadamard_for

RTOL = 1e-8


def _design_df(n_psu=(2, 3, 2, 2, 3, 2, 2, 2), seed=1) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    rows = [
        (h, p + 1)
        for h, k in enumerate(n_psu)
        for p in range(k)
        for _ in range(int(rng.integers(3, 8)))
    ]
    df = pd.DataFrame(rows, columns=["stratum", "psu"])
    n = len(df)
    psu_eff = rng.normal(0, 2, 100)[df.stratum * 3 + df.psu]
    df["wt"] = rng.uniform(1, 5, n)
    df["y"] = rng.normal(10, 3, n) + df.stratum + psu_eff
    df["x"] = rng.uniform(1, 3, n)
    df["b"] = (rng.random(n) < 0.3 + 0.05 * psu_eff).astype(int)
    df["cat"] = rng.choice(["a", "b", "c"], n)
    return df


@pytest.fixture(scope="module")
def df() -> pd.DataFrame:
    return _design_df()


def _svy(df: pd.DataFrame, rep: object | None = None, design: bool = True) -> svy.Sample:
    cols = {c: pl.Float64 for c in df.columns if c == "wt" or c.startswith("rw_")}
    data = pl.from_pandas(df).with_columns([pl.col(c).cast(t) for c, t in cols.items()])
    if design:
        return svy.Sample(data, svy.Design(stratum="stratum", psu="psu", wgt="wt", rep_wgts=rep))
    return svy.Sample(data, svy.Design(wgt="wt", rep_wgts=rep))


def _col(est, name: str) -> np.ndarray:
    return est.to_polars()[name].to_numpy()


# ------------------------------------------------------------------ Taylor
def test_taylor_hand_worked():
    # 2 strata: stratum 0 with PSUs of 2, 3 records; stratum 1 with 3 PSUs of 2, 1, 2 records
    df = pd.DataFrame(
        {
            "stratum": [0] * 5 + [1] * 5,
            "psu": [1, 1, 2, 2, 2, 1, 1, 2, 3, 3],
            "wt": [2.0, 3, 1, 2, 4, 5, 1, 2, 3, 1],
            "y": [1.0, 4, 2, 0, 3, 5, 2, 1, 6, 2],
        }
    )
    d = SurveyDesign(df, weight="wt", strata="stratum", psu="psu")
    w, y = df.wt.to_numpy(), df.y.to_numpy()
    # total: PSU totals of w*y
    t0 = np.array([2 * 1 + 3 * 4, 1 * 2 + 2 * 0 + 4 * 3])
    t1 = np.array([5 * 5 + 1 * 2, 2 * 1, 3 * 6 + 1 * 2])
    v = 2 / 1 * ((t0 - t0.mean()) ** 2).sum() + 3 / 2 * ((t1 - t1.mean()) ** 2).sum()
    got = d.total("y")
    assert got.loc["y", "estimate"] == pytest.approx((w * y).sum(), rel=1e-12)
    assert got.loc["y", "se"] == pytest.approx(np.sqrt(v), rel=1e-12)
    # mean: scores w (y - ybar) / W
    ybar = (w * y).sum() / w.sum()
    z = w * (y - ybar) / w.sum()
    z0 = np.array([z[0:2].sum(), z[2:5].sum()])
    z1 = np.array([z[5:7].sum(), z[7], z[8:10].sum()])
    vm = 2 * ((z0 - z0.mean()) ** 2).sum() + 1.5 * ((z1 - z1.mean()) ** 2).sum()
    got = d.mean("y")
    assert got.loc["y", "estimate"] == pytest.approx(ybar, rel=1e-12)
    assert got.loc["y", "se"] == pytest.approx(np.sqrt(vm), rel=1e-12)
    # Kish deff: V / (W^2 s2_w / n), s2_w the weighted variance with n/(n-1)
    n = len(y)
    s2 = n / (n - 1) * (w * (y - ybar) ** 2).sum() / w.sum()
    assert got.loc["y", "deff"] == pytest.approx(vm / (s2 / n), rel=1e-12)


def test_taylor_against_svy(df):
    d = SurveyDesign(df, weight="wt", strata="stratum", psu="psu")
    s = _svy(df)
    ours = d.mean(["y", "b"])
    for v in ("y", "b"):
        e = s.estimation.mean(v, deff="wr")
        np.testing.assert_allclose(ours.loc[v, "estimate"], _col(e, "est")[0], rtol=RTOL)
        np.testing.assert_allclose(ours.loc[v, "se"], _col(e, "se")[0], rtol=RTOL)
        np.testing.assert_allclose(ours.loc[v, "deff"], _col(e, "deff")[0], rtol=RTOL)
    tot = d.total(["y", "b"])
    for v in ("y", "b"):
        e = s.estimation.total(v)
        np.testing.assert_allclose(
            tot.loc[v, ["estimate", "se"]], [_col(e, "est")[0], _col(e, "se")[0]], rtol=RTOL
        )
    p = d.proportion("cat")
    e = s.estimation.prop("cat").to_polars().sort("cat")
    np.testing.assert_allclose(p["estimate"], e["est"].to_numpy(), rtol=RTOL)
    np.testing.assert_allclose(p["se"], e["se"].to_numpy(), rtol=RTOL)
    assert list(p.index.get_level_values("category")) == ["a", "b", "c"]
    r = d.ratio("y", "x")
    e = s.estimation.ratio("y", "x")
    np.testing.assert_allclose(
        r.loc["y/x", ["estimate", "se"]], [_col(e, "est")[0], _col(e, "se")[0]], rtol=RTOL
    )
    dm = d.mean("y", by="cat")
    e = s.estimation.mean("y", by="cat").to_polars().sort("cat")
    np.testing.assert_allclose(dm["estimate"], e["est"].to_numpy(), rtol=RTOL)
    np.testing.assert_allclose(dm["se"], e["se"].to_numpy(), rtol=RTOL)
    dt = d.total("b", by="cat")
    e = s.estimation.total("b", by="cat").to_polars().sort("cat")
    np.testing.assert_allclose(dt["se"], e["se"].to_numpy(), rtol=RTOL)


def test_deff_against_svy_wr(df):
    """deff is Kish's with-replacement deff: V_design / (W^2 s2_w / n), svy's deff='wr'."""
    d = SurveyDesign(df, weight="wt", strata="stratum", psu="psu")
    s = _svy(df)
    pairs = [
        (d.total("y")["deff"], _col(s.estimation.total("y", deff="wr"), "deff")),
        (d.ratio("y", "x")["deff"], _col(s.estimation.ratio("y", "x", deff="wr"), "deff")),
        (
            d.proportion("cat")["deff"],
            s.estimation.prop("cat", deff="wr").to_polars().sort("cat")["deff"],
        ),
        (
            d.mean("y", by="cat")["deff"],
            s.estimation.mean("y", by="cat", deff="wr").to_polars().sort("cat")["deff"],
        ),
    ]
    for ours, theirs in pairs:
        np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=RTOL)


def test_many_columns_match_one_at_a_time(df):
    rng = np.random.default_rng(5)
    Y = pd.DataFrame(rng.normal(size=(len(df), 300)), columns=[f"v{i}" for i in range(300)])
    big = pd.concat([df, Y], axis=1)
    reps = SurveyDesign(big, weight="wt", strata="stratum", psu="psu").with_replicates("jkn")
    d = SurveyDesign(
        pd.concat([big, reps], axis=1),
        "wt",
        "stratum",
        "psu",
        replicate_weights=list(reps),
        method="jkn",
    )
    for kind in ("taylor", "replicate"):
        allv = d.mean(list(Y), variance=kind)
        for c in ("v0", "v137", "v299"):
            one = d.mean(c, variance=kind)
            np.testing.assert_allclose(allv.loc[c, "se"], one.loc[c, "se"], rtol=1e-12)


# ------------------------------------------------------------------ replicate variance
def _rep_frame(df: pd.DataFrame, method: str, **kw) -> tuple[pd.DataFrame, pd.DataFrame]:
    reps = SurveyDesign(df, weight="wt", strata="stratum", psu="psu").with_replicates(method, **kw)
    return pd.concat([df, reps], axis=1), reps


@pytest.mark.parametrize(
    "method,kw,svy_rep",
    [
        (
            "jkn",
            {},
            lambda R, a: svy.JackknifeWgts(
                prefix="rw_", n_reps=R, kind="jkn", scale=list(a["rscales"])
            ),
        ),
        ("jk1", {}, lambda R, a: svy.JackknifeWgts(prefix="rw_", n_reps=R, kind="jk1")),
        ("brr", {}, lambda R, a: svy.BrrWgts(prefix="rw_", n_reps=R)),
        ("fay", {"rho": 0.3}, lambda R, a: svy.BrrWgts(prefix="rw_", n_reps=R, fay_coef=0.3)),
        (
            "bootstrap",
            {"seed": 3, "n_replicates": 50},
            lambda R, a: svy.BootstrapWgts(prefix="rw_", n_reps=R),
        ),
    ],
)
def test_replicate_against_svy(method, kw, svy_rep):
    df = _design_df(n_psu=(2,) * 7 if method in ("brr", "fay") else (2, 3, 2, 2, 3, 2, 2, 2))
    full, reps = _rep_frame(df, method, **kw)
    a = reps.attrs
    R = reps.shape[1]
    d = SurveyDesign(
        full, "wt", "stratum", "psu", replicate_weights=list(reps), method=a["method"], rho=a["rho"]
    )
    np.testing.assert_allclose(d.rscales, a["rscales"], rtol=1e-12)  # derived == stored
    s = _svy(full, svy_rep(R, a), design=False)
    for v in ("y", "b"):
        for ours, theirs in (
            (d.mean(v), s.estimation.mean(v, method="replication", variance_center="estimate")),
            (d.total(v), s.estimation.total(v, method="replication", variance_center="estimate")),
        ):
            np.testing.assert_allclose(ours.loc[v, "estimate"], _col(theirs, "est")[0], rtol=RTOL)
            np.testing.assert_allclose(ours.loc[v, "se"], _col(theirs, "se")[0], rtol=RTOL)
    r = d.ratio("y", "x")
    e = s.estimation.ratio("y", "x", method="replication", variance_center="estimate")
    np.testing.assert_allclose(r["se"].iloc[0], _col(e, "se")[0], rtol=RTOL)
    dm = d.mean("y", by="cat")
    e = (
        s.estimation.mean("y", by="cat", method="replication", variance_center="estimate")
        .to_polars()
        .sort("cat")
    )
    np.testing.assert_allclose(dm["se"], e["se"].to_numpy(), rtol=RTOL)


def test_sdr_scale_against_svy(df):
    full, reps = _rep_frame(df, "bootstrap", seed=9, n_replicates=20)  # any replicate weights
    d = SurveyDesign(full, "wt", "stratum", "psu", replicate_weights=list(reps), method="sdr")
    s = _svy(full, svy.SdrWgts(prefix="rw_", n_reps=20), design=False)
    e = s.estimation.mean("y", method="replication", variance_center="estimate")
    np.testing.assert_allclose(d.mean("y").loc["y", "se"], _col(e, "se")[0], rtol=RTOL)


@pytest.mark.parametrize("perturb", [False, True])
def test_replicate_psu_factor_path_and_full_product_agree_by_hand(df, perturb):
    """PSU-factor shortcut (replicates = w x factor per PSU) and the full W'y product
    (e.g. recalibrated replicates) both match a plain numpy computation, overall and in domains."""
    full, reps = _rep_frame(df, "jkn")
    if perturb:
        noise = 1 + 0.1 * np.random.default_rng(2).random(reps.shape)
        full[list(reps)] = reps.to_numpy() * noise
    d = SurveyDesign(full, "wt", "stratum", "psu", replicate_weights=list(reps), method="jkn")
    assert (d._F is None) == perturb
    W = full[list(reps)].to_numpy()
    sc = reps.attrs["rscales"]
    for level in ("a", "c"):
        m = (df.cat == level).to_numpy()
        yy, xx, w = df.y.to_numpy()[m], df.x.to_numpy()[m], df.wt.to_numpy()[m]
        th, th_r = (
            (w * yy).sum() / (w * xx).sum(),
            (W[m] * yy[:, None]).sum(0) / (W[m] * xx[:, None]).sum(0),
        )
        got = d.ratio("y", "x", by="cat").xs(level, level="cat")["se"].iloc[0]
        assert got == pytest.approx(np.sqrt((sc * (th_r - th) ** 2).sum()), rel=1e-10)
    th, th_r = (df.wt * df.b).sum(), (W * df.b.to_numpy()[:, None]).sum(0)
    assert d.total("b")["se"].iloc[0] == pytest.approx(
        np.sqrt((sc * (th_r - th) ** 2).sum()), rel=1e-10
    )


def test_linearized_scores_give_taylor_se(df):
    d = SurveyDesign(df, weight="wt", strata="stratum", psu="psu")
    for est in ("mean", "total"):
        z = d.linearized_scores(["y", "b"], est)
        ref = getattr(d, est)(["y", "b"])["se"].to_numpy()
        np.testing.assert_allclose(np.sqrt(d.taylor_variance(z)), ref, rtol=1e-12)


def test_replicate_mse_convention_by_hand(df):
    full, reps = _rep_frame(df, "jkn")
    d = SurveyDesign(full, "wt", "stratum", "psu", replicate_weights=list(reps), method="jkn")
    W = reps.to_numpy()
    y = df.y.to_numpy()
    theta = (df.wt * df.y).sum() / df.wt.sum()
    theta_r = (W * y[:, None]).sum(axis=0) / W.sum(axis=0)
    # rscales by hand: stratum of the zeroed PSU
    n_h = df.groupby("stratum").psu.nunique()
    zero = (W == 0).argmax(axis=0)
    scale = ((n_h - 1) / n_h).to_numpy()[df.stratum.to_numpy()[zero]]
    se = np.sqrt((scale * (theta_r - theta) ** 2).sum())
    assert d.mean("y").loc["y", "se"] == pytest.approx(se, rel=1e-12)
    # svy's default centres on the replicate mean: smaller, and equal to the by-hand version
    s = _svy(
        full,
        svy.JackknifeWgts(prefix="rw_", n_reps=W.shape[1], kind="jkn", scale=list(scale)),
        design=False,
    )
    e = s.estimation.mean("y", method="replication")
    se_rm = np.sqrt((scale * (theta_r - theta_r.mean()) ** 2).sum())
    assert _col(e, "se")[0] == pytest.approx(se_rm, rel=1e-8)
    assert se_rm <= se


def test_svy_created_weights_give_our_se(df):
    """svy's own jackknife/BRR weights and ours give the same SEs (order-free statistics)."""
    full, reps = _rep_frame(df, "jkn")
    ours = SurveyDesign(
        full, "wt", "stratum", "psu", replicate_weights=list(reps), method="jkn"
    ).mean(["y", "b"])
    s = _svy(df).weighting.create_jk_wgts()
    for v in ("y", "b"):
        e = s.estimation.mean(v, method="replication", variance_center="estimate")
        np.testing.assert_allclose(ours.loc[v, "se"], _col(e, "se")[0], rtol=RTOL)
    df2 = _design_df(n_psu=(2,) * 9)
    s2 = _svy(df2).weighting.create_brr_wgts()
    e = s2.estimation.total("y", method="replication", variance_center="estimate")
    taylor = SurveyDesign(df2, "wt", "stratum", "psu").total("y").loc["y", "se"]
    np.testing.assert_allclose(taylor, _col(e, "se")[0], rtol=RTOL)


# ------------------------------------------------------------------ identities
@pytest.mark.parametrize("n_psu", [(2,) * 6, (3,) * 5, (2, 3, 4, 2, 3)])
def test_jkn_total_equals_taylor(n_psu):
    df = _design_df(n_psu=n_psu, seed=11)
    full, reps = _rep_frame(df, "jkn")
    d = SurveyDesign(full, "wt", "stratum", "psu", replicate_weights=list(reps), method="jkn")
    t = d.total(["y", "b"], variance="taylor")
    r = d.total(["y", "b"])
    np.testing.assert_allclose(r["se"], t["se"], rtol=1e-10)
    tb = d.total("y", by="cat", variance="taylor")
    rb = d.total("y", by="cat")
    np.testing.assert_allclose(rb["se"], tb["se"], rtol=1e-10)


def test_jk1_total_equals_taylor_unstratified(df):
    u = df.assign(stratum=0, psu=df.stratum * 10 + df.psu)
    full, reps = _rep_frame(u, "jk1")
    d = SurveyDesign(full, "wt", "stratum", "psu", replicate_weights=list(reps), method="jk1")
    np.testing.assert_allclose(
        d.total("y")["se"], d.total("y", variance="taylor")["se"], rtol=1e-10
    )


@pytest.mark.parametrize("n_strata", [3, 4, 7, 10, 12])
def test_brr_total_equals_taylor_and_fay0_is_brr(n_strata):
    df = _design_df(n_psu=(2,) * n_strata, seed=n_strata)
    full, reps = _rep_frame(df, "brr")
    assert reps.shape[1] == 4 * int(np.ceil(n_strata / 4))  # smallest multiple of 4 >= H here
    d = SurveyDesign(full, "wt", "stratum", "psu", replicate_weights=list(reps), method="brr")
    np.testing.assert_allclose(
        d.total(["y", "b"])["se"], d.total(["y", "b"], variance="taylor")["se"], rtol=1e-10
    )
    fullf, repsf = _rep_frame(df, "fay", rho=0.0)
    np.testing.assert_array_equal(repsf.to_numpy(), reps.to_numpy())
    df_ = SurveyDesign(
        fullf, "wt", "stratum", "psu", replicate_weights=list(repsf), method="fay", rho=0.0
    )
    np.testing.assert_allclose(df_.mean("y")["se"], d.mean("y")["se"], rtol=1e-12)
    # Fay with rho: still exact for a total (balance), whatever rho
    fullf, repsf = _rep_frame(df, "fay", rho=0.5)
    dfy = SurveyDesign(
        fullf, "wt", "stratum", "psu", replicate_weights=list(repsf), method="fay", rho=0.5
    )
    np.testing.assert_allclose(
        dfy.total("y")["se"], d.total("y", variance="taylor")["se"], rtol=1e-10
    )


def test_hadamard_orders():
    for H in (1, 5, 11, 13, 21, 27, 35, 43, 60):
        M = hadamard_for(H)
        R = M.shape[0]
        assert R % 4 == 0 and R >= H
        np.testing.assert_array_equal(M @ M.T, R * np.eye(R))
        assert (M[:, 0] == 1).all()
    assert [hadamard_for(H).shape[0] for H in (11, 13, 21, 27, 43)] == [12, 16, 24, 28, 44]


def test_bootstrap_rao_wu(df):
    _, a = _rep_frame(df, "bootstrap", seed=4, n_replicates=30)
    _, b = _rep_frame(df, "bootstrap", seed=4, n_replicates=30)
    np.testing.assert_array_equal(a.to_numpy(), b.to_numpy())
    assert list(a)[:2] == ["rw_001", "rw_002"] and (a.index == df.index).all()
    # Rao-Wu: per stratum the PSU multipliers n_h/(n_h-1) * count sum to n_h
    f = a.to_numpy() / df.wt.to_numpy()[:, None]
    psu_f = pd.DataFrame(f).groupby([df.stratum, df.psu]).first()
    n_h = df.groupby("stratum").psu.nunique().to_numpy()
    np.testing.assert_allclose(
        psu_f.groupby(level=0).sum().to_numpy(), np.repeat(n_h[:, None], 30, 1)
    )


# ------------------------------------------------------------------ validation
def test_errors_name_the_column(df):
    with pytest.raises(DesignError, match="wgt"):
        SurveyDesign(df, weight="wgt", strata="stratum", psu="psu")
    bad = df.assign(wt=df.wt.where(df.index != 3, 0.0))
    with pytest.raises(DesignError, match="'wt'"):
        SurveyDesign(bad, weight="wt", strata="stratum", psu="psu")
    one = df[~((df.stratum == 2) & (df.psu == 2))]
    with pytest.raises(DesignError, match=r"strata \[2\].*single PSU"):
        SurveyDesign(one, weight="wt", strata="stratum", psu="psu").mean("y")
    with pytest.raises(DesignError, match=r"strata \[1, 4\].*jkn"):
        SurveyDesign(df, weight="wt", strata="stratum", psu="psu").with_replicates("brr")
    with pytest.raises(DesignError, match="nope"):
        SurveyDesign(df, weight="wt", strata="stratum", psu="psu").mean("nope")
    full, reps = _rep_frame(df, "jkn")
    d = SurveyDesign(full, "wt", "stratum", "psu", replicate_weights="rw_*", method="jkn")
    assert d.replicate_weights == list(reps)
    full.loc[0, "rw_004"] = np.nan
    with pytest.raises(DesignError, match="rw_004"):
        SurveyDesign(full, "wt", "stratum", "psu", replicate_weights="rw_*", method="jkn")
    with pytest.raises(DesignError, match="rho"):
        SurveyDesign(df, "wt", "stratum", "psu", replicate_weights=["wt"], method="fay")


def test_sorted_fast_path_equals_block_path():
    """A file sorted by PSU with many records per PSU takes the one-GEMV-per-PSU path; the same
    records shuffled take the centred block path: same estimates, SEs and deffs. A column with
    mean 1e3 and sd 1e-2 (its one-pass sum of squares cancels) is redone centred."""
    rng = np.random.default_rng(5)
    n_h, per = 12, 80
    h = np.repeat(np.arange(n_h), 3 * per)
    p = np.repeat(np.arange(3 * n_h), per)
    u = rng.normal(size=3 * n_h)[p]
    d = pd.DataFrame(
        {
            "h": h,
            "p": p,
            "w": rng.uniform(1, 5, len(p)),
            "y": u + rng.normal(size=len(p)),
            "b": (u + rng.normal(size=len(p)) > 0).astype(float),
            "c": 1e3 + 1e-2 * (u + rng.normal(size=len(p))),
        }
    )
    w, c = d["w"].to_numpy(), d["c"].to_numpy()
    one_pass = w @ (c * c) - (w @ c) ** 2 / w.sum()
    two_pass = w @ (c - (w @ c) / w.sum()) ** 2
    assert abs(one_pass / two_pass - 1) > 1e-6  # the naive formula would be off here
    shuffled = d.sample(frac=1.0, random_state=1)
    for est in ("mean", "total"):
        fast = getattr(SurveyDesign(d, "w", "h", "p"), est)(["y", "b", "c"], variance="taylor")
        slow = getattr(SurveyDesign(shuffled, "w", "h", "p"), est)(
            ["y", "b", "c"], variance="taylor"
        )
        assert SurveyDesign(d, "w", "h", "p")._psu_order is None
        assert SurveyDesign(shuffled, "w", "h", "p")._psu_order is not None
        np.testing.assert_allclose(fast.to_numpy(), slow.to_numpy(), rtol=1e-9)
    bad = d.assign(y=d["y"].where(d.index != 7))
    with pytest.raises(DesignError, match=r"\['y'\] have missing values"):
        SurveyDesign(bad, "w", "h", "p").mean(["b", "y"], variance="taylor")


def test_replicate_sorted_file_path_by_hand(monkeypatch):
    """Replicate estimates and SEs of a file sorted by PSU (PSU totals of w y by one GEMV per
    PSU) equal plain numpy on the replicate weights, W' y, and the shuffled file's (sparse PSU
    sums); a missing value in a study variable is refused on that path too."""
    import sdl_design.survey.design as design

    calls = []
    gemv = design.psu_sums
    monkeypatch.setattr(design, "psu_sums", lambda *a, **k: calls.append(1) or gemv(*a, **k))
    rng = np.random.default_rng(5)
    p = np.repeat(np.arange(12), rng.integers(60, 120, 12))
    d = pd.DataFrame({"h": p // 3, "p": p % 3, "w": rng.uniform(1, 4, len(p))})
    d["y"] = rng.normal(size=len(p)) + rng.normal(size=12)[p]
    d["x"] = rng.uniform(1, 2, len(p))
    d["b"] = (rng.random(len(p)) < 0.3).astype(float)
    reps = SurveyDesign(d, "w", "h", "p").with_replicates("bootstrap", seed=3, n_replicates=30)
    full = pd.concat([d, reps], axis=1)
    rw = list(reps)
    fast = SurveyDesign(full, "w", "h", "p", replicate_weights=rw, method="bootstrap")
    slow = SurveyDesign(
        full.sample(frac=1.0, random_state=2),
        "w",
        "h",
        "p",
        replicate_weights=rw,
        method="bootstrap",
    )
    assert fast._sorted_psu_starts is not None and slow._sorted_psu_starts is None
    W, w, sc = reps.to_numpy(), d["w"].to_numpy(), reps.attrs["rscales"]
    Y, x = d[["y", "x", "b"]].to_numpy(), d["x"].to_numpy()
    cases = {
        "total": (w @ Y, W.T @ Y),
        "mean": (w @ Y / w.sum(), W.T @ Y / W.sum(axis=0)[:, None]),
        "ratio": (w @ Y[:, ::2] / (w @ x), W.T @ Y[:, ::2] / (W.T @ x)[:, None]),  # y/x, b/x
    }
    for est, (th, th_r) in cases.items():
        n_calls = len(calls)
        if est == "ratio":
            got, ref = (s.ratio(["y", "b"], "x", variance="replicate") for s in (fast, slow))
        else:
            got, ref = (
                getattr(s, est)(["y", "x", "b"], variance="replicate") for s in (fast, slow)
            )
        assert len(calls) == n_calls + 1  # the sorted file took the GEMV path, the shuffled not
        np.testing.assert_allclose(got["estimate"], th, rtol=1e-12)
        np.testing.assert_allclose(got["se"], np.sqrt(sc @ (th_r - th) ** 2), rtol=1e-10)
        np.testing.assert_allclose(got.to_numpy(), ref.to_numpy(), rtol=1e-12)
    bad = full.assign(y=full["y"].where(full.index != 7))
    with pytest.raises(DesignError, match=r"\['y'\] have missing values"):
        SurveyDesign(bad, "w", "h", "p", replicate_weights=rw, method="bootstrap").mean(
            ["b", "y"], variance="replicate"
        )


@pytest.mark.parametrize("constant_in_psu", [True, False])
def test_replicate_cell_totals_equal_brute_force(constant_in_psu):
    """Totals of y within each cell under every replicate weight equal W_c' y_c summed record
    by record (numpy on the cell's rows), through the PSU factors F when the replicate factors
    are constant within PSUs and through the per-cell products when they are not (replicates
    recalibrated); records of no cell (-1) count nowhere."""
    from sdl_design.synth import make_survey

    df = make_survey(4000, seed=4)
    reps = [c for c in df.columns if c.startswith("rw_")]
    rng = np.random.default_rng(1)
    if not constant_in_psu:
        df = df.assign(**{c: df[c] * rng.uniform(0.9, 1.1, len(df)) for c in reps})
    d = SurveyDesign(df, "wt", "stratum", "psu", replicate_weights=reps, method="jkn")
    assert (d._F is not None) == constant_in_psu
    L, k = 5, 3
    codes = rng.integers(-1, L, len(df))
    y = rng.normal(size=(len(df), k))
    W = df[reps].to_numpy()
    brute = np.stack([W[codes == c].T @ y[codes == c] for c in range(L)], axis=1)  # R x L x k
    got = d.replicate_cell_totals(y, codes, L)
    np.testing.assert_allclose(got, brute, rtol=1e-12, atol=1e-9 * np.abs(brute).max())


def test_factor_groups_recalibrated_replicates_match_the_full_product():
    """Replicates recalibrated by a profile (each replicate times a factor per sex, as a
    replicate calibration does) are constant within PSU x profile: the design finds those
    groups, and replicate totals, cell totals and replicate SEs of means through them equal
    the full products W' y (numpy, record by record) to 1e-12."""
    from sdl_design.synth import make_survey

    df = make_survey(4000, seed=6)
    reps = [c for c in df.columns if c.startswith("rw_")]
    rng = np.random.default_rng(2)
    female = (df["sex"] == "female").to_numpy()
    g = rng.uniform(0.8, 1.2, size=(2, len(reps)))  # calibration factor per profile, replicate
    df = df.assign(**{c: df[c] * g[female.astype(int), j] for j, c in enumerate(reps)})
    d = SurveyDesign(df, "wt", "stratum", "psu", replicate_weights=reps, method="jkn")
    assert d._F is None
    codes, G, F = d._factor_groups
    assert G <= 2 * d.n_psu
    W, w = df[reps].to_numpy(), df["wt"].to_numpy()
    y = df[["income", "bmi"]].fillna(0).to_numpy()
    np.testing.assert_allclose(d.replicate_totals(y), W.T @ y, rtol=1e-12)
    cells = rng.integers(0, 4, len(df))
    brute = np.stack([W[cells == c].T @ y[cells == c] for c in range(4)], axis=1)
    np.testing.assert_allclose(d.replicate_cell_totals(y, cells, 4), brute, rtol=1e-12)
    # replicate SE of the mean of bmi, by hand: sqrt(sum_r c_r (ybar_r - ybar)^2)
    se = d.mean("bmi", variance="replicate")["se"].iloc[0]
    b = df["bmi"].to_numpy()
    ok = ~np.isnan(b)
    est = (w[ok] @ b[ok]) / w[ok].sum()
    est_r = (W[ok].T @ b[ok]) / W[ok].sum(axis=0)
    assert se == pytest.approx(np.sqrt(d.rscales @ (est_r - est) ** 2), rel=1e-12)


@pytest.mark.parametrize("recalibrated", [False, True])
def test_replicate_se_by_domain_equals_numpy_per_domain(recalibrated):
    """Replicate SEs by domain (every domain in one pass through the factor groups) equal
    sqrt(sum_r c_r (theta_r - theta)^2) with theta_r = W_d' y / W_d' x over each domain's
    records in numpy, for means, totals and ratios; a record with no domain value counts in no
    domain. PSU-constant replicate factors and recalibrated ones (factors per PSU x sex)."""
    from sdl_design.synth import make_survey

    df = make_survey(3000, seed=11)
    reps = [c for c in df.columns if c.startswith("rw_")]
    if recalibrated:
        g = np.random.default_rng(3).uniform(0.9, 1.1, size=(2, len(reps)))
        female = (df["sex"] == "female").to_numpy().astype(int)
        df = df.assign(**{c: df[c] * g[female, j] for j, c in enumerate(reps)})
    df.loc[df.index[:7], "race"] = np.nan
    df["one"] = 1.0
    d = SurveyDesign(df, "wt", "stratum", "psu", replicate_weights=reps, method="jkn")
    assert (d._F is None) == recalibrated and d._factors is not None
    W, w = df[reps].to_numpy(), df["wt"].to_numpy()
    y = df[["hh_size", "diabetes"]].to_numpy(float)
    x = df[["one", "hh_size"]].to_numpy(float)
    levels = sorted(df["race"].dropna().unique())
    for kind in ("mean", "total", "ratio"):
        if kind == "ratio":
            got = d.ratio(
                ["hh_size", "diabetes"], ["one", "hh_size"], by="race", variance="replicate"
            )
        else:
            got = getattr(d, kind)(["hh_size", "diabetes"], by="race", variance="replicate")
        for lev in levels:
            m = (df["race"] == lev).to_numpy()
            num, num_r = w[m] @ y[m], W[m].T @ y[m]
            if kind == "total":
                est, est_r = num, num_r
            else:
                den = x[m] if kind == "ratio" else np.ones((m.sum(), 2))
                est, est_r = num / (w[m] @ den), num_r / (W[m].T @ den)
            se = np.sqrt(d.rscales @ (est_r - est) ** 2)
            rows = got.xs(lev, level="race")
            np.testing.assert_allclose(rows["estimate"].to_numpy(), est, rtol=1e-12)
            np.testing.assert_allclose(rows["se"].to_numpy(), se, rtol=1e-10)


def test_replicate_weights_side_by_side_in_a_block_are_read_in_place():
    """Replicate columns that sit side by side in the frame's float block are W without a
    copy (a read-only view, equal to the values); shuffled, interleaved or split columns are
    copied, with the same values."""
    from sdl_design.survey.design import _fortran_columns, block_view

    rng = np.random.default_rng(3)
    df = pd.DataFrame(rng.random((50, 8)), columns=[f"c{j}" for j in range(8)])
    df["s"], df["i"] = "x", 1
    W = _fortran_columns(df, ["c2", "c3", "c4"])
    assert W.flags.f_contiguous and not W.flags.writeable
    assert np.shares_memory(W, df._mgr.blocks[0].values)
    assert np.array_equal(W, df[["c2", "c3", "c4"]].to_numpy())
    for cols in (["c4", "c3"], ["c2", "c4"], ["c2", "i"]):
        assert block_view(df, cols) is None
        V = _fortran_columns(df, cols)
        assert V.flags.f_contiguous and np.array_equal(V, df[cols].to_numpy(dtype=float))
    split = df.assign(c3=0.5)  # a replaced column leaves the block
    assert np.array_equal(_fortran_columns(split, ["c2", "c3", "c4"])[:, 1], np.full(50, 0.5))


def test_factor_groups_survive_factors_with_equal_projections():
    """Records whose replicate factors differ from their group's but project to the same value
    on one of the design's two fixed projections (f2 = f1 + t (v_b e_a - v_a e_b)) are told
    apart: the groups are found, and replicate means equal W'y / W'1 by hand."""
    rng = np.random.default_rng(8)
    n, R, P = 2000, 8, 10
    psu = rng.integers(0, P, n)
    f = rng.uniform(0.5, 1.5, (P, R))  # a factor row per PSU (constant within PSU)
    fac = f[psu]
    v = np.random.default_rng(0).uniform(1.0, 2.0, (R, 2))[:, 0]  # _find_groups' first
    odd = np.flatnonzero(psu == 0)[:5]
    fac[odd] = f[0] + 0.2 * (v[3] * np.eye(R)[1] - v[1] * np.eye(R)[3])  # same projection
    w = rng.uniform(1.0, 3.0, n)
    y = rng.normal(10.0, 2.0, n)
    rw = [f"r{j}" for j in range(R)]
    df = pd.DataFrame({"w": w, "psu": psu, "y": y}).join(pd.DataFrame(w[:, None] * fac, columns=rw))
    d = SurveyDesign(df, "w", None, "psu", replicate_weights=rw, method="bootstrap")
    groups = d.factor_groups
    assert groups is not None and groups[1] == P + 1
    W = df[rw].to_numpy()
    theta_r = (W.T @ y) / W.sum(axis=0)
    se = np.sqrt(np.sum((theta_r - np.average(y, weights=w)) ** 2) / R)
    got = d.mean("y", variance="replicate")
    assert got["se"].iloc[0] == pytest.approx(se, rel=1e-12)


def test_replicate_factor_groups_by_rows_or_columns_are_the_same():
    """The factor groups of replicate weights held by rows (a partition's) or by columns (a
    design's): the same groups and factors; a record off its PSU's factors in one replicate by
    1e-3 makes its own group; F' times the group totals of w y is W'y."""
    from sdl_design.survey.design import replicate_factor_groups

    rng = np.random.default_rng(4)
    n, R, P = 5000, 12, 30
    psu = rng.integers(0, P, n)
    f = rng.uniform(0.0, 2.0, (P, R))
    w = rng.uniform(1.0, 3.0, n)
    W = np.ascontiguousarray(w[:, None] * f[psu])
    by_rows, by_cols = (
        replicate_factor_groups(W, w),
        replicate_factor_groups(np.asfortranarray(W), w),
    )
    assert by_rows[1] == by_cols[1] == P and np.array_equal(by_rows[0], by_cols[0])
    assert np.array_equal(by_rows[2], by_cols[2])
    W[17, 5] *= 1.001
    codes, G, F = replicate_factor_groups(W, w)
    assert G == P + 1 and (codes == codes[17]).sum() == 1
    y = rng.normal(size=n)
    t = np.bincount(codes, w * y, minlength=G)
    np.testing.assert_allclose(F.T @ t, W.T @ y, rtol=1e-11)


def test_take_rows_is_the_row_gather():
    from sdl_design.survey.design import take_rows

    rng = np.random.default_rng(2)
    W = np.asfortranarray(rng.random((500, 7)))
    rows = rng.integers(0, 500, 120)
    out = take_rows(W, rows)
    assert out.flags.f_contiguous and np.array_equal(out, W[rows])
    C = np.ascontiguousarray(W)
    assert np.array_equal(take_rows(C, rows), C[rows])


def test_factor_groups_regroup_factors_that_match_both_projections():
    """Factors that differ by a vector orthogonal to both fixed projections land in one
    candidate group; the records that differ from their group's first record are grouped
    again by their factors (exactly: up to one group each), and replicate means equal
    W'y / W'1 by hand."""
    rng = np.random.default_rng(9)
    n, R, P = 2000, 8, 10
    psu = rng.integers(0, P, n)
    f = rng.uniform(0.5, 1.5, (P, R))
    fac = f[psu]
    V = np.random.default_rng(0).uniform(1.0, 2.0, (R, 2))  # _find_groups' projections
    delta = np.linalg.svd(V.T)[2][-1]  # orthogonal to both
    odd = np.flatnonzero(psu == 0)[-5:]  # not the PSU's first record
    fac[odd] = f[0] + 0.2 * delta / np.abs(delta).max()
    w = rng.uniform(1.0, 3.0, n)
    y = rng.normal(10.0, 2.0, n)
    rw = [f"r{j}" for j in range(R)]
    df = pd.DataFrame({"w": w, "psu": psu, "y": y}).join(pd.DataFrame(w[:, None] * fac, columns=rw))
    d = SurveyDesign(df, "w", None, "psu", replicate_weights=rw, method="bootstrap")
    h = np.round((d.W @ V) / d.w[:, None], 9)
    assert (h[odd] == h[np.flatnonzero(psu == 0)[0]]).all()  # the projections do collide
    groups = d.factor_groups
    assert groups is not None and P < groups[1] <= P + 5
    W = df[rw].to_numpy()
    theta_r = (W.T @ y) / W.sum(axis=0)
    se = np.sqrt(np.sum((theta_r - np.average(y, weights=w)) ** 2) / R)
    assert d.mean("y", variance="replicate")["se"].iloc[0] == pytest.approx(se, rel=1e-12)


@pytest.mark.parametrize("layout", ["C", "F"])
def test_factors_equal_is_the_largest_deviation_against_tol(layout):
    """factors_equal(W, w, codes, F, tol) is max |W_i / w_i - F_g(i)| <= tol (brute force), in
    both memory layouts, with a deviation in the first, a middle or the last block."""
    from sdl_design.survey.design import factors_equal

    rng = np.random.default_rng(11)
    n, R, G = 40_000, 9, 40  # F layout: blocks of 16K records
    codes = rng.integers(0, G, n)
    w = rng.uniform(1.0, 5.0, n)
    F = rng.choice([0.0, 0.5, 2.0], (G, R))
    W0 = w[:, None] * F[codes]
    tol = 1e-12
    for row, size in [(None, 0.0), (0, 1e-9), (n // 2, 1e-9), (n - 1, 1e-9), (n - 1, 1e-15)]:
        W = W0.copy()
        if row is not None:
            W[row, R - 1] += size * w[row]
        W = np.asarray(W, order=layout)
        want = bool(np.abs(W / w[:, None] - F[codes]).max() <= tol)
        assert factors_equal(W, w, codes, F, tol) is want
        assert want is (row is None or size < tol)


def test_dense_codes_is_numpy_unique_with_inverse():
    """dense_codes(x) == np.unique(x, return_inverse=True): counted (small range), hashed
    (negative values, a wide range), for floats and empty input."""
    from sdl_design.survey.design import dense_codes

    rng = np.random.default_rng(13)
    cases = [
        rng.integers(0, 50, 5000),
        rng.integers(-(10**12), 10**12, 300)[rng.integers(0, 300, 5000)],
        rng.integers(0, 2**40, 200)[rng.integers(0, 200, 5000)],
        np.array([3, -1, 3, 7, -1], dtype=np.int32),
        rng.random(100) < 0.3,
        np.round(rng.normal(size=400), 1),
        np.zeros(0, dtype=np.int64),
    ]
    for x in cases:
        u, inv = dense_codes(x)
        want_u, want_inv = np.unique(x, return_inverse=True)
        np.testing.assert_array_equal(u, want_u)
        np.testing.assert_array_equal(inv, want_inv.ravel())
        np.testing.assert_array_equal(u[inv], x)


def test_sparse_times_group_indicator_is_scipys_product_bit_for_bit():
    """sparse_times of a column-major y: a CSR group indicator (unit or weighted entries, one
    per column) goes as CSC and gives scipy's CSR product bit for bit; a CSR matrix with a
    column of two entries, or unsorted indices, keeps scipy's product."""
    import scipy.sparse as sp

    from sdl_design.survey.design import _one_entry_per_column, sparse_times

    rng = np.random.default_rng(5)
    n, G, k = 30_000, 17, 6
    g = rng.integers(0, G, n)
    y = np.asfortranarray(rng.normal(0, 1e3, (n, k)))
    for data in (np.ones(n), rng.uniform(0.1, 9.0, n)):
        A = sp.csr_matrix((data, (g, np.arange(n))), shape=(G, n))
        assert _one_entry_per_column(A)
        want = np.column_stack([A @ y[:, j] for j in range(k)])
        np.testing.assert_array_equal(sparse_times(A, y), want)
        two = sp.csr_matrix(
            (np.r_[data, 1.0], (np.r_[g, (g[0] + 1) % G], np.r_[np.arange(n), 0])), shape=(G, n)
        )
        assert not _one_entry_per_column(two)
        np.testing.assert_array_equal(
            sparse_times(two, y), np.column_stack([two @ y[:, j] for j in range(k)])
        )
    shuffled = A.copy()
    shuffled.indices = shuffled.indices.copy()
    a, b = shuffled.indptr[0], shuffled.indptr[1]
    shuffled.indices[a:b] = shuffled.indices[a:b][::-1]
    shuffled.data[a:b] = shuffled.data[a:b][::-1]
    shuffled.has_sorted_indices = False
    assert not _one_entry_per_column(shuffled)


def test_distinct_rows_number_rows_by_first_appearance():
    """distinct_rows against a dictionary of row tuples: 60 dummies (0/1, -0.0 equal to 0.0:
    two groups of bits), integers, values with inf and NaN, and enough columns of many values
    that the codes are compressed on the way (a product of value counts past 2^62); a matrix
    with no dummy, one of dummies only, and one whose last column has NaN."""
    from sdl_design.survey.design import distinct_rows

    rng = np.random.default_rng(11)
    n = 3000
    cols = [rng.integers(0, 2, n) * 1.0 for _ in range(59)]
    cols += [np.where(rng.random(n) < 0.5, -0.0, 1.0)]
    cols += [rng.integers(-3, 3, n) * 1.0, rng.choice([0.5, np.inf, np.nan], n)]
    cols += [rng.integers(0, 700, n) * 1.0 for _ in range(8)]  # 700^8 > 2^62
    A = np.column_stack(cols)
    A[::3, 55:] = 0.0  # many repeated rows
    A[::3, :50] = 1.0
    nan_last = np.column_stack([rng.integers(0, 5, n) * 1.0, rng.choice([0.5, np.nan], n)])
    for M in (A, A[:, 60:], A[:, :60], nan_last):  # nan_last: NaN a value of its own
        U, g = distinct_rows(M)
        seen: dict = {}
        want = [seen.setdefault(tuple(str(v + 0.0) for v in r), len(seen)) for r in M.tolist()]
        assert np.array_equal(g, want) and len(U) == len(seen) < n
        assert np.array_equal(U, M[[want.index(k) for k in range(len(seen))]], equal_nan=True)
