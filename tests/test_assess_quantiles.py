"""The assessment's quantile rows (issue 34): the quartiles of every continuous study variable,
overall and by each utility domain, on both files. References: SurveyDesign.quantile called on
each file and domain (R's svyquantile, tests/test_quantiles.py), the in-memory assessment for the
partitioned one, and identical files (nothing to compare but equality)."""

from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from flows.cli import write_demo_spec
from sdl_design.engine import partitions as P
from sdl_design.keys import coarsen
from sdl_design.spec import load_spec
from sdl_design.stages.assess import passes as pas
from sdl_design.stages.assess.method import MEAN_STATISTICS, QUANTILES, assess
from sdl_design.survey.design import SurveyDesign

N = 1200
CONTINUOUS = ["income", "bmi", "hh_size"]  # the default spec's study variables not 0/1
DOMAINS = ["age", "sex", ["age", "sex"]]
AGE = [0, 18, 25, 35, 45, 55, 65, 75, 91]  # the default spec's bins of age


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> tuple:
    """The default survey (1,200 persons, bmi missing in every 13th record) in 3 partitions and
    a released file: 90% of its records, income noised and rounded, bmi missing in every 17th
    record, 10% of household sizes one larger, in 4 partitions. Each file read whole too."""
    folder = tmp_path_factory.mktemp("assess_quantiles")
    spec = load_spec(write_demo_spec(folder, n_persons=N))
    src = Path(spec.release.input)
    df = pd.read_parquet(src)
    df.loc[df.index % 13 == 0, "bmi"] = np.nan
    pq.write_table(pa.Table.from_pandas(df, preserve_index=False), src, row_group_size=400)
    rng = np.random.default_rng(3)
    rel = df.sample(frac=0.9, random_state=1).sort_index()
    rel["income"] = np.round(rel["income"] * rng.lognormal(0, 0.1, len(rel)), -2)
    rel.loc[rel.index % 17 == 0, "bmi"] = np.nan
    rel["hh_size"] += (rng.random(len(rel)) < 0.1).astype(rel["hh_size"].dtype)
    released = folder / "released.parquet"
    pq.write_table(pa.Table.from_pandas(rel, preserve_index=False), released, row_group_size=300)
    with pytest.MonkeyPatch.context() as mp:  # partitions end where row groups end
        mp.setattr(P, "_block_aligned", lambda ends: ends)
        parts = [P.plan_partitions(src), P.plan_partitions(released)]
    assert [len(p) for p in parts] == [3, 4]
    whole = [P.read_partition(P.plan_partitions(p, 1)[0], None, spec) for p in (src, released)]
    return spec, whole, parts


def _quantile_rows(est: pd.DataFrame) -> pd.DataFrame:
    return est[est["statistic"].isin(QUANTILES)]


@pytest.mark.parametrize("variance", ["taylor", "replicate"])
def test_quantile_rows_are_survey_design_quantiles_of_each_file_and_domain(files, variance):
    spec, (o, r), _ = files
    a = assess(o, r, spec, domains=DOMAINS, variance=variance, pmse=False, reid=False, models=[])
    q = _quantile_rows(a.domain_estimates)
    # overall and each domain (a crossing declared as one domain too), not the pairs
    assert set(q["domain"]) == {"all", "age", "sex", "age x sex"}
    assert set(q["variable"]) == set(CONTINUOUS) and len(q) == 3 * 3 * (1 + 8 + 2 + 16)
    other = "replicate" if variance == "taylor" else "taylor"
    assert q[f"se_{other}_original"].isna().all()  # the SE of the assessment's variance only
    assert np.array_equal(q["se_original"], q[f"se_{variance}_original"], equal_nan=True)
    q = q.set_index(["variable", "statistic", "domain", "level"])
    for side, df in (("original", o), ("released", r)):
        df = df.assign(
            all="all", age=coarsen(df["age"], AGE).astype(str), sex=df["sex"].astype(str)
        )
        df["age x sex"] = df["age"] + ", " + df["sex"]
        design = SurveyDesign.from_spec(df, spec.design)
        for by in ("all", "age", "sex", "age x sex"):
            ref = design.quantile(CONTINUOUS, list(QUANTILES.values()), by=by, variance=variance)
            stat = {p: s for s, p in QUANTILES.items()}
            for (var, p, level), row in ref.iterrows():
                got = q.loc[(var, stat[p], by, level)]
                assert got[f"estimate_{side}"] == row["estimate"], (var, p, by, level)
                np.testing.assert_allclose(got[f"se_{side}"], row["se"], rtol=1e-12)
                observed = (df[by] == level) & df[var].notna()
                assert got[f"n_{side}"] == observed.sum()
    # bmi's quartiles are over the records where it is not missing: they count for n
    assert q.loc[("bmi", "median", "all", "all"), "n_original"] == N - len(range(0, N, 13))


def _by_partition(spec, parts, whole, variance):
    """The domain estimates by partition (passes 1 and 2, the quantiles' records gathered, the
    quantile pass for replicate SEs), in process."""
    req = pas.assess_request(spec, list(whole[0].columns), list(whole[1].columns))
    first = [[pas.assess_pass1(p, spec, req, f) for p in ps] for f, ps in enumerate(parts)]
    plan = pas.assess_plan(first, req)
    second = [[pas.assess_pass2(p, spec, req, f, plan) for p in ps] for f, ps in enumerate(parts)]
    quantiles = pas.partition_quantiles(plan, second)
    if variance == "replicate":
        cuts = [quantiles.cuts(plan, f) for f in (0, 1)]
        quantiles.add_replicates(
            [
                [pas.quantile_pass(p, spec, req, f, plan, cuts[f]) for p in ps]
                for f, ps in enumerate(parts)
            ]
        )
    return pas.assess_combine(plan, second, quantiles, variance)


@pytest.mark.parametrize("variance", ["taylor", "replicate"])
def test_quantile_rows_by_partition_equal_the_in_memory_assessment(files, variance):
    spec, whole, parts = files
    want = assess(*whole, spec, variance=variance, pmse=False, reid=False, models=[])
    got = _by_partition(spec, parts, whole, variance)
    w, g = want.domain_estimates, got.domain_estimates
    assert list(g.columns) == list(w.columns) and len(g) == len(w)
    quant = w["statistic"].isin(QUANTILES).to_numpy()
    assert quant.sum() == 3 * 3 * (1 + 5 + 8 + 2 + 5 + 4 + 16)  # the default spec's domains
    for c in w.columns:
        if w[c].dtype.kind in "fb":
            a, b = g[c].to_numpy(float), w[c].to_numpy(float)
            # the quantile rows to the bit; the means' replicate SEs sum in another order
            np.testing.assert_array_equal(a[quant], b[quant], err_msg=c)
            np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12, err_msg=c)
        else:
            assert g[c].astype(str).tolist() == w[c].astype(str).tolist(), c
    for k, v in want.metrics.items():
        if k in got.metrics:
            assert got.metrics[k] == pytest.approx(v, rel=1e-12, abs=1e-15), k
    assert {"se_ratio_quantile_p10", "se_ratio_quantile_p90"} <= set(got.metrics)


def test_quantiles_count_in_the_overlap_gates_not_in_the_se_ratio_gates(files):
    spec, whole, _ = files
    a = assess(*whole, spec, pmse=False, reid=False, models=[])
    e, m = a.domain_estimates, a.metrics
    rel = e[e["reliable"]]
    assert rel["statistic"].isin(QUANTILES).sum() > 100
    assert m["overlap_median"] == np.median(rel["ci_overlap"])
    assert m["share_abs_std_bias_gt2"] == (rel["std_bias"].abs() > 2).mean()
    ratio = rel["se_ratio"].where(np.isfinite(rel["se_ratio"]))  # NaN: no released SE
    means = ratio[rel["statistic"].isin(MEAN_STATISTICS)].dropna()
    assert m["se_ratio_p10"] == np.percentile(means, 10)
    quant = ratio[rel["statistic"].isin(QUANTILES)].dropna()
    assert m["se_ratio_quantile_p90"] == np.percentile(quant, 90) != m["se_ratio_p90"]


@pytest.mark.parametrize("which", [0, 1])
@pytest.mark.parametrize("variance", ["taylor", "replicate"])
def test_a_file_against_itself_has_quantile_overlap_one(files, which, variance):
    spec, whole, _ = files
    df = whole[which]
    a = assess(df, df.copy(), spec, variance=variance, pmse=False, reid=False, models=[])
    q = _quantile_rows(a.domain_estimates)
    assert q["estimate_original"].notna().all() and (q["std_bias"] == 0.0).all()
    se = q["se_original"].notna()  # NaN: a Woodruff bound beyond 0 or 1, or no df
    assert se.mean() > 0.9 and q["reliable"].sum() > 100
    assert (q.loc[se, "ci_overlap"] == 1.0).all() and (q.loc[se, "se_ratio"] == 1.0).all()
    assert q.loc[~se, "ci_overlap"].isna().all()
    m = a.metrics
    assert m["se_ratio_quantile_p10"] == m["se_ratio_quantile_p90"] == 1.0
    assert m["overlap_min"] == 1.0 and m["share_abs_std_bias_gt2"] == 0.0
