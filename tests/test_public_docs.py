"""The public README and codebook: the Python variance recipe the README prints gives
SurveyDesign's SEs on the 3,000-person demo public file, and finite ones over the records with
a value when a variable has missing values; the scale factors in replicate_scales.csv are the
method's closed form; only treatments that changed the file are described, cited by author and
year; PRB transition probabilities agree with a brute-force sum over blocks of eq. 2.1's
matrix."""

from __future__ import annotations

import contextlib
import io
import re

import numpy as np
import pandas as pd
import pytest
import yaml

from flows.cli import default_spec_text
from flows.public_docs import CSV_FORMULA_NOTE, codebook, replicate_scales, variance_notes
from flows.public_files import public_frame, write_public_files
from sdl_design.spec import ReleaseSpec
from sdl_design.stage import design_columns, public_design
from sdl_design.stages import run_stages
from sdl_design.stages.prb.method import expected_transitions, post_randomize, transition_matrix
from sdl_design.survey.design import SurveyDesign
from sdl_design.synth import make_survey


def _release(disable: tuple[str, ...] = (), missing: int = 0):
    """The default spec's release of 3,000 persons (disable: stages off; missing: bmi, made
    the first study variable, without a value in every missing-th record)."""
    data = yaml.safe_load(default_spec_text())
    for name in disable:
        data["stages"][name]["enabled"] = False
    survey = make_survey(n_persons=3000)
    if missing:
        survey.loc[survey.index % missing == 0, "bmi"] = np.nan
        study = data["variables"]["study"]
        data["variables"]["study"] = ["bmi", *(c for c in study if c != "bmi")]
    spec = ReleaseSpec.model_validate(data)
    results = run_stages(spec, survey)
    df = results[-1].data
    masked = any(r.masks_design for r in results)
    built = design_columns(public_design(spec, results), list(df.columns))  # as the flow
    puf = public_frame(df, spec, masked, [c for r in results for c in r.drop_public], built)
    for r in results:
        r.data = None
    return spec, results, puf


@pytest.fixture(scope="module")
def demo():
    spec, results, puf = _release()
    return spec, results, puf, variance_notes(spec, results, puf)


def _block(text: str, lang: str) -> str:
    m = re.search(rf"```{lang}\n(.*?)```", text, re.S)
    assert m, f"no {lang} block"
    return m.group(1)


def _run_python_recipe(puf, readme, folder, monkeypatch) -> tuple[dict, str]:
    """The README's Python block run as-is in the public folder its release writes (the
    namespace it leaves, and what it printed)."""
    write_public_files(puf, folder, readme)
    monkeypatch.chdir(folder)
    ns: dict = {}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(_block(readme, "python"), ns)  # noqa: S102 - the README's own code
    return ns, out.getvalue()


def test_python_recipe_gives_survey_design_ses(demo, tmp_path, monkeypatch):
    spec, _, puf, readme = demo
    ns, _ = _run_python_recipe(puf, readme, tmp_path / "public", monkeypatch)
    des = SurveyDesign.from_spec(puf, spec.design.model_copy(update={"segment": None}))
    assert des.method == "jkn" and len(des.replicate_weights) == 70
    study = [c for c in spec.variables.study if c in puf.columns]
    rep = des.mean(study, variance="replicate")
    tay = des.mean(study, variance="taylor")
    for c in study:
        est, se = ns["mean_se"](puf[c])
        est_t, se_t = ns["mean_se_taylor"](puf[c])
        row_r, row_t = rep.loc[c], tay.loc[c]
        assert est == pytest.approx(row_r["estimate"], rel=1e-12)
        assert se == pytest.approx(row_r["se"], rel=1e-10), c
        assert est_t == pytest.approx(row_t["estimate"], rel=1e-12)
        assert se_t == pytest.approx(row_t["se"], rel=1e-10), c
    # a domain: the mean of bmi among women, replicate SE
    dom = (puf["sex"] == "female").to_numpy()
    est, se = ns["mean_se"](puf["bmi"], dom)
    w = puf[spec.design.weight].to_numpy() * dom
    assert est == pytest.approx(np.sum(w * puf["bmi"]) / w.sum(), rel=1e-12)
    byd = des.mean("bmi", by="sex", variance="replicate")
    assert se == pytest.approx(byd.loc[("bmi", "female"), "se"], rel=1e-10)


def _rep_vector(readme) -> np.ndarray:
    """The multipliers c_r the README's replicate_scales.csv holds, in replicate order."""
    return readme.replicate_scales["rscale"].to_numpy(dtype=float)


def test_jkn_scale_factors_are_the_closed_form(demo, tmp_path):
    spec, _, puf, readme = demo
    reps = spec.replicate_columns(puf)
    c = _rep_vector(readme)
    write_public_files(puf, tmp_path / "public", readme)
    csv = pd.read_csv(tmp_path / "public" / "replicate_scales.csv")
    assert list(csv.columns) == ["replicate", "rscale"] and list(csv["replicate"]) == reps
    assert np.array_equal(csv["rscale"].to_numpy(), c)  # written at full precision
    # independently: the PSU a replicate deletes has zero replicate weight; (n_h - 1)/n_h
    psu_id = puf["stratum"].astype(str) + "/" + puf["psu"].astype(str)
    n_h = puf.groupby("stratum")["psu"].nunique()
    expect = []
    for r in reps:
        tot = puf.groupby(psu_id)[r].sum()
        (gone,) = tot.index[tot == 0]
        h = int(gone.split("/")[0])
        expect.append((n_h[h] - 1) / n_h[h])
    assert np.array_equal(c, np.array(expect))
    # not all equal: Stata and SUDAAN list them, SAS and R read them from the file
    stata = re.search(r"multiplier\((.*?)\)\)", readme).group(1).split()
    assert np.array_equal(np.array(stata, dtype=float), c)
    sudaan = re.search(r"adjjack=(.*?);", readme).group(1).split()
    assert np.array_equal(np.array(sudaan, dtype=float), c)
    assert "jkcoefs=scales;" in readme and 'datafile="replicate_scales.csv"' in readme
    assert "rscales = scales$rscale" in readme


@pytest.mark.parametrize(
    "method, rho, closed",
    [
        ("brr", None, lambda R, rho: 1 / R),
        ("fay", 0.3, lambda R, rho: 1 / (R * (1 - rho) ** 2)),
        ("jk1", None, lambda R, rho: (R - 1) / R),
        ("sdr", None, lambda R, rho: 4 / R),
        ("bootstrap", None, lambda R, rho: 1 / R),
    ],
)
def test_constant_scale_factors_printed_as_closed_form(demo, method, rho, closed):
    spec, results, puf, _ = demo
    s = spec.model_copy(deep=True)
    s.design.replicate_weights.method = method
    s.design.replicate_weights.rho = rho
    unmasked = [r for r in results if not r.masks_design]  # the spec's method, not the swap's
    text = variance_notes(s, unmasked, puf)
    R = 70
    c = closed(R, rho)
    assert np.array_equal(_rep_vector(text), np.full(R, c))
    # all equal: one value for Stata, SAS and SUDAAN, said once in the formula
    assert f"multiplier({c!r}))" in text and f"jkcoefs={c!r};" in text
    assert f"adjjack={c!r};" in text and f"= {c!r} for every replicate" in text
    got = replicate_scales(puf, "wt", spec.replicate_columns(puf), method, rho, None, None)
    assert np.array_equal(got, np.full(R, c))


def test_readme_describes_what_ran(demo):
    spec, results, puf, readme = demo
    for section in (
        "### Post-randomization of the keys (PRB): Zhang and Nayak (2018)",
        "(MASSC): Singh (2009)",
        "### Masked design (segment swapping): Park et al. (2006)",
        "### Top- and bottom-coding: Cox (2000)",
    ):
        assert section in readme
    # cited by author and year, listed in full; no file number or stage name
    refs = readme[readme.index("## References") :]
    for who in ("Singh, A.C. (2009)", "Zhang, C. and Nayak, T.K. (2018)", "Park, I.", "Cox, L.H."):
        assert who in refs
    assert "paper 00" not in readme and "Shlomo" not in readme
    assert not any(f"{r.name} stage" in readme for r in results)
    assert CSV_FORMULA_NOTE in readme  # what the quoted cells of puf.csv are
    # the PRB diagonal printed for region is the transitions table's; sex never moved
    tr = next(r for r in results if r.name == "prb").tables["transitions"]
    p = tr[(tr["variable"] == "region") & (tr["original"] == "west") & (tr["published"] == "west")]
    assert f"west {p['p'].iloc[0]:.4f}" in readme and p["p"].iloc[0] < 1
    assert "`sex`: P is the identity (never moved)." in readme
    assert "- `sex`: female" not in readme
    # top-code: the codebook flag names the threshold and the records at the replacement value
    cb = codebook(puf, readme.codebook_notes).set_index("variable")
    th = next(r for r in results if r.name == "topcode").tables["thresholds"].set_index("column")
    thr, rep = th.loc["income", "threshold"], th.loc["income", "replacement"]
    n = int((puf["income"] >= thr).sum())
    assert n == int(np.isclose(puf["income"], rep).sum()) > 0
    assert f"top-coded at {thr:,.6g}: {n} records" in cb.loc["income", "topcoded"]
    assert cb.loc["diabetes", "topcoded"] == "" and cb.loc["diabetes", "treatment"] == "unchanged"
    # bmi's threshold coded no record: no treatment, one line in the method section
    assert cb.loc["bmi", "topcoded"] == "" and cb.loc["bmi", "treatment"] == "unchanged"
    assert "No record lay beyond the thresholds of `bmi` (top 60): unchanged." in readme
    assert ": 0 records" not in readme and "0.0% of records" not in readme
    assert cb.loc["rw_070", "label"] == (
        "replicate weight 70 of 70 (jkn; its multiplier c_r: replicate_scales.csv)"
    )
    assert cb.loc["sex", "values"] == "female; male"
    assert set(cb.index) == set(puf.columns)


def test_readme_without_prb_has_no_prb_section():
    spec, results, puf = _release(disable=("prb",))
    assert "prb" not in {r.name for r in results}
    readme = variance_notes(spec, results, puf)
    cb = codebook(puf, readme.codebook_notes)
    cells = " ".join(map(str, cb.to_numpy().ravel()))
    for word in ("PRB", "post-random", "transition", "Zhang"):
        assert word not in readme and word not in cells
    assert "(MASSC): Singh (2009)" in readme and "Top- and bottom-coding: Cox (2000)" in readme


def test_expected_transitions_match_a_brute_force_sum_over_blocks():
    rng = np.random.default_rng(7)
    n = 400
    df = pd.DataFrame(
        {
            "a": rng.choice(list("pqrst"), n, p=[0.5, 0.2, 0.15, 0.1, 0.05]),
            "b": rng.choice(["x", "y", "z"], n),
            "c": rng.choice(["u", "v", "w", "k"], n),
            "w": rng.uniform(1, 5, n),
        }
    )
    res = post_randomize(df, ["a", "b", "c"], 0.395, "w", seed=3)
    tr = expected_transitions(res, df["w"].to_numpy())
    rows = tr.groupby(["variable", "original"])["p"].sum()
    assert np.allclose(rows, 1.0, atol=1e-12)
    # brute force: per block, eq. 2.1's P (P[i, j] = P(Z = c_i | X = c_j)), record by record
    w = df["w"].to_numpy()
    blk = res.block.to_numpy(dtype="float64", na_value=np.nan)
    vals = res.cell_values
    for v in ("a", "b", "c"):
        flow: dict[tuple[str, str], float] = {}
        for k in range(n):
            a = str(vals[v].iloc[res.cell[k]])
            if np.isnan(blk[k]):
                flow[(a, a)] = flow.get((a, a), 0.0) + w[k]
                continue
            members = np.flatnonzero(blk == blk[k])
            cells, t = np.unique(res.cell[members], return_counts=True)
            P = transition_matrix(t, res.theta)
            j = int(np.flatnonzero(cells == res.cell[k])[0])
            for i, ci in enumerate(cells):
                b = str(vals[v].iloc[ci])
                flow[(a, b)] = flow.get((a, b), 0.0) + w[k] * P[i, j]
        tot = pd.Series(
            {a: w[[str(vals[v].iloc[c]) == a for c in res.cell]].sum() for a, _ in flow}
        )
        got = tr[tr["variable"] == v].set_index(["original", "published"])["p"]
        want = pd.Series({k: f / tot[k[0]] for k, f in flow.items() if f > 0})
        want.index.names = ["original", "published"]
        pd.testing.assert_series_equal(
            got.sort_index(), want.sort_index(), check_names=False, rtol=1e-12
        )


def test_missing_codes_read_defensively():
    from types import SimpleNamespace

    from flows.public_docs import _missing_codes

    spec = SimpleNamespace(variables=SimpleNamespace(missing_codes={"income": [-9, -8], "bmi": -1}))
    assert _missing_codes(spec) == {"income": "-9; -8", "bmi": "-1"}
    assert _missing_codes(SimpleNamespace(variables=SimpleNamespace())) == {}


def _r_survey() -> bool:
    import shutil
    import subprocess

    if shutil.which("Rscript") is None:
        return False
    r = subprocess.run(["Rscript", "-e", "library(survey)"], capture_output=True)
    return r.returncode == 0


def _run_r_recipes(puf, readme, folder) -> tuple[str, list[float]]:
    """The README's R blocks run by R survey in the public folder its release writes, the
    file read from puf.csv (R's arrow may be absent): (the example variable, the estimate and
    SE each svymean line gives)."""
    import subprocess

    write_public_files(puf, folder, readme)
    taylor, rep = re.findall(r"```r\n(.*?)```", readme, re.S)
    call = re.search(r"svymean\(~(\w+), des(, na.rm = TRUE)?\)", taylor)
    ex = call.group(1)
    show = f"r <- {call.group(0)}; cat(sprintf('%.17g\\n', c(coef(r), SE(r))))"
    code = (
        "suppressMessages(library(survey))\n"
        + taylor.replace("library(survey)\n", "").replace(
            'arrow::read_parquet("puf.parquet")', 'read.csv("puf.csv")'
        )
        + rep
    ).replace(call.group(0), show)
    (folder / "check.R").write_text(code)
    out = subprocess.run(
        ["Rscript", "check.R"], cwd=folder, capture_output=True, text=True, check=True
    ).stdout.split()
    return ex, [float(v) for v in out]


@pytest.mark.skipif(not _r_survey(), reason="Rscript with the survey package not installed")
def test_r_recipes_give_survey_design_ses(demo, tmp_path):
    """The README's R code (svydesign, and svrepdesign with the rscales of
    replicate_scales.csv), run by R survey on the CSV, gives SurveyDesign's Taylor and
    replicate SEs."""
    spec, _, puf, readme = demo
    ex, out = _run_r_recipes(puf, readme, tmp_path / "public")
    des = SurveyDesign.from_spec(puf, spec.design.model_copy(update={"segment": None}))
    assert out[1] == pytest.approx(des.mean(ex, variance="taylor")["se"].iloc[0], rel=1e-10)
    assert out[3] == pytest.approx(des.mean(ex, variance="replicate")["se"].iloc[0], rel=1e-10)


def test_pseudo_design_stage_described_instead_of_the_swap(demo):
    """A pseudo-design stage (params as sdl_design.pseudo records them: counts under
    pseudo_strata/pseudo_psus, the published names under public_design) replaces the swap's
    section; the recipes use its columns and method."""
    from sdl_design.stage import StageResult

    spec, results, puf, _ = demo
    reps = spec.replicate_columns(puf)
    fake = StageResult(
        "pseudo_design",
        None,
        params={
            "built": True,
            "pseudo_strata": 30,
            "pseudo_psus": 70,
            "public_design": {
                "weight": "wt",
                "strata": "stratum",
                "psu": "psu",
                "replicate_weights": reps,
                "replicate_method": "jkn",
            },
        },
        notes=["Pseudo design for the public file: 30 pseudo strata of 2 or 3 pseudo PSUs."],
        masks_design=True,
    )
    rest = [r for r in results if r.name not in ("swap", "pseudo_design")]
    rest.insert(next(i for i, r in enumerate(rest) if r.name == "final"), fake)  # release order
    text = variance_notes(spec, rest, puf)
    assert "### Pseudo-design for variance estimation" in text
    assert "30 pseudo strata of 2 or 3 pseudo PSUs" in text
    assert "Park et al." not in text and "swapped" not in text
    assert "strata = ~stratum" in text and "ids = ~psu" in text
    assert "pseudo-design label built for this file (not the survey's)" in text
    assert "replicate weights built for this file's pseudo-design" in text
    assert "pseudo_design" not in text
    # MASSC ran before the pseudo design: the published replicates are not its recalibrated ones
    assert "each recalibrated as the full-sample weight" not in text
    assert "built after this treatment, from the final weight" in text
    assert np.array_equal(_rep_vector(text), _rep_vector(demo[3]))


def test_readme_of_an_unweighted_file_says_so():
    """An unweighted original file (design: {weight: null}): the public README's variance
    section names its weight of ones and says what estimates then are; a weighted file's
    README does not."""
    from sdl_design.io import unit_weight

    data = yaml.safe_load(default_spec_text())
    for name in ("swap", "prb", "massc"):
        data["stages"][name]["enabled"] = False
    data["design"] = {"weight": None, "strata": "stratum", "psu": "psu"}
    spec = ReleaseSpec.model_validate(data)
    survey = make_survey(n_persons=3000)
    survey = unit_weight(
        survey.drop(columns=[c for c in survey if c == "wt" or c.startswith("rw_")]), spec
    )
    results = run_stages(spec, survey)
    masked = any(r.masks_design for r in results)
    puf = public_frame(results[-1].data, spec, masked, [c for r in results for c in r.drop_public])
    readme = str(variance_notes(spec, results, puf))
    assert "Every estimate must use the weight `unit_weight`." in readme
    assert "The original file carries no weights (an equal-probability sample)" in readme
    assert (puf["unit_weight"] == 1.0).all()
    weighted = _release(disable=("swap", "prb", "massc"))
    assert "carries no weights" not in str(variance_notes(*weighted))


# ---------------------------------------------------------------- missing values


@pytest.fixture(scope="module")
def with_missing():
    """A release whose first study variable, bmi, has no value in every 9th record (the
    swap, PRB and MASSC off: the pseudo design gives the file its strata, PSUs and replicate
    weights)."""
    spec, results, puf = _release(disable=("swap", "prb", "massc"), missing=9)
    return spec, results, puf, variance_notes(spec, results, puf)


def _domain_taylor(puf, y, w, strata, psu) -> tuple[float, float]:
    """The weighted mean over the records with a value of y and its Taylor SE as a domain
    (the others in the design with 0), written out: with-replacement PSUs within strata."""
    d = ~np.isnan(y)
    wd = np.where(d, w, 0.0)
    m = np.sum(wd * np.where(d, y, 0.0)) / wd.sum()
    z = pd.Series(wd * (np.where(d, y, 0.0) - m) / wd.sum())
    tot = z.groupby([puf[strata].to_numpy(), puf[psu].to_numpy()]).sum()
    v = 0.0
    for _, t in tot.groupby(level=0):
        n = len(t)
        v += n / (n - 1) * float(((t - t.mean()) ** 2).sum()) if n > 1 else 0.0
    return float(m), float(np.sqrt(v))


def test_python_recipe_with_missing_values_prints_finite_domain_estimates(
    with_missing, tmp_path, monkeypatch
):
    """The README's Python block, copied as-is into the public folder of a release whose
    example variable has missing values, prints finite numbers: the mean over the records with
    a value and its replicate and Taylor SEs, those of SurveyDesign on the records with a
    value and of the domain estimator written out."""
    spec, results, puf, readme = with_missing
    y = puf["bmi"].to_numpy(dtype=float)
    assert np.isnan(y).sum() > 0
    ns, printed = _run_python_recipe(puf, readme, tmp_path / "public", monkeypatch)
    lines = [ln for ln in printed.splitlines() if ln.startswith("(")]
    (est, se), (est_t, se_t) = (tuple(map(float, ln.strip("()").split(", "))) for ln in lines)
    assert all(np.isfinite([est, se, est_t, se_t])) and se > 0 and se_t > 0
    # independently: the public file's records with a value, in the published design
    pd_ = next(r for r in results if r.masks_design).params["public_design"]
    w, strata, psu, reps = pd_["weight"], pd_["strata"], pd_["psu"], pd_["replicate_weights"]
    obs = puf[~np.isnan(y)]
    assert obs.groupby([strata, psu]).ngroups == puf.groupby([strata, psu]).ngroups
    des = SurveyDesign(obs, w, strata, psu, replicate_weights=reps, method="jkn")
    rep, tay = des.mean("bmi", variance="replicate"), des.mean("bmi", variance="taylor")
    assert est == pytest.approx(rep["estimate"].iloc[0], rel=1e-12)
    assert se == pytest.approx(rep["se"].iloc[0], rel=1e-10)
    assert est_t == pytest.approx(tay["estimate"].iloc[0], rel=1e-12)
    assert se_t == pytest.approx(tay["se"].iloc[0], rel=1e-10)
    m, s = _domain_taylor(puf, y, puf[w].to_numpy(dtype=float), strata, psu)
    assert (est_t, se_t) == (pytest.approx(m, rel=1e-12), pytest.approx(s, rel=1e-10))
    # a domain within the records with a value: women
    women = (puf["sex"] == "female").to_numpy()
    est_d, se_d = ns["mean_se"](puf["bmi"], women)
    byd = des.mean("bmi", by="sex", variance="replicate").loc[("bmi", "female")]
    assert est_d == pytest.approx(byd["estimate"], rel=1e-12)
    assert se_d == pytest.approx(byd["se"], rel=1e-10)


def test_readme_says_how_many_values_are_missing_and_every_recipe_leaves_them_out(
    with_missing, demo
):
    spec, _, puf, readme = with_missing
    n = int(puf["bmi"].isna().sum())
    assert f"`bmi` {n:,} ({100 * n / len(puf):.1f}%)" in readme
    assert readme.count("svymean(~bmi, des, na.rm = TRUE)") == 2  # Taylor and replicate R
    assert "svymean(~bmi, des)" not in readme
    assert "proc surveymeans data=puf nomcar;" in readme  # SAS's domain Taylor variance
    assert "svy, subpop(if !missing(bmi)): mean bmi" in readme  # Stata's
    cb = codebook(puf, readme.codebook_notes).set_index("variable")
    assert cb.loc["bmi", "n_missing"] == n
    # without missing values: the README says there are none, the recipes have no na.rm
    demo_readme = demo[3]
    assert "No published variable has a missing value." in demo_readme
    assert "na.rm = TRUE)\n" not in demo_readme and "nomcar" not in demo_readme


@pytest.mark.skipif(not _r_survey(), reason="Rscript with the survey package not installed")
def test_r_recipes_with_missing_values_give_the_python_recipes_numbers(
    with_missing, tmp_path, monkeypatch
):
    """R survey's svymean(..., na.rm = TRUE) on the published CSV with the README's R code
    gives the estimate and the Taylor and replicate SEs the README's Python code prints."""
    spec, _, puf, readme = with_missing
    ex, out = _run_r_recipes(puf, readme, tmp_path / "r")
    ns, _ = _run_python_recipe(puf, readme, tmp_path / "py", monkeypatch)
    est_t, se_t = ns["mean_se_taylor"](puf[ex])
    est, se = ns["mean_se"](puf[ex])
    assert out[0] == pytest.approx(est_t, rel=1e-12) and out[1] == pytest.approx(se_t, rel=1e-10)
    assert out[2] == pytest.approx(est, rel=1e-12) and out[3] == pytest.approx(se, rel=1e-10)


# ---------------------------------------------------------------- what changed nothing


def _unchanged(results):
    """The demo's results with PRB, MASSC and top-coding made to have changed nothing (their
    tables and metrics as a release that changed nothing records them)."""
    import copy

    out = []
    for r in results:
        r = copy.copy(r)
        r.metrics, r.params = dict(r.metrics), dict(r.params)
        r.tables = dict(r.tables)
        if r.name == "prb":
            r.metrics.update(n_changed=0.0, share_changed=0.0, n_blocks=0.0)
            ch = r.tables["changed_by_variable"].copy()
            ch[["n_changed", "share_changed"]] = 0
            r.tables["changed_by_variable"] = ch
            tr = r.tables["transitions"]
            r.tables["transitions"] = tr[tr["original"] == tr["published"]].assign(p=1.0)
        elif r.name == "massc":
            r.metrics.update(
                n_substituted=0.0, n_subsampled_out=0.0, share_substituted=0.0,
                calibration_factor_min=1.0, calibration_factor_max=1.0,
            )  # fmt: skip
            r.params["phi"] = dict.fromkeys(r.params["phi"], 1.0)
            rc = r.tables.get("replicate_calibration")
            if rc is not None:
                r.tables["replicate_calibration"] = rc.assign(g_min=1.0, g_max=1.0)
        elif r.name == "topcode":
            r.tables["thresholds"] = r.tables["thresholds"].assign(n_coded=0)
        out.append(r)
    return out


def test_stages_that_changed_nothing_get_one_line_and_no_treatment(demo):
    """A stage that ran but changed nothing (no record post-randomized, calibration factors
    1 to 1, no value top-coded) is not described as if it had acted: one line each, and the
    treatments table and codebook say `unchanged`."""
    spec, results, puf, _ = demo
    text = variance_notes(spec, _unchanged(results), puf)
    quiet = text[text.index("Also run, without changing this file:") :]
    quiet = quiet[: quiet.index("## Estimating variances")]
    assert (
        "Post-randomization of the keys (PRB) of Zhang and Nayak (2018) changed no record" in quiet
    )
    assert "(MASSC) of Singh (2009) changed nothing" in quiet
    assert "Top- and bottom-coding as in Cox (2000) changed no value" in quiet
    for gone in ("### Post-randomization", "(MASSC):", "### Top-", "factors 1.000 to 1.000",
                 "0.0% of records", "eligible for", "recalibrated", "transition"):  # fmt: skip
        assert gone not in text, gone
    cb = codebook(puf, text.codebook_notes).set_index("variable")
    for c in ("age", "race", "wt", "income"):
        assert cb.loc[c, "treatment"] == "unchanged", c
    assert (cb["topcoded"] == "").all()
    # the swap did change the file: described in full, cited
    assert "### Masked design (segment swapping): Park et al. (2006)" in text
    refs = text[text.index("## References") :]
    assert all(a in refs for a in ("Singh", "Zhang", "Park", "Cox"))


def test_not_published_columns_are_grouped_by_reason():
    from flows.public_docs import dropped_lines

    why = "original replicate weight, replaced by those of the public design"
    dropped = {f"derived_jkn_{i:02d}": why for i in range(1, 32)}
    dropped |= {"name": "direct identifier", "person_id": "direct identifier", "county": "drop"}
    assert dropped_lines(dropped) == [
        f"- `derived_jkn_01` .. `derived_jkn_31` (31 columns): {why}",
        "- `name`, `person_id`: direct identifier",
        "- `county`: drop",
    ]


def test_columns_not_published_are_grouped_by_reason_in_readme_and_report():
    from flows.public_docs import dropped_groups, dropped_lines

    dropped = {f"rw{i:02d}": "replaced" for i in range(1, 32)} | {"id": "identifier"}
    assert dropped_groups(dropped) == [
        ([f"rw{i:02d}" for i in range(1, 32)], "replaced"),
        (["id"], "identifier"),
    ]
    assert dropped_lines(dropped) == [
        "- `rw01` .. `rw31` (31 columns): replaced",
        "- `id`: identifier",
    ]
