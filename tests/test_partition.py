"""The partitioned path (sdl_design.engine.partitions, `puf scan`): the input read by row groups gives
the whole file's numbers: key-profile counts and risk strata exactly as the risk stage's, edit
failures as validate_edits', and domain means with Taylor SE, deff and replicate SE equal to
SurveyDesign's on the whole file (1e-12)."""

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from helpers import flat

from flows.cli import main as puf
from flows.cli import write_demo_spec
from sdl_design.edits import rule_failures
from sdl_design.engine import partitions as P
from sdl_design.io import read_input
from sdl_design.risk import cell_sizes, profile_codes, risk_profile, risk_strata
from sdl_design.spec import load_spec
from sdl_design.stages.massc import calibration_passes as pcal
from sdl_design.stages.massc import passes as pms
from sdl_design.stages.prb import passes as pprb
from sdl_design.survey.design import SurveyDesign

N = 3000
GROUP = 450  # records per row group: 7 row groups, PSUs cut at their edges
CHAIN = 4  # partitions of the MASSC chain the thread and Dask runs compare


def _cut_at_row_groups(monkeypatch):
    """Partitions end where row groups end (plan_partitions' move to a block boundary off):
    with small blocks they begin inside blocks, whose terms the driver continues."""
    monkeypatch.setattr(P, "_block_aligned", lambda ends: ends)


@pytest.fixture(scope="module")
def survey(tmp_path_factory):
    """The default survey (3,000 persons) with missing bmi values and records that break
    edit rules 0 (age <= 90) and 3 (hh_size <= 20), in row groups of 450 records."""
    folder = tmp_path_factory.mktemp("partition")
    path = write_demo_spec(folder, n_persons=N)
    spec = load_spec(path)
    src = spec.release.input
    df = pd.read_parquet(src)
    df.loc[df.index % 37 == 0, "bmi"] = np.nan
    df.loc[[5, 1200, 2999], "age"] = 95
    df.loc[[17], "hh_size"] = 25
    pq.write_table(pa.Table.from_pandas(df, preserve_index=False), src, row_group_size=GROUP)
    whole, _ = read_input(spec)
    return path, spec, whole


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """The default survey (3,000 persons) with missing bmi values, every edit rule holding
    (PRB checks them on its output), in row groups of 450 records; 2 MASSC replications (10
    in the default spec: each chain would run 10 treatments and calibrations)."""
    folder = tmp_path_factory.mktemp("partition_clean")
    path = write_demo_spec(folder, n_persons=N)
    data = yaml.safe_load(path.read_text())
    data["stages"]["massc"]["replications"] = 2
    path.write_text(yaml.safe_dump(data))
    spec = load_spec(path)
    df = pd.read_parquet(spec.release.input)
    df.loc[df.index % 37 == 0, "bmi"] = np.nan
    pq.write_table(
        pa.Table.from_pandas(df, preserve_index=False), spec.release.input, row_group_size=GROUP
    )
    whole, _ = read_input(spec)
    return path, spec, whole


def _puf(folder: Path) -> Path:
    """A partitioned run's public files: puf/, or puf-gates-failed/ when a gate failed (the
    3,000-person chains here fail the SE-ratio gates; their files are compared all the same)."""
    from flows.scan import REFUSED

    return folder / "puf" if (folder / "puf").exists() else folder / REFUSED


def scan(spec, parts, req=None):
    """Both passes by partition, in process: the combined pass 1 and the SE table."""
    req = req or P.means_request(spec, P.input_columns(spec.release.input))
    agg = P.combine_scan([P.scan_pass1(p, spec, req) for p in parts])
    levels, R = agg["means"].levels, P.ratios(agg["means"])
    second = [P.scan_pass2(p, spec, req, levels, R) for p in parts]
    return agg, P.domain_means(req, agg["means"], second)


def test_a_scan_without_ses_has_the_same_psus_profiles_and_edits(survey, tmp_path):
    """A release's scan skips the means' sums (it measures the published file): the PSUs,
    profiles and edit failures are the full scan's; a weight <= 0 is still refused."""
    _, spec, whole = survey
    parts = P.plan_partitions(spec.release.input, 3)
    req = P.means_request(spec, P.input_columns(spec.release.input))
    full = P.combine_scan([P.scan_pass1(p, spec, req) for p in parts])
    lean = P.combine_scan([P.scan_pass1(p, spec, req, means=False) for p in parts])
    pd.testing.assert_frame_equal(lean["means"].psus, full["means"].psus)
    pd.testing.assert_frame_equal(lean["profiles"], full["profiles"])
    assert lean["records"] == full["records"] == N and lean["means"].levels == []
    bad = whole.assign(**{spec.design.weight: whole[spec.design.weight].where(whole.index != 7, 0)})
    with pytest.raises(P.PartitionError, match="weights <= 0"):
        P.psus_of(bad, req)


def test_plan_partitions_cover_the_file_in_order(survey):
    _, spec, _ = survey
    groups = -(-N // GROUP)
    for n in (None, 1, 2, 3, groups, 50):
        parts = P.plan_partitions(spec.release.input, n)
        assert len(parts) == (groups if n is None else min(n, groups))
        assert parts[0].start == 0 and parts[-1].stop == N
        assert all(a.stop == b.start for a, b in zip(parts, parts[1:], strict=False))
        assert all(len(p.pieces) == 1 and p.pieces[0].skip == 0 for p in parts)
        flat = [g for p in parts for g in p.pieces[0].row_groups]
        assert flat == list(range(groups))  # every row group once, in file order
        for p in parts:  # a partition holds exactly its row groups' records
            sizes = [min(GROUP, N - g * GROUP) for g in p.pieces[0].row_groups]
            assert p.stop - p.start == p.pieces[0].rows == sum(sizes)


def test_plan_moves_partition_ends_to_block_boundaries_and_reads_cut_row_groups(
    survey, monkeypatch
):
    """Blocks of 256 records, row groups of 450: 3 partitions end at 1,280 and 2,304 (the
    multiples of 256 nearest the row-group ends 1,350 and 2,250), read from the middle of row
    groups 2 and 5; blocks of 1,024 and 7 partitions asked: the ends 450, ..., 2,700 move to
    0, 1,024, 1,024, 2,048, 2,048 and 3,072 (past the end), 3 partitions of whole blocks
    remain. Every partition reads exactly its records, with their global row numbers."""
    from sdl_design.survey import blocksum

    _, spec, whole = survey
    monkeypatch.setattr(blocksum, "BITS", 8)
    monkeypatch.setattr(blocksum, "BLOCK", 256)
    parts = P.plan_partitions(spec.release.input, 3)
    path = str(spec.release.input)
    assert parts == [
        P.Partition((P.Piece(path, (0, 1, 2), 0, 1280),), 0, 1280),
        P.Partition((P.Piece(path, (2, 3, 4, 5), 1280 - 900, 1024),), 1280, 2304),
        P.Partition((P.Piece(path, (5, 6), 2304 - 2250, N - 2304),), 2304, N),
    ]
    for n in (None, 2, 3, 5, 7):
        parts = P.plan_partitions(spec.release.input, n)
        assert blocksum.split_blocks([p.start for p in parts]) == 0
        assert parts[0].start == 0 and parts[-1].stop == N
        assert all(a.stop == b.start for a, b in zip(parts, parts[1:], strict=False))
        for p in parts:
            df = P.read_partition(p, ["age", "wt"])
            assert df.index.equals(pd.RangeIndex(p.start, p.stop))
            pd.testing.assert_frame_equal(df, whole[["age", "wt"]].iloc[p.start : p.stop])
    monkeypatch.setattr(blocksum, "BITS", 10)
    monkeypatch.setattr(blocksum, "BLOCK", 1024)
    parts = P.plan_partitions(spec.release.input, 7)
    assert [(p.start, p.stop) for p in parts] == [(0, 1024), (1024, 2048), (2048, N)]
    monkeypatch.setattr(blocksum, "BITS", 12)  # one block of 4,096: the ends stay
    monkeypatch.setattr(blocksum, "BLOCK", 4096)
    parts = P.plan_partitions(spec.release.input, 7)
    assert [p.start for p in parts] == list(range(0, N, GROUP))


def test_plan_of_a_folder_spans_files_at_block_boundaries_and_refuses_other_columns(
    tmp_path, survey, monkeypatch
):
    """Files of 1,000, 1,300 and 700 records read as one input: in blocks of 256 the partitions end at 1,024 and 2,304, the multiples nearest the
    files' ends, each reading the end of one file and the start of the next; in one block
    (the default 65,536) they end at the files' ends. Every partition reads exactly the whole
    file's records, typed as read_input types them. A file that stores a column with another
    type, or other columns, is refused."""
    from sdl_design.survey import blocksum

    _, spec, whole = survey
    folder = tmp_path / "parts"
    folder.mkdir()
    whole.iloc[:1000].to_parquet(folder / "a.parquet", index=False)
    whole.iloc[1000:2300].to_parquet(folder / "b.parquet", index=False)
    whole.iloc[2300:].to_parquet(folder / "c.parquet", index=False)
    a, b, c = (str(folder / f"{x}.parquet") for x in "abc")
    parts = P.plan_partitions(folder)
    assert [(p.start, p.stop) for p in parts] == [(0, 1000), (1000, 2300), (2300, N)]
    assert all(len(p.pieces) == 1 for p in parts)
    monkeypatch.setattr(blocksum, "BITS", 8)
    monkeypatch.setattr(blocksum, "BLOCK", 256)
    parts = P.plan_partitions(folder)
    assert parts == [
        P.Partition((P.Piece(a, (0,), 0, 1000), P.Piece(b, (0,), 0, 24)), 0, 1024),
        P.Partition((P.Piece(b, (0,), 24, 1276), P.Piece(c, (0,), 0, 4)), 1024, 2304),
        P.Partition((P.Piece(c, (0,), 4, 696),), 2304, N),
    ]
    one = P.plan_partitions(folder, 1)
    assert len(one) == 1 and [q.rows for q in one[0].pieces] == [1000, 1300, 700]
    for p in parts + one:
        df = P.read_partition(p, None, spec)
        assert df.index.equals(pd.RangeIndex(p.start, p.stop))
        pd.testing.assert_frame_equal(df, whole.iloc[p.start : p.stop])
    whole.iloc[2300:].astype({"age": float}).to_parquet(folder / "c.parquet", index=False)
    with pytest.raises(P.PartitionError, match="column age is int64 in a.parquet and double in c"):
        P.plan_partitions(folder)
    whole.iloc[:10, :5].to_parquet(folder / "c.parquet", index=False)
    with pytest.raises(P.PartitionError, match="same columns"):
        P.plan_partitions(folder)
    (tmp_path / "x.csv").write_text("a\n1\n")
    with pytest.raises(P.PartitionError, match="Parquet"):
        P.plan_partitions(tmp_path / "x.csv")


def test_a_stages_folder_is_read_in_the_partitions_it_was_written_in(tmp_path):
    """A partition's records are written in one row group, past pyarrow's default of
    1,048,576 rows too, and the folder is planned one partition per row group: the partitions
    that wrote it (ends 17 blocks of 65,536 and 5 records later)."""
    import pyarrow.parquet as pq

    end = 17 * 65_536
    for part in (P.Partition((), 0, end), P.Partition((), end, end + 5)):
        n = part.stop - part.start
        P._write_partition(pd.DataFrame({"x": np.arange(n, dtype=np.int32)}), part, tmp_path)
    files = sorted(tmp_path.glob("part-*.parquet"))
    assert [pq.ParquetFile(f).metadata.num_row_groups for f in files] == [1, 1]
    got = P.plan_partitions(tmp_path)
    assert [(p.start, p.stop) for p in got] == [(0, end), (end, end + 5)]


def test_profile_counts_by_partition_are_the_risk_stage_counts(survey):
    _, spec, whole = survey
    keys = spec.variables.keys
    parts = P.plan_partitions(spec.release.input)
    frames = [P.read_partition(p, None, spec) for p in parts]
    table = P.combine_profiles([P.profile_counts(f, keys) for f in frames])
    # the whole file's profiles, numbered in first-appearance order by the risk module
    codes = profile_codes(whole, keys).to_numpy()
    assert table["count"].tolist() == np.bincount(codes).tolist()
    assert table["first"].tolist() == [int(np.argmax(codes == g)) for g in range(codes.max() + 1)]
    sizes = np.concatenate([P.profile_sizes(f, keys, table) for f in frames])
    assert np.array_equal(sizes, cell_sizes(whole, keys).to_numpy())
    strata = risk_strata(whole, keys).value_counts()
    assert P.strata_counts(table).to_dict() == {s: int(strata.get(s, 0)) for s in "UDTO"}


@pytest.mark.parametrize("interactions", [False, True])
def test_risk_metrics_by_partition_are_the_risk_stages(survey, interactions):
    """Uniques, GenMASSC scores (paper 000 eq. 1-2) and the pseudo-ML log-linear tau1, tau2
    (paper 001 eq. 4, 7) from the partitions' profile tables equal risk_profile on the whole
    file: counts exactly, the rest to 1e-12."""
    _, spec, whole = survey
    v, wt = spec.variables, spec.design.weight
    parts = P.plan_partitions(spec.release.input, 4)
    frames = [P.read_partition(p, None, spec) for p in parts]
    # weights in (1, 2]: a sampling fraction near 1/2 leaves population uniques to find
    top = whole[wt].max()
    whole = whole.assign(**{wt: 1.0 + whole[wt] / top})
    frames = [f.assign(**{wt: 1.0 + f[wt] / top}) for f in frames]
    table = P.combine_profiles(
        [P.profile_counts(f, v.keys, spec.design.weight, v.sensitive) for f in frames]
    )
    got = P.profile_measures(table, v.keys, v.sensitive, interactions=interactions).metrics
    want = risk_profile(
        whole, v.keys, v.sensitive, weight=spec.design.weight, interactions=interactions
    ).metrics
    assert set(got) == set(want)
    assert want["n_unique"] > 100 and want["tau1"] > 1  # the checks below have work to do
    for name in ("n_records", "n_profiles", "n_unique", "n_double", "n_triple", "n_other"):
        assert got[name] == want[name], name
    assert got["n_score_1"] == want["n_score_1"]
    for name in ("mean_score", "max_score", "tau1", "tau2", "unique_share", "tau1_share"):
        assert abs(got[name] - want[name]) <= 1e-12 * abs(want[name]), name
    # sensitive-category counts add up to each profile's records
    sens = [c for c in table.columns if c.startswith(P.SENS + "diabetes=")]
    assert (table[sens].sum(axis=1) == table["count"]).all()
    assert np.isclose(table["wsum"].sum(), whole[wt].sum(), rtol=1e-13)


def test_edit_failures_by_partition_are_the_whole_files(survey):
    _, spec, whole = survey
    parts = P.plan_partitions(spec.release.input, 3)
    frames = [P.read_partition(p, None, spec) for p in parts]
    rules = spec.edits
    combined = P.combine_rule_failures([rule_failures(f, rules) for f in frames])
    assert combined == rule_failures(whole, rules, np.arange(N))
    assert combined[0] == (3, [5, 1200, 2999])  # the ages set to 95, across partitions
    assert combined[3] == (1, [17])
    assert combined[1] == (0, [])  # income >= 0 holds everywhere
    # a rule that cannot be evaluated says why, in every partition's combination
    bad = rules[0].model_copy(update={"column": "no_such_column"})
    out = P.combine_rule_failures([rule_failures(f, [bad]) for f in frames])
    assert isinstance(out[0], str) and "no_such_column" in out[0]


def _reference(whole, req):
    """estimate, se, deff, se_rep of every variable/domain/level by SurveyDesign on the whole
    file: each variable a ratio of sum w y 1{observed} to sum w 1{observed}."""
    frame = whole[[req.weight, req.strata, req.psu, *req.replicate_weights]].copy()
    for v in req.variables:
        x = whole[v].to_numpy(float, na_value=np.nan)
        frame[f"__y0:{v}"] = np.where(np.isnan(x), 0.0, x)
        frame[f"__nn:{v}"] = (~np.isnan(x)).astype(float)
    for d, (code, lab) in zip(req.domains, req.domain_codes(whole), strict=True):
        labels = np.where(code >= 0, lab[np.maximum(code, 0)], None)
        frame["_dom_" + ":".join(d)] = pd.Series(labels, index=whole.index, dtype=object)
    design = SurveyDesign(
        frame,
        weight=req.weight,
        strata=req.strata,
        psu=req.psu,
        replicate_weights=list(req.replicate_weights) or None,
        method=req.method,
        rho=req.rho,
    )
    num = [f"__y0:{v}" for v in req.variables]
    den = [f"__nn:{v}" for v in req.variables]
    out = []
    for name in ["all"] + [":".join(d) for d in req.domains]:
        by = None if name == "all" else f"_dom_{name}"
        t = design.ratio(num, den, by=by, variance="taylor").reset_index()
        if req.replicate_weights:
            t["se_rep"] = design.ratio(num, den, by=by, variance="replicate")["se"].to_numpy()
        t["domain"] = name
        t["level"] = "all" if by is None else t[by].astype(str)
        t["variable"] = t["variable"].str.removeprefix("__y0:").str.split("/__nn:").str[0]
        out.append(t.drop(columns=[by] if by else []))
    return pd.concat(out, ignore_index=True)


def _agree(table, ref, columns, tol=1e-12):
    m = table.merge(ref, on=["domain", "level", "variable"], suffixes=("", "_ref"))
    assert len(m) == len(table) == len(ref)
    for c in columns:
        a, b = m[c].to_numpy(), m[f"{c}_ref"].to_numpy()
        assert np.array_equal(np.isnan(a), np.isnan(b)), c
        ok = ~np.isnan(b)
        assert np.all(np.abs(a[ok] - b[ok]) <= tol * np.abs(b[ok])), (c, np.abs(a - b).max())


def test_domain_means_by_partition_equal_survey_design_on_the_whole_file(survey):
    _, spec, whole = survey
    parts = P.plan_partitions(spec.release.input)
    agg, table = scan(spec, parts)
    req = P.means_request(spec, list(whole.columns))
    assert req.method == "jkn" and len(req.replicate_weights) == 70 and "bmi" in req.variables
    assert whole["bmi"].isna().sum() == len(range(0, N, 37))
    _agree(table, _reference(whole, req), ["estimate", "se", "deff", "se_rep"])
    # the record counts by level are the whole file's
    sex = table[(table.domain == "sex") & (table.variable == "income")]
    assert dict(zip(sex.level, sex.n, strict=True)) == whole["sex"].value_counts().to_dict()
    assert agg["records"] == N


def test_taylor_only_design_and_any_partitioning_give_the_same_numbers(survey, tmp_path):
    path, _, whole = survey
    data = yaml.safe_load(path.read_text())
    data["design"].pop("replicate_weights")
    data["release"]["input"] = str(path.parent / data["release"]["input"])
    other = tmp_path / "taylor.yaml"
    other.write_text(yaml.safe_dump(data))
    spec = load_spec(other)
    _, one = scan(spec, P.plan_partitions(spec.release.input, 1))
    _, seven = scan(spec, P.plan_partitions(spec.release.input, 7))
    assert "se_rep" not in one.columns
    req = P.means_request(spec, list(whole.columns))
    _agree(one, _reference(whole, req), ["estimate", "se", "deff"])
    _agree(seven, one, ["estimate", "se", "deff"], tol=1e-13)
    assert seven["n"].tolist() == one["n"].tolist()


def test_means_request_without_psu_names_the_field(survey):
    _, spec, whole = survey
    bad = spec.model_copy(update={"design": spec.design.model_copy(update={"psu": None})})
    with pytest.raises(P.PartitionError, match="design.psu"):
        P.means_request(bad, list(whole.columns))


def test_puf_scan_writes_its_tables_whole(survey, tmp_path, capsys):
    path, spec, whole = survey
    out = tmp_path / "scan"
    assert puf(["scan", str(path), "--partitions", "3", "--out", str(out)]) == 1  # 2 rules fail
    text = capsys.readouterr().out
    assert f"{N} records in 3 partition(s)" in text
    assert "[FAIL] edit[0] age between 0 and 90: 3 records fail (e.g. row [5, 1200, 2999])" in text
    assert sorted(p.name for p in out.iterdir()) == [
        "edits.csv",
        "key_risk.csv",
        "profiles.csv",
        "risk_strata.csv",
        "se.csv",
    ]
    strata = pd.read_csv(out / "risk_strata.csv").set_index("stratum")["records"]
    assert strata.sum() == N
    assert strata.to_dict() == risk_strata(whole, spec.variables.keys).value_counts().to_dict()
    se = pd.read_csv(out / "se.csv", keep_default_na=False, na_values=[""])
    _, table = scan(spec, P.plan_partitions(spec.release.input, 3))
    assert np.allclose(se["se_rep"], table["se_rep"], rtol=1e-15, atol=0, equal_nan=True)
    # a spec naming a column the input lacks: refused before any work, nothing written
    data = yaml.safe_load(path.read_text())
    data["variables"]["study"].append("no_such_column")
    bad = path.parent / "bad.yaml"
    bad.write_text(yaml.safe_dump(data))
    assert puf(["scan", str(bad), "--out", str(tmp_path / "none")]) == 2
    assert "no_such_column" in capsys.readouterr().err
    assert not (tmp_path / "none").exists()
    # more partitions asked for than row groups: said, with the fix
    assert puf(["scan", str(path), "--partitions", "50", "--out", str(out)]) == 1
    assert "not 50: the input has 7 row group(s)" in capsys.readouterr().err


def test_split_blocks_counts_partitions_that_begin_inside_a_block():
    from sdl_design.survey.blocksum import BLOCK, split_blocks

    assert BLOCK == 65_536
    assert split_blocks([0, BLOCK, 100_000, 2 * BLOCK, 4 * BLOCK + 1]) == 2
    assert split_blocks([0]) == 0


def test_puf_scan_says_why_it_reads_fewer_partitions_than_asked(
    survey, tmp_path, capsys, monkeypatch
):
    """Blocks of 1,024 (3,000 records span 3 blocks): 7 partitions asked, 3 of whole blocks
    read, and the run says why (more than the row groups: test_puf_scan_writes_its_tables_whole)."""
    from sdl_design.survey import blocksum

    monkeypatch.setattr(blocksum, "BITS", 10)
    monkeypatch.setattr(blocksum, "BLOCK", 1 << 10)
    path = survey[0]
    puf(["scan", str(path), "--partitions", "7", "--out", str(tmp_path / "a")])
    err = capsys.readouterr().err
    assert "3 partition(s), not 7: a partition holds whole blocks of 1,024 records (the " in err
    assert "input has 3)" in err


def _with_donors(clean, restrictions=(), delta_max=None):
    """The clean survey's spec with declared domains sex and region only (the default declares
    every key, so that no record has a donor): donors share the recipient's sex and region
    (and restriction columns) and differ on another key."""
    path, _, whole = clean
    data = yaml.safe_load(path.read_text())
    data["utility"]["domains"] = ["sex", "region"]
    data["stages"]["massc"]["donor_restrictions"] = list(restrictions)
    if delta_max is not None:
        data["gates"]["delta_max"] = delta_max
    new = path.parent / f"donors-{'-'.join(restrictions) or 'none'}-{delta_max}.yaml"
    new.write_text(yaml.safe_dump(data))
    return new, load_spec(new), whole


@pytest.fixture(scope="module")
def domains_chain(clean, tmp_path_factory):
    """The MASSC chain with donors in the declared domains (sex, region), every stage by
    partition in this process (CHAIN partitions, the replications one batch at a time): its
    folder and run_partitioned's result. Shared by the chain's test against the in-memory
    stages and the Dask test against this run."""
    from flows.scan import run_partitioned

    path, _, _ = _with_donors(clean)
    folder = tmp_path_factory.mktemp("domains_chain") / f"p{CHAIN}"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pcal, "REPLICATIONS_AT_ONCE", 1)  # the 2 replications in 2 batches
        out = run_partitioned(path, "thread", partitions=CHAIN, out=folder)
    return folder, out


@pytest.mark.flow
def test_scan_and_partitioned_stages_on_a_local_dask_cluster_are_byte_identical(
    clean, domains_chain, tmp_path
):
    """One local cluster of 2 worker processes: `puf partitioned` (CHAIN partitions; the
    replications at once) writes the same files as the thread runner's chain (domains_chain,
    the replications one at a time), byte for byte: its scan of the input (scan/, `puf scan`'s
    tables), the records after the swap and PRB, MASSC's substituted file of its donor search,
    its selections (records exchanged between workers), the calibrated and top-coded records,
    the public data files and every table."""
    import logging

    from distributed import Client, LocalCluster

    from sdl_design.engine import cache as C

    path, _, _ = _with_donors(clean)
    with LocalCluster(
        n_workers=2,
        threads_per_worker=1,
        processes=True,
        dashboard_address=None,
        silence_logs=logging.WARNING,
    ) as cluster:
        dask = ["--runner", "dask", "--dask-address", cluster.scheduler_address]
        out = str(tmp_path / "partitioned-dask")
        puf(["partitioned", str(path), "--partitions", str(CHAIN), "--out", out, *dask])  # (fails)
        # the workers outlive the runs: their partition caches were emptied at each end
        with Client(cluster) as client:
            assert set(client.run(lambda: C.CACHE.nbytes).values()) == {0}
    thread, dask = domains_chain[0], tmp_path / "partitioned-dask"
    files = sorted(p.relative_to(thread) for p in thread.rglob("*.*") if p.name != "run.json")
    assert files == sorted(p.relative_to(dask) for p in dask.rglob("*.*") if p.name != "run.json")
    parquet = [f for f in files if f.suffix == ".parquet"]
    # the swap's, PRB's, MASSC's donors, its two selections', its calibrated records, the
    # top-coded ones (CHAIN each), the public file (puf/puf.parquet; puf.csv is compared too) and
    # the confidential record map (internal/record_map.parquet)
    assert len(parquet) == 7 * CHAIN + 2 and (_puf(thread) / "puf.csv").exists()
    assert Path("internal/record_map.parquet") in parquet
    scan = {Path("scan") / f"{t}.csv" for t in ("se", "edits", "risk_strata", "profiles")}
    assert scan <= set(files)
    assert len([f for f in parquet if f.parts[:2] == ("massc", "data")]) == CHAIN
    assert json.loads((dask / "run.json").read_text())["stages"]["massc"]["n_with_donor"] > 0
    for f in files:
        assert (thread / f).read_bytes() == (dask / f).read_bytes(), f


# ---------------------------------------------------------------- the swap by partition


def _in_memory(spec, whole):
    """The swap and PRB stages in memory, as the release flow runs them (the release's
    Generators): their results."""
    from sdl_design.stage import StageContext
    from sdl_design.stages.prb import PrbStage
    from sdl_design.stages.swap import SwapStage

    ctx = StageContext(whole, spec, "swap")
    swap = SwapStage.from_spec(spec).run(whole, ctx)
    prb = PrbStage.from_spec(spec).run(swap.data, ctx.for_stage("prb", [swap]))
    return swap, prb


def _same_bits(got, expect):
    pd.testing.assert_frame_equal(got, expect, check_exact=True)
    for c in expect.select_dtypes("number").columns:  # the bits, NaN included
        assert got[c].to_numpy().tobytes() == expect[c].to_numpy().tobytes(), c


def test_segment_aggregates_by_partition_are_the_whole_files_to_the_bit():
    """Pass 1 and 2 on slices of a toy survey (cut inside segments, in a shuffled order) give
    the aggregates segment_aggregates gives on the whole file, bit for bit; the scores are
    eq. 3's sums of w (x - xbar) / W over each segment's records (math.fsum brute force)."""
    import math

    from test_swap import toy_survey

    from sdl_design.stages.swap.method import (
        aggregates_from_sums,
        combine_segment_pass1,
        segment_aggregates,
        segment_design,
        segment_pass1,
        segment_pass2,
    )
    from sdl_design.survey.exactsum import add_limbs_at

    df = toy_survey(n_strata=6, q=3, seed=11)
    df.loc[df.index % 7 == 0, "x0"] = np.nan
    cols = ["x0", "x1", "x2"]
    whole = segment_aggregates(df, "w", "st", "psu", "seg", cols)
    rng = np.random.default_rng(0)
    shuffled = df.iloc[rng.permutation(len(df))]
    cuts = [0, 37, 200, 201, 333, len(df)]
    slices = [shuffled.iloc[a:b] for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
    design = segment_design(
        combine_segment_pass1([segment_pass1(s, "w", "st", "psu", "seg", cols) for s in slices]),
        cols,
    )
    limbs = np.zeros((3, len(design.segment_labels), 2 * len(cols)))
    for s in slices[::-1]:
        every = np.arange(len(design.segment_labels))
        limbs = add_limbs_at(limbs, every, segment_pass2(s, "w", "seg", cols, design))
    parts = aggregates_from_sums(design, limbs, cols)
    for name in ("segment_labels", "seg_psu", "psu_stratum", "psu_labels", "score", "mean"):
        np.testing.assert_array_equal(getattr(parts, name), getattr(whole, name), err_msg=name)
    j = 4  # one segment's score by brute force
    x, w = df["x0"].to_numpy(), df["w"].to_numpy()
    obs = ~np.isnan(x)
    W = math.fsum(w[obs])
    xbar = math.fsum(w[obs] * x[obs]) / W
    mine = (df["seg"].to_numpy() == whole.segment_labels[j]) & obs
    z = math.fsum(w[mine] * (x[mine] - xbar)) / W
    assert abs(whole.score[j, 0] - z) <= 1e-12 * np.abs(whole.score[:, 0]).max()


@pytest.mark.flow  # a whole release chain by partition
def test_swap_and_prb_by_partition_give_the_stages_records_to_the_bit(clean, tmp_path):
    """`puf partitioned` in process on 2 and on 7 partitions: the records after the swap
    (pseudo strata and PSUs, rebuilt replicate weights) and after PRB (the moved records'
    values of C) equal the in-memory stages', bit for bit, with the swap's pairs and PRB's
    changes and exact risk; the masked SEs are SurveyDesign's on the swap's masked frame
    (MASSC and top-coding off: their own tests run them after these two)."""
    from flows.scan import run_partitioned

    path, spec, whole = clean
    data = yaml.safe_load(path.read_text())
    data["stages"]["massc"]["enabled"] = False
    data["stages"]["topcode"]["enabled"] = False
    path = path.parent / "swap-prb.yaml"
    path.write_text(yaml.safe_dump(data))
    swap, prb = _in_memory(spec, whole)
    for n in (2, 7):
        out = run_partitioned(path, "thread", partitions=n, out=tmp_path / f"p{n}", release=False)
        st = {k: flat(v) for k, v in out["stages"].items()}
        # the swap masked the design: the pseudo design builds nothing, records unchanged
        assert list(st) == ["swap", "prb", "pseudo_design"]  # (release False: no measures)
        assert out["public_files"] is None and not (tmp_path / f"p{n}" / "puf").exists()
        assert st["pseudo_design"]["built"] is False
        assert len(st["swap"]["files"]) == n
        _same_bits(
            pd.read_parquet(tmp_path / f"p{n}" / "swap" / "data"), swap.data.reset_index(drop=True)
        )
        _same_bits(
            pd.read_parquet(tmp_path / f"p{n}" / "prb" / "data"), prb.data.reset_index(drop=True)
        )
        pairs = st["swap"]["tables"]["pairs"]
        pd.testing.assert_frame_equal(pairs, swap.tables["pairs"], check_exact=True)
        for m in ("n_changed", "max_risk", "n_blocks", "theta", "share_changed"):
            assert st["prb"][m] == prb.metrics[m], m
        # the README's: PrbStage's params, transition probabilities (category sums by
        # partition, the same bits) and changes by variable
        assert st["prb"]["params"] == prb.params
        got = st["prb"]["tables"]
        pd.testing.assert_frame_equal(
            got["transitions"], prb.tables["transitions"], check_exact=True
        )
        want = prb.tables["changed_by_variable"]
        pd.testing.assert_frame_equal(got["changed_by_variable"], want, check_exact=True)
    assert prb.metrics["n_changed"] > 0  # the chain moved records
    assert (prb.tables["transitions"]["p"] < 1).any() and len(want) == len(
        spec.stages.prb.variables
    )
    # the swap's own SE table (its broad characteristics, the masked design's SEs)
    se = st["swap"]["tables"]["se_ratios"]
    se = se[se["domain"] == "all"].set_index("variable")
    d = SurveyDesign.from_spec(swap.data, spec.design)
    for v in ("income", "diabetes"):
        m = d.mean(v, variance="taylor")
        assert se.loc[v, "se_masked"] == pytest.approx(float(m["se"].iloc[0]), 1e-12)
    t = st["swap"]["tables"]["se_ratios"]  # the swap moves no record: the same estimates
    assert np.allclose(t["estimate_masked"], t["estimate"], rtol=1e-12)
    # after PRB: measured on its records against the input, which PRB moved between domains
    se = st["prb"]["tables"]["se_ratios"].set_index(["domain", "level", "variable"])
    m = SurveyDesign.from_spec(prb.data, spec.design).mean("income", by="race", variance="taylor")
    for (_, lv), row in m.iterrows():
        assert se.loc[("race", str(lv), "income"), "se_masked"] == pytest.approx(row["se"], 1e-12)
    assert (se["n_masked"] != se["n_original"]).any()


@pytest.mark.flow  # a whole release chain by partition
def test_puf_partitioned_leaves_nothing_when_a_partition_fails(
    clean, tmp_path, monkeypatch, capsys
):
    from flows.scan import run_partitioned

    path, _, _ = clean
    # the run's life is under test: the intruder knows the declared keys only (on 3,000
    # persons the default intruder's key makes the SE-ratio gates refuse the file)
    data = yaml.safe_load(path.read_text())
    data["intruder"]["unknown"].update(dict.fromkeys(["education", "hh_size", "pregnant"], "t"))
    data["stages"]["prb"]["cells"] = None
    data["stages"]["prb"]["variables"].remove("hh_size")
    path = path.parent / "keys-only.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    out = tmp_path / "run"
    assert puf(["partitioned", str(path), "--partitions", "2", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "pairs in internal/swap/pairs.csv (confidential)" in text
    assert "every stage ran by partition" in text
    # the command that publishes it: the user's arguments kept, --out (a scratch folder) left out
    publish = f"puf partitioned {path} --partitions 2 --publish --approve NAME"
    assert f"not published: `{publish}` publishes it" in text
    assert "puf/puf.parquet and puf/puf.csv" in text and "domain estimates of the" in text
    # the record-level maps only under internal/ (issue 35 item 3)
    assert (out / "internal" / "swap" / "pairs.csv").exists()
    assert (out / "internal" / "massc" / "donors").exists()
    assert (out / "internal" / "record_map.parquet").exists()
    assert not (out / "swap" / "pairs.csv").exists() and not (out / "massc" / "donors").exists()
    before = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    calls = []

    def fail_second(part, *args):
        calls.append(part.start)
        if len(calls) == 2:
            raise OSError("disk full")
        return apply(part, *args)

    apply = pprb.prb_apply
    monkeypatch.setattr(pprb, "prb_apply", fail_second)
    with pytest.raises(OSError, match="disk full"):
        run_partitioned(path, "thread", partitions=3, out=out)
    # the earlier run's folder is whole, and no temporary folder is left beside it
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_puf_partitioned_names_the_field_of_a_design_it_cannot_swap(clean, tmp_path, capsys):
    """A segment label in two PSUs (across partitions): refused with the field and the fix,
    exit 2, nothing written."""
    path, spec, whole = clean
    bad = whole.copy()
    bad.loc[bad.index[-1], spec.design.segment] = bad[spec.design.segment].iloc[0]
    src = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pandas(bad, preserve_index=False), src, row_group_size=GROUP)
    data = yaml.safe_load(path.read_text())
    data["release"]["input"] = str(src)
    bad_spec = tmp_path / "bad.yaml"
    bad_spec.write_text(yaml.safe_dump(data))
    out = tmp_path / "run"
    assert puf(["partitioned", str(bad_spec), "--out", str(out)]) == 2
    assert "design.segment: segments span several PSUs" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize(
    "change",
    [{"method": "nzy", "tuned": True}, {"partition": None}],
    ids=["nzy-tuned", "no-partition"],
)
def test_prb_alone_by_partition_gives_the_stages_records(clean, tmp_path, change):
    """PRB as the first stage (no swap) on the input's row groups, as NZY with tuned theta, or
    without partition sets: the in-memory stage's records, bit for bit."""
    from flows.scan import run_partitioned
    from sdl_design.stage import StageContext
    from sdl_design.stages.prb import PrbStage

    path, _, whole = clean
    data = yaml.safe_load(path.read_text())
    del data["stages"]["swap"]
    for k, v in change.items():
        if v is None:
            data["stages"]["prb"].pop(k)
        else:
            data["stages"]["prb"][k] = v
    data["stages"]["massc"]["enabled"] = False  # (MASSC by partition has its own tests)
    data["stages"]["topcode"]["enabled"] = False  # (and top-coding)
    new = path.parent / f"prb-{'-'.join(change)}.yaml"
    new.write_text(yaml.safe_dump(data))
    spec = load_spec(new)
    prb = PrbStage.from_spec(spec).run(whole, StageContext(whole, spec, "prb"))
    out = run_partitioned(new, "thread", partitions=5, out=tmp_path / "p", release=False)
    # no swap: the pseudo design is built after PRB (its test: pseudo_design_by_partition)
    assert list(out["stages"]) == ["prb", "pseudo_design"]
    _same_bits(pd.read_parquet(tmp_path / "p" / "prb" / "data"), prb.data.reset_index(drop=True))
    assert out["stages"]["prb"].metrics["n_changed"] == prb.metrics["n_changed"] > 0


@pytest.mark.parametrize("cuts", ["row groups", "blocks", "files"])
def test_prb_transitions_by_partition_in_blocks_across_partitions(
    clean, tmp_path, monkeypatch, cuts
):
    """PRB's transition probabilities (the public README's) by partition, with block sums of
    256 records (12 blocks over 3,000 records; partitions of 450 records that begin and end
    inside blocks, or moved to the blocks' boundaries; or the input as files of 1,000, 1,300
    and 700 records, read in 3 partitions that end at 1,024 and 2,304, inside the files): the
    in-memory stage's table, bit for bit, p and the category weights."""
    from flows.scan import run_partitioned
    from sdl_design.stage import StageContext
    from sdl_design.stages.prb import PrbStage
    from sdl_design.survey import blocksum

    monkeypatch.setattr(blocksum, "BITS", 8)
    monkeypatch.setattr(blocksum, "BLOCK", 256)
    assert blocksum.n_blocks(N) == 12
    if cuts == "row groups":
        _cut_at_row_groups(monkeypatch)
    path, _, whole = clean
    data = yaml.safe_load(path.read_text())
    del data["stages"]["swap"]
    data["stages"]["massc"]["enabled"] = False
    data["stages"]["topcode"]["enabled"] = False
    if cuts == "files":
        table = pq.read_table(load_spec(path).release.input)
        (tmp_path / "in").mkdir()
        for name, a, b in [("a", 0, 1000), ("b", 1000, 2300), ("c", 2300, N)]:
            pq.write_table(table.slice(a, b - a), tmp_path / "in" / f"{name}.parquet")
        data["release"]["input"] = str(tmp_path / "in")
    new = path.parent / f"prb-{cuts.replace(' ', '-')}.yaml"
    new.write_text(yaml.safe_dump(data))
    spec = load_spec(new)
    prb = PrbStage.from_spec(spec).run(whole, StageContext(whole, spec, "prb"))
    out = run_partitioned(new, "thread", partitions=7, out=tmp_path / "p", release=False)
    starts = P.plan_partitions(spec.release.input, 7)
    assert blocksum.split_blocks([p.start for p in starts]) == (6 if cuts == "row groups" else 0)
    if cuts == "files":
        assert [(p.start, len(p.pieces)) for p in starts] == [(0, 2), (1024, 2), (2304, 1)]
    got = out["stages"]["prb"].tables["transitions"]
    want = prb.tables["transitions"]
    pd.testing.assert_frame_equal(got, want, check_exact=True)
    assert (want["p"] < 1).sum() > 10 and want["weight_original"].gt(0).all()


def test_swap_with_bootstrap_replicates_by_partition_gives_the_stages_records(clean, tmp_path):
    """The swap rebuilding bootstrap replicate weights (100 resamples drawn on the driver from
    the swap's Generator) by partition: the in-memory stage's records, bit for bit."""
    from flows.scan import run_partitioned
    from sdl_design.stage import StageContext
    from sdl_design.stages.swap import SwapStage

    path, _, whole = clean
    data = yaml.safe_load(path.read_text())
    data["stages"]["swap"]["replicate_method"] = "bootstrap"
    del data["stages"]["prb"]
    data["stages"]["massc"]["enabled"] = False
    data["stages"]["topcode"]["enabled"] = False
    new = path.parent / "boot.yaml"
    new.write_text(yaml.safe_dump(data))
    spec = load_spec(new)
    swap = SwapStage.from_spec(spec).run(whole, StageContext(whole, spec, "swap"))
    out = run_partitioned(new, "thread", partitions=3, out=tmp_path / "p", release=False)
    assert list(out["stages"]) == ["swap", "pseudo_design"]
    got = pd.read_parquet(tmp_path / "p" / "swap" / "data")
    assert sum(c.startswith("rw") for c in got.columns) == 100
    _same_bits(got, swap.data.reset_index(drop=True))


def test_puf_partitioned_stops_on_the_inputs_edit_failures(survey, tmp_path, capsys):
    """As the release flow: an input that breaks edit rules is refused before any stage runs
    (exit 1, the rules named), nothing written; a clean input's scan tables are kept."""
    path, _, _ = survey
    out = tmp_path / "run"
    assert puf(["partitioned", str(path), "--partitions", "3", "--out", str(out)]) == 1
    assert "edit validation failed on the input file" in capsys.readouterr().err
    assert not out.exists() and list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- MASSC's donors by partition


@pytest.mark.flow  # a whole release chain by partition
@pytest.mark.parametrize(
    ("restrictions", "delta_max"),
    [((), None), (("education",), None), ((), 0.2)],
    ids=["domains", "restricted", "revised"],
)
def test_massc_donors_by_partition_are_the_release_plans_to_the_bit(
    clean, tmp_path, monkeypatch, request, restrictions, delta_max
):
    """MASSC by partition after the partitioned swap and PRB, on 7 partitions: every
    record's donor (global row), the substituted file tilde, the strata, moments, costs, psi,
    the substitution, phi, the subsampling, delta and meet_delta's revisions equal the
    release's MASSC (_main on the in-memory stages' output, the release's Generator), and so
    do the calibrated records (Step IV), the replications' estimates and the top-coded
    records after it, bit for bit, and the public data files, byte for byte; donors keep the recipient's sex, region and restriction
    values and change another key."""
    from flows.scan import run_partitioned

    path, spec, whole = _with_donors(clean, restrictions, delta_max)
    swap, prb = _in_memory(spec, whole)
    cfg, plan, tr, dm, revisions = _release_massc(spec, prb, whole)
    assert (len(revisions) > 0) == (delta_max is not None)  # delta_max 0.2 revises the rates
    donor = plan.donors.donor
    has = donor >= 0
    assert has.mean() > 0.9  # nearly every record has a donor
    keys = [k.name for k in cfg.keys]
    for c in ("sex", "region", *restrictions):
        assert (prb.data[c].to_numpy()[has] == prb.data[c].to_numpy()[donor[has]]).all(), c
    moved = prb.data[keys].to_numpy()[has] != prb.data[keys].to_numpy()[donor[has]]
    assert moved.any(axis=1).all()
    chain = not restrictions and delta_max is None  # the chain the Dask test compares with
    n = CHAIN if chain else 7  # partitions (2 partitions: the swap's and PRB's tests)
    if chain:
        folder, out = request.getfixturevalue("domains_chain")
    else:
        folder = tmp_path / f"p{n}"
        if restrictions:
            monkeypatch.setattr(pcal, "REPLICATIONS_AT_ONCE", 1)  # the 2 replications in 2 batches
        else:  # in one batch, their study totals in two maps (one replication's partials each)
            monkeypatch.setattr(pcal, "TOTALS_BYTES", 1)
        # (the assessment, final stage, public files, docs and gates read only the records:
        # checked on the domains chain, which shares them with the Dask test, and the pseudo
        # chains; the revised chain's own records are checked up to the top-coding)
        out = run_partitioned(path, "thread", partitions=n, out=folder, release=False)
    m = flat(out["stages"]["massc"])
    assert m["n_with_donor"] == int(has.sum()) and len(m["files"]) == n
    got = pd.read_parquet(folder / "internal" / "massc" / "donors")
    assert got["__donor"].to_numpy().tobytes() == donor.tobytes()
    _same_bits(got.drop(columns="__donor"), plan.tilde.reset_index(drop=True))
    levels = pd.read_csv(folder / "massc" / "donor_levels.csv")
    assert levels["records"].tolist() == list(plan.donors.by_level.values())
    _same_moments(m, plan)
    _same_treatment(m, folder / "massc", got["__donor"].to_numpy(), tr, dm, plan)
    assert m["n_delta_revisions"] == len(revisions) and m["budget_scale"] == cfg.budget_scale
    data = _same_calibration(m, folder / "massc", spec, prb, whole, cfg, tr)
    if not restrictions:  # the revised rates too
        _same_replications(m, spec, prb, whole, (cfg, plan, tr, dm, revisions))
        final = _same_topcode(folder, spec, data)
    if not restrictions and delta_max is None:
        # the driver's peak resident set by step: each at most the process's lifetime peak
        import resource

        steps = out["driver_peak_gib"]
        assert list(steps) == [
            "scan", "risk", "swap", "prb", "massc", "topcode", "pseudo_design",
            "final + assess", "public_files",
        ]  # fmt: skip
        if all(v is not None for v in steps.values()):  # (None: no /proc/self/clear_refs)
            life = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
            # (ru_maxrss lags VmHWM by the kernel's batched RSS counters: 2% slack measured on
            # a quiet machine, 3.5% with four processes on two cores: 5%)
            assert all(0 < v <= life * 1.05 for v in steps.values()), (steps, life)
        public = _same_public(folder, spec, final, tmp_path)
        assert len(public[0]) < N  # MASSC's subsample
        assessed = _same_assessment(folder, spec, whole, final)
        assert assessed.metrics["psu_recoverable"] > 0  # the swap's labels leak some PSUs
        fin = _same_final(folder, spec, whole, final)
        assert 0 < fin.metrics["share_keys_changed"] < 1  # PRB and MASSC changed keys
        from sdl_design.stages.massc.stage import delta_gates

        gates = [*prb.gates, *delta_gates(spec, dm.delta), *assessed.gates]
        _same_gates(folder, spec, gates, public)
        main = (cfg, plan, tr, dm, revisions)
        _same_docs(folder, spec, whole, out, (swap, prb, main, assessed), public[0])
    assert not (folder / "massc" / "replications").exists()


def _same_replications(m, spec, prb, whole, main):
    """The replications by partition (their selections, calibrations and study totals) give
    the release's estimates: the empirical epsilon and its table equal massc_replications',
    bit for bit, and the stage's epsilon is the larger of the formula's and this one."""
    from massc_reference import _release_margins, massc_replications, replication_plan

    from sdl_design.rng import release_seed
    from sdl_design.stages.massc.measures import epsilon_from_replications

    cfg, plan = main[0], main[1]
    R = int(spec.stages.massc.replications)
    assert R == 2 and m["n_replications"] == R
    prepared = replication_plan(
        prb.data, spec, whole, main, _release_margins(prb.data, spec, whole, cfg)
    )
    seed = release_seed(spec.release.seed, spec.release.year)
    est = massc_replications(prb.data, spec, seed, whole, list(range(R)), prepared=prepared)
    assert np.ptp(est, axis=0).max() > 0  # the replications differ
    eps, table = epsilon_from_replications(est, plan.truth, [tuple(x) for x in plan.zvars.labels])
    pd.testing.assert_frame_equal(m["tables"]["epsilon_replications"], table, check_exact=True)
    assert m["epsilon_empirical"] == eps > 0
    assert m["epsilon"] == max(eps, m["epsilon_formula"])


def _same_calibration(m, folder, spec, prb, whole, cfg, tr):
    """Step IV by partition equals the release's calibration (calibrate_treated on the
    treatment, with the original's cached side): the retained records with their calibrated
    weight and replicate weights, bit for bit, the domains' table, the replicates' report, the
    weight factors and the metrics; and the calibrated weights meet the original's control
    totals."""
    from massc_reference import _calibrate, _release_margins

    from sdl_design.survey.calibration import control_totals

    data, tables, metrics = _calibrate(
        prb.data, spec, cfg, tr, whole, True, margins=_release_margins(prb.data, spec, whole, cfg)
    )
    got = pd.read_parquet(folder / "data")
    assert len(got) == int(tr.retained.sum()) == len(data)
    _same_bits(got, data.reset_index(drop=True))
    for name in ("calibration_domains", "replicate_calibration", "weight_factors"):
        pd.testing.assert_frame_equal(m["tables"][name], tables[name], check_exact=True)
    assert {k: m[k] for k in metrics} == metrics
    assert m["calibration_domains_kept"] >= 1  # a declared domain is calibrated to
    # the control totals are met (to calibration's tolerance): an independent check
    cal = spec.stages.massc.calibration
    names = [k if isinstance(k, str) else k.name for k in cal.controls]
    from sdl_design.stages.massc.treatment import _coarsened

    want = control_totals(_coarsened(whole, cal.controls)[0], "wt", names)
    have = control_totals(_coarsened(got, cal.controls)[0], "wt", names)
    for c in names:
        for cat, v in want[c].items():
            assert abs(have[c][cat] - v) <= 1e-8 * v, (c, cat)
    return data


def _same_topcode(folder, spec, calibrated):
    """Top-coding by partition on MASSC's records equals TopcodeStage on the in-memory
    calibrated records: the coded records, the thresholds table and the metrics, bit for
    bit."""
    from sdl_design.stage import StageContext
    from sdl_design.stages.topcode import TopcodeStage

    stage = TopcodeStage.from_spec(spec)
    res = stage.run(calibrated, StageContext(calibrated, spec, "topcode"))
    got = pd.read_parquet(folder / "topcode" / "data")
    _same_bits(got, res.data.reset_index(drop=True))
    table = pd.read_csv(folder / "topcode" / "thresholds.csv", float_precision="round_trip")
    num = res.tables["thresholds"].select_dtypes("number").columns
    want = res.tables["thresholds"]
    for c in num:
        assert table[c].to_numpy(float).tobytes() == want[c].to_numpy(float).tobytes(), c
    assert want.loc[want["column"] == "income", "n_coded"].iloc[0] > 0  # the 99.5th percentile
    run = json.loads((folder / "run.json").read_text())["stages"]["topcode"]
    assert {k: run[k] for k in res.metrics} == res.metrics
    return res.data


def _same_assessment(folder, spec, whole, final, previous=None, rtol=1e-12, model_rtol=1e-10):
    """The assessment by partition equals the whole frames' (assess_reference) on the in-memory
    original and published records (previous: the stages before it; default the swap, which masked the
    design): the domain estimates (Taylor and replicate SEs of both files, 1e-12), the model
    coefficients (1e-10), the metrics (the published file's risk: re-identification, sample
    uniques, delta, PSU leak, 1e-12; its pMSE, 1e-9) and the gates, their values and
    verdicts (rtol, model_rtol: the domain estimates' and the models' tolerances)."""
    from assess_reference import assess_frames

    from sdl_design.stage import StageContext, StageResult

    if previous is None:
        previous = [StageResult("swap", None, masks_design=True, drop_public=[spec.design.segment])]
    stage = assess_frames(final, StageContext(whole, spec, "assess", previous))
    got = pd.read_csv(folder / "assess" / "domain_estimates.csv", float_precision="round_trip")
    want = stage.tables["domain_estimates"]
    assert list(got.columns) == list(want.columns) and len(got) == len(want) > 100
    for c in want.columns:
        if want[c].dtype.kind in "fiub":  # differences of estimates: to 1e-12 absolute
            atol = 1e-12 if c in ("relative_bias", "std_bias", "ci_overlap") else 1e-300
            np.testing.assert_allclose(
                got[c].to_numpy(float), want[c].to_numpy(float), rtol=rtol, atol=atol, err_msg=c
            )
        else:
            assert got[c].astype(str).tolist() == want[c].astype(str).tolist(), c
    assert want["se_replicate_released"].gt(0).any()  # replicate SEs on both sides
    coefs = pd.read_csv(folder / "assess" / "model_coefficients.csv", float_precision="round_trip")
    want = stage.tables["model_coefficients"]
    assert list(coefs.columns) == list(want.columns) and len(want) == 13  # age, sex, race terms
    for c in want.columns:
        if want[c].dtype.kind in "fi":  # (the replicate SEs: refits on 70 replicate weights)
            atol = 1e-12 if c in ("std_diff", "ci_overlap") else 1e-300
            np.testing.assert_allclose(
                coefs[c].to_numpy(float),
                want[c].to_numpy(float),
                rtol=model_rtol,
                atol=atol,
                err_msg=c,
            )
        else:
            assert coefs[c].astype(str).tolist() == want[c].astype(str).tolist(), c
    run = json.loads((folder / "run.json").read_text())["stages"]["assess"]
    m = stage.metrics
    compared = list(m)
    assert {"reid_share", "delta_published", "delta_profile_max_published"} <= set(compared)
    assert {"psu_recoverable", "unique_share_published", "epsilon_published"} <= set(compared)
    assert {"pmse_ratio", "pmse_k", "pmse_converged"} <= set(compared)
    # the intruder's attacks (sdl_design.attack), gathered from the partitions: the same numbers
    attacks = {"reid_share_worst", "reid_share_keys", "reid_precision", "nn_informed_share"}
    assert attacks | {"records_violating_2_anonymity", "global_risk_expected"} <= set(compared)
    assert run["pmse_k"] == m["pmse_k"] > 10 and run["pmse_converged"] == 1.0
    for k in compared:
        rel = model_rtol if k.startswith("model_") else 1e-9 if k.startswith("pmse") else rtol
        assert run[k] == pytest.approx(m[k], rel=rel, abs=1e-15), k
    assert run["psu_recoverable"] == m["psu_recoverable"]  # (a share of PSUs: exact)
    # the report's assessment: the same notes and worst estimates (its figures are drawn from
    # the same two tables)
    assert run["notes"] == stage.notes and len(stage.notes) >= 3
    worst = pd.read_csv(folder / "assess" / "worst_estimates.csv")
    key = ["variable", "statistic", "domain", "level"]
    want = stage.tables["worst_estimates"][key].astype(str)
    assert worst[key].astype(str).values.tolist() == want.values.tolist() and len(want) == 20
    assert m["reid_sample_uniques"] > 0 and m["reid_expected_matches"] > 0
    assert m["delta_published"] > 0 and m["unique_share_published"] > 0
    assert run["share_abs_std_bias_gt2"] < 0.5 and run["overlap_median"] > 0.5
    # AssessStage's gates (in the release's gates.csv): the same checks on the same values,
    # with the same verdicts
    got = pd.read_csv(folder / "gates.csv", float_precision="round_trip")
    got = got[got["name"].isin([g.name for g in stage.gates])]
    assert got["name"].tolist() == [g.name for g in stage.gates] and len(got) >= 9
    pairs = zip(got[["name", "value"]].itertuples(index=False), stage.gates, strict=True)
    for (name, value), g in pairs:
        rel = model_rtol if "model coefficient" in name else 1e-10  # (the models' refits)
        assert value == pytest.approx(g.value, rel=rel, abs=1e-15), name
    inside = [
        (g.lower is None or g.value >= g.lower) and (g.upper is None or g.value <= g.upper)
        for g in stage.gates
    ]
    assert got["passed"].tolist() == inside
    return stage


def _same_final(folder, spec, whole, final, previous=None, rtol=1e-11):
    """FinalStage by partition equals FinalStage on the in-memory records after the last
    stage (previous: the stages before it; default the swap): its SE table (every broad
    characteristic of both files, the same rows in the same order, SEs and deffs to rtol),
    its summary by design-effect class and its metrics (the SE ratios' quantiles, sample
    uniques before and after, records with a changed key, records retained)."""
    from sdl_design.stage import StageContext, StageResult
    from sdl_design.stages.final import FinalStage

    if previous is None:
        previous = [StageResult("swap", None, masks_design=True, drop_public=[spec.design.segment])]
    want = FinalStage(spec).run(final, StageContext(whole, spec, "final", previous))
    for name, t in want.tables.items():
        got = pd.read_csv(folder / "final" / f"{name}.csv", float_precision="round_trip")
        assert list(got.columns) == list(t.columns), name
        assert len(got) == len(t) > 0, name
        for c in t.columns:
            if t[c].dtype.kind in "fiu":
                np.testing.assert_allclose(
                    got[c].to_numpy(float), t[c].to_numpy(float), rtol=rtol, err_msg=(name, c)
                )
            else:
                assert got[c].astype(str).tolist() == t[c].astype(str).tolist(), (name, c)
    run = json.loads((folder / "run.json").read_text())["stages"]["final"]
    assert set(want.metrics) <= set(run)
    for k, v in want.metrics.items():
        assert run[k] == pytest.approx(v, rel=rtol, abs=1e-15), k
    assert run["notes"] == want.notes
    assert len(want.tables["se_ratios"]) > 100
    return want


def _same_gates(folder, spec, metric_gates, public, design=None, n=27, model_rtol=1e-10):
    """The partitioned release's gates.csv is the Great Expectations suites' gate table (the metric
    gates of PRB, MASSC and the assessment, then the public file's, read with its design:
    default the spec's) on the in-memory records: the same n gates in order, verdicts, and
    values (to 1e-10; a model coefficient's to model_rtol: the replicate refits)."""
    from expectations.suites import validate_metric_gates, validate_output

    puf, detail = public
    design = design or spec.design
    reps = design.replicate_weights.resolve(list(puf.columns))
    want = pd.concat(
        [
            validate_metric_gates([g.as_dict() for g in metric_gates]),
            validate_output(puf, spec, reps, True, detail),
        ],
        ignore_index=True,
    )
    got = pd.read_csv(folder / "gates.csv", float_precision="round_trip")
    assert got["name"].tolist() == want["name"].tolist() and len(got) == n
    assert got["passed"].tolist() == want["passed"].tolist()
    for name, value, expect in zip(got["name"], got["value"], want["value"], strict=True):
        rel = model_rtol if "model coefficient" in name else 1e-10
        assert value == pytest.approx(float(expect), rel=rel, abs=1e-15), name
    assert got["threshold"].tolist() == want["threshold"].tolist()
    run = json.loads((folder / "run.json").read_text())["public_files"]
    assert run["gates"] == n and run["gates_passed"] == int(want["passed"].sum())


def _same_docs(folder, spec, whole, out, memory, puf):
    """The partitioned chain's README.md and codebook.csv are, byte for byte, what
    write_public_files writes from variance_notes and codebook on the in-memory stages'
    results (swap, PRB, MASSC, top-coding, assessment) and public frame, and run.json has
    their digests; the partitioned StageResults carry the in-memory params and metrics
    the README reads."""
    import hashlib

    from massc_reference import _release_margins, massc_result

    from flows.public_docs import codebook, variance_notes
    from flows.public_files import neutralize_formulas
    from sdl_design.rng import release_seed
    from sdl_design.stage import StageContext
    from sdl_design.stages.topcode import TopcodeStage

    swap, prb, main, assessed = memory
    seed = release_seed(spec.release.seed, spec.release.year)
    margins = _release_margins(prb.data, spec, whole, main[0])
    massc = massc_result(prb.data, spec, seed, whole, main=main, margins=margins)
    topcode = TopcodeStage.from_spec(spec).run(massc.data, StageContext(whole, spec, "topcode"))
    results = [swap, prb, massc, topcode, assessed]
    readme = variance_notes(spec, results, puf)
    book = neutralize_formulas(codebook(puf, readme.codebook_notes))
    want = {
        "README.md": str(readme).encode(),
        "codebook.csv": book.to_csv(index=False, lineterminator="\n").encode(),
    }
    run = json.loads((folder / "run.json").read_text())["public_files"]["files"]
    for name, data in want.items():
        assert (_puf(folder) / name).read_bytes() == data, name
        assert run[name] == hashlib.sha256(data).hexdigest(), name
    # what they were made from: the partitioned stages' params and metrics
    got = out["stages"]
    assert got["swap"].params == swap.params and got["swap"].masks_design
    assert got["prb"].params == prb.params
    assert {k: massc.params[k] for k in got["massc"].params} == got["massc"].params
    for k in (
        "n_substituted", "share_substituted", "n_subsampled_out", "calibration_factor_min",
        "calibration_factor_max", "n_no_donor", "n_no_donor_domain",
    ):  # fmt: skip
        assert got["massc"].metrics[k] == massc.metrics[k], k
    assert massc.metrics["n_substituted"] > 0
    for k in ("published_columns", "dropped_columns"):
        assert got["assess"].params[k] == assessed.params[k], k
    # the README says what ran, with the numbers of the in-memory stages
    text = str(readme)
    assert (
        "JKn" in text and "substituted by MASSC of Singh (2009)" in text and "top-coded at" in text
    )
    assert f"{int(massc.metrics['n_substituted']):,} records" in text
    assert book.set_index("variable").loc["bmi", "n_missing"] == puf["bmi"].isna().sum() > 0


def _same_public(folder, spec, final, tmp_path, design=None, drop=None):
    """The public data files the partitioned chain writes (puf/) are the release's, byte for
    byte: public_frame of the in-memory records after the last stage (the design masked:
    by the swap, which drops the segment, by default; design: the public file's when a stage
    built one), written by write_public_files."""
    from flows.public_files import detail_frame, public_records, write_public_files
    from sdl_design.stage import design_columns

    d = design or spec.design
    built = design_columns(d, list(final.columns))
    drop = [spec.design.segment] if drop is None else drop
    puf, rows = public_records(final, spec, True, drop, built, [c for c in (d.strata, d.psu) if c])
    detail = detail_frame(puf, final, rows, spec)  # the edit rules' values (_same_gates)
    # the confidential record map: each public row's input row, as the release's
    rm = pd.read_parquet(folder / "internal" / "record_map.parquet")
    got = rm.dropna().sort_values("public_row")
    assert got["public_row"].tolist() == list(range(len(puf)))
    assert got["input_row"].tolist() == list(rows)
    ref = write_public_files(puf, tmp_path / "public-in-memory", "")
    run = json.loads((folder / "run.json").read_text())["public_files"]
    assert run["records"] == len(puf)
    for name in ("puf.parquet", "puf.csv"):
        assert (_puf(folder) / name).read_bytes() == (
            tmp_path / "public-in-memory" / name
        ).read_bytes(), name
        assert run["files"][name] == ref[f"public/{name}"]
    return puf, detail


@pytest.mark.flow  # a whole release chain by partition
def test_massc_calibration_by_partition_pools_drops_and_calibrates_replicates_to_domains(
    clean, tmp_path
):
    """Without the swap the replicate weights are the original's, so Step IV calibrates them
    to the declared domains too; age x race and age x race x marital pool their small cells,
    and with bounds (0.8, 1.25) the weight's calibration is infeasible until age x race is
    dropped. By partition (7 partitions, PRB then MASSC) the cells, pooling, the drop, the
    replicates' totals and factors and every calibrated weight equal the release's."""
    from flows.scan import run_partitioned
    from sdl_design.stage import StageContext
    from sdl_design.stages.prb import PrbStage

    path, _, whole = clean
    data = yaml.safe_load(path.read_text())
    data["utility"]["domains"] = ["sex", "region", ["age", "race"], ["age", "race", "marital"]]
    data["stages"]["massc"]["donor_restrictions"] = []
    data["stages"]["swap"]["enabled"] = False
    data["stages"]["massc"]["calibration"]["bounds"] = [0.8, 1.25]
    data["stages"]["prb"]["cells"] = None  # the keys of C: the setting this case was built on
    new = path.parent / "calibration-pools-drops.yaml"
    new.write_text(yaml.safe_dump(data))
    spec = load_spec(new)
    prb = PrbStage.from_spec(spec).run(whole, StageContext(whole, spec, "prb"))
    cfg, _, tr, _, _ = _release_massc(spec, prb, whole)
    out = run_partitioned(new, "thread", partitions=7, out=tmp_path / "p", release=False)
    m = flat(out["stages"]["massc"])
    _same_calibration(m, tmp_path / "p" / "massc", spec, prb, whole, cfg, tr)
    status = m["tables"]["calibration_domains"]["status"].tolist()
    assert status[:2] == ["kept", "kept"]
    assert status[2] == "dropped: calibration of the weight infeasible with it"
    assert status[3].endswith("cells pooled")
    assert m["calibration_replicate_domains"] == 3.0  # the replicates take the margins
    assert (m["tables"]["replicate_calibration"]["status"] == "ok").all()


@pytest.mark.flow  # a whole release chain by partition
@pytest.mark.parametrize(
    ("method", "replicates", "per_stratum"),
    [("jkn", None, None), ("bootstrap", 20, 3)],
    ids=["jkn", "bootstrap"],
)
def test_pseudo_design_by_partition_is_the_stages_and_the_release_reads_it(
    clean, tmp_path, method, replicates, per_stratum
):
    """Without the swap, PRB and MASSC, the pseudo design by partition (after top-coding, 7
    partitions; the original PSUs of a stratum span partitions) gives PseudoDesignStage's
    records bit for bit: pseudo strata and PSUs in place of the original labels, its
    replicate weights in place of the original 70 (w times the factors of the record's pseudo
    PSU: JKn, or Rao-Wu bootstrap draws from the stage's Generator), and its params, metrics
    (PSU purity) and notes. The release then reads the file with the pseudo design: the public
    data files are the release's, byte for byte; the assessment (domain estimates with the
    pseudo design's replicate SEs) and the gates are the flow's."""
    from flows.scan import run_partitioned
    from sdl_design.stage import StageContext, public_design
    from sdl_design.stages.pseudo import PseudoDesignStage
    from sdl_design.stages.topcode import TopcodeStage

    path, _, whole = clean
    data = yaml.safe_load(path.read_text())
    data["stages"]["swap"]["enabled"] = False
    data["stages"]["prb"] = data["stages"]["massc"] = None
    data["gates"]["xi"] = None  # no PRB: its gate is not checked
    data["design"]["pseudo"] = {"replicate_method": method}
    if replicates:
        data["design"]["pseudo"] |= {"replicates": replicates, "psus_per_stratum": per_stratum}
    new = path.parent / f"pseudo-{method}.yaml"
    new.write_text(yaml.safe_dump(data))
    spec = load_spec(new)
    out = run_partitioned(new, "thread", partitions=7, out=tmp_path / "p")
    assert list(out["stages"]) == ["risk", "topcode", "pseudo_design", "final", "assess"]
    ctx = StageContext(whole, spec, "topcode")
    top = TopcodeStage.from_spec(spec).run(whole, ctx)
    ps = PseudoDesignStage.from_spec(spec).run(top.data, ctx.for_stage("pseudo_design", [top]))
    assert ps.params["built"] and ps.params["pseudo_strata"] > 1
    got = pd.read_parquet(tmp_path / "p" / "pseudo_design" / "data")
    _same_bits(got, ps.data.reset_index(drop=True))
    reps = ps.params["public_design"]["replicate_weights"]
    assert len(reps) == (replicates or ps.params["pseudo_psus"])
    assert not (
        got[reps].to_numpy() == whole[spec.replicate_columns(whole)[0]].to_numpy()[:, None]
    ).all()
    res = flat(out["stages"]["pseudo_design"])
    assert res["params"] == ps.params and res["notes"] == ps.notes
    assert {k: res[k] for k in ps.metrics} == ps.metrics and res["psu_purity_max"] < 1
    design = public_design(spec, [top, ps])
    public = _same_public(tmp_path / "p", spec, ps.data, tmp_path, design=design, drop=[])
    puf = public[0]
    assert set(reps) <= set(puf.columns)
    # the pseudo design's SEs to 1e-11 (one Taylor SE of 6,370 near cancellation: 2.4e-12);
    # a bootstrap replicate separates a model term (its refit runs off to |b| 31): its
    # coefficients move by 2e-6 when the same records are only shuffled in memory
    assessed = _same_assessment(
        tmp_path / "p",
        spec,
        whole,
        ps.data,
        [top, ps],
        rtol=1e-11,
        model_rtol=1e-10 if method == "jkn" else 1e-5,
    )
    assert assessed.metrics["psu_recoverable"] == 0  # no original PSU in the pseudo design
    fin = _same_final(tmp_path / "p", spec, whole, ps.data, [top, ps])
    assert fin.metrics["share_keys_changed"] == 0  # top-coding changes no key
    _same_gates(
        tmp_path / "p",
        spec,
        assessed.gates,
        public,
        design=design,
        n=24,
        model_rtol=1e-10 if method == "jkn" else 1e-5,
    )
    # the public README and codebook: the in-memory docs of these stages, with the pseudo
    # design's section and its replicate scales
    from flows.public_docs import codebook, variance_notes
    from flows.public_files import neutralize_formulas

    readme = variance_notes(spec, [top, ps, assessed], puf)
    book = neutralize_formulas(codebook(puf, readme.codebook_notes))
    assert (_puf(tmp_path / "p") / "README.md").read_text() == str(readme)
    assert "Pseudo-design for variance estimation" in str(readme)
    assert (_puf(tmp_path / "p") / "codebook.csv").read_text() == book.to_csv(
        index=False, lineterminator="\n"
    )


def _release_massc(spec, prb, whole):
    """MASSC's treatment as the release runs it (plan, treatment, meet_delta's revisions)."""
    from massc_reference import _main

    from sdl_design.rng import release_seed

    seed = release_seed(spec.release.seed, spec.release.year)
    return _main(prb.data, spec, seed, whole)


def _same_treatment(m, folder, donor, tr, dm, plan):
    """The partitioned chain's substitution d(1), retention rates phi, subsampling d(2),
    delta (by appearance) and information loss (eq. 7-8b, epsilon) equal the release's, bit
    for bit."""
    from sdl_design.stages.massc.measures import information_loss

    sel = pd.read_parquet(folder / "select_psi")["__sel"].to_numpy()
    assert ((sel & (donor >= 0)) == tr.substituted).all()
    assert (pd.read_parquet(folder / "select_phi")["__sel"].to_numpy() == tr.retained).all()
    assert m["tables"]["rates"]["phi"].to_numpy().tobytes() == tr.phi.rates.tobytes()
    assert m["n_substituted"] == int(tr.substituted.sum()) > 0
    assert m["n_subsampled_out"] == int((~tr.retained).sum()) > 0
    assert m["delta"] == dm.delta
    pd.testing.assert_frame_equal(m["tables"]["delta"], dm.by_appearance, check_exact=True)
    il = information_loss(tr.moments, plan.psi.rates, tr.phi.rates, plan.truth, plan.sampling_var)
    pd.testing.assert_frame_equal(m["tables"]["epsilon_formula"], il, check_exact=True)
    assert m["epsilon_formula"] == float(np.nanmax(il["rrmse"])) > 0


def _same_moments(m, plan):
    """The partitioned chain's strata, moments, original totals with their Taylor SEs,
    disclosure costs and substitution rates psi equal the release's MASSC plan's (psi and the
    costs after meet_delta's revisions), bit for bit."""
    mom = plan.moments
    assert m["strata"] == dict(zip(plan.labels, np.bincount(plan.h).tolist(), strict=True))
    t, k = m["tables"]["moments"], len(mom.theta)
    totals = m["tables"]["study_totals"]
    assert m["tables"]["epsilon_formula"]["theta"].to_numpy().tobytes() == mom.theta.tobytes()
    assert totals["original_total"].to_numpy().tobytes() == plan.truth.tobytes()
    assert totals["original_se"].to_numpy().tobytes() == np.sqrt(plan.sampling_var).tobytes()
    assert (plan.sampling_var > 0).all()
    rates = m["tables"]["rates"]
    assert rates["cost_a"].to_numpy().tobytes() == plan.cost.tobytes()
    assert rates["psi"].to_numpy().tobytes() == plan.psi.rates.tobytes()
    assert m["psi_method"] == plan.psi.method
    assert (plan.psi.rates > 0).any()  # a stratum is treated
    assert t["stratum"].tolist() == [h for h in mom.strata for _ in range(k)]
    for col, ref in (("sum_nu", mom.V), ("S2_nu", mom.S2_nu)):
        assert t[col].to_numpy().reshape(len(mom.strata), k).tobytes() == ref.tobytes(), col


@pytest.mark.flow  # a whole release chain by partition
@pytest.mark.parametrize("cuts", ["row groups", "files"])
def test_massc_moments_by_partition_span_blocks_to_the_bit(clean, tmp_path, monkeypatch, cuts):
    """With blocks of 64 records (sdl_design.survey.blocksum) the 3,000 records are 47 blocks, cut by
    the 7 partitions inside blocks (or the input as files of 760, 270, 1,000 and 970 records,
    read in partitions of 768, 256, 1,024 and 952 that span files, and each stage's records
    read back in those partitions): the moments, original totals and variances, psi, the
    selections and phi by partition are still massc_plan's and massc_treat's bits (memory
    sums in the same blocks), and the sums differ from one bincount's."""
    from flows.scan import run_partitioned
    from sdl_design.stages.massc.stage import massc_config
    from sdl_design.stages.massc.treatment import massc_plan
    from sdl_design.survey import blocksum

    path, spec, whole = _with_donors(clean)
    _, prb = _in_memory(spec, whole)
    cfg = massc_config(spec, prb.data)
    first = massc_plan(prb.data, cfg, _massc_rng(spec), whole)
    one_block, one_block_var = first.moments, first.sampling_var
    monkeypatch.setattr(blocksum, "BITS", 6)
    monkeypatch.setattr(blocksum, "BLOCK", 64)
    n = 7
    if cuts == "row groups":
        _cut_at_row_groups(monkeypatch)  # partitions that begin inside blocks
    else:
        table = pq.read_table(spec.release.input)
        (tmp_path / "in").mkdir()
        for i, (a, b) in enumerate([(0, 760), (760, 1030), (1030, 2030), (2030, N)]):
            pq.write_table(table.slice(a, b - a), tmp_path / "in" / f"{i}.parquet")
        data = yaml.safe_load(path.read_text())
        data["release"]["input"] = str(tmp_path / "in")
        path = tmp_path / "files.yaml"
        path.write_text(yaml.safe_dump(data))
        parts = P.plan_partitions(tmp_path / "in")
        assert [(p.start, len(p.pieces)) for p in parts] == [(0, 2), (768, 1), (1024, 3), (2048, 1)]
        n = None
    cfg, plan, tr, dm, _ = _release_massc(spec, prb, whole)
    assert plan.moments.S2_nu.tobytes() != one_block.S2_nu.tobytes()  # other sums, other bits
    assert plan.sampling_var.tobytes() != one_block_var.tobytes()
    np.testing.assert_allclose(plan.moments.theta, one_block.theta, rtol=1e-12)
    out = run_partitioned(path, "thread", partitions=n, out=tmp_path / "p", release=False)
    _same_moments(flat(out["stages"]["massc"]), plan)
    donor = pd.read_parquet(tmp_path / "p" / "internal" / "massc" / "donors")["__donor"].to_numpy()
    _same_treatment(flat(out["stages"]["massc"]), tmp_path / "p" / "massc", donor, tr, dm, plan)
    _same_calibration(
        flat(out["stages"]["massc"]), tmp_path / "p" / "massc", spec, prb, whole, cfg, tr
    )
    from massc_reference import _calibrate

    got = pd.read_parquet(tmp_path / "p" / "massc" / "data")
    monkeypatch.setattr(blocksum, "BITS", 16)  # one block: other sums, other weights' bits
    monkeypatch.setattr(blocksum, "BLOCK", 1 << 16)
    one = _calibrate(prb.data, spec, cfg, tr, whole, True)[0]
    assert one["wt"].to_numpy().tobytes() != got["wt"].to_numpy().tobytes()
    np.testing.assert_allclose(one["wt"].to_numpy(), got["wt"].to_numpy(), rtol=1e-12)


def _massc_rng(spec):
    from sdl_design.rng import release_seed, stage_rng

    return stage_rng(release_seed(spec.release.seed, spec.release.year), "massc")


def test_donor_draws_by_partition_continue_the_generator_as_find_donors(clean):
    """The driver's Generator after the donor plan is where find_donors leaves it (the
    partitions' draws skipped by PCG64.advance), so later MASSC draws are the same; a
    Generator other than PCG64 is refused with the fix."""
    from sdl_design.stages.massc.donors import find_donors
    from sdl_design.stages.massc.treatment import domain_cells

    path, spec, whole = _with_donors(clean)
    req = pms.massc_request(spec, P.input_columns(spec.release.input))
    parts = P.plan_partitions(spec.release.input, 3)
    tables = [pms.donor_pass1(p, spec, req) for p in parts]
    a, b = np.random.default_rng(5), np.random.default_rng(5)
    find_donors(
        whole, list(req.keys), list(req.sensitive), dict(req.importance), [], a,
        cells=domain_cells(whole, list(req.cells)),
    )  # fmt: skip
    plan = pms.donor_plan(tables, req, b)
    assert a.random(4).tolist() == b.random(4).tolist()
    assert sum(len(t) for t in tables) >= plan.n_profiles  # a profile may be in several parts
    with pytest.raises(P.PartitionError, match="PCG64"):
        pms.donor_plan(tables, req, np.random.Generator(np.random.MT19937(1)))


@pytest.mark.parametrize(
    ("domains", "restrictions"),
    [(None, ()), (["sex", ["age", "race", "region"]], ("education",))],
    ids=["every-key", "age-race-region"],
)
def test_records_without_a_donor_in_their_domain_cell_by_partition(clean, domains, restrictions):
    """The donor plan's count of records with no partner only because of the declared domain
    cells (MASSC's n_no_donor_domain, for the README) is the in-memory count: records whose
    cell (restrictions x domains) holds a single key profile while their restriction group
    holds several, counted by pandas on the whole file."""
    from sdl_design.stages.massc.treatment import domain_cells

    path, _, whole = clean
    data = yaml.safe_load(path.read_text())
    if domains is not None:
        data["utility"]["domains"] = domains
    data["stages"]["massc"]["donor_restrictions"] = list(restrictions)
    new = path.parent / f"no-donor-{len(restrictions)}.yaml"
    new.write_text(yaml.safe_dump(data))
    spec = load_spec(new)
    req = pms.massc_request(spec, P.input_columns(spec.release.input))
    parts = P.plan_partitions(spec.release.input, 3)
    plan = pms.donor_plan([pms.donor_pass1(p, spec, req) for p in parts], req, _massc_rng(spec))
    f = pd.DataFrame(
        {
            "r": whole[list(restrictions)].astype(str).agg("|".join, axis=1) if restrictions else 0,
            "cell": domain_cells(whole, list(req.cells)),
            "key": domain_cells(whole, list(req.keys)),
        }
    )
    one = f.groupby(["r", "cell"])["key"].transform("nunique") == 1
    several = f.groupby("r")["key"].transform("nunique") > 1
    want = int((one & several).sum())
    assert plan.n_no_donor_domain == want
    if domains is None:  # every key a domain: no record has a partner
        assert want == len(whole)
    else:
        assert 0 < want < len(whole)


def test_advanced_generator_draws_the_stages_doubles_from_the_kth_on():
    """A partition's draws: the stage Generator's doubles from the k-th on, for any k (PCG64
    takes one step per double), so draws made by partition are the in-memory draws."""
    rng = np.random.default_rng(2026)
    state = rng.bit_generator.state
    whole = rng.random(1000)
    for k in (0, 1, 17, 999):
        assert pms.advanced(state, k).random(1000 - k).tobytes() == whole[k:].tobytes()


def test_numeric_control_and_substrata_by_partition(clean, tmp_path):
    """A numeric calibration control (a single total, sum w x) and k-means substrata by
    partition, the same bits on 1 and 3 partitions: the retained records' weights, solved on
    profile sums (records of one calibration profile, the numeric value included, share g),
    meet the original's total of income and its sex margin; a variable y of two separated
    groups splits every merged risk stratum of 200 records or more into exactly those groups,
    numbered by increasing centroid (the N of each substratum in the rates table)."""
    from flows.scan import run_partitioned
    from sdl_design.stages.massc.strata import massc_strata

    path, spec, whole = clean
    grp = np.random.default_rng(4).integers(0, 2, len(whole))
    df = pd.read_parquet(spec.release.input)
    df["y"] = grp * 100.0 + np.random.default_rng(5).normal(0, 1, len(df))
    new_input = path.parent / "input" / "with_y.parquet"
    pq.write_table(pa.Table.from_pandas(df, preserve_index=False), new_input, row_group_size=GROUP)
    data = yaml.safe_load(path.read_text())
    data["release"]["input"] = str(new_input)
    massc = data["stages"]["massc"]
    massc["calibration"]["controls"] = ["sex", "income"]
    massc["replications"] = 0
    massc["strata_merge"] = {"D": "NU", "T": "NU", "O": "NU"}
    massc["substrata"] = {"variables": ["y"], "k": 2, "min_records": 100}
    for name in ("swap", "topcode"):
        data["stages"][name]["enabled"] = False
    del data["stages"]["prb"]
    new = path.parent / "numeric-substrata.yaml"
    new.write_text(yaml.safe_dump(data))
    spec = load_spec(new)
    got, rates = {}, {}
    for n in (1, 3):
        out = run_partitioned(new, "thread", partitions=n, out=tmp_path / str(n), release=False)
        got[n] = pd.read_parquet(tmp_path / str(n) / "massc" / "data")
        rates[n] = out["stages"]["massc"].tables["rates"]
    _same_bits(got[3], got[1])
    pd.testing.assert_frame_equal(rates[3], rates[1], check_exact=True)
    w, w0 = spec.design.weight, whole[spec.design.weight]
    b2 = got[3]
    assert (b2[w] * b2["income"]).sum() == pytest.approx((w0 * whole["income"]).sum(), rel=1e-9)
    want_sex = w0.groupby(whole["sex"]).sum()
    pd.testing.assert_series_equal(b2.groupby("sex")[w].sum(), want_sex, rtol=1e-9)
    base = massc_strata(whole, spec.variables.keys, massc["strata_merge"]).to_numpy()
    want = {}
    for label in np.unique(base):
        n_h = (base == label).sum()
        for g in (0, 1):
            name = f"{label}:{g + 1}" if n_h >= 200 else label
            want[name] = want.get(name, 0) + int(((base == label) & (grp == g)).sum())
    assert len(want) >= 3 and any(":" in k for k in want)
    assert dict(zip(rates[3]["stratum"], rates[3]["N"], strict=True)) == want


@pytest.mark.flow  # two assessment chains by partition
def test_models_of_continuous_terms_by_partition_are_their_cells_fits(clean, tmp_path, monkeypatch):
    """Models whose distinct (x, y) rows are about their records (a continuous response or
    term) are fitted from their partitions' sums, no record on the driver (fit_by_partition:
    Newton's steps by pass, the replicate refits, the sandwich from PSU totals): with
    MODEL_CELLS_MAX at 200 (3 partitions of 1,000 records) the coefficients, Taylor and
    replicate SEs and statuses equal svyglm's on the gathered cells (the same run, the cap at
    its default) to 1e-9, for a gaussian, a logit and a log model."""
    from flows.scan import run_partitioned
    from sdl_design.stages.assess import passes as pas

    path, _, _ = clean
    data = yaml.safe_load(path.read_text())
    del data["stages"]["prb"]
    data["stages"]["massc"]["enabled"] = False
    data["stages"]["topcode"]["enabled"] = False
    data["utility"]["models"] = [
        {"formula": "bmi ~ sex + C(age)", "family": "gaussian"},
        {"formula": "diabetes ~ bmi + income + sex", "family": "binomial"},
        {"formula": "hh_size ~ age + sex", "family": "poisson"},
    ]
    new = path.parent / "continuous-model.yaml"
    new.write_text(yaml.safe_dump(data))
    run_partitioned(new, "thread", partitions=3, out=tmp_path / "cells")
    calls = []
    real = pas.model_sums_pass
    monkeypatch.setattr(pas, "MODEL_CELLS_MAX", 200)
    monkeypatch.setattr(pas, "model_sums_pass", lambda *a: calls.append(a[5]) or real(*a))
    run_partitioned(new, "thread", partitions=3, out=tmp_path / "sums")
    assert {"first", "newton", "candidate", "taylor"} <= set(calls)
    got, want = (
        pd.read_csv(
            tmp_path / d / "assess" / "model_coefficients.csv", float_precision="round_trip"
        )
        for d in ("sums", "cells")
    )
    assert len(got) == len(want) > 20 and got["model"].nunique() == 3
    for c in want.columns:
        if want[c].dtype.kind == "f":
            np.testing.assert_allclose(got[c], want[c], rtol=1e-9, atol=1e-11, err_msg=c)
        else:
            assert got[c].astype(str).tolist() == want[c].astype(str).tolist(), c


@pytest.mark.flow  # a whole release chain by partition
def test_puf_partitioned_with_a_failed_gate_exits_1_and_leaves_no_puf(clean, tmp_path, capsys):
    """Issue 35 item 3: an unpublished partitioned run whose gates fail exits 1, names the
    failed gate, and leaves its files in puf-gates-failed/, never a puf/ that looks ready."""
    path, _, _ = clean
    data = yaml.safe_load(path.read_text())
    data["gates"].setdefault("utility", {})["overlap_median_min"] = 0.999
    strict = path.parent / "strict.yaml"
    strict.write_text(yaml.safe_dump(data, sort_keys=False))
    out = tmp_path / "run"
    assert puf(["partitioned", str(strict), "--partitions", "2", "--out", str(out)]) == 1
    cap = capsys.readouterr()
    assert "median CI overlap of domain estimates" in cap.err and "Traceback" not in cap.err
    assert "puf-gates-failed/puf.parquet" in cap.out
    assert not (out / "puf").exists() and (out / "puf-gates-failed" / "puf.parquet").exists()


def test_validate_by_partition_is_the_scan(clean, tmp_path, capsys):
    """`puf validate SPEC --partitions N` scans the input as `puf scan` does (its tables in
    --out)."""
    path, _, _ = clean
    folder = tmp_path / "scan"
    assert puf(["validate", str(path), "--partitions", "2", "--out", str(folder)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("scanned") and "risk strata" in out
    assert {"se.csv", "edits.csv", "key_risk.csv"} <= {p.name for p in folder.iterdir()}


def test_replications_at_once_bounded_by_their_indicators():
    """A batch of MASSC replications exchanges two 1-byte indicators a record each (the
    uniforms are drawn where the records are selected): at most REPLICATION_BYTES of them
    (10 at the ACS's 15M records: one batch), never none."""
    at = pcal.replications_at_once
    assert at(300_000) == pcal.REPLICATIONS_AT_ONCE
    assert at(15_000_000) == 13 and at(10**9) == 1
    for n in (10**5, 10**6, 3 * 10**6, 10**7, 10**8):
        assert 2 * n * at(n) <= pcal.REPLICATION_BYTES or at(n) == 1


def test_totals_at_once_and_the_arrays_they_measure():
    """The replications' study totals in maps of as many as TOTALS_BYTES holds when about
    TOTALS_HELD partitions' partials are held at a time (measured by array_bytes: every numpy
    array in dataclasses, dicts, lists, tuples), never none."""
    from dataclasses import dataclass

    from sdl_design.engine.cache import array_bytes

    @dataclass
    class Partial:
        sums: np.ndarray
        head: list
        first: int

    got = [Partial(np.zeros((3, 4)), [{"x": np.zeros(10, np.int32)}, None], 7), (np.ones(5),)]
    assert array_bytes(got) == 3 * 4 * 8 + 10 * 4 + 5 * 8
    at, B, H = pcal.totals_at_once, pcal.TOTALS_BYTES, pcal.TOTALS_HELD
    assert at(0, 1) == at(1, 15) == pcal.REPLICATIONS_AT_ONCE
    # partials added as they arrive: about TOTALS_HELD partitions' worth held at a time
    assert at(B // 3, 1) == 3 and at(B + 1, 1) == 1 and at(B + 1, H) == 1
    assert at(B // 2, 15) == 15 * 2 // H and at(3 * B, 15) == 1
    assert at(B // 3, 4) == 3  # fewer partitions than TOTALS_HELD: all of them held


def test_record_uniforms_are_splitmix64_by_row():
    """record_uniforms(key, rows): output row + 1 of SplitMix64 from state key, as its
    reference loop computes it in Python integers (Steele, Lea & Flood 2014), in any order
    of rows; 53 bits as Generator.random; uniform on [0, 1) (Kolmogorov-Smirnov)."""
    from scipy import stats

    from sdl_design.stages.massc.treatment import record_uniforms

    mask = 2**64 - 1

    def splitmix(state: int, n: int) -> list[float]:
        out = []
        for _ in range(n):
            state = (state + 0x9E3779B97F4A7C15) & mask
            z = state
            z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
            z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
            out.append(((z ^ (z >> 31)) >> 11) * 2.0**-53)
        return out

    key = 0xFEDCBA9876543210
    ref = splitmix(key, 300)
    rows = np.random.default_rng(0).permutation(300)
    assert record_uniforms(np.uint64(key), rows).tolist() == [ref[r] for r in rows]
    u = record_uniforms(np.uint64(12345), np.arange(200_000))
    assert u.min() >= 0.0 and u.max() < 1.0
    assert stats.kstest(u, "uniform").pvalue > 1e-3


@pytest.mark.parametrize("strata", ["h", None])
def test_psu_rows_are_the_pairs_lookup(strata):
    """A record's row in the design's PSU table: the lookup of its (stratum, psu) pair in a
    MultiIndex of the table (labels of several types, a design without strata too)."""
    rng = np.random.default_rng(1)
    b0 = pd.DataFrame({"h": rng.choice(["a", "b", "c"], 1000), "p": rng.integers(1, 5, 1000)})
    first = b0["h"] if strata else pd.Series(np.zeros(len(b0), np.int64))
    pairs = pd.MultiIndex.from_arrays([first, b0["p"]])
    psus = pd.DataFrame({"s": pairs.get_level_values(0), "p": pairs.get_level_values(1)})
    psus = psus.drop_duplicates().sort_values(["s", "p"]).reset_index(drop=True)
    want = [psus.index[(psus["s"] == s) & (psus["p"] == p)][0] for s, p in pairs]
    req = pms.MasscRequest(
        keys=(), sensitive=(), importance=(), restrictions=(), cells=(), substitute=(),
        need=(), study=(), weight="w", merge=(), max_levels=0, min_records=0, strata=strata,
        psu="p",
    )  # fmt: skip
    assert pms._psu_rows(b0, req, psus).tolist() == want


def test_retained_counts_are_mapped_once_for_a_selection_as_written(tmp_path):
    """Run.retained: each input partition's selected records (the __sel column of the
    selection's part files), counted by one map however often the stages ask (the final stage
    and the assessment's risk), again once the selection is written anew; without a
    selection every record."""
    import os

    from sdl_design.engine.records import Run

    inputs = [P.Partition((), a, b) for a, b in ((0, 40), (40, 100))]
    folder = tmp_path / "selected"
    folder.mkdir()
    rng = np.random.default_rng(2)

    def write() -> list[int]:
        counts = []
        for p in inputs:
            sel = rng.random(p.stop - p.start) < 0.6
            pd.DataFrame({"__sel": sel}).to_parquet(folder / f"part-{p.start:012d}.parquet")
            counts.append(int(sel.sum()))
        return counts

    calls = []

    def run_map(fn, parts, *args, what=""):
        calls.append(what)
        return [fn(p, *args) for p in parts]

    run = Run(run_map, inputs, {})
    assert run.retained([]) == [40, 60] and not calls  # no selection: every record
    want = write()
    run.selected = str(folder)
    assert run.retained([]) == want and run.retained([]) == want
    assert calls == ["retained records"]
    want = write()  # written anew (another file identity): counted again
    for p in inputs:
        path = folder / f"part-{p.start:012d}.parquet"
        os.utime(path, ns=(path.stat().st_mtime_ns + 10**9,) * 2)
    assert run.retained([]) == want and len(calls) == 2
