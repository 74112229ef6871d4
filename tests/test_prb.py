"""PRB post-randomization (Zhang and Nayak 2018)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from helpers import DEFAULT_SPEC

from sdl_design.edits import edit_masks, failing_rows
from sdl_design.prb import (
    block_risk,
    default_combos,
    h,
    m0,
    post_randomize,
    theta0,
    theta_tuned,
    transition_matrix,
    tvd_table,
)
from sdl_design.spec import parse_spec
from sdl_design.synth import make_survey

C = ["age", "sex", "race", "marital", "region", "county", "education", "pregnant"]
PART = {"age": [0, 15, 18, 91], "sex": None}


@pytest.fixture(scope="module")
def survey():
    return make_survey(n_persons=12000, seed=11)


def test_theta0_m0_h():
    assert round(theta0(0.395), 3) == 0.799
    assert m0(0.395) == 5
    assert h(2 / 3) == pytest.approx((2 - 2 / 3) / (4 - 4 / 3 + 4 / 9), abs=1e-12)
    g = np.linspace(0.001, 0.999, 500)
    assert np.all(np.diff([h(x) for x in g]) < 0)
    assert round(theta_tuned(0.395), 2) == 0.69


def test_ifpr_unbiased_exact_and_simulated():
    """eq. 2.1: E[S] = T exactly under P. Simulated: G copies of one block with cell counts t,
    kept apart by the partition and perturbed in one call: a record of cell j moves to cell i
    with probability P[i, j], and the block's counts average t."""
    t = np.array([1, 2, 1, 2, 1, 1])
    P = transition_matrix(t, 0.8)
    assert np.allclose(P.sum(axis=0), 1.0)
    assert np.allclose(P @ t, t)  # E[S] = T
    G = 2000
    x = np.tile(np.repeat(np.arange(len(t)), t), G)
    df = pd.DataFrame({"g": np.repeat(np.arange(G), t.sum()), "x": x, "w": 1.0})
    r = post_randomize(df, ["g", "x"], 0.395, "w", {"g": None}, seed=5)
    assert r.theta == pytest.approx(theta0(0.395)) and r.merges == []
    assert r.block.nunique() == G  # one block per copy
    assert (r.data["g"] == df["g"]).all()  # never out of its partition set
    P = transition_matrix(t, r.theta)
    n_from = G * t  # records starting in each cell
    freq = pd.crosstab(r.data["x"], df["x"]).to_numpy() / n_from  # rows: to, columns: from
    assert np.all(np.abs(freq - P) < 4.5 * np.sqrt(P * (1 - P) / n_from))
    var_s = (P * (1 - P)) @ t  # variance of a block's count S_i (independent moves)
    counts = np.bincount(r.data["x"], minlength=len(t)) / G
    assert np.all(np.abs(counts - t) < 4.5 * np.sqrt(var_s / G))


def _brute_risk(t, theta):
    P = transition_matrix(np.asarray(t, float), theta)
    out = []
    for j in range(len(t)):
        s = sum(P[j, i] / (1 - P[j, i]) * t[i] for i in range(len(t)) if i != j)
        out.append(1 / (t[j] + (1 - P[j, j]) / P[j, j] * s))
    return out


def test_every_block_risk_below_xi(survey):
    r = post_randomize(survey, C, 0.395, "wt", PART, seed=2)
    rk = block_risk(r.block, r.cell, r.theta)
    assert rk["risk"].max() <= 0.395
    for b in rk["block"].unique()[:30]:  # eq. 2.2 by brute force on the transition matrix
        sub = rk[rk["block"] == b]
        assert np.allclose(sub["risk"], _brute_risk(sub["t"].to_numpy(), r.theta))
    assert r.block.notna().sum() == (np.bincount(r.cell)[r.cell] <= 2).sum()
    assert (r.data.index == survey.index).all()


def test_prb_beats_nzy_on_weighted_distributions(survey):
    prb = post_randomize(survey, C, 0.395, "wt", PART, seed=7, method="prb").data
    nzy = post_randomize(survey, C, 0.395, "wt", PART, seed=7, method="nzy").data
    combos = default_combos(["race", "marital", "region", "education"], ["diabetes"])
    tab = tvd_table(survey, {"prb": prb, "nzy": nzy}, combos, "wt")
    assert len(tab) >= 10
    assert (tab["prb"] < tab["nzy"]).mean() >= 0.7
    assert tab["prb"].mean() < 0.9 * tab["nzy"].mean()


def test_same_seed_identical(survey):
    a = post_randomize(survey, C, 0.395, "wt", PART, seed=9).data
    b = post_randomize(survey, C, 0.395, "wt", PART, seed=9).data
    assert pd.util.hash_pandas_object(a).equals(pd.util.hash_pandas_object(b))
    c = post_randomize(survey, C, 0.395, "wt", PART, seed=10).data
    assert not a.equals(c)


def _rules():
    spec = parse_spec(
        {
            "release": {"name": "t", "year": 2026, "input": "x.parquet", "seed": 1},
            "design": {"weight": "wt", "strata": "stratum", "psu": "psu"},
            "variables": {"keys": ["age", "sex"]},
            "edits": [
                {"rule": "between", "column": "age", "min": 0, "max": 90},
                {
                    "rule": "in_set",
                    "column": "marital",
                    "values": ["never_married"],
                    "when": "age < 15",
                },
                {"rule": "in_set", "column": "education", "values": ["child"], "when": "age < 18"},
                {"rule": "in_set", "column": "pregnant", "values": [0], "when": "sex == 'male'"},
            ],
        }
    )
    return spec.edits


def test_edits_checker_and_edit_safety(survey):
    rules = _rules()
    assert failing_rows(survey, rules).empty
    bad = survey.head(10).copy()
    bad.loc[bad.index[:3], "age"] = 5
    bad.loc[bad.index[:3], "marital"] = "married"
    m = edit_masks(bad, rules)
    assert int(m[1].sum()) == 3 and int(m[0].sum()) == 0
    assert len(failing_rows(bad, rules)) >= 3
    out = post_randomize(survey, C, 0.395, "wt", PART, seed=4).data
    assert failing_rows(out, rules).empty  # partition keeps ages 0-14/15-17 apart


def test_small_partition_sets_are_merged():
    rng = np.random.default_rng(3)
    n = 400
    df = pd.DataFrame(
        {
            "g": np.r_[np.zeros(n - 3, int), np.ones(3, int)],  # set g=1 has 3 unique cells < m0
            "x": rng.integers(0, 60, n),
            "w": rng.uniform(1, 5, n),
        }
    )
    r = post_randomize(df, ["g", "x"], 0.395, "w", {"g": None}, seed=1)
    assert len(r.merges) == 1 and "g=0" in r.merges[0] and "g=1" in r.merges[0]
    assert block_risk(r.block, r.cell, r.theta)["risk"].max() <= 0.395


def test_task_gate_and_edit_failure():
    from conftest import run_stage

    from sdl_design.edits import EditFailure
    from sdl_design.prb import PrbStage
    from sdl_design.spec import load_spec

    spec = load_spec(DEFAULT_SPEC)
    survey = make_survey(n_persons=4000, seed=11)  # the weighted-count SEs cost ~ records
    out = run_stage(PrbStage, survey, spec, 5)
    assert out.gates[0].value <= 0.395 and out.metrics["m0"] == 5
    assert {"se", "se_star"} <= set(out.tables["weighted_counts"].columns)
    assert len(out.tables["tvd"]) >= 10
    bad = spec.model_copy(deep=True)
    # marital left out of C and ages no longer kept apart: adults move into child cells
    bad.stages.prb.variables = [c for c in C if c != "marital"]
    bad.stages.prb.partition = {"sex": None}
    with pytest.raises(EditFailure, match=r"edits\[\d+\]"):
        run_stage(PrbStage, survey, bad, 5)


def test_tuned_theta_only_when_exact_risk_allows(survey):
    """Section 6: the tuned theta is kept only when eq. 2.2 under it, by brute force over every
    block, stays <= xi; otherwise theta0 (here the tuned theta is rejected)."""
    xi = 0.395
    r = post_randomize(survey, C, xi, "wt", PART, seed=2, tuned=True)
    ok = r.block.notna().to_numpy()
    b, c = r.block.to_numpy()[ok].astype(int), r.cell[ok]
    t = pd.Series(c).groupby([b, c]).size()
    worst = max(max(_brute_risk(g.to_numpy(), theta_tuned(xi))) for _, g in t.groupby(level=0))
    kept = worst <= xi
    assert r.theta == pytest.approx(theta_tuned(xi) if kept else theta0(xi))
    (note,) = r.notes
    assert f"{worst:.4f}" in note and ("rejected" in note) == (not kept)
    assert block_risk(r.block, r.cell, r.theta)["risk"].max() <= xi


def test_tuned_theta_accepted_on_singleton_block():
    df = pd.DataFrame({"x": np.arange(10), "w": np.linspace(1, 2, 10)})  # one block of singletons
    r = post_randomize(df, ["x"], 0.395, "w", None, seed=1, tuned=True)
    assert r.theta == pytest.approx(theta_tuned(0.395))
    # eq. 2.2 with t = 1: [1 + theta/(1-theta) * 9 a/(1-a)]^-1, a = theta/9
    a = r.theta / 9
    expected = 1 / (1 + r.theta / (1 - r.theta) * 9 * a / (1 - a))
    assert block_risk(r.block, r.cell, r.theta)["risk"].to_numpy() == pytest.approx(expected)
    assert expected <= 0.395
