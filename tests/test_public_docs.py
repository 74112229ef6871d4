"""The public README and codebook: the Python variance recipe the README prints gives
SurveyDesign's SEs on the 3,000-person demo public file; the scale factors it prints are the
method's closed form; only treatments that ran are described; PRB transition probabilities
agree with a brute-force sum over blocks of eq. 2.1's matrix."""

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
from flows.public_files import public_frame
from sdl_design.prb import expected_transitions, post_randomize, transition_matrix
from sdl_design.spec import ReleaseSpec
from sdl_design.stages import run_stages
from sdl_design.survey.design import SurveyDesign
from sdl_design.synth import make_survey


def _release(disable: tuple[str, ...] = ()):
    data = yaml.safe_load(default_spec_text())
    for name in disable:
        data["stages"][name]["enabled"] = False
    spec = ReleaseSpec.model_validate(data)
    results = run_stages(spec, make_survey(n_persons=3000))
    df = results[-1].data
    masked = any(r.masks_design for r in results)
    puf = public_frame(df, spec, masked, [c for r in results for c in r.drop_public])
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


def test_python_recipe_gives_survey_design_ses(demo, tmp_path, monkeypatch):
    spec, _, puf, readme = demo
    puf.to_parquet(tmp_path / "puf.parquet", index=False)
    monkeypatch.chdir(tmp_path)
    ns: dict = {}
    with contextlib.redirect_stdout(io.StringIO()):
        exec(_block(readme, "python"), ns)  # noqa: S102 - the README's own code
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


def _rep_vector(readme: str) -> np.ndarray:
    line = next(ln for ln in readme.splitlines() if ln.startswith("rscales <- "))
    m = re.fullmatch(r"rscales <- rep\(c\((.*)\), c\((.*)\)\)", line)
    vals = [float(v) for v in m.group(1).split(",")]
    runs = [int(v) for v in m.group(2).split(",")]
    return np.repeat(vals, runs)


def test_jkn_scale_factors_are_the_closed_form(demo):
    spec, _, puf, readme = demo
    reps = spec.replicate_columns(puf)
    c = _rep_vector(readme)
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
    # the same vector in the Python, SAS and Stata recipes
    sas = re.search(r"jkcoefs=\((.*?)\);", readme).group(1).split()
    assert np.array_equal(np.array(sas, dtype=float), c)
    stata = re.search(r"multiplier\((.*?)\)\)", readme).group(1).split()
    assert np.array_equal(np.array(stata, dtype=float), c)


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
    assert f"C = np.full({R}, {c!r})" in text
    assert f"rscales <- {c!r}" in text
    got = replicate_scales(puf, "wt", spec.replicate_columns(puf), method, rho, None, None)
    assert np.array_equal(got, np.full(R, c))


def test_readme_describes_what_ran(demo):
    spec, results, puf, readme = demo
    for section in ("PRB, paper 002", "MASSC, paper 000", "paper 003", "paper 004"):
        assert section in readme
    assert CSV_FORMULA_NOTE in readme  # what the quoted cells of puf.csv are
    # the PRB diagonal printed for sex is the transitions table's
    tr = next(r for r in results if r.name == "prb").tables["transitions"]
    p = tr[(tr["variable"] == "sex") & (tr["original"] == "female") & (tr["published"] == "female")]
    assert f"female {p['p'].iloc[0]:.4f}" in readme
    # top-code: the codebook flag names the threshold and the records at the replacement value
    cb = codebook(puf, readme.codebook_notes).set_index("variable")
    th = next(r for r in results if r.name == "topcode").tables["thresholds"].set_index("column")
    thr, rep = th.loc["income", "threshold"], th.loc["income", "replacement"]
    n = int((puf["income"] >= thr).sum())
    assert n == int(np.isclose(puf["income"], rep).sum()) > 0
    assert f"top-coded at {thr:,.6g}: {n} records" in cb.loc["income", "topcoded"]
    assert cb.loc["diabetes", "topcoded"] == "" and cb.loc["diabetes", "treatment"] == "unchanged"
    assert cb.loc["rw_070", "label"] == "replicate weight 70 of 70 (jkn)"
    assert cb.loc["sex", "values"] == "female; male"
    assert set(cb.index) == set(puf.columns)


def test_readme_without_prb_has_no_prb_section():
    spec, results, puf = _release(disable=("prb",))
    assert "prb" not in {r.name for r in results}
    readme = variance_notes(spec, results, puf)
    cb = codebook(puf, readme.codebook_notes)
    cells = " ".join(map(str, cb.to_numpy().ravel()))
    for word in ("PRB", "post-random", "transition"):
        assert word not in readme and word not in cells
    assert "MASSC, paper 000" in readme and "paper 004" in readme


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


@pytest.mark.skipif(not _r_survey(), reason="Rscript with the survey package not installed")
def test_r_recipes_give_survey_design_ses(demo, tmp_path):
    """The README's R code (svydesign and svrepdesign with its rscales), run by R survey on the
    CSV, gives SurveyDesign's Taylor and replicate SEs."""
    import subprocess

    spec, _, puf, readme = demo
    puf.to_csv(tmp_path / "puf.csv", index=False)
    taylor, rep = re.findall(r"```r\n(.*?)```", readme, re.S)
    ex = re.search(r"svymean\(~(\w+), des\)", taylor).group(1)
    show = f"cat(sprintf('%.17g\\n', SE(svymean(~{ex}, des))))"
    code = (
        "suppressMessages(library(survey))\n"
        + taylor.replace("library(survey)\n", "").replace(
            'arrow::read_parquet("puf.parquet")', 'read.csv("puf.csv")'
        )
        + rep
    ).replace(f"svymean(~{ex}, des)", show)
    (tmp_path / "check.R").write_text(code)
    out = subprocess.run(
        ["Rscript", "check.R"], cwd=tmp_path, capture_output=True, text=True, check=True
    ).stdout.split()
    des = SurveyDesign.from_spec(puf, spec.design.model_copy(update={"segment": None}))
    assert float(out[0]) == pytest.approx(des.mean(ex, variance="taylor")["se"].iloc[0], rel=1e-10)
    assert float(out[1]) == pytest.approx(
        des.mean(ex, variance="replicate")["se"].iloc[0], rel=1e-10
    )


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
    rest = [fake, *(r for r in results if r.name not in ("swap", "pseudo_design"))]
    text = variance_notes(spec, rest, puf)
    assert "### Pseudo-design for variance estimation" in text
    assert "30 pseudo strata of 2 or 3 pseudo PSUs" in text
    assert "paper 003" not in text and "swapped" not in text
    assert "strata = ~stratum" in text and "ids = ~psu" in text
    assert "built by the pseudo_design stage" in text
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
