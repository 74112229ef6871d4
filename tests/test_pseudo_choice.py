"""The variance-preserving choice of the pseudo design (sdl_design.pseudo): its scores are the
linearized scores whose with-replacement variance is the survey engine's Taylor variance of
each domain mean, and the design kept is the best of the candidates drawn."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from sdl_design import pseudo
from sdl_design.pseudo import build_pseudo_design, pseudo_scores, unit_labels, unit_score_sums
from sdl_design.spec import parse_spec
from sdl_design.survey.design import SurveyDesign


def _clustered(H: int = 12, m: int = 2, per: int = 40, seed: int = 5) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    s = np.repeat(np.arange(H), m * per)
    p = np.tile(np.repeat(np.arange(m), per), H)
    u = rng.normal(0, 1, H * m)[s * m + p]
    n = len(s)
    y = 5 + 0.2 * s + u + rng.normal(0, 1, n)
    y[rng.random(n) < 0.1] = np.nan  # missing: means over the observed records
    return pd.DataFrame(
        {
            "stratum": 100 + s,
            "psu": p + 1,
            "w": rng.uniform(1, 3, n),
            "sex": rng.choice(["f", "m"], n),
            "age": rng.integers(0, 90, n),
            "y": y,
            "b": (rng.random(n) < 0.3 + 0.1 * (u > 0)).astype(float),
        }
    )


def _spec(**pseudo_section) -> object:
    return parse_spec(
        {
            "release": {"name": "t", "year": 2026, "seed": 1},
            "design": {"weight": "w", "strata": "stratum", "psu": "psu", "pseudo": pseudo_section},
            "variables": {
                "keys": ["sex", {"name": "age", "bins": [0, 30, 60, 91]}],
                "study": ["y", "b"],
            },
        }
    )


def _scores(df: pd.DataFrame, spec) -> tuple[np.ndarray, pd.DataFrame]:
    units = unit_labels(df, spec).unique().sort_values().to_frame(index=False)
    return pseudo_scores(unit_score_sums(df, spec), units), units


def test_scores_give_the_engines_taylor_variance_of_every_domain_mean():
    """The with-replacement variance of the scores' PSU totals is the squared Taylor SE the
    survey engine gives each domain mean (y over its observed records: a ratio)."""
    df, spec = _clustered(), _spec()
    z, units = _scores(df, spec)
    v = pseudo._variances(z, pd.factorize(units["stratum"], sort=True)[0])
    d = df.assign(
        agebin=pd.cut(df.age, [0, 30, 60, 91], right=False).astype(str),
        y0=df.y.fillna(0.0),
        seen=df.y.notna().astype(float),
        one=1.0,
    )
    d["cross"] = d.sex + "|" + d.agebin
    des = SurveyDesign(d, "w", "stratum", "psu")
    want = [des.ratio(["y0", "b"], ["seen", "one"])["se"].to_numpy()]
    for by in ("sex", "agebin", "cross"):  # the keys and their crossing
        want.append(des.ratio(["y0", "b"], ["seen", "one"], by=by)["se"].to_numpy())
    want = np.concatenate(want) ** 2
    # the 2 overall means repeated round(sqrt(22 / 2)) = 3 times, then the 22 domain means
    assert len(want) == 2 * (1 + 2 + 3 + 6) and len(v) == 2 * 3 + 2 * (2 + 3 + 6)
    np.testing.assert_allclose(np.sort(v[4:]), np.sort(want), rtol=1e-10)
    np.testing.assert_allclose(v[:4].reshape(2, 2), np.tile(v[4:6], (2, 1)), rtol=0)


def test_the_kept_design_is_the_best_of_the_candidates_drawn():
    df, spec = _clustered(), _spec()
    z, _ = _scores(df, spec)
    args = (df.stratum.to_numpy(), df.psu.to_numpy())
    best = build_pseudo_design(*args, np.random.default_rng(3), scores=z, candidates=30)
    # brute force: the same draws one by one, each design's loss measured on its own labels
    u = pseudo._units(*args, len(df))
    h = u.unit_h
    v0 = pseudo._variances(z, h)
    keep = v0 > 1e-12 * v0.max()
    rng, losses = np.random.default_rng(3), []
    for m in pseudo._sizes(u, None, 2):
        for _ in range(30):
            st, ps, *_ = pseudo._deal(u, m, 100, 2, rng)
            losses.append(pseudo._loss(z[:, keep], v0[keep], st, ps))
    assert best.variance_loss == pytest.approx(min(losses), abs=0)
    assert best.variance_loss < np.median(losses) / 2  # the choice matters
    # one candidate: the first draw with 2 pseudo PSUs a stratum, no choice
    one = build_pseudo_design(*args, np.random.default_rng(3), scores=z, candidates=1)
    plain = build_pseudo_design(*args, np.random.default_rng(3))
    assert one.psus_per_stratum == plain.psus_per_stratum == 2 and one.variance_loss is None
    assert np.array_equal(one.stratum, plain.stratum) and np.array_equal(one.psu, plain.psu)


def test_the_kept_design_preserves_the_domain_ses_better_than_a_random_one():
    """The SE ratios (pseudo / original) of the domain means, over 5 seeds: the chosen designs'
    mean |log ratio| is below the first draws'."""
    df, spec = _clustered(H=15, seed=9), _spec()
    z, _ = _scores(df, spec)
    args = (df.stratum.to_numpy(), df.psu.to_numpy())
    orig = SurveyDesign(df, "w", "stratum", "psu").mean(["b"], by="sex")["se"].to_numpy()

    def spread(des) -> float:
        d = df.assign(ps=des.stratum, pp=des.psu)
        se = SurveyDesign(d, "w", "ps", "pp").mean(["b"], by="sex")["se"].to_numpy()
        return float(np.mean(np.abs(np.log(se / orig))))

    chosen = [
        spread(build_pseudo_design(*args, np.random.default_rng(s), scores=z, candidates=50))
        for s in range(5)
    ]
    first = [spread(build_pseudo_design(*args, np.random.default_rng(s))) for s in range(5)]
    assert np.mean(chosen) < np.mean(first), (chosen, first)


def test_a_failing_se_gate_names_the_fix_when_the_design_is_a_pseudo_design():
    from expectations.suites import GateFailed
    from sdl_design.pseudo import se_fix
    from sdl_design.stage import StageResult

    built = StageResult("p", None, params={"pseudo_strata": 7, "psus_per_stratum": 2})
    assert se_fix([StageResult("q", None, params={"built": False})]) == ""
    fix = se_fix([built])
    assert "7 pseudo strata of 2 PSUs" in fix and "design.publish_design_labels" in fix
    detail = f"0.69 is below 0.8 by 0.11; {fix}; worst estimates: SE ratio 0.33 for ..."
    results = pd.DataFrame(
        {"name": ["utility: SE ratio p10", "ok"], "passed": [False, True], "detail": [detail, ""]}
    )
    line = GateFailed("release gates failed", results).one_line()
    assert "0.69 is below 0.8 by 0.11; fix: the pseudo design" in line
    assert "design.pseudo.candidates" in line and "worst estimates" not in line


def test_the_largest_domains_steer_the_choice_when_there_are_many(monkeypatch):
    """At most MAX_SCORES domain means steer the choice (the work stays bounded): the largest
    domains, here the two sexes of both variables (about 240 records each) before any age
    group (about 160) or crossing (about 80)."""
    df, spec = _clustered(), _spec()
    monkeypatch.setattr(pseudo, "MAX_SCORES", 4)
    z, units = _scores(df, spec)
    assert z.shape[1] == 2 * 1 + 4  # the 2 overall means once (round(sqrt(4 / 2)) = 1), then 4
    v = pseudo._variances(z, pd.factorize(units["stratum"], sort=True)[0])
    d = df.assign(y0=df.y.fillna(0.0), seen=df.y.notna().astype(float), one=1.0)
    by_sex = SurveyDesign(d, "w", "stratum", "psu").ratio(["y0", "b"], ["seen", "one"], by="sex")
    np.testing.assert_allclose(np.sort(v[2:]), np.sort(by_sex["se"].to_numpy() ** 2), rtol=1e-10)
