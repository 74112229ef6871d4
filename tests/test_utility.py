"""Broad characteristics for the SE checks: the domains are the caller's, none are built in."""

from __future__ import annotations

import numpy as np
import pandas as pd

from sdl_design.spec import KeySpec
from sdl_design.utility import broad_characteristics, domain_mean_se


def frame(n: int = 240, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    return pd.DataFrame(
        {
            "years": rng.integers(0, 90, n),
            "gender": rng.choice(["f", "m"], n),
            "parish": [f"p{i:03d}" for i in rng.integers(0, 40, n)],  # 40 categories
            "y": rng.normal(size=n),
            "w": rng.uniform(1, 3, n),
            "st": np.repeat([0, 1], n // 2),
            "psu": np.tile(np.repeat([0, 1, 2], n // 6), 2),
        }
    )


def test_no_domains_unless_asked():
    df = frame()
    chars = broad_characteristics(df, exclude=["w", "st", "psu"])
    assert chars.domains == [] and chars.domain_vars == ["years", "y"]
    # a survey whose columns happen to be called sex and age gets none either
    chars = broad_characteristics(df.rename(columns={"gender": "sex", "years": "age"}))
    assert chars.domains == []


def test_domains_from_keys():
    df = frame()
    keys = [KeySpec(name="years", bins=[0, 18, 65, 91]), KeySpec(name="gender"), "parish"]
    chars = broad_characteristics(df, exclude=["w", "st", "psu"], domains=keys)
    # parish has 40 > max_categories categories: left out; the first two keys are crossed
    assert chars.domains == ["_dom_years", "_dom_gender", "_dom_years:gender"]
    band = np.select([df.years < 18, df.years < 65], ["0-18", "18-65"], "65-91")
    assert (chars.extra["_dom_years"] == band).all()
    assert (chars.extra["_dom_years:gender"] == pd.Series(band) + ":" + df.gender).all()
    t = domain_mean_se(df, chars, "w", "st", "psu").set_index(["variable", "domain"])
    # a domain mean is the weighted mean within the domain
    d = (band == "18-65") & (df.gender == "f").to_numpy()
    expect = np.average(df.y[d], weights=df.w[d])
    assert np.isclose(t.loc[("y", "years:gender=18-65:f"), "estimate"], expect)
    assert not t.index.get_level_values("domain").str.startswith("parish").any()
    chars = broad_characteristics(df, domains=keys, max_categories=50, cross=False)
    assert chars.domains == ["_dom_years", "_dom_gender", "_dom_parish"]


def test_final_stage_reads_the_original_se_table_the_swap_computed(monkeypatch):
    """The original side of the SE tables is computed once per release (ctx.shared): the final
    stage reuses the swap's, and its table equals the one it computes alone with its own
    characteristics (pregnant dropped from the public file: its rows fall out of the match)."""
    import yaml
    from helpers import DEFAULT_SPEC

    import sdl_design.utility as utility
    from sdl_design.spec import parse_spec
    from sdl_design.stage import StageContext
    from sdl_design.stages.final import FinalStage
    from sdl_design.stages.swap import SwapStage
    from sdl_design.stages.swap.method import design_columns
    from sdl_design.synth import make_survey
    from sdl_design.utility import se_ratio_table

    data = yaml.safe_load(DEFAULT_SPEC.read_text())
    data["variables"]["other"] = {"keep": ["education"], "drop": ["county", "pregnant"]}
    data["stages"]["prb"]["variables"].remove("pregnant")
    data["stages"]["prb"]["cells"].remove("pregnant")
    spec = parse_spec(data)
    df = make_survey(3000, seed=2)
    calls = []
    real = utility.original_domain_se
    monkeypatch.setattr(
        utility, "original_domain_se", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    ctx = StageContext(df, spec)
    swap = SwapStage.from_spec(spec).run(df, ctx.for_stage("swap"))
    masked = swap.data.drop(columns=["pregnant"])
    out = FinalStage.from_spec(spec).run(masked, ctx.for_stage("final", [swap]))
    assert len(calls) == 1  # the swap's, reused by the final stage
    # alone: the final stage's own characteristics (pregnant left out) on both sides
    from sdl_design.survey.design import SurveyDesign

    exclude = ["person_id", "name", "household", "county", "pregnant"]
    doms = spec.variables.keys[:2]
    pub = design_columns(
        SurveyDesign.from_spec(masked, ctx.for_stage("final", [swap]).public_design())
    )
    alone = se_ratio_table(
        df,
        masked,
        design_columns(ctx.design),
        pub["replicate_weights"],
        broad_characteristics(df, design=design_columns(ctx.design), exclude=exclude, domains=doms),
        pub["method"],
        pub["rho"],
        chars_masked=broad_characteristics(masked, design=pub, exclude=exclude, domains=doms),
        masked_design=pub,
    )
    assert not alone["characteristic"].str.startswith("pregnant").any()
    pd.testing.assert_frame_equal(out.tables["se_ratios"], alone, check_exact=False, rtol=1e-12)


def test_domain_mean_se_equals_each_estimate_computed_alone():
    """Every row of domain_mean_se (read from one float block of the characteristics) equals
    the design's estimate of that variable alone: means of numeric and binary columns, shares of
    categories, domain means, and the mean of a variable with missing values over the records
    that have it (sum w y / sum w over them, in closed form; its SE from the ratio of the
    zero-filled variable to the observed indicator)."""
    from sdl_design.survey.design import SurveyDesign

    df = frame(n=600, seed=4)
    rng = np.random.default_rng(5)
    df["z"] = rng.integers(0, 2, len(df)).astype(bool)
    df["v"] = np.where(rng.uniform(size=len(df)) < 0.2, np.nan, rng.gamma(2.0, size=len(df)))
    design = {"weight": "w", "strata": "st", "psu": "psu"}
    chars = broad_characteristics(df, design=design, exclude=["parish"], domains=["gender"])
    for rw in (False, True):
        data, reps, method = df, [], None
        if rw:
            r = SurveyDesign(df, "w", strata="st", psu="psu").with_replicates("jkn")
            data, reps, method = pd.concat([df, r], axis=1), list(r.columns), "jkn"
        t = domain_mean_se(
            data, chars, "w", "st", "psu", replicate_weights=reps, method=method
        ).set_index(["variable", "domain"])
        ref = SurveyDesign(df, "w", strata="st", psu="psu")
        if rw:
            rd = SurveyDesign(data, "w", "st", "psu", replicate_weights=reps, method="jkn")
            for v in ("years", "y", "z"):
                m = rd.mean(v, variance="replicate").iloc[0]
                np.testing.assert_allclose(t.loc[(v, "all"), "se_rep"], m["se"], rtol=1e-12)
        for v in ("years", "y", "z"):
            m = ref.mean(v, variance="taylor").iloc[0]
            np.testing.assert_allclose(
                t.loc[(v, "all"), ["estimate", "se", "deff"]].to_numpy(float),
                m[["estimate", "se", "deff"]].to_numpy(float),
                rtol=1e-12,
            )
        g = df["gender"].to_numpy()
        for level in ("f", "m"):
            share = df["w"][g == level].sum() / df["w"].sum()
            np.testing.assert_allclose(t.loc[(f"gender={level}", "all"), "estimate"], share)
            dm = ref.mean("y", by="gender", variance="taylor").xs(level, level="gender")
            np.testing.assert_allclose(
                t.loc[("y", f"gender={level}"), ["estimate", "se"]].to_numpy(float),
                dm[["estimate", "se"]].iloc[0].to_numpy(float),
                rtol=1e-12,
            )
        seen = df["v"].notna().to_numpy()
        w, v = df["w"].to_numpy(), df["v"].to_numpy()
        np.testing.assert_allclose(
            t.loc[("v", "all"), "estimate"], (w[seen] * v[seen]).sum() / w[seen].sum()
        )
        both = df.assign(y0=np.where(seen, v, 0.0), nn=seen.astype(float))
        r = SurveyDesign(both, "w", strata="st", psu="psu").ratio("y0", "nn").iloc[0]
        np.testing.assert_allclose(t.loc[("v", "all"), "se"], r["se"])


def test_original_se_reads_the_declared_replicate_scale():
    """The original side of the SE-ratio gates uses the replicates' declared factors: with
    bootstrap replicates and a producer's scale (0.03, not the undeclared 1/R) and mse off,
    domain_mean_se of design_columns equals the design's own replicate SE of the mean."""
    from sdl_design.survey.design import SurveyDesign, design_columns
    from sdl_design.utility import original_domain_se

    rng = np.random.default_rng(5)
    n, R = 400, 20
    df = pd.DataFrame({"w": rng.uniform(1, 3, n), "y": rng.normal(size=n)})
    df["g"] = rng.choice(["a", "b"], n)
    for r in range(R):
        df[f"bs{r}"] = df["w"] * rng.poisson(1.0, n)
    reps = [f"bs{r}" for r in range(R)]
    design = SurveyDesign(
        df, "w", replicate_weights=reps, method="bootstrap", scale=0.03, mse=False
    )
    dc = design_columns(design)
    chars = broad_characteristics(df, design=dc, exclude=reps)
    got = original_domain_se(df, dc, chars).set_index(["domain", "variable"])
    want = design.mean("y", variance="replicate")["se"].iloc[0]
    row = got.xs("y", level="variable").iloc[0]
    assert np.isclose(row["se_rep"], want, rtol=1e-12)
    undeclared = SurveyDesign(df, "w", replicate_weights=reps, method="bootstrap")
    assert not np.isclose(want, undeclared.mean("y", variance="replicate")["se"].iloc[0])


def test_text_columns_with_many_values_are_left_out_from_their_first_records(monkeypatch):
    """A text column is a categorical characteristic exactly when it has 2..max_categories
    values, whether its first records already show more (counted first) or not."""
    import sdl_design.utility as ut

    rng = np.random.default_rng(4)
    n = 600
    df = frame(n).assign(
        pid=[f"id{i}" for i in range(n)],  # an identifier: every prefix shows too many
        late=np.where(np.arange(n) < 60, "a", rng.choice([f"c{i}" for i in range(40)], n)),
        few=rng.choice(["x", "y", "z"], n),
    )
    want = {c for c in ("gender", "parish", "pid", "late", "few") if 2 <= df[c].nunique() <= 30}
    for prefix in (50, 10**9):
        monkeypatch.setattr(ut, "PREFIX", prefix)
        chars = broad_characteristics(df, exclude=["w", "st", "psu"])
        got = {k.split("=")[0] for k, v in chars.kinds.items() if v == "proportion"}
        assert got == want == {"gender", "few"}


def test_partition_indicators_are_the_columns_compared_with_each_category():
    """The partitioned SEs' 0/1 indicators (each column factorized once) equal df[c] == v for
    text with missing values, mixed objects, integers, floats with -0.0 and NaN, booleans,
    and categories of another type or absent."""
    from sdl_design.engine.characteristics import _indicators

    rng = np.random.default_rng(1)
    n = 5000
    df = pd.DataFrame(
        {
            "s": pd.Series(rng.choice(["a", "b", None, "c"], n), dtype="str"),
            "o": pd.Series(rng.choice(["a", 1, 2.0, None], n), dtype=object),
            "i": rng.integers(0, 3, n),
            "f": rng.choice([0.0, -0.0, 1.5, np.nan], n),
            "b": rng.random(n) < 0.3,
        }
    )
    values = {"s": ["a", "c", "zz"], "o": ["a", 1, 2, "2"], "i": [0, 2.0, "1"], "f": [0.0, 1.5]}
    ind = [(f"{c}={v!r}", c, v) for c, vs in {**values, "b": [True, False]}.items() for v in vs]
    got = _indicators(df, ind)
    for name, c, v in ind:
        assert np.array_equal(got[name], (df[c] == v).to_numpy(dtype=float)), name
    assert got["o=2"].sum() > 0 and got["s='zz'"].sum() == 0
