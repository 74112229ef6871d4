"""PRB post-randomization (Zhang and Nayak 2018)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from helpers import DEFAULT_SPEC

from sdl_design.edits import edit_masks, failing_rows
from sdl_design.keys import key_frame
from sdl_design.spec import KeySpec, UtilitySection, parse_spec
from sdl_design.stages.prb.method import (
    block_risk,
    default_combos,
    domains_not_kept,
    h,
    m0,
    post_randomize,
    published,
    theta0,
    theta_tuned,
    transition_matrix,
    tvd_table,
)
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


def test_tvd_table_equals_the_groupby_distributions(survey):
    """Table 6 from shared codes and bincounts equals TVD of pandas groupby distributions
    (weighted_distribution), cell counts included, with missing values left out."""
    from sdl_design.utility import tvd, weighted_distribution

    prb = post_randomize(survey, C, 0.395, "wt", PART, seed=7, method="prb").data
    prb = prb.assign(education=prb["education"].mask(prb.index % 11 == 0))  # some missing
    combos = default_combos(["race", "marital", "region", "education"], ["diabetes"])
    tab = tvd_table(survey, {"prb": prb}, combos, "wt").set_index("variables")
    for cols in combos:
        p0 = weighted_distribution(survey, list(cols), "wt")
        row = tab.loc[", ".join(cols)]
        assert row["cells"] == len(p0)
        assert row["prb"] == pytest.approx(
            tvd(p0, weighted_distribution(prb, list(cols), "wt")), abs=1e-14
        )


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
    from sdl_design.spec import load_spec
    from sdl_design.stages.prb import PrbStage

    spec = load_spec(DEFAULT_SPEC)
    survey = make_survey(n_persons=4000, seed=11)  # the weighted-count SEs cost ~ records
    out = run_stage(PrbStage, survey, spec, 5)
    assert out.gates[0].value <= 0.395 and out.metrics["m0"] == 5
    assert {"se", "se_star"} <= set(out.tables["weighted_counts"].columns)
    assert len(out.tables["tvd"]) >= 10
    bad = spec.model_copy(deep=True)
    # marital left out of C and age groups no longer kept (only sex is a declared domain):
    # married adults take the age of a child record of their block
    bad.stages.prb.variables = [c for c in C if c != "marital"]
    bad.stages.prb.cells = None
    bad.stages.prb.partition = {"sex": None}
    bad.utility = UtilitySection(domains=["sex"])
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


# ---------------------------------------------------------------- cells as the intruder sees them

AGE = KeySpec(name="age", bins=[0, 30, 60, 91])
REGION = KeySpec(name="region", map={"r1": "east", "r2": "east", "r3": "west", "r4": "west"})


def _toy(rare: list[tuple[int, str, str]], seed: int = 0, n_common: int = 300) -> pd.DataFrame:
    """n_common records in large coded cells (x = common; raw ages nearly all distinct) and one
    cell per rare tuple (count, coded age group start, raw region); weights rise along the rows."""
    rng = np.random.default_rng(seed)
    rows = {
        "age": list(rng.integers(0, 91, n_common)),
        "x": ["common"] * n_common,
        "region": list(rng.choice(["r1", "r2", "r3", "r4"], n_common)),
    }
    for i, (count, lo, reg) in enumerate(rare):
        for _ in range(count):
            rows["age"].append(int(lo) + int(rng.integers(0, 30)))
            rows["x"].append(f"rare{i}")
            rows["region"].append(reg)
    df = pd.DataFrame(rows)
    df["edu"] = np.where(df["age"] < 18, "child", "adult")  # carried: tied to raw age
    df["w"] = np.r_[rng.uniform(1, 2, n_common), 10 + np.arange(len(df) - n_common)]
    return df


def test_published_coding_of_a_key():
    s = pd.Series([0, 29, 30, 90, 95], name="age")
    assert list(published(s, AGE).astype(str)) == ["0-30", "0-30", "30-60", "60-91", "out_of_range"]
    assert published(s, AGE).cat.ordered  # neighbouring intervals sort next to each other
    r = pd.Series(["r2", "r3", "r9"], name="region")
    assert list(published(r, REGION)) == ["east", "west", "r9"]  # as keys.coarsen: unmapped kept
    assert published(r).equals(r)


def test_only_singleton_doubleton_coded_cells_move_at_the_ifpr_rate():
    # 30 blocks of 10 units (weight ranks 10k..10k+9): 4 singletons and 3 doubletons each
    one = [(1, 0, "r1")] * 2 + [(1, 60, "r2")] * 2 + [(2, 30, "r3"), (2, 0, "r4"), (2, 60, "r1")]
    df = _toy(one * 30)
    cells, C4 = [AGE, "x", REGION], ["age", "x", "region", "edu"]
    tcell = df.groupby(["x", published(df["age"], AGE)], observed=True)["w"].transform("size")
    tcell = tcell.to_numpy()
    sd = np.flatnonzero(tcell <= 2)
    n_rep, th = 80, theta0(0.395)
    moved = np.zeros(len(df))
    for s in range(n_rep):
        r = post_randomize(df, C4, 0.395, "w", seed=s, cells=cells)
        assert (r.block.iloc[sd].to_numpy() == np.arange(len(sd)) // 10).all()
        moved += r.changed
        out = r.data
        # a unit in a cell of 3+ (coded) keeps every value, however unique its raw age
        assert out.loc[tcell > 2].equals(df.loc[tcell > 2])
        # a moved unit takes all of C from one record of its own block (raw age and edu together)
        ch = np.flatnonzero(r.changed)
        rows = df[C4].assign(b=r.block).iloc[sd]
        assert set(map(tuple, out[C4].assign(b=r.block).iloc[ch].to_numpy())) <= set(
            map(tuple, rows.to_numpy())
        )
        assert (out["edu"] == np.where(out["age"] < 18, "child", "adult")).all()
    # P(move) = 1 - p_jj = theta / t_j, the sum of the IFPR off-diagonal probabilities (eq. 2.1)
    for k in (1, 2):
        sel = tcell == k
        se = np.sqrt(th / k * (1 - th / k) / (sel.sum() * n_rep))
        assert abs(moved[sel].mean() / n_rep - th / k) < 4 * se
    share = moved.sum() / n_rep / len(df)
    expected = (tcell == 1).mean() * th + (tcell == 2).mean() * th / 2
    p = np.where(tcell <= 2, th / tcell, 0.0)
    assert abs(share - expected) < 4 * np.sqrt((p * (1 - p)).sum() / n_rep) / len(df)


def test_raw_partition_bins_kept_by_the_record_copied():
    # the partition cuts the coded group 0-30 at raw age 15: a copy comes from the same set
    rare = [(1, 0, "r1")] * 12 + [(2, 0, "r3")] * 6 + [(1, 30, "r2")] * 10
    df = _toy(rare, seed=3)
    for s in range(40):
        r = post_randomize(
            df, ["age", "x", "region", "edu"], 0.395, "w", {"age": [0, 15, 91]}, seed=s,
            cells=[AGE, "x", REGION],
        )  # fmt: skip
        assert ((r.data["age"] < 15) == (df["age"] < 15)).all()
        assert block_risk(r.block, r.cell, r.theta)["risk"].max() <= 0.395


def test_declared_domains_kept_when_every_set_holds_m0():
    # domain region (published: east/west) x age group: each domain cell holds >= m0 sd cells
    rare = [(1, lo, reg) for lo in (0, 30) for reg in ("r1", "r2", "r3", "r4") for _ in range(3)]
    rare += [(2, lo, reg) for lo in (0, 30) for reg in ("r2", "r3")]
    df = _toy(rare, seed=5)
    cells = [AGE, "x", REGION]
    before = key_frame(df, [AGE, REGION])
    raw_moved = 0
    for s in range(40):
        r = post_randomize(
            df, ["age", "x", "region", "edu"], 0.395, "w", seed=s, cells=cells,
            domains=[["region"], ["age", "region"]],
        )  # fmt: skip
        assert r.merges == []
        assert key_frame(r.data, [AGE, REGION]).equals(before)  # never leaves its domain cell
        raw_moved += int((r.data["region"] != df["region"]).sum())  # raw region moves inside
        n, tab = domains_not_kept(r)
        assert n == 0 and tab.empty
        assert block_risk(r.block, r.cell, r.theta)["risk"].max() <= 0.395
        assert r.changed.any()
    assert raw_moved > 0


def test_forced_merge_is_reported_with_brute_force_counts():
    # west has 3 sd cells (< m0 = 5) in age group 0-30: merged with east of the same age group
    rare = [(1, 0, "r1")] * 8 + [(1, 0, "r3")] * 2 + [(2, 0, "r4")]
    rare += [(1, 30, "r2")] * 6 + [(1, 30, "r3")] * 6
    df = _toy(rare, seed=7)
    cells, doms = [AGE, "x", REGION], [["age"], ["region"]]
    total_moved = 0
    for s in range(30):
        r = post_randomize(
            df, ["age", "x", "region", "edu"], 0.395, "w", seed=s, cells=cells, domains=doms
        )
        assert len(r.merges) == 1 and "region=east" in r.merges[0] and "region=west" in r.merges[0]
        assert "age=0-30" in r.merges[0] and "30-60" not in r.merges[0]  # the last column first
        kb, ka = key_frame(df, [AGE, REGION]), key_frame(r.data, [AGE, REGION])
        assert (kb["age"] == ka["age"]).all()
        brute = (kb != ka).any(axis=1)
        n, tab = domains_not_kept(r)
        assert n == brute.sum()
        assert list(tab["domain"]) == ["region"]
        assert tab["cells_merged"].iloc[0] == "region=east + region=west"
        assert tab["n_moved"].iloc[0] == (kb["region"] != ka["region"]).sum()
        young_sd = (published(df["age"], AGE) == "0-30") & (df["x"] != "common")
        assert tab["n_records"].iloc[0] == young_sd.sum() == 8 + 2 + 2
        assert block_risk(r.block, r.cell, r.theta)["risk"].max() <= 0.395
        total_moved += n
    assert total_moved > 0  # the merge does move records across east/west


def _stage_checks(out, df, spec):
    keys, doms = spec.variables.keys, spec.utility.domain_list(spec.variables.key_names)
    kb, ka = key_frame(df, keys), key_frame(out.data, keys)
    t = kb.groupby(list(kb.columns), observed=True)[kb.columns[0]].transform("size")
    changed = (out.data[spec.stages.prb.variables] != df[spec.stages.prb.variables]).any(axis=1)
    assert out.metrics["n_changed"] == changed.sum() > 0
    assert (t[changed] <= 2).all()  # only units of singleton/doubleton cells of the coded keys
    assert failing_rows(out.data, spec.edits).empty
    assert out.tables["risk_by_block"]["max_risk"].max() <= 0.395
    cols = list(dict.fromkeys(c for d in doms for c in d))
    assert out.metrics["n_moved_across_domains"] == (kb[cols] != ka[cols]).any(axis=1).sum()
    tab = out.tables["domains_not_kept"]
    for d in doms:
        brute = (kb[d] != ka[d]).any(axis=1).sum()
        assert tab.loc[tab["domain"] == " x ".join(d), "n_moved"].sum() == brute
    return kb, ka


def test_stage_cells_on_published_keys_and_declared_domains(survey):
    from conftest import run_stage
    from helpers import county_key_spec

    from sdl_design.stages.prb import PrbStage

    spec = county_key_spec()
    spec.utility = UtilitySection(domains=["age", "sex", "race", ["age", "sex"]])
    out = run_stage(PrbStage, survey, spec, 5)
    kb, ka = _stage_checks(out, survey, spec)
    assert out.params["cells"] == ["age", "sex", "race", "marital", "region", "county"]
    assert out.metrics["n_moved_across_domains"] == 0 and out.tables["domains_not_kept"].empty
    assert (kb[["age", "sex", "race"]] == ka[["age", "sex", "race"]]).all().all()
    # every key a domain (the default): what cannot be kept is merged and reported
    spec.utility = UtilitySection()
    out = run_stage(PrbStage, survey, spec, 5)
    _stage_checks(out, survey, spec)
    assert out.metrics["n_moved_across_domains"] > 0
    assert any("could not keep the domain 'county'" in n for n in out.notes)


def test_cells_outside_c_refused_by_the_spec():
    from sdl_design.spec import SpecError, load_spec

    spec = load_spec(Path(__file__).parents[1] / "flows" / "default_spec.yaml")
    data = spec.model_dump(mode="json")
    data["stages"]["prb"]["cells"] = ["age", "income"]
    with pytest.raises(SpecError, match=r"stages\.prb.*income"):
        parse_spec(data)


def test_count_changes_counts_only_the_categories_records_have():
    """Tables 1/4 of two files are the same whether their categoricals also list a category
    only a third file has (the PRB stage counts them beside the NZY baseline, with the two
    files' categories): record counts by brute force, and equal tables either way."""
    from sdl_design.keys import shared_categories
    from sdl_design.spec import load_spec
    from sdl_design.stages.prb.method import count_changes

    spec = load_spec(DEFAULT_SPEC)
    a = make_survey(n_persons=2000, seed=3)
    b = a.copy()
    b.loc[b.index[:40], "marital"] = "married"
    third = a.iloc[:5].copy()
    third["marital"] = "unheard_of"  # a category neither file has
    two = shared_categories([a, b], C)
    three = shared_categories([a, b, third], C)[:2]
    assert "unheard_of" in three[0]["marital"].cat.categories
    assert "unheard_of" not in two[0]["marital"].cat.categories
    t2 = count_changes(*two, C, spec.design.weight, spec.design)
    t3 = count_changes(*three, C, spec.design.weight, spec.design)
    pd.testing.assert_frame_equal(t2, t3)
    married = t2.loc[("marital", "married")]
    assert married["t"] == (a["marital"] == "married").sum()
    assert married["t_star"] == (b["marital"] == "married").sum()
