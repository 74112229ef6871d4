"""The assessment is written once, as its passes: in memory they run on the working frame as
one partition, and give what the whole frames' estimators give (assess_reference: survey
design estimates, GLMs and attacks on the records, not sums by profile and PSU)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from assess_reference import assess_frames
from helpers import DEFAULT_SPEC

from sdl_design.engine.cache import CACHE
from sdl_design.spec import load_spec, parse_spec
from sdl_design.stage import StageContext
from sdl_design.stages import run_stages
from sdl_design.synth import make_survey


def _close(got: pd.DataFrame, want: pd.DataFrame, rtol: float, loose: dict | None = None) -> None:
    assert list(got.columns) == list(want.columns) and len(got) == len(want)
    for c in want.columns:
        if want[c].dtype.kind in "fiub":
            r = (loose or {}).get(c, rtol)
            np.testing.assert_allclose(
                got[c].to_numpy(float), want[c].to_numpy(float), rtol=r, atol=1e-12, err_msg=c
            )
        else:
            assert got[c].astype(str).tolist() == want[c].astype(str).tolist(), c


def _default() -> tuple:
    return load_spec(DEFAULT_SPEC), make_survey(n_persons=3000, seed=11)


def _strata_without_clusters() -> tuple:
    """Strata, no PSU column (each record its own PSU), a pseudo design of records."""
    from test_design_optional import _weights_only, _weights_only_spec

    data = _weights_only_spec(xi=0.45, se_ratio=[0.7, 1.4])
    data["design"]["strata"] = "stratum"
    return parse_spec(data), _weights_only().assign(stratum=lambda d: d.pid % 6)


@pytest.mark.parametrize("case", [_default, _strata_without_clusters])
def test_the_stage_in_memory_is_the_whole_frames_assessment(case):
    """The default release of 3,000 persons, and a stratified file without clusters: the
    in-memory assessment (its passes on one partition) has the whole frames' params, domain
    estimates (1e-12), model coefficients (1e-10), metrics (1e-9), gates with the same
    verdicts, notes and worst estimates."""
    spec, df = case()
    results = run_stages(spec, df)
    # what the partition cache kept of the frames held in memory went with them
    assert not [k for k in CACHE._items if "('frame', " in repr(k)]
    at = next(i for i, r in enumerate(results) if r.section and r.tables.get("attacks") is not None)
    got, before = results[at], results[at - 1].data
    want = assess_frames(before, StageContext(df, spec).for_stage(got.name, results[:at]))
    assert got.params == want.params and "intruder_key" in got.params
    assert " records, " in got.params["design_original"] and got.params["domains"]
    _close(got.tables["domain_estimates"], want.tables["domain_estimates"], 1e-12)
    # the replicate SEs of the age terms are ~17 (Taylor ~1): in some replicates the youngest
    # group has no case and the refit runs off to its iteration cap, where the two fits' last
    # steps differ in rounding; every other column to 1e-10
    rep = ["se_original", "se_released", "se_replicate_original", "se_replicate_released"]
    loose = dict.fromkeys([*rep, "ci_overlap", "std_diff", "se_ratio"], 1e-4)
    _close(got.tables["model_coefficients"], want.tables["model_coefficients"], 1e-10, loose)
    assert set(got.metrics) == set(want.metrics) and len(want.metrics) > 30
    for k, v in want.metrics.items():
        assert got.metrics[k] == pytest.approx(v, rel=1e-9, abs=1e-15), k
    assert [g.name for g in got.gates] == [g.name for g in want.gates]
    for g, w in zip(got.gates, want.gates, strict=True):
        assert g.value == pytest.approx(w.value, rel=1e-9, abs=1e-15) and g.holds() == w.holds()
    assert got.notes == want.notes and got.section == want.section
    key = ["variable", "statistic", "domain", "level"]
    worst = [t.tables["worst_estimates"][key].astype(str).values.tolist() for t in (got, want)]
    assert worst[0] == worst[1]
    assert got.tables["attacks"].equals(want.tables["attacks"])


def test_segment_totals_through_replicate_factors_are_the_full_product(monkeypatch):
    """The quantile pass's replicate totals by (cell, segment): F' times the totals of w by
    (segment, factor group), dense or sparse, equal the sparse product with W (1e-12) and the
    sums over each cell's records between its quantiles (brute force), records with a missing
    value left out."""
    from sdl_design.stages.assess import passes
    from sdl_design.stages.assess.passes import _segment_totals
    from sdl_design.survey.design import replicate_factor_groups

    rng = np.random.default_rng(5)
    n, R, P, L = 3000, 20, 25, 6
    psu = rng.integers(0, P, n)
    w = rng.uniform(1.0, 4.0, n)
    W = np.ascontiguousarray(w[:, None] * rng.uniform(0.0, 2.0, (P, R))[psu])
    X = rng.normal(size=(n, 2))
    X[rng.random(n) < 0.1, 1] = np.nan
    cell = rng.integers(0, L, n)
    qs = [np.sort(rng.normal(size=(L, 3)), axis=1) for _ in range(2)]
    full = _segment_totals(W, X, cell, L, qs)
    groups = replicate_factor_groups(W, w)
    assert groups is not None and groups[1] == P
    by_factors = _segment_totals(None, X, cell, L, qs, (w, groups))  # W not read
    monkeypatch.setattr(passes, "DENSE_CELLS", 0)
    sparse = _segment_totals(None, X, cell, L, qs, (w, groups))
    for j, (a, b, c) in enumerate(zip(full, by_factors, sparse, strict=True)):
        assert a.shape == (R, L * 4)
        np.testing.assert_allclose(b, a, rtol=1e-12, atol=1e-9)
        np.testing.assert_allclose(c, a, rtol=1e-12, atol=1e-9)
        for h in range(L):
            bounds = [-np.inf, *qs[j][h], np.inf]
            for s in range(4):
                x = X[:, j]
                inside = (cell == h) & (x > bounds[s]) & (x <= bounds[s + 1])
                np.testing.assert_allclose(a[:, h * 4 + s], W[inside].sum(axis=0), rtol=1e-12)


def test_cell_grams_through_factors_and_by_rows_are_each_cells_product(monkeypatch):
    """The quantile pass's Gram W_c'W_c of each cell's records where a variable is observed:
    through the replicate factors (F' diag(s) F, s the sums of w^2 by factor group) with the
    finest groups' sums dense or by (finest group, factor group) pair, W not read, and by the
    rows of W (factors that differ by record) equal the product over the cell's records
    (brute force, 1e-12); records missing the variable are left out."""
    from sdl_design.stages.assess import passes
    from sdl_design.stages.assess.passes import _cell_grams
    from sdl_design.survey.design import replicate_factor_groups

    rng = np.random.default_rng(17)
    n, R, P = 2500, 12, 30
    psu = rng.integers(0, P, n)
    w = rng.uniform(1.0, 4.0, n)
    by_psu = np.ascontiguousarray(w[:, None] * rng.uniform(0.0, 2.0, (P, R))[psu])
    missing = np.column_stack([np.zeros(n, bool), rng.random(n) < 0.2])
    cells = [(np.zeros(n, dtype=np.int64), 1), (rng.integers(0, 5, n), 5)]
    groups = replicate_factor_groups(by_psu, w)
    assert groups is not None and groups[1] == P
    got = {"dense": _cell_grams(None, cells, missing, (w, groups))}
    monkeypatch.setattr(passes, "DENSE_CELLS", 0)  # by (finest group, factor group) pair
    got["pairs"] = _cell_grams(None, cells, missing, (w, groups))
    by_record = by_psu * rng.uniform(0.9, 1.1, (n, R))
    got["rows"] = _cell_grams(by_record, cells, missing, (w, None))
    for how, grams in got.items():
        W = by_record if how == "rows" else by_psu
        for (cell, L), by_var in zip(cells, grams, strict=True):
            for j, G in enumerate(by_var):
                assert G.shape == (L, R, R)
                for c in range(L):
                    rows = (cell == c) & ~missing[:, j]
                    want = W[rows].T @ W[rows]
                    np.testing.assert_allclose(G[c], want, rtol=1e-12, atol=1e-9, err_msg=how)


def test_replicate_totals_by_profile_through_factors_and_by_rows_are_the_products():
    """Pass 2's W'Y of each profile's records: through the replicate factors (W_i = w_i F_g:
    F' times the sums of w Y by profile and group) and, with factors that differ by record,
    by each profile's rows of W, equal the product over the profile's records (brute force,
    1e-12); a profile with no record gives zeros."""
    from sdl_design.stages.assess.passes import _replicate_totals_by_profile
    from sdl_design.survey.design import replicate_factor_groups

    rng = np.random.default_rng(11)
    n, R, P, k, profiles = 4000, 16, 40, 5, 9
    psu = rng.integers(0, P, n)
    w = rng.uniform(1.0, 4.0, n)
    Y = rng.normal(size=(n, k))
    inv = rng.integers(0, profiles - 1, n)  # the last profile has no record
    by_psu = np.ascontiguousarray(w[:, None] * rng.uniform(0.0, 2.0, (P, R))[psu])
    by_record = by_psu * rng.uniform(0.9, 1.1, (n, R))  # calibrated: a factor per record
    assert replicate_factor_groups(by_psu, w) is not None
    assert replicate_factor_groups(by_record, w) is None
    for W in (by_psu, by_record):
        groups = replicate_factor_groups(W, w)  # through the factors, W is not read
        got = _replicate_totals_by_profile(None if groups else W, w, Y, inv, profiles, groups)
        assert got.shape == (R, profiles, k) and got.flags.c_contiguous
        for j in range(profiles):
            want = W[inv == j].T @ Y[inv == j]
            np.testing.assert_allclose(got[:, j], want, rtol=1e-12, atol=1e-9)


def test_psu_positives_are_pandas_groupby_max():
    """Pass 1's rows per PSU: labels in first appearance order, the fpc's largest value and
    whether each replicate weight gives a record of the PSU weight are pandas' groupby max
    of the indicators (a missing label's records left out)."""
    from sdl_design.stages.assess.passes import _psu_positives

    rng = np.random.default_rng(3)
    n, R = 5000, 7
    labels = pd.DataFrame(
        {
            "stratum": rng.integers(0, 9, n).astype(float),
            "psu": rng.integers(0, 56, n),
            "fpc": rng.integers(100, 103, n),
        }
    )
    labels.loc[rng.random(n) < 0.01, "stratum"] = np.nan
    W = pd.DataFrame(rng.choice([-1.0, 0.0, 0.0, 2.5], (n, R)), columns=[f"r{i}" for i in range(R)])
    pos = pd.DataFrame((W.to_numpy() > 0).astype(float), columns=W.columns)
    want = pd.concat([labels, pos], axis=1).groupby(["stratum", "psu"], sort=False).max()
    got = _psu_positives(labels, ["stratum", "psu"], W)
    pd.testing.assert_frame_equal(got, want.reset_index())
    assert 0 < got[W.columns].to_numpy().mean() < 1


def test_model_cells_replicate_totals_through_factors_are_the_products():
    """The models' cells: their replicate weights' sums through the replicate factors (F' times
    the sums of w by factor group) equal G W (brute force, 1e-12)."""
    from sdl_design.stages.assess.passes import _totals_through_factors
    from sdl_design.survey.design import replicate_factor_groups
    from sdl_design.survey.glm import glm_cells

    rng = np.random.default_rng(13)
    n, R, P = 3000, 10, 25
    psu = rng.integers(0, P, n)
    w = rng.uniform(1.0, 4.0, n)
    W = np.ascontiguousarray(w[:, None] * rng.uniform(0.0, 2.0, (P, R))[psu])
    X = np.column_stack([np.ones(n), rng.integers(0, 3, n), rng.integers(0, 2, n)]).astype(float)
    y = rng.integers(0, 2, n).astype(float)
    ok = rng.random(n) > 0.05
    want = glm_cells(X, y, ok, w, psu, W=W)
    got = glm_cells(
        X, y, ok, w, psu, replicate_totals=_totals_through_factors(w, replicate_factor_groups(W, w))
    )
    np.testing.assert_array_equal(got.rows, want.rows)
    np.testing.assert_allclose(got.W, want.W, rtol=1e-12)
    for i, row in enumerate(want.rows):  # brute force: the rows with these (x, y)
        at = ok & (np.column_stack([X, y]) == row).all(axis=1)
        np.testing.assert_allclose(got.W[i], W[at].sum(axis=0), rtol=1e-12)


def test_cell_grams_through_replicate_factors_are_the_products():
    """The quantile pass's Grams by grouping, cell and variable: through the replicate factors
    (F' diag(s) F) and by the product of the rows equal each cell's W_c'W_c over the records
    with the variable observed (brute force, 1e-12)."""
    from sdl_design.stages.assess.passes import _cell_grams
    from sdl_design.survey.design import replicate_factor_groups

    rng = np.random.default_rng(7)
    n, R, P = 2000, 12, 30
    psu = rng.integers(0, P, n)
    w = rng.uniform(1.0, 4.0, n)
    W = np.ascontiguousarray(w[:, None] * rng.choice([0.0, 2.0], (P, R))[psu])
    missing = np.column_stack([np.zeros(n, bool), rng.random(n) < 0.2, rng.random(n) < 0.2])
    cells = [(np.zeros(n, dtype=np.int64), 1), (rng.integers(0, 4, n), 4)]
    groups = replicate_factor_groups(W, w)
    assert groups is not None
    for got in (_cell_grams(W, cells, missing), _cell_grams(W, cells, missing, (w, groups))):
        for (cell, L), by_var in zip(cells, got, strict=True):
            for j, grams in enumerate(by_var):
                assert grams.shape == (L, R, R)
                for h in range(L):
                    S = W[(cell == h) & ~missing[:, j]]
                    np.testing.assert_allclose(grams[h], S.T @ S, rtol=1e-12, atol=1e-9)


def test_attacks_gather_no_replicate_weight():
    """The attacks' columns (gathered to the driver) leave out the replicate weights of both
    files, which no intruder's key holds: the same attacks on the files without them."""
    from sdl_design.stages.assess import passes as pas
    from sdl_design.stages.assess.method import published_attacks

    spec, df = _default()
    cols = list(df.columns)
    reps = [c for c in cols if c.startswith("rw_")]
    assert len(reps) > 10
    rel, orig = pas.attack_columns(spec, cols, cols, reps)
    assert not set(reps) & (set(rel) | set(orig))
    assert {spec.design.weight, "age", "sex", spec.design.strata} <= set(rel)
    released = df.sample(frac=0.9, random_state=3)
    whole, key = published_attacks(df, released, spec, spec.design, True)
    less, key2 = published_attacks(df[orig], released[rel], spec, spec.design, True)
    assert key.describe() == key2.describe()
    assert dict(whole) == dict(less) and whole.table.equals(less.table)
