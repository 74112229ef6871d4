"""The producer's design is the baseline (issue 34 item 3): when the input comes with replicate
weights, the SEs the gates compare are replicate SEs on both files, computed independently here
with the survey engine; a file without strata or PSUs keeps its design and the producer's
replicate columns under their names (no pseudo design: nothing to mask)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from sdl_design.spec import parse_spec
from sdl_design.stages import run_stages
from sdl_design.stages.assess.method import gate_variance
from sdl_design.survey.design import SurveyDesign

R = 40


def _bootstrap_file(n: int = 800, seed: int = 3) -> pd.DataFrame:
    """Weights, a key, a study variable and R bootstrap replicates (records resampled with
    replacement, n/(n-1) rescaled, as NMIHS' bsrw columns)."""
    rng = np.random.default_rng(seed)
    w = rng.uniform(100, 900, n)
    df = pd.DataFrame(
        {
            "id": np.arange(n),
            "w": w,
            "sex": rng.choice(["f", "m"], n),
            "y": rng.gamma(3, 1000, n) * (1 + (w > 500)),  # y tied to w: Taylor != bootstrap
        }
    )
    mult = rng.multinomial(n - 1, np.full(n, 1 / n), size=R).T * n / (n - 1)
    reps = pd.DataFrame(w[:, None] * mult, columns=[f"bw{r + 1}" for r in range(R)])
    return pd.concat([df, reps], axis=1)


def _spec(**design) -> object:
    return parse_spec(
        {
            "release": {"name": "b", "year": 2026, "seed": 11},
            "design": {"weight": "w", **design},
            "variables": {"direct_identifiers": ["id"], "keys": ["sex"], "study": ["y"]},
            "stages": {"massc": {"enabled": False}, "topcode": {"enabled": False}},
            "gates": {"se_ratio": [0.8, 1.25]},
        }
    )


def test_gate_variance_is_replicate_only_with_the_producers_replicates_on_both_files():
    with_rw = _spec(replicate_weights={"columns": "bw*", "method": "bootstrap"})
    cols = list(_bootstrap_file(5).columns)
    assert gate_variance(with_rw, cols) == "replicate"
    assert gate_variance(with_rw, [c for c in cols if not c.startswith("bw")]) == "taylor"
    assert gate_variance(_spec(), cols) == "taylor"


def test_the_gates_compare_the_producers_bootstrap_ses():
    df = _bootstrap_file()
    spec = _spec(replicate_weights={"columns": "bw*", "method": "bootstrap"})
    res = {r.name: r for r in run_stages(spec, df)}
    assert "pseudo_design" not in res  # no strata, no PSUs: nothing to mask
    a = res["assess"]
    assert a.params["variance"] == "replicate"
    assert a.params["published_columns"]["replicate weight"] == [f"bw{r + 1}" for r in range(R)]
    est = a.tables["domain_estimates"]
    row = est[(est.variable == "y") & (est.statistic == "mean") & (est.domain == "all")].iloc[0]
    reps = [f"bw{r + 1}" for r in range(R)]
    des = SurveyDesign(df, "w", replicate_weights=reps, method="bootstrap")
    want = des.mean("y", variance="replicate")["se"].iloc[0]
    taylor = SurveyDesign(df, "w").mean("y")["se"].iloc[0]
    assert row.se_original == pytest.approx(want, rel=1e-12)
    assert abs(want / taylor - 1) > 0.02  # the baseline is not the made-up design's Taylor SE
    assert row.se_taylor_original == pytest.approx(taylor, rel=1e-12)
    # nothing changed the file (no treatment ran on y or the weights): ratio 1, overlap 1
    assert row.se_ratio == pytest.approx(1.0, abs=1e-12) and row.ci_overlap == pytest.approx(1.0)


def test_the_baseline_takes_the_declared_fpc_and_lonely_psu_rule():
    """design.fpc and design.lonely_psu reach the original's design in the assessment (the
    published file carries no fpc: its SEs are with replacement)."""
    from sdl_design.stages.assess import AssessStage

    df, spec = _fpc_file("adjust")
    a = {r.name: r for r in run_stages(spec, df)}["assess"]
    est = a.tables["domain_estimates"]
    row = est[(est.variable == "y") & (est.statistic == "mean") & (est.domain == "all")].iloc[0]
    with_fpc = SurveyDesign(df, "w", "h", "p", fpc="N", lonely_psu="adjust").mean("y")
    without = SurveyDesign(df, "w", "h", "p", lonely_psu="adjust").mean("y")
    assert row.se_original == pytest.approx(with_fpc["se"].iloc[0], rel=1e-12)
    assert row.se_released == pytest.approx(without["se"].iloc[0], rel=1e-12)
    assert row.se_original < 0.95 * row.se_released  # the fpc the public file cannot carry
    assert not hasattr(AssessStage, "check_partitions")  # one path: nothing refused by partition


@pytest.mark.parametrize("rule", ["adjust", "remove", "average", "certainty"])
def test_fpc_and_lonely_psu_by_partition_give_the_in_memory_assessment(rule):
    """The assessment by partition (3 partitions that cut strata; the released file without
    the fpc column, in 2; PSUs of 2 records, one of them cut) gives the in-memory
    assessment's domain estimates and SEs: the fpc and the lonely stratum's rule act on the
    PSU totals, which the partitions sum."""
    from sdl_design.engine.partitions import FramePartition
    from sdl_design.stages.assess import passes as pas
    from sdl_design.stages.assess.method import assess

    df, spec = _fpc_file(rule, size=2)
    rel = df.drop(columns="N")
    want = assess(df, rel, spec, pmse=False, reid=False, models=[]).domain_estimates
    files = [(df, (0, 31, 75, len(df))), (rel, (0, 65, len(rel)))]
    parts = [
        [FramePartition(f.iloc[a:b], a, b) for a, b in zip(cut[:-1], cut[1:], strict=True)]
        for f, cut in files
    ]
    req = pas.assess_request(spec, list(df.columns), list(rel.columns))
    assert req.files[0].fpc == "N" and req.files[1].fpc is None
    first = [[pas.assess_pass1(p, spec, req, f) for p in ps] for f, ps in enumerate(parts)]
    plan = pas.assess_plan(first, req)
    second = [[pas.assess_pass2(p, spec, req, f, plan) for p in ps] for f, ps in enumerate(parts)]
    got = pas.assess_combine(plan, second).domain_estimates
    assert len(got) == len(want) and list(got.columns) == list(want.columns)
    for c in ("estimate_original", "se_original", "se_released", "n_original"):
        np.testing.assert_allclose(got[c], want[c], rtol=1e-12, atol=1e-15, err_msg=c)
    row = got[(got.variable == "y") & (got.statistic == "mean") & (got.domain == "all")]
    ref = SurveyDesign(df, "w", "h", "p", fpc="N", lonely_psu=rule).mean("y")
    np.testing.assert_allclose(row["se_original"], ref["se"], rtol=1e-12)


def _fpc_file(rule: str, size: int = 1) -> tuple[pd.DataFrame, object]:
    """101 records in 3 strata of 40, 60 and 1 records, in PSUs of size records (the third
    stratum one PSU of one record), with their populations of PSUs (fpc N), and its spec with
    lonely_psu: rule."""
    rng = np.random.default_rng(5)
    n_h = np.array([40, 60, 1])  # the third stratum has one PSU of one record
    h = np.repeat(np.arange(3), n_h)
    df = pd.DataFrame(
        {
            "id": np.arange(len(h)),
            "h": h,
            "p": np.arange(len(h)) // size,
            "N": np.array([200, 120, 50])[h],  # PSUs in the stratum's population
            "w": np.array([5.0, 2.0, 50.0])[h],
            "sex": rng.choice(["f", "m"], len(h)),
            "y": rng.normal(10, 2, len(h)) + h,
        }
    )
    spec = parse_spec(
        {
            "release": {"name": "f", "year": 2026, "seed": 3},
            "design": {
                "weight": "w",
                "strata": "h",
                "psu": "p",
                "fpc": "N",
                "lonely_psu": rule,
                "publish_design_labels": True,
            },
            "variables": {"direct_identifiers": ["id"], "keys": ["sex"], "study": ["y"]},
            "stages": {"massc": {"enabled": False}, "topcode": {"enabled": False}},
        }
    )
    return df, spec
