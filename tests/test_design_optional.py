"""Designs as they come (issue 13 items 4, 9): no strata, no PSU, weights only; the pseudo
design of the public file; risk gates on the published file whatever stages ran."""

import numpy as np
import pandas as pd
import pytest
import yaml

from sdl_design.pseudo import build_pseudo_design, psu_purity
from sdl_design.spec import SpecError, parse_spec
from sdl_design.stages import run_stages
from sdl_design.survey.design import SurveyDesign


def _srs(n=400, seed=3) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    return pd.DataFrame(
        {
            "w": rng.uniform(1, 9, n),
            "y": rng.gamma(2.0, 3.0, n),
            "h": rng.integers(0, 5, n),
        }
    )


def test_no_strata_no_psu_is_srs_with_replacement():
    """Weighted mean, each record its own PSU, one stratum: V = n/(n-1) sum (w_i (y_i - ybar))^2
    / W^2 (the with-replacement linearization, by hand)."""
    df = _srs()
    w, y = df.w.to_numpy(), df.y.to_numpy()
    n, W = len(df), w.sum()
    ybar = w @ y / W
    z = w * (y - ybar) / W
    se = np.sqrt(n / (n - 1) * np.sum((z - z.mean()) ** 2))
    t = SurveyDesign(df, weight="w").mean("y")
    assert t.loc["y", "estimate"] == pytest.approx(ybar, rel=1e-12)
    assert t.loc["y", "se"] == pytest.approx(se, rel=1e-10)
    # jkn replicates without strata or PSU: delete one record, scale (n-1)/n: same SE (jackknife
    # of a ratio equals its linearization only asymptotically: within 2%)
    reps = SurveyDesign(df, weight="w").with_replicates("jkn")
    r = SurveyDesign(
        pd.concat([df, reps], axis=1), "w", replicate_weights=list(reps.columns), method="jkn"
    ).mean("y", variance="replicate")
    assert r.loc["y", "se"] == pytest.approx(se, rel=0.02)


def test_stratified_only_brute_force():
    """Strata without PSU columns: V = sum_h n_h/(n_h-1) sum_{i in h} (z_i - zbar_h)^2."""
    df = _srs()
    w, y, h = df.w.to_numpy(), df.y.to_numpy(), df.h.to_numpy()
    W = w.sum()
    z = w * (y - w @ y / W) / W
    v = 0.0
    for k in np.unique(h):
        zk = z[h == k]
        v += len(zk) / (len(zk) - 1) * np.sum((zk - zk.mean()) ** 2)
    t = SurveyDesign(df, weight="w", strata="h").mean("y")
    assert t.loc["y", "se"] == pytest.approx(np.sqrt(v), rel=1e-10)
    tot = SurveyDesign(df, weight="w", strata="h").total("y")
    zt = w * y
    vt = sum(
        (h == k).sum() / ((h == k).sum() - 1) * np.sum((zt[h == k] - zt[h == k].mean()) ** 2)
        for k in np.unique(h)
    )
    assert tot.loc["y", "se"] == pytest.approx(np.sqrt(vt), rel=1e-10)


def _clustered(H=40, n_h=3, m_psu=12, seed=5) -> pd.DataFrame:
    """H strata of n_h PSUs of m_psu records, PSU effects (intra-cluster correlation)."""
    rng = np.random.default_rng(seed)
    s = np.repeat(np.arange(H), n_h * m_psu)
    p = np.repeat(np.arange(H * n_h), m_psu)
    u = rng.normal(0, 1.5, H * n_h)[p]
    n = len(s)
    return pd.DataFrame(
        {
            "stratum": s + 100,
            "psu": p % n_h + 1,
            "w": rng.uniform(1, 4, n),
            "y1": 5 + 0.1 * s + u + rng.normal(0, 1, n),
            "y2": (rng.random(n) < 0.3 + 0.05 * u).astype(float),
            "y3": rng.gamma(2, 2, n) * (1 + 0.2 * u.clip(-2, 2)),
        }
    )


def test_pseudo_design_se_ratios_near_one_on_average():
    """Random groups of PSUs dealt within strata: the pseudo design's variance is unbiased for
    the original one; over 30 draws the mean variance ratio is within 10% of 1."""
    df = _clustered()
    orig = SurveyDesign(df, "w", "stratum", "psu").mean(["y1", "y2", "y3"])["se"].to_numpy()
    ratios = []
    for seed in range(30):
        pdes = build_pseudo_design(
            df.stratum.to_numpy(), df.psu.to_numpy(), np.random.default_rng(seed)
        )
        d = df.assign(ps=pdes.stratum, pp=pdes.psu)
        se = SurveyDesign(d, "w", "ps", "pp").mean(["y1", "y2", "y3"])["se"].to_numpy()
        ratios.append((se / orig) ** 2)
    mean_ratio = np.mean(ratios, axis=0)
    assert np.all(np.abs(mean_ratio - 1) < 0.1), mean_ratio


def test_pseudo_design_hides_original_psus_and_is_deterministic():
    df = _clustered()
    a = build_pseudo_design(df.stratum.to_numpy(), df.psu.to_numpy(), np.random.default_rng(7))
    b = build_pseudo_design(df.stratum.to_numpy(), df.psu.to_numpy(), np.random.default_rng(7))
    c = build_pseudo_design(df.stratum.to_numpy(), df.psu.to_numpy(), np.random.default_rng(8))
    assert np.array_equal(a.stratum, b.stratum) and np.array_equal(a.psu, b.psu)
    assert not (np.array_equal(a.stratum, c.stratum) and np.array_equal(a.psu, c.psu))
    orig = df.stratum.to_numpy() * 10 + df.psu.to_numpy()
    pseudo = a.stratum * 100 + a.psu
    # every pseudo PSU mixes at least two original PSUs: at most half its records from one
    assert psu_purity(orig, pseudo).max() <= 0.5 + 1e-12
    # original PSUs are never split (clustering kept) and no pseudo stratum is one original one
    assert (pd.DataFrame({"o": orig, "p": pseudo}).groupby("o")["p"].nunique() == 1).all()
    assert (pd.DataFrame({"h": df.stratum, "s": a.stratum}).groupby("s")["h"].nunique() >= 2).all()
    # JKn replicate zero patterns: each replicate zeroes exactly one pseudo PSU, never exactly
    # the records of one original PSU
    d = df.assign(ps=a.stratum, pp=a.psu)
    reps = SurveyDesign(d, "w", "ps", "pp").with_replicates("jkn")
    zero = reps.to_numpy() == 0
    for r in range(zero.shape[1]):
        assert len(np.unique(orig[zero[:, r]])) >= 2
        assert len(np.unique(pseudo[zero[:, r]])) == 1


def _weights_only(n=1500, seed=11) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    age = rng.integers(18, 90, n)
    return pd.DataFrame(
        {
            "pid": np.arange(n),
            "w": rng.uniform(50, 400, n),
            "age": age,
            "sex": rng.choice(["f", "m"], n),
            "region": rng.choice(list("abcd"), n),
            "income": np.round(rng.lognormal(10, 1, n) * (age / 50)),
            "sick": (rng.random(n) < 0.1).astype(int),
            "score": rng.normal(50, 10, n).round(1),
        }
    )


def _weights_only_spec(**gates) -> dict:
    return {
        "release": {"name": "wo", "year": 2026, "seed": 123},
        "design": {"weight": "w"},
        "variables": {
            "direct_identifiers": ["pid"],
            "keys": [{"name": "age", "bins": [18, 30, 45, 60, 75, 91]}, "sex", "region"],
            "sensitive": [{"name": "sick", "sensitivity": {1: 1.0, 0: 0.0}}],
            "study": ["income", "score", "sick"],
        },
        "stages": {"topcode": {"income": {"upper": {"percentile": 99}}}},
        "gates": gates,
        "utility": {"domains": ["age", "sex"]},
    }


def test_weights_only_spec_keeps_its_design():
    """No strata and no PSUs: no labels to mask, so no pseudo design; the public file is read
    with the input's design (each record its own PSU, SRS with replacement)."""
    df = _weights_only()
    spec = parse_spec(_weights_only_spec(xi=0.45, se_ratio=[0.7, 1.4]))
    assert spec.design.strata is None and spec.design.psu is None
    res = {r.name: r for r in run_stages(spec, df)}
    assert "pseudo_design" not in res
    a = res["assess"]
    assert (
        a.params["design_released"]
        == a.params["design_original"]
        == ("1500 records, 1 strata, 1500 PSUs")
    )
    roles = a.params["published_columns"]
    assert not roles.get("stratum") and not roles.get("PSU") and not roles.get("replicate weight")
    assert 0.7 < a.metrics["se_ratio_median"] < 1.4


def test_stratified_only_spec_publishes_a_pseudo_design_of_records():
    """Strata and no PSUs (each record its own): the strata are masked by a pseudo design of 10
    pseudo PSUs of records a pseudo stratum, JKn replicates (one per pseudo PSU) with scale
    (m-1)/m; the assessment reads the released file with it."""
    df = _weights_only().assign(stratum=lambda d: d.pid % 6)
    data = _weights_only_spec(xi=0.45, se_ratio=[0.7, 1.4])
    data["design"]["strata"] = "stratum"
    spec = parse_spec(data)
    res = {r.name: r for r in run_stages(spec, df)}
    pdr = res["pseudo_design"]
    assert pdr.masks_design and pdr.params["built"]
    pub = pdr.params["public_design"]
    out = pdr.data
    m = pdr.params["psus_per_stratum"]
    assert m == 10 and pub["rscales"] == [pytest.approx(0.9)]
    # named for what they are: the pseudo design's JKn replicates, numbered
    assert pub["replicate_weights"][:2] == ["pseudo_jkn_001", "pseudo_jkn_002"]
    assert (out.groupby(pub["strata"])[pub["psu"]].nunique() == m).all()
    assert (
        len(pub["replicate_weights"]) == out[[pub["strata"], pub["psu"]]].drop_duplicates().shape[0]
    )
    a = res["assess"]
    G = pdr.params["pseudo_strata"]
    assert a.params["design_released"] == (
        f"1500 records, {G} strata, {G * m} PSUs, {G * m} jkn replicate weights"
    )
    assert "6 strata, 1500 PSUs" in a.params["design_original"]
    assert 0.7 < a.metrics["se_ratio_median"] < 1.4
    roles = a.params["published_columns"]
    assert roles["replicate weight"] == list(pub["replicate_weights"])
    assert roles["stratum"] == [pub["strata"]] and roles["PSU"] == [pub["psu"]]


def test_swap_without_segment_is_a_spec_error():
    data = _weights_only_spec()
    data["stages"]["swap"] = {"rate": 0.1, "matching": ["income"]}
    with pytest.raises(SpecError) as e:
        parse_spec(data)
    msg = str(e.value)
    assert "stages.swap.enabled:" in msg and "design.segment" in msg and "design.psu" in msg
    data["stages"]["swap"]["enabled"] = False
    parse_spec(data)  # off: valid


@pytest.fixture(scope="module")
def demo():
    from flows.cli import default_spec_text
    from sdl_design.synth import make_survey

    data = yaml.safe_load(default_spec_text())
    return data, make_survey(seed=data["release"]["seed"], n_persons=1500)


def test_topcoding_only_release_fails_its_risk_gates(demo):
    """Issue 13 item 9: PRB, MASSC and the swap off, only top-coding: the published file keeps
    every sample unique, so xi, delta_max and max_unique_share must fail on it."""
    data, df = demo
    data = yaml.safe_load(yaml.safe_dump(data))
    for s in ("swap", "prb", "massc"):
        data["stages"][s]["enabled"] = False
    data["gates"] = {"xi": 0.395, "delta_max": 0.05, "max_unique_share": 0.05}
    data["utility"]["models"] = []
    spec = parse_spec(data)
    res = {r.name: r for r in run_stages(spec, df)}
    assert set(res) == {"risk", "topcode", "pseudo_design", "final", "assess"}
    gates = {g.name: g for g in res["assess"].gates}
    uniq = gates["risk: share of published records unique on the intruder's key"]
    # nothing perturbed: the unique share is the input's on the intruder's key (the keys in
    # their published coding, education, household size and pregnancy), counted here by pandas
    age = pd.cut(df["age"], [0, 18, 25, 35, 45, 55, 65, 75, 91], right=False).astype(str)
    key = [age, *(df[c] for c in ("sex", "race", "marital", "region", "education", "hh_size"))]
    sizes = df.groupby([*key, df["pregnant"]], dropna=False, observed=True)["age"].transform("size")
    assert uniq.value == pytest.approx(float((sizes == 1).mean()))
    assert uniq.value > res["risk"].metrics["unique_share"] > 0.05
    xi = gates["risk: share of original sample uniques re-identified (worst exact-match attack)"]
    assert xi.value == pytest.approx(1.0)  # nothing perturbed: every unique re-identified
    delta = gates["risk: delta (MASSC) of the published file against the original keys"]
    assert delta.value > 0.05
    for g in (uniq, xi, delta):
        assert g.value > g.upper  # fails
