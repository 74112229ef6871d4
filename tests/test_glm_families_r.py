"""glm.py's poisson and quasibinomial families and interactions (a:b, a*b) against R survey
4.1.1 svyglm, and the warnings of fits that separate.

References: tests/fixtures/make_svyglm_families.R (R 4.2.2, survey 4.1.1) - coefficients and
Taylor, JKn and bootstrap SEs (R's bootstrap replicates written as PSU multipliers) of 11
models on svyglm_data.csv (svyglm_families_fixture.csv), and which fits R's glm.fit warned
about on a small constructed file with quasi-separated replicates and on one model of
svyglm_data.csv (svyglm_separation_fixture.csv); brute force (a linear program per fit) for
which fits separate."""

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from scipy.optimize import linprog

from sdl_design.spec import ModelSpec
from sdl_design.stages.assess.method import model_fits, model_rows
from sdl_design.survey.design import SurveyDesign
from sdl_design.survey.glm import (
    LOG_MIN_ETA,
    LOGIT_MAX_ETA,
    GLMFit,
    combine_cells,
    design_matrix,
    fit_cells,
    glm_cells,
    parse_formula,
    svyglm,
    term_levels,
)

FIXTURES = Path(__file__).with_name("fixtures")


def _r_names(names: list[str]) -> list[str]:
    """Ours (Intercept, age[T.35-65], sex[female]:age) as R names them."""
    out = [n.replace("[T.", "").replace("[", "").replace("]", "") for n in names]
    return ["(Intercept)", *out[1:]]


def _boot(df: pd.DataFrame, mult: pd.DataFrame, by: list[str]) -> pd.DataFrame:
    """R's bootstrap replicate weights: the PSU's multiplier times the record's weight."""
    cols = [c for c in mult.columns if c.startswith("b")]
    m = df[by].merge(mult, on=by, how="left")[cols].to_numpy()
    return pd.DataFrame(m * df["wt"].to_numpy()[:, None], columns=cols, index=df.index)


@pytest.fixture(scope="module")
def families() -> tuple[pd.DataFrame, dict[str, SurveyDesign]]:
    data = pd.concat(
        [
            pd.read_csv(FIXTURES / "svyglm_data.csv"),
            pd.read_csv(FIXTURES / "svyglm_families_data.csv"),
        ],
        axis=1,
    )
    mult = pd.read_csv(FIXTURES / "svyglm_families_boot.csv")
    jkn = SurveyDesign(data, "wt", "stratum", "psu").with_replicates("jkn", prefix="jkn_")
    boot = _boot(data, mult.drop(columns="scale"), ["stratum", "psu"])
    df = pd.concat([data, jkn, boot], axis=1)
    designs = {
        "jkn": SurveyDesign(
            df, "wt", "stratum", "psu", replicate_weights=list(jkn.columns), method="jkn"
        ),
        "bootstrap": SurveyDesign(
            df,
            "wt",
            "stratum",
            "psu",
            replicate_weights=list(boot.columns),
            method="bootstrap",
            rscales=np.full(boot.shape[1], mult["scale"].iloc[0]),  # R's scale x rscales
        ),
    }
    return df, designs


def test_families_and_interactions_equal_r_svyglm(families):
    """Coefficients to 1e-10 and Taylor, JKn and bootstrap SEs to 1e-8 (relative) of poisson
    (integer and non-integer counts), quasibinomial (and binomial: the same numbers) and
    gaussian models with interactions categorical x categorical, categorical x numeric and
    numeric x numeric, with R's coding (treatment contrasts, or an indicator of every level
    where the term's margin is absent), R's order and names of the columns, and R's NA for an
    aliased one (R's replicate fit stops there: no replicate SEs to compare)."""
    df, designs = families
    ref = pd.read_csv(FIXTURES / "svyglm_families_fixture.csv")
    assert ref["model"].nunique() == 10 and len(ref) == 88
    worst = {"coef": 0.0, "se_taylor": 0.0, "se_jkn": 0.0, "se_bootstrap": 0.0}
    for (text, family), r in ref.groupby(["model", "family"], sort=False):
        f = parse_formula(text)
        X, y, ok, names = design_matrix(df, f, term_levels(f, [df]))
        assert _r_names(names) == r["term"].tolist(), text
        jkn = svyglm(X, y, ok, names, designs["jkn"], family, label=text)
        boot = svyglm(X, y, ok, names, designs["bootstrap"], family)
        assert jkn.n_used == r["n_used"].iloc[0]
        assert jkn.warnings == [] and jkn.status == "converged", jkn.warnings
        assert (jkn.replicate_status == "converged").all()
        np.testing.assert_array_equal(np.isnan(jkn.coef), r["coef"].isna(), err_msg=text)
        for ours, col, rtol in (
            (jkn.coef, "coef", 1e-10),
            (boot.coef, "coef", 1e-10),
            (jkn.se_taylor, "se_taylor", 1e-8),
            (jkn.se_replicate, "se_jkn", 1e-8),
            (boot.se_replicate, "se_bootstrap", 1e-8),
        ):
            want = r[col].to_numpy()
            have = np.isfinite(want)
            np.testing.assert_allclose(
                ours[have], want[have], rtol=rtol, atol=0, err_msg=f"{text} {col}"
            )
            d = np.abs(ours[have] - want[have])
            worst[col] = max(worst[col], float(d.max(initial=0.0)))
            worst[f"{col} (relative)"] = max(
                worst.get(f"{col} (relative)", 0.0),
                float((d / np.abs(want[have])).max(initial=0.0)),
            )
    print("largest differences from R:", worst)


# ------------------------------------------------------------------ separation


@pytest.fixture(scope="module")
def separation() -> tuple[pd.DataFrame, dict[str, SurveyDesign]]:
    """The constructed file (level c of grp has y = 1 exactly when x > 0 but for one record
    in PSU 7; level b has y = 0 and k = 0 but for one record in PSU 12; y2 none) with its
    JK1 and R's bootstrap replicates."""
    data = pd.read_csv(FIXTURES / "svyglm_separation_data.csv")
    jk1 = SurveyDesign(data, "wt", None, "psu").with_replicates("jk1", prefix="jk1_")
    boot = _boot(data, pd.read_csv(FIXTURES / "svyglm_separation_boot.csv"), ["psu"])
    df = pd.concat([data, jk1, boot], axis=1)
    designs = {
        "jk1": SurveyDesign(df, "wt", None, "psu", replicate_weights=list(jk1.columns), method="jk1"),
        "bootstrap": SurveyDesign(
            df, "wt", None, "psu", replicate_weights=list(boot.columns), method="bootstrap",
            bootstrap="rao-wu",
        ),
    }  # fmt: skip
    return df, designs


def separates(X: np.ndarray, y: np.ndarray, family: str) -> bool:
    """Brute force (a linear program): whether the rows (x, y) separate, so that the maximum
    likelihood estimate does not exist - some direction b with x'b >= 0 where y = 1, <= 0
    where y = 0, = 0 where 0 < y < 1 (poisson: <= 0 where y = 0, = 0 where y > 0) that is
    not 0 on every row."""
    if family == "poisson":
        le, eq, s = X[y == 0], X[y > 0], -(X[y == 0].sum(axis=0))
    else:
        le = np.vstack([-X[y == 1], X[y == 0]])
        eq, s = X[(y > 0) & (y < 1)], X[y == 1].sum(axis=0) - X[y == 0].sum(axis=0)
    res = linprog(
        -s, A_ub=le, b_ub=np.zeros(len(le)), A_eq=eq if len(eq) else None,
        b_eq=np.zeros(len(eq)) if len(eq) else None, bounds=(-1, 1), method="highs",
    )  # fmt: skip
    return bool(res.status == 0 and -res.fun > 1e-7)


def _brute_force(X, y, ok, des: SurveyDesign, family: str) -> tuple[bool, np.ndarray]:
    """separates() on the full sample's and each replicate's records of positive weight."""
    W = des.df[des.replicate_weights].to_numpy()
    full = separates(X[ok], y[ok], family)
    reps = [
        separates(X[ok & (W[:, r] > 0)], y[ok & (W[:, r] > 0)], family) for r in range(W.shape[1])
    ]
    return full, np.array(reps)


def test_separation_flags_brute_force_and_r(separation, families):
    """Every fit (full sample, each replicate) of 3 logit and 1 poisson models on the
    constructed file (JK1, R's bootstrap) and of a logit model with a cell of 1 hypertensive
    record on svyglm_data.csv (JKn, R's bootstrap) is flagged (status not converged, said in
    the warnings) exactly when it separates (a linear program, brute force); and exactly when
    R's glm.fit warned (binomial(), epsilon 1e-14) but for two kinds, checked: R's IRLS
    (Fisher scoring, no step halving) running off to coefficients ~1e15 from its warm start
    on a replicate that does not separate (R warns; ours converges inside |eta| < 30), and
    poisson fits that diverge but stop at R's deviance criterion before a rate is below 10 eps
    (eta in (-33.7, -25): R's check does not fire; ours flags the divergence)."""
    ref = pd.read_csv(FIXTURES / "svyglm_separation_fixture.csv", keep_default_na=False)
    files = {"jk1": separation, "jkn": families}
    counts = {}
    for (model, family), r in ref.groupby(["model", "family"], sort=False):
        df, designs = files["jk1" if "jk1" in set(r["design"]) else "jkn"]
        f = parse_formula(model)
        X, y, ok, names = design_matrix(df, f, term_levels(f, [df]))
        full_r = bool(r[r["design"] == "full"]["warned"].iloc[0])
        for dname, des in designs.items():
            fit = svyglm(X, y, ok, names, des, family, label=model)
            full, reps = _brute_force(X, y, ok, des, family)
            flags = fit.replicate_status != "converged"
            assert (fit.status != "converged") == full == full_r, (model, dname)
            np.testing.assert_array_equal(flags, reps, err_msg=f"{model} {dname}")
            rr = r[r["design"] == dname].sort_values("replicate")
            warned = rr["warned"].to_numpy(dtype=bool)
            assert len(warned) == len(flags)
            only_r, only_ours = warned & ~flags, flags & ~warned
            assert (rr["coef_max_abs"].to_numpy()[only_r] > 1e10).all()  # R's IRLS overflow
            eta = X[ok] @ np.nan_to_num(fit.replicate_coef[only_r].T)
            assert (np.abs(eta).max(axis=0) < LOGIT_MAX_ETA).all()
            if family == "poisson":  # R's diverging fits that stopped short of its bound
                e = rr["eta_min"].to_numpy()[only_ours]
                assert ((e > LOG_MIN_ETA) & (e < -25)).all()
            else:
                assert not only_ours.any(), (model, dname, np.flatnonzero(only_ours) + 1)
            # the warnings name the model, the replicates and what happened
            assert bool(fit.warnings) == bool(full or flags.any())
            if flags.any():
                said = " ".join(fit.warnings)
                first = np.flatnonzero(flags)[0] + 1
                assert said.startswith(f"{model}: ") and f"replicates {first}" in said
                assert "the coefficients diverge (separation" in said
            counts[model, dname] = (int(flags.sum()), int(only_r.sum()), int(only_ours.sum()))
    print("flagged, R only, ours only:", counts)
    assert counts["y ~ grp * x", "bootstrap"] == (20, 1, 0)  # R's overflow: replicate 4
    assert counts["k ~ grp + x", "jk1"] == (1, 0, 1)
    assert counts["k ~ grp + x", "bootstrap"] == (12, 0, 11)
    assert counts["hypertension ~ C(agegrp) * sex + bmi", "jkn"] == (1, 0, 0)  # replicate 19
    assert counts["hypertension ~ C(agegrp) * sex + bmi", "bootstrap"] == (9, 0, 0)
    assert sum(c[1] + c[2] for c in counts.values()) == 13


def test_quasibinomial_is_binomial_and_separation_in_the_full_sample(separation):
    """quasibinomial: binomial's coefficients, SEs and flags; a separated full sample says so
    (status, converged False, a warning naming the diverging coefficient)."""
    df, designs = separation
    for model in ("y ~ grp * x", "y2 ~ grp + x"):
        f = parse_formula(model)
        X, y, ok, names = design_matrix(df, f, term_levels(f, [df]))
        a = svyglm(X, y, ok, names, designs["jk1"], "binomial")
        b = svyglm(X, y, ok, names, designs["jk1"], "quasibinomial")
        np.testing.assert_array_equal(a.coef, b.coef)
        np.testing.assert_array_equal(a.se_taylor, b.se_taylor)
        np.testing.assert_array_equal(a.replicate_status, b.replicate_status)
        assert a.warnings == b.warnings
    assert a.status == "separated" and not a.converged
    assert a.warnings[0].startswith("full sample: the coefficients diverge (separation: fitted ")
    assert "(largest coefficient grp[T.b])" in a.warnings[0]


def test_assessment_carries_the_warnings(separation):
    """assess.model_fits and model_rows with the new families: the model table's warnings
    column says which file's fits diverged (NaN when none did); the spec accepts them."""
    df, designs = separation
    des = designs["jk1"]
    for family in ("poisson", "quasibinomial", "binomial", "gaussian"):
        assert ModelSpec(formula="y ~ grp * x", family=family).family == family
    fo, fr = model_fits([df, df], [des, des], "k ~ C(grp) + x", "poisson", {})
    rows = model_rows("k ~ C(grp) + x", "poisson", fo, fr, "replicate", 0.95)
    assert rows["warnings"].nunique() == 1
    text = rows["warnings"].iloc[0]
    assert text.startswith("original: replicates 12 (1 of 20): the coefficients diverge")
    assert "; released: replicates 12 (1 of 20)" in text
    fo, fr = model_fits([df, df], [des, des], "y ~ C(grp) * x", "quasibinomial", {})
    assert fo.replicate_status[[6, 11]].tolist() == ["separated"] * 2
    fit = model_fits([df], [des], "x ~ grp + y", "gaussian", {})[0]
    assert isinstance(fit, GLMFit) and fit.warnings == []
    rows = model_rows("x ~ grp + y", "gaussian", fit, fit, "taylor", 0.95)
    assert rows["warnings"].isna().all()


def test_partitioned_cells_fit_as_the_whole_file(families):
    """The partitioned assessment's path (glm_cells of each partition with its replicate
    weights, combine_cells, fit_cells) gives svyglm's fit on the whole file: coefficients,
    Taylor and replicate SEs, statuses and warnings (a poisson model with interactions, and
    the logit model whose JKn replicate 19 separates)."""
    df, designs = families
    des = designs["jkn"]
    W = df[des.replicate_weights].to_numpy()
    cuts = [0, 150, 151, 320, len(df)]  # 4 partitions in record order
    for text, family in (
        ("cost ~ C(agegrp) * sex + age:income", "poisson"),
        ("hypertension ~ C(agegrp) * sex + bmi", "quasibinomial"),
    ):
        f = parse_formula(text)
        X, y, ok, names = design_matrix(df, f, term_levels(f, [df]))
        whole = svyglm(X, y, ok, names, des, family)
        parts = [
            glm_cells(X[a:b], y[a:b], ok[a:b], des.w[a:b], des.g[a:b], W=W[a:b])
            for a, b in zip(cuts[:-1], cuts[1:], strict=True)
        ]
        fit = fit_cells(combine_cells(parts), names, des, family)
        for k in ("coef", "se_taylor", "se_replicate"):
            np.testing.assert_allclose(getattr(fit, k), getattr(whole, k), rtol=1e-12, err_msg=k)
        assert fit.status == whole.status == "converged"
        assert fit.replicate_status.tolist() == whole.replicate_status.tolist()
        assert fit.warnings == whole.warnings
    assert whole.warnings[0].startswith("replicates 19 (1 of 25): the coefficients diverge")


def test_boundary_fit_converges_and_is_said():
    """A fit whose estimate exists but puts a fitted probability within 10 eps of 1 (|eta| >
    30 at x = 40; the records overlap around x = 0, so nothing separates) converges, with R's
    warning and no 'not meaningful'; its coefficients are irls' (the single fit's)."""
    from sdl_design.survey.glm import irls

    rng = np.random.default_rng(5)
    x = np.r_[rng.normal(0, 2, 200), 40.0]
    y = (rng.random(201) < 1 / (1 + np.exp(-x))).astype(float)
    df = pd.DataFrame({"y": y, "x": x, "psu": np.arange(201) % 20, "wt": 1.0 + (x > 0)})
    des = SurveyDesign(df, "wt", None, "psu")
    f = parse_formula("y ~ x")
    X, yy, ok, names = design_matrix(df, f, term_levels(f, [df]))
    fit = svyglm(X, yy, ok, names, des, "binomial")
    assert fit.status == "boundary" and fit.converged
    assert fit.warnings == [
        "full sample: fitted probabilities numerically 0 or 1 (largest coefficient x)"
    ]
    assert not separates(X, yy, "binomial") and (X @ fit.coef).max() > LOGIT_MAX_ETA
    beta = irls(X, yy, df["wt"].to_numpy() / df["wt"].mean(), "binomial")[0]
    np.testing.assert_allclose(fit.coef, beta, rtol=1e-9)
