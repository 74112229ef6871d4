"""Segment/PSU masking (paper 003): exact O(1) variance update, Methods 2a/2b, constraints."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from sdl_design.stages.swap.method import (
    VarianceState,
    plan_swaps,
    pseudo_labels,
    segment_aggregates,
)


@pytest.fixture(scope="module", autouse=True)
def _figures(figures):
    """The report's figures are drawn in this module (tests look at them)."""


def toy_survey(n_strata=8, n_h=(2, 3), segs=6, per=5, q=3, seed=0) -> pd.DataFrame:
    """Strata with 2 or 3 PSUs, PSU and segment effects, unequal weights."""
    rng = np.random.default_rng(seed)
    rows, sid = [], 0
    for h in range(n_strata):
        for i in range(1, n_h[h % len(n_h)] + 1):
            pe = rng.normal(size=q)
            for _ in range(segs):
                se, sw, sid = rng.normal(size=q), rng.lognormal(0, 0.4), sid + 1
                for _ in range(per):
                    x = pe + se + rng.normal(size=q)
                    rows.append((h + 1, i, sid, sw * rng.uniform(0.5, 2.0), *x))
    df = pd.DataFrame(rows, columns=["st", "psu", "seg", "w", *[f"x{j}" for j in range(q)]])
    df["x2"] = (df["x2"] > 0.5).astype(int)  # a binary characteristic
    return df


def taylor_oracle(df: pd.DataFrame, strata: str, psu: str, cols: list[str]) -> np.ndarray:
    """Full recomputation over records: Taylor variance of the weighted means, PSUs with
    replacement in strata: sum_h n_h/(n_h-1) sum_i (z_hi - zbar_h)^2."""
    w = df["w"].to_numpy()
    out = []
    for c in cols:
        y = df[c].to_numpy(dtype=float)
        z = w * (y - (w @ y) / w.sum()) / w.sum()
        t = pd.Series(z).groupby([df[strata].to_numpy(), df[psu].to_numpy()]).sum()
        v = 0.0
        for _, g in t.groupby(level=0):
            v += len(g) / (len(g) - 1) * float(((g - g.mean()) ** 2).sum())
        out.append(v)
    return np.array(out)


COLS = ["x0", "x1", "x2"]


def _relabel(df, agg, seg_psu):
    d = df.copy()
    d["st"] = agg.strata_labels[agg.psu_stratum[seg_psu[agg.record_segment]]]
    d["psu"] = agg.psu_labels[seg_psu[agg.record_segment]]
    return d


def test_o1_update_equals_full_recomputation():
    df = toy_survey()
    agg = segment_aggregates(df, "w", "st", "psu", "seg", COLS)
    state = VarianceState(agg)
    np.testing.assert_allclose(state.v0, taylor_oracle(df, "st", "psu", COLS), rtol=1e-12)
    rng = np.random.default_rng(5)
    kinds = {"same2": 0, "same3": 0, "cross": 0}
    n_h = agg.n_h
    for _ in range(60):
        a, b = rng.choice(len(agg.segment_labels), 2, replace=False)
        pa, pb = state.seg_psu[a], state.seg_psu[b]
        if pa == pb:
            continue
        ha, hb = agg.psu_stratum[pa], agg.psu_stratum[pb]
        kinds["cross" if ha != hb else f"same{n_h[ha]}"] += 1
        predicted = state.delta(a, np.array([b]))[0]
        before = state.v.copy()
        state.apply(a, b)
        oracle = taylor_oracle(_relabel(df, agg, state.seg_psu), "st", "psu", COLS)
        np.testing.assert_allclose(state.v, oracle, rtol=1e-10)
        np.testing.assert_allclose(before + predicted, oracle, rtol=1e-10)
    # also a same-stratum swap in each kind of stratum, forced
    for h in (0, 1):  # stratum 1 has 2 PSUs, stratum 2 has 3 PSUs
        segs = np.flatnonzero(agg.psu_stratum[state.seg_psu] == h)
        a = segs[0]
        b = next(s for s in segs if state.seg_psu[s] != state.seg_psu[a])
        kinds[f"same{n_h[h]}"] += 1
        state.apply(a, b)
        oracle = taylor_oracle(_relabel(df, agg, state.seg_psu), "st", "psu", COLS)
        np.testing.assert_allclose(state.v, oracle, rtol=1e-10)
    assert min(kinds.values()) >= 1, kinds
    np.testing.assert_allclose(state.full_variance(), state.v, rtol=1e-10)


def test_candidate_evaluation_vectorized_equals_one_by_one():
    df = toy_survey(seed=3)
    agg = segment_aggregates(df, "w", "st", "psu", "seg", COLS)
    state = VarianceState(agg)
    a = 0
    cand = np.flatnonzero(agg.seg_psu != agg.seg_psu[a])
    many = state.delta(a, cand)
    for k in (0, 7, len(cand) - 1):
        s2 = VarianceState(agg)
        s2.apply(a, int(cand[k]))
        np.testing.assert_allclose(s2.v - s2.v0, many[k], rtol=1e-9, atol=1e-18)


def test_frozen_state_evaluates_the_same_bits_after_swaps():
    """FrozenVariance.delta (per-segment dev and c gathered once, eq. 4's cross-stratum case
    for every pair, the same-stratum case where they share a stratum) equals
    VarianceState.delta bit for bit, for blocks of segments against their partners and for
    one segment, in the first state and after swaps; both cases occur."""
    df = toy_survey(n_strata=10, segs=8, seed=4)
    agg = segment_aggregates(df, "w", "st", "psu", "seg", COLS)
    state = VarianceState(agg)
    rng = np.random.default_rng(6)
    n = len(agg.segment_labels)
    for step in range(3):
        frozen = state.frozen()
        a = np.arange(n)
        b = rng.integers(0, n, (n, 9))
        b = np.where(agg.seg_psu[b] == state.seg_psu[a][:, None], (b + 1) % n, b)
        h = agg.psu_stratum[state.seg_psu]
        same = h[a][:, None] == h[b]
        assert same.any() and (~same).any()
        assert frozen.delta(a, b).tobytes() == state.delta(a, b).tobytes(), step
        assert frozen.delta(3, b[3]).tobytes() == state.delta(3, b[3]).tobytes()
        x, y = 0, int(np.flatnonzero(state.seg_psu != state.seg_psu[0])[step])
        state.apply(x, y)  # a swap changes t and tbar: a new frozen state reads them


@pytest.mark.parametrize("scope", ["any", "same_stratum", "cross_stratum"])
@pytest.mark.parametrize("method", ["2a", "2b"])
def test_constraints_hold(method, scope):
    df = toy_survey(n_strata=10, segs=8, seed=1)
    agg = segment_aggregates(df, "w", "st", "psu", "seg", COLS)
    max_share = 0.25
    plan = plan_swaps(
        agg, 0.2, np.random.default_rng(2), method=method, max_share=max_share, scope=scope
    )
    a = np.array([p[0] for p in plan.pairs])
    b = np.array([p[1] for p in plan.pairs])
    both = np.concatenate([a, b])
    assert len(plan.pairs) == plan.target_pairs == round(0.2 * len(agg.segment_labels) / 2)
    assert len(np.unique(both)) == len(both)  # each segment swapped at most once
    assert np.all(agg.seg_psu[a] != agg.seg_psu[b])  # never within one PSU
    m_p = np.bincount(agg.seg_psu)
    swapped_p = np.bincount(agg.seg_psu[both], minlength=len(m_p))
    assert np.all(swapped_p <= np.floor(max_share * m_p))
    sa, sb = agg.seg_stratum[a], agg.seg_stratum[b]
    if scope == "same_stratum":
        assert np.all(sa == sb)
    if scope == "cross_stratum":
        assert np.all(sa != sb)
    # the swapped segments sit in the partner's PSU, the others where they were
    moved = np.zeros(len(agg.seg_psu), bool)
    moved[both] = True
    assert np.all(plan.state.seg_psu[a] == agg.seg_psu[b])
    assert np.all(plan.state.seg_psu[b] == agg.seg_psu[a])
    assert np.all(plan.state.seg_psu[~moved] == agg.seg_psu[~moved])


def test_labels_permuted_and_consistent():
    df = toy_survey(n_strata=30, segs=4, per=2, seed=4)
    agg = segment_aggregates(df, "w", "st", "psu", "seg", COLS)
    plan = plan_swaps(agg, 0.25, np.random.default_rng(1))
    h, p = pseudo_labels(agg, plan.state.seg_psu, np.random.default_rng(9))
    # pseudo strata 1..H, pseudo PSUs 1..n_h in each stratum
    assert sorted(np.unique(h)) == list(range(1, 31))
    per_h = pd.Series(p).groupby(h).agg(lambda s: sorted(s.unique()))
    n_h = pd.Series(agg.n_h, index=range(30))
    assert sorted(len(v) for v in per_h) == sorted(n_h)
    assert all(v == list(range(1, len(v) + 1)) for v in per_h)
    # one pseudo PSU per (current) PSU: same partition of records
    cur = plan.state.seg_psu[agg.record_segment]
    pair = pd.Series(list(zip(h, p, strict=True)))
    assert pair.groupby(cur).nunique().max() == 1
    assert pd.Series(cur).groupby(pair.to_numpy()).nunique().max() == 1
    # the labels are permuted: most records do not keep their original stratum label
    assert np.mean(h == df["st"].to_numpy()) < 0.2


def test_same_seed_same_swaps_different_seed_different_swaps():
    df = toy_survey(n_strata=12, segs=10, seed=6)
    agg = segment_aggregates(df, "w", "st", "psu", "seg", COLS)
    p1 = plan_swaps(agg, 0.2, np.random.default_rng(11)).pairs
    p2 = plan_swaps(agg, 0.2, np.random.default_rng(11)).pairs
    p3 = plan_swaps(agg, 0.2, np.random.default_rng(12)).pairs
    assert p1 == p2
    assert {frozenset(x[:2]) for x in p1} != {frozenset(x[:2]) for x in p3}


def test_2b_preserves_matching_variances_better_than_2a_on_toy():
    df = toy_survey(n_strata=20, segs=12, seed=8)
    agg = segment_aggregates(df, "w", "st", "psu", "seg", COLS)
    dev = {}
    for m in ("2a", "2b"):
        st = plan_swaps(agg, 0.25, np.random.default_rng(3), method=m).state
        dev[m] = np.abs(np.log(st.v / st.v0)).mean()
    assert dev["2b"] < dev["2a"]


def test_bad_input_names_the_field():
    df = toy_survey()
    with pytest.raises(ValueError, match="matching: column 'nope'"):
        segment_aggregates(df, "w", "st", "psu", "seg", ["nope"])
    bad = df.assign(seg=1)
    with pytest.raises(ValueError, match="design.segment"):
        segment_aggregates(bad, "w", "st", "psu", "seg", COLS)


# ---------------------------------------------------------------- swap_segments on the default survey

MATCHING = ["income", "bmi", "diabetes", "hypertension", "insured", "smoker"]
EXCLUDE = ["person_id", "name", "household"]


def _design(df):
    from sdl_design.survey.design import SurveyDesign

    rw = [c for c in df.columns if c.startswith("rw_")]
    return SurveyDesign(
        df, weight="wt", strata="stratum", psu="psu", segment="segment",
        replicate_weights=rw, method="jkn",
    )  # fmt: skip


@pytest.fixture(scope="module")
def survey():
    from sdl_design.synth import make_survey

    return make_survey(seed=1)


@pytest.fixture(scope="module")
def small_survey():
    """For the seeding and task tests, whose assertions do not need the full 20,000 persons."""
    from sdl_design.synth import make_survey

    return make_survey(5000, seed=1)


@pytest.fixture(scope="module")
def results(survey):
    from sdl_design.spec import KeySpec
    from sdl_design.stages.swap.method import design_columns, swap_segments
    from sdl_design.utility import broad_characteristics

    d = _design(survey)
    domains = [KeySpec(name="sex"), KeySpec(name="age", bins=[0, 18, 45, 65, 91])]
    chars = broad_characteristics(
        survey, design=design_columns(d), exclude=EXCLUDE, domains=domains
    )
    return {
        m: swap_segments(survey, d, MATCHING, 0.25, method=m, seed=3, characteristics=chars)
        for m in ("2a", "2b")
    }


def test_public_output_has_pseudo_labels_only(survey, results):
    res = results["2b"]
    out = res.data
    assert out.index.equals(survey.index) and list(out.columns) == list(survey.columns)
    same = [c for c in survey.columns if c not in ("stratum", "psu") and not c.startswith("rw_")]
    pd.testing.assert_frame_equal(out[same], survey[same])
    # strata/PSU columns now hold pseudo labels, different from the originals in general
    assert np.mean(out["stratum"].to_numpy() == survey["stratum"].to_numpy()) < 0.2
    orig_pair = survey["stratum"].astype(str) + ":" + survey["psu"].astype(str)
    new_pair = out["stratum"].astype(str) + ":" + out["psu"].astype(str)
    assert np.mean(orig_pair.to_numpy() == new_pair.to_numpy()) < 0.2
    # swapped segments moved with their records to the partner's (pseudo) PSU
    seg_psu = new_pair.groupby(out["segment"]).agg(["nunique", "first"])
    assert seg_psu["nunique"].max() == 1
    home = orig_pair.groupby(survey["segment"]).first()
    for a, b in res.pairs[["segment_a", "segment_b"]].head(20).itertuples(index=False):
        mates_b = home.index[(home == home[b]) & ~home.index.isin(res.pairs.segment_b)]
        mates_b = mates_b[~mates_b.isin(res.pairs.segment_a)]
        assert (seg_psu.loc[mates_b, "first"] == seg_psu.loc[a, "first"]).all()
    # replicate weights rebuilt for the pseudo design: each zero in exactly one pseudo PSU
    rw = [c for c in out.columns if c.startswith("rw_")]
    zero = (out[rw] == 0).groupby(new_pair).all().sum(axis=0)
    assert (zero == 1).all()
    assert not np.allclose(out[rw].to_numpy(), survey[rw].to_numpy())


def test_point_estimates_unchanged(survey, results):
    se = results["2b"].se_ratios
    assert len(se) >= 100
    for res in results.values():
        out = res.data
        w0, w1 = survey["wt"].to_numpy(), out["wt"].to_numpy()
        for c in MATCHING + ["age"]:
            assert np.isclose(w1 @ out[c] / w1.sum(), w0 @ survey[c] / w0.sum(), rtol=1e-13)
            assert np.isclose(w1 @ out[c], w0 @ survey[c], rtol=1e-13)
        # Taylor SE of the matching means from the table agree with the O(1) state
        m = res.se_ratios[res.se_ratios.matching].set_index("variable")
        np.testing.assert_allclose(
            m.loc[MATCHING, "ratio"], res.variance.loc[MATCHING, "se_ratio"], rtol=1e-9
        )
        np.testing.assert_allclose(
            m.loc[MATCHING, "se_original"] ** 2, res.variance.loc[MATCHING, "v_original"], rtol=1e-9
        )


def test_2b_closer_to_one_than_2a(results):
    """The paper's finding (Table 1, Figure 2): smaller mean |log ratio| and range under 2b."""
    stats = {}
    for m, res in results.items():
        se = res.se_ratios
        for name, r in (("matching", se.loc[se.matching, "ratio"]), ("broad", se["ratio"])):
            lr = np.log(r.to_numpy())
            stats[m, name] = (np.abs(lr).mean(), np.ptp(r.to_numpy()))
    for name in ("matching", "broad"):
        assert stats["2b", name][0] < stats["2a", name][0], stats
        assert stats["2b", name][1] < stats["2a", name][1], stats


def test_swap_segments_seeded(small_survey):
    from sdl_design.stages.swap.method import swap_segments

    survey = small_survey
    d = _design(survey)
    chars = None
    small = dict(characteristics=chars, method="2b")
    r1 = swap_segments(survey, d, MATCHING[:2], 0.1, seed=5, **small)
    r2 = swap_segments(survey, d, MATCHING[:2], 0.1, seed=5, **small)
    r3 = swap_segments(survey, d, MATCHING[:2], 0.1, seed=6, **small)
    pd.testing.assert_frame_equal(r1.data, r2.data)
    pd.testing.assert_frame_equal(r1.pairs, r2.pairs)
    s1 = {frozenset(p) for p in r1.pairs[["segment_a", "segment_b"]].itertuples(index=False)}
    s3 = {frozenset(p) for p in r3.pairs[["segment_a", "segment_b"]].itertuples(index=False)}
    assert s1 != s3
    assert not r1.data[["stratum", "psu"]].equals(r3.data[["stratum", "psu"]])


def test_bootstrap_rebuild_draws_from_the_seed(small_survey):
    """Replicate weights rebuilt by the bootstrap draw their resamples from the swap's
    Generator: the same seed gives the same bits (it drew from fresh entropy before), another
    seed other resamples; each is w times a Rao-Wu factor constant within the pseudo PSU."""
    from sdl_design.stages.swap.method import swap_segments

    d = _design(small_survey)
    kw = dict(characteristics=None, replicate_method="bootstrap")
    r1, r2, r3 = (
        swap_segments(small_survey, d, MATCHING[:2], 0.1, seed=s, **kw) for s in (5, 5, 6)
    )
    rw = [c for c in r1.data.columns if c.startswith("rw_")]
    assert len(rw) == 100  # with_replicates' default bootstrap count, rebuilt in place or added
    pd.testing.assert_frame_equal(r1.data, r2.data, check_exact=True)
    assert not np.array_equal(r1.data[rw].to_numpy(), r3.data[rw].to_numpy())
    f = r1.data[rw].to_numpy() / r1.data[["wt"]].to_numpy()
    by_psu = pd.DataFrame(f).groupby([r1.data["stratum"].to_numpy(), r1.data["psu"].to_numpy()])
    assert (by_psu.max() - by_psu.min()).to_numpy().max() < 1e-12


def test_deff_class_summary_matches_numpy():
    from sdl_design.utility import deff_class_summary

    rng = np.random.default_rng(0)
    deff = rng.uniform(0.2, 20, 300)
    ratio = rng.lognormal(0, 0.1, 300)
    t = deff_class_summary(ratio, deff)
    sel = (deff > 2) & (deff <= 5)
    x = ratio[sel]
    assert t.loc["count", "(2,5]"] == sel.sum()
    assert np.isclose(t.loc["90%", "(2,5]"], np.percentile(x, 90))
    assert np.isclose(t.loc["IQR", "(2,5]"], np.percentile(x, 75) - np.percentile(x, 25))
    assert np.isclose(t.loc["range", "overall"], np.ptp(ratio))
    assert t.loc["count", "overall"] == 300


def test_se_ratio_metrics_with_collapsed_se():
    """A zero SE ratio is counted, not turned into an infinite mean |log ratio|."""
    import warnings

    from sdl_design.utility import se_ratio_metrics

    r = np.array([0.0, 0.5, 1.0, 2.0, np.nan])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m = se_ratio_metrics(pd.DataFrame({"ratio": r}))
    assert m["se_ratio_n_zero"] == 1
    assert np.isclose(m["se_ratio_mean_abs_log"], 2 * np.log(2) / 3)
    assert m["se_ratio_min"] == 0 and np.isclose(m["se_ratio_median"], 0.75)


def test_domain_mean_se_equals_oracle():
    from sdl_design.utility import Characteristics, domain_mean_se

    df = toy_survey(seed=2)
    df["g"] = np.where(df["x1"] > 0, "a", "b")
    chars = Characteristics(
        extra=pd.DataFrame({"_dom_g": df["g"]}), overall=COLS, domain_vars=COLS,
        domains=["_dom_g"], kinds={},
    )  # fmt: skip
    t = domain_mean_se(df, chars, "w", "st", "psu")
    overall = t[t.domain == "all"].set_index("variable")
    np.testing.assert_allclose(overall.loc[COLS, "se"] ** 2, taylor_oracle(df, "st", "psu", COLS))
    # domain mean = ratio of totals: score w 1_d (y - ybar_d) / W_d; brute force
    sub = t[t.domain == "g=a"].set_index("variable")
    ind = (df["g"] == "a").to_numpy()
    for c in COLS:
        y = df[c].to_numpy(float)
        wd = df["w"].to_numpy() * ind
        yb = wd @ y / wd.sum()
        z = pd.Series(wd * (y - yb) / wd.sum())
        tt = z.groupby([df["st"], df["psu"]]).sum()
        v = sum(len(g) / (len(g) - 1) * ((g - g.mean()) ** 2).sum() for _, g in tt.groupby(level=0))
        assert np.isclose(sub.loc[c, "estimate"], yb)
        assert np.isclose(sub.loc[c, "se"] ** 2, v, rtol=1e-10)


def test_swap_task_stage_output(small_survey):
    from conftest import run_stage
    from helpers import DEFAULT_SPEC

    from sdl_design.spec import load_spec
    from sdl_design.stages.swap import SwapStage

    spec = load_spec(DEFAULT_SPEC)
    survey = small_survey
    out = run_stage(SwapStage, survey, spec, 20261122)
    assert out.name == "swap" and out.data.index.equals(survey.index)
    assert set(out.tables) >= {"pairs", "se_ratios", "se_ratio_summary"}
    n_seg = survey["segment"].nunique()
    assert out.metrics["share_swapped"] == 2 * round(0.25 * n_seg / 2) / n_seg
    assert out.metrics["n_characteristics"] >= 100
    s = out.tables["se_ratio_summary"].set_index("statistic")
    assert s.loc["count", "overall"] == len(out.tables["se_ratios"])
    # Taylor SEs of the overall means of the matching variables: brute force on the original
    # design and on the released pseudo design
    se = out.tables["se_ratios"]
    m = se[se["domain"] == "all"].set_index("variable").loc[MATCHING]
    before = taylor_oracle(survey.assign(w=survey["wt"]), "stratum", "psu", MATCHING)
    after = taylor_oracle(out.data.assign(w=out.data["wt"]), "stratum", "psu", MATCHING)
    np.testing.assert_allclose(m["se_original"] ** 2, before, rtol=1e-9)
    np.testing.assert_allclose(m["se_masked"] ** 2, after, rtol=1e-9)
    # median, 10th and 90th percentile of the broad set's SE ratios: diagnostics (the SE-ratio
    # gate reads the published file, in the assess stage)
    np.testing.assert_allclose(se["ratio"], se["se_masked"] / se["se_original"], rtol=1e-12)
    q = np.percentile(se["ratio"], [50, 10, 90])
    got = [out.metrics[f"se_ratio_{k}"] for k in ("median", "p10", "p90")]
    np.testing.assert_allclose(got, q, rtol=1e-12)
    assert out.gates == []
    assert out.figures["se_ratio_boxplot"][:8] == b"\x89PNG\r\n\x1a\n"
    assert "segment" in out.drop_public
    again = run_stage(SwapStage, survey, spec, 20261122)
    pd.testing.assert_frame_equal(out.data, again.data)


@pytest.mark.parametrize("labels", ["int", "str"])
def test_psu_codes_match_multiindex_factorize(labels):
    """The integer-key PSU numbering equals pandas' factorize of (stratum, PSU) pairs."""
    from sdl_design.stages.swap.method import _psu_codes

    rng = np.random.default_rng(4)
    h = rng.integers(0, 7, 5000)
    p = rng.integers(1, 5, 5000) * 10
    psu = p if labels == "int" else np.array([f"p{v}" for v in p], dtype=object)
    code, stratum, lab = _psu_codes(h, psu)
    want, uniq = pd.factorize(pd.MultiIndex.from_arrays([h, psu]), sort=True)
    np.testing.assert_array_equal(code, want)
    np.testing.assert_array_equal(stratum, uniq.get_level_values(0))
    np.testing.assert_array_equal(lab, np.asarray(uniq.get_level_values(1)))


@pytest.mark.parametrize("method", ["jkn", "jk1", "brr", "fay"])
def test_rebuilt_replicates_equal_with_replicates_on_the_full_file(method):
    """The replicate weights built from one record per PSU are those SurveyDesign.with_replicates
    gives on the whole masked file, to the bit, with the same scale factors."""
    from sdl_design.stages.swap.method import (
        Masking,
        _psu_pseudo_labels,
        apply_masking,
        replicate_factors,
    )
    from sdl_design.survey.design import SurveyDesign

    df = toy_survey(n_strata=6, n_h=(2,) if method in ("brr", "fay") else (2, 3), seed=5)
    agg = segment_aggregates(df, "w", "st", "psu", "seg", COLS)
    plan = plan_swaps(agg, rate=0.3, rng=np.random.default_rng(2))
    psu_h, psu_p = _psu_pseudo_labels(agg, np.random.default_rng(3))
    rec_psu = plan.state.seg_psu[agg.record_segment]
    dc = {"weight": "w", "strata": "st", "psu": "psu", "replicate_weights": []}
    rho = 0.3 if method == "fay" else None
    f, rscales = replicate_factors(dc, psu_h, psu_p, method, rho, np.random.default_rng(4))
    masking = Masking(plan.state.seg_psu, psu_h, psu_p, f, rscales, method)
    data, rw, _ = apply_masking(df, dc, agg.record_segment, masking)
    full = SurveyDesign(data, weight="w", strata="st", psu="psu").with_replicates(method, rho=rho)
    assert rw == list(full.columns)
    np.testing.assert_array_equal(data[rw].to_numpy(), full.to_numpy())
    np.testing.assert_array_equal(rscales, full.attrs["rscales"])
    # and the records' pseudo labels are their PSU's
    np.testing.assert_array_equal(data["st"].to_numpy(), psu_h[rec_psu])


def test_se_table_with_known_scales_equals_derived(small_survey):
    """swap_segments hands the rebuilt replicates' scale factors to the SE table; the table is
    the one SurveyDesign gives when it derives them from the replicate weights."""
    from sdl_design.stages.swap.method import design_columns, swap_segments
    from sdl_design.utility import broad_characteristics, se_ratio_table

    d = _design(small_survey)
    dc = design_columns(d)
    chars = broad_characteristics(small_survey, design=dc, exclude=EXCLUDE)
    res = swap_segments(small_survey, d, MATCHING, 0.25, seed=2, characteristics=chars)
    rw = [c for c in res.data.columns if c.startswith("rw_")]
    derived = se_ratio_table(small_survey, res.data, dc, rw, chars, "jkn")
    assert "ratio_rep" in derived.columns
    pd.testing.assert_frame_equal(res.se_ratios.drop(columns="matching"), derived)


@pytest.mark.parametrize("scope", ["any", "same_stratum", "cross_stratum"])
def test_candidate_lists_equal_brute_force_neighbours(scope):
    """The k partners of each segment are the first valid ones among its 2k+1 (4k+1 across
    strata) nearest in the projected feature space, by brute force over all distances; the
    short first query and the second one for the segments it leaves short give those lists."""
    from sdl_design.stages.swap.method import _candidate_lists

    df = toy_survey(n_strata=6, n_h=(2, 3), segs=40, per=2, q=3, seed=8)
    agg = segment_aggregates(df, "w", "st", "psu", "seg", COLS)
    rng = np.random.default_rng(1)  # features clustered by PSU: many same-PSU neighbours
    psu_effect = 3 * rng.normal(size=(len(agg.psu_stratum), 3))
    feat = psu_effect[agg.seg_psu] + agg.score / agg.score.std(axis=0)
    k, n_dims = 20, 2
    got = _candidate_lists(feat, agg.seg_psu, agg.seg_stratum, scope, k, n_dims=n_dims)
    f = feat - feat.mean(axis=0)
    f = f @ np.linalg.svd(f, full_matrices=False)[2][:n_dims].T
    psu, stratum = agg.seg_psu, agg.seg_stratum
    kq = 4 * k + 1 if scope == "cross_stratum" else 2 * k + 1
    short = 0
    for a in range(len(f)):
        pool = (
            np.flatnonzero(stratum == stratum[a]) if scope == "same_stratum" else np.arange(len(f))
        )
        near = pool[np.argsort(((f[pool] - f[a]) ** 2).sum(axis=1), kind="stable")][:kq]
        ok = psu[near] != psu[a]
        if scope == "cross_stratum":
            ok &= stratum[near] != stratum[a]
        want = near[ok][:k]
        short += ok[: k + 16].sum() < k  # needs the second query
        assert list(got[a, : len(want)]) == list(want) and (got[a, len(want) :] == -1).all()
    assert short > 0
