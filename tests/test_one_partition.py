"""The in-memory release as the one-partition case of the stages' passes: a frame held in
memory is a partition (FramePartition) whose passes read it and whose writes are held, not
written; a stage written once (Passes) runs on it with run(df, ctx) and gives, on a file cut
into Parquet partitions, the same records."""

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_design_optional import _weights_only, _weights_only_spec

from sdl_design.engine import partitions as P
from sdl_design.engine.records import IN_MEMORY, Records, Run, in_memory
from sdl_design.pseudo import apply_pseudo, pseudo_plan
from sdl_design.spec import parse_spec
from sdl_design.stage import StageContext
from sdl_design.stages.pseudo import PseudoDesignStage
from sdl_design.stages.topcode import TopcodeStage
from sdl_design.stages.topcode.method import _block_total, topcode_frame, topcode_summary
from sdl_design.survey.design import design_columns


def test_a_frame_partition_reads_by_position_and_holds_what_is_written():
    df = pd.DataFrame({"a": [3, 1, 2], "b": list("xyz")}, index=[10, 4, 7])
    part = P.FramePartition.of(df)
    got = P.read_partition(part, ["b"], None)
    assert list(got.index) == [0, 1, 2] and list(got["b"]) == list("xyz")
    assert list(df.index) == [10, 4, 7]  # the frame itself is not relabelled
    folder = P.memory_folder("t")
    name = P._write_partition(got.assign(__sel=[True, False, True]), part, folder)
    assert name.startswith(P.MEMORY) and not any(P.Path(".").glob("memory:*"))
    assert P._selected(part, folder).tolist() == [True, False, True]
    (held,) = P.held(folder)
    assert list(held.columns) == ["b", "__sel"]
    P.release_memory(folder)
    assert P.held(folder) == []


def _stratified():
    df = _weights_only().assign(stratum=lambda d: d.pid % 6)
    data = _weights_only_spec(xi=0.45, se_ratio=[0.7, 1.4])
    data["design"]["strata"] = "stratum"
    return df, parse_spec(data)


def test_topcode_in_memory_is_the_whole_frame_method_with_the_frames_labels():
    """TopcodeStage.run (its passes on one partition held in memory) on a frame labelled by
    other than its positions (the records MASSC kept): topcode_frame's records (the method on
    the whole frame), under the frame's labels; none of the run's laps in its metrics."""
    df, spec = _stratified()
    kept = df.iloc[::2].copy()  # index 0, 2, 4, ...: not the positions
    res = TopcodeStage.from_spec(spec).run(kept, StageContext(df, spec, "topcode"))
    want, table = topcode_frame(kept, spec.stages.topcode.columns, "w")
    pd.testing.assert_frame_equal(res.data, want)
    assert res.data.index.equals(kept.index)
    assert int(res.tables["thresholds"]["n_coded"].sum()) == int(table["n_coded"].sum()) > 0
    assert not [k for k in res.metrics if k.endswith("seconds")] and res.facts == {}
    # the report's: the thresholds table and topcode_summary's sentences of the whole frame's
    w = kept["w"].to_numpy(dtype=float)
    totals = {
        c: (_block_total(w * kept[c].to_numpy(float)), _block_total(w * want[c].to_numpy(float)))
        for c in spec.stages.topcode.columns
    }
    rules = spec.stages.topcode.columns
    _, _, notes = topcode_summary(rules, table, _block_total(w), totals)
    assert res.notes == notes and res.notes and res.report_tables == ["thresholds"]


def _record_level(df, spec, rng):
    """The pseudo design of a file without PSUs dealt record by record (each record its own
    unit, in record order), as build_pseudo_design defines it on the records."""
    d = spec.design
    plan = pseudo_plan(spec, list(df.columns), df[d.strata].to_numpy(), None, rng, n=len(df))
    return apply_pseudo(df, plan, np.arange(len(df)), d.weight), plan


@pytest.mark.parametrize("sizes", [[1500], [500, 400, 600]], ids=["one", "three"])
def test_pseudo_design_without_psus_by_partition_is_the_record_level_design(tmp_path, sizes):
    """Strata and no PSUs: the pseudo design deals the records (10 pseudo PSUs of records a
    pseudo stratum) in memory and on the file cut into 1 or 3 Parquet partitions: the
    record-level design's records, bit for bit."""
    df, spec = _stratified()
    ctx = StageContext(df, spec, "pseudo_design")
    want, plan = _record_level(df, spec, ctx.rng())
    assert plan.design.units == "record" and plan.design.psus_per_stratum == 10
    mem = PseudoDesignStage.from_spec(spec).run(df, ctx)
    pd.testing.assert_frame_equal(mem.data, want)

    records = _parquet_records(tmp_path, df, sizes)
    got = PseudoDesignStage.from_spec(spec).run_partitions(records, ctx)
    files = pd.read_parquet(tmp_path / "out" / "data")
    pd.testing.assert_frame_equal(files, want.reset_index(drop=True), check_dtype=False)
    assert got.params == mem.params
    # records as units: a pseudo PSU's purest share is one record of the smallest one's
    assert got.metrics["psu_purity_max"] == 1 / got.params["units_per_pseudo_psu_min"]


def test_in_memory_records_read_the_original_as_the_runs_input():
    df, spec = _stratified()
    ctx = StageContext(df, spec, "x")
    r = in_memory(df, ctx)
    assert r.parts == r.run.inputs and r.n == len(df) and r.data.startswith(P.MEMORY)
    other = in_memory(df.iloc[:10], ctx)
    assert other.parts != other.run.inputs and other.n == 10
    P.release_memory(r.data)
    P.release_memory(other.data)


def _parquet_records(tmp_path, df, sizes):
    """df as a Parquet file of row groups of these sizes, as the records so far of a stage
    writing to tmp_path/out (its partitions: one per row group)."""
    table = pa.Table.from_pandas(df, preserve_index=False)
    path = tmp_path / "in.parquet"
    with pq.ParquetWriter(path, table.schema) as w:
        for a, b in zip(np.cumsum([0, *sizes[:-1]]), np.cumsum(sizes), strict=True):
            w.write_table(table.slice(a, b - a))
    parts = P.plan_partitions(path)
    assert len(parts) == len(sizes)
    (tmp_path / "out" / "data").mkdir(parents=True)
    return Records(Run(IN_MEMORY, parts, {}, pd.DataFrame()), parts, list(df), tmp_path / "out")


@pytest.fixture(scope="module")
def prb_case():
    """The default spec's PRB on a small survey, and the whole-frame method's results with the
    stage's Generator: post_randomize, then the other method at its theta (the same stream)."""
    from helpers import DEFAULT_SPEC

    from sdl_design.spec import load_spec
    from sdl_design.stages.prb.method import post_randomize, prb_cells
    from sdl_design.synth import make_survey

    spec = load_spec(DEFAULT_SPEC)
    df = make_survey(n_persons=3000, seed=11)
    st = spec.stages.prb
    ctx = StageContext(df, spec, "prb")
    rng = ctx.rng()
    kw = dict(partition=st.partition, seed=rng, cells=prb_cells(spec, st))
    kw["domains"] = spec.utility.domain_list(spec.variables.key_names)
    w = spec.design.weight
    res = post_randomize(df, st.variables, st.xi, w, method=st.method, **kw)
    other = "nzy" if st.method == "prb" else "prb"
    base = post_randomize(df, st.variables, st.xi, w, method=other, theta=res.theta, **kw)
    return spec, df, ctx, res, base, other


def test_prb_stage_tables_are_the_whole_frame_methods(prb_case):
    """PrbStage.run (its passes on one partition held in memory): post_randomize's records,
    and its tables those of the whole-frame functions of paper 002 on them: Tables 1/4 with
    replicate SEs (count_changes), Table 6 (tvd_table, against the baseline method's file),
    Table 3 (empirical_risk), the domains not kept and the blocks' risks."""
    from sdl_design.stages.prb import PrbStage
    from sdl_design.stages.prb.method import (
        block_risk,
        count_changes,
        default_combos,
        domains_not_kept,
        empirical_risk,
        risk_by_block,
        tvd_table,
    )

    spec, df, ctx, res, base, other = prb_case
    st, w = spec.stages.prb, spec.design.weight
    out = PrbStage.from_spec(spec).run(df, ctx)
    pd.testing.assert_frame_equal(out.data, res.data)
    counts = count_changes(df, res.data, st.variables, w, spec.design).reset_index()
    got = out.tables["weighted_counts"]
    assert {"se", "se_star"} <= set(got.columns) and len(got) == len(counts)
    pd.testing.assert_frame_equal(got, counts, check_dtype=False, rtol=1e-9)
    combos = default_combos(st.variables[:5])
    tv = tvd_table(df, {st.method: res.data, other: base.data}, combos, w)
    pd.testing.assert_frame_equal(out.tables["tvd"], tv, rtol=1e-9)
    assert out.metrics[f"tvd_mean_{other}"] == pytest.approx(tv[other].mean(), rel=1e-9)
    emp = empirical_risk(res).reset_index(names="row")
    pd.testing.assert_frame_equal(out.tables["identification_risk"], emp)
    n, not_kept = domains_not_kept(res)
    assert out.metrics["n_moved_across_domains"] == n
    pd.testing.assert_frame_equal(out.tables["domains_not_kept"], not_kept, check_dtype=False)
    risk = block_risk(res.block, res.cell, res.theta)
    pd.testing.assert_frame_equal(
        out.tables["risk_by_block"], risk_by_block(risk).reset_index(), check_dtype=False
    )
    assert out.gates[0].value == risk["risk"].max() and "risk_hist" in out.figures


def test_prb_by_three_partitions_is_the_one_partition_stage(prb_case, tmp_path):
    """The same stage on the file cut into 3 Parquet partitions: the same records and params,
    the same tables (sums over partitions to 1e-12)."""
    from sdl_design.stages.prb import PrbStage

    spec, df, ctx, res, _, _ = prb_case
    one = PrbStage.from_spec(spec).run(df, ctx)
    records = _parquet_records(tmp_path, df, [1000, 1100, 900])
    three = PrbStage.from_spec(spec).run_partitions(records, ctx)
    files = pd.read_parquet(tmp_path / "out" / "data")
    pd.testing.assert_frame_equal(files, res.data.reset_index(drop=True), check_dtype=False)
    assert three.params == one.params and three.notes == one.notes
    for name, table in one.tables.items():
        pd.testing.assert_frame_equal(three.tables[name], table, rtol=1e-12, obj=name)


@pytest.fixture(scope="module")
def swap_case():
    from helpers import DEFAULT_SPEC

    from sdl_design.spec import load_spec
    from sdl_design.synth import make_survey

    spec = load_spec(DEFAULT_SPEC)
    return spec, make_survey(n_persons=3000, seed=5)


def test_swap_stage_is_the_whole_frame_method_and_its_baseline(swap_case):
    """SwapStage.run (its passes on one partition held in memory): swap_segments' records,
    pairs and SE table (the method on the whole frame, se_ratio_table's SEs), and the baseline
    method's SE table, each with its Generator."""
    from sdl_design.stages.swap import SwapStage
    from sdl_design.stages.swap.method import swap_segments
    from sdl_design.utility import broad_characteristics, se_exclude

    spec, df = swap_case
    st = spec.stages.swap
    ctx = StageContext(df, spec, "swap")
    out = SwapStage.from_spec(spec).run(df, ctx)
    chars = broad_characteristics(
        df,
        design=design_columns(ctx.design),
        exclude=se_exclude(spec),
        domains=spec.variables.keys[:2],
    )
    kw = dict(max_share=st.max_share, cumulative=st.cumulative, scope=st.scope)
    kw |= dict(replicate_method=st.replicate_method, rho=st.rho, characteristics=chars)
    other = "2a" if st.method == "2b" else "2b"
    main = swap_segments(
        df, ctx.design, st.matching, st.rate, method=st.method, seed=ctx.rng("swap"), **kw
    )
    pd.testing.assert_frame_equal(out.data, main.data)
    pd.testing.assert_frame_equal(out.tables["pairs"], main.pairs)
    pd.testing.assert_frame_equal(out.tables["se_ratios"], main.se_ratios, rtol=1e-12)
    base = swap_segments(
        df, ctx.design, st.matching, st.rate, method=other, seed=ctx.rng("swap-baseline"), **kw
    )
    key = f"se_ratio_baseline_{other}_median"
    assert out.metrics[key] == pytest.approx(base.se_ratios["ratio"].median(), rel=1e-12)
    assert out.params["baseline"] == other and out.masks_design


def test_swap_by_three_partitions_is_the_one_partition_stage(swap_case, tmp_path):
    """The same stage on the file cut into 3 Parquet partitions: the same records and pairs;
    its SE tables (domain means by partition, the replicate scales derived from the rebuilt
    weights) those of the frame to 1e-10."""
    from sdl_design.stages.swap import SwapStage

    spec, df = swap_case
    ctx = StageContext(df, spec, "swap")
    one = SwapStage.from_spec(spec).run(df, ctx)
    records = _parquet_records(tmp_path, df, [1000, 1100, 900])
    three = SwapStage.from_spec(spec).run_partitions(records, StageContext(df, spec, "swap"))
    files = pd.read_parquet(tmp_path / "out" / "data")
    pd.testing.assert_frame_equal(files, one.data.reset_index(drop=True), check_dtype=False)
    assert three.params == one.params and three.notes == one.notes
    for name in ("pairs", "se_ratios", "se_ratio_summary", "se_ratio_summary_baseline"):
        pd.testing.assert_frame_equal(three.tables[name], one.tables[name], rtol=1e-10, obj=name)


def test_prb_stage_without_replicate_weights_counts_without_ses(prb_case, tmp_path):
    """A design without replicate weights: Tables 1/4 without SE columns, count_changes'
    counts, in memory and on 3 Parquet partitions."""
    from sdl_design.stages.prb import PrbStage
    from sdl_design.stages.prb.method import count_changes

    spec, df, _, res, _, _ = prb_case
    spec = spec.model_copy(deep=True)
    spec.design.replicate_weights = None
    reps = [c for c in df.columns if c.startswith("rw_")]
    df = df.drop(columns=reps)
    ctx = StageContext(df, spec, "prb")
    one = PrbStage.from_spec(spec).run(df, ctx)
    pd.testing.assert_frame_equal(one.data, res.data.drop(columns=reps))
    want = count_changes(df, one.data, spec.stages.prb.variables, spec.design.weight, spec.design)
    got = one.tables["weighted_counts"]
    assert "se" not in got.columns
    pd.testing.assert_frame_equal(got, want.reset_index(), check_dtype=False, rtol=1e-9)
    records = _parquet_records(tmp_path, df, [1000, 1100, 900])
    three = PrbStage.from_spec(spec).run_partitions(records, StageContext(df, spec, "prb"))
    pd.testing.assert_frame_equal(three.tables["weighted_counts"], got, rtol=1e-12)


def test_prb_stage_without_psus_reads_the_replicate_scales_of_records(prb_case, tmp_path):
    """Replicate weights and no strata or PSUs (each record its own PSU, JK1): Tables 1/4's
    replicate SEs are count_changes' (SurveyDesign on the records), in memory and on 3
    Parquet partitions."""
    from sdl_design.stages.prb import PrbStage
    from sdl_design.stages.prb.method import count_changes

    spec, df, _, _, _, _ = prb_case
    spec = spec.model_copy(deep=True)
    spec.design.strata = spec.design.psu = spec.design.segment = None
    spec.design.replicate_weights.method = "jk1"
    one = PrbStage.from_spec(spec).run(df, StageContext(df, spec, "prb"))
    want = count_changes(df, one.data, spec.stages.prb.variables, spec.design.weight, spec.design)
    got = one.tables["weighted_counts"]
    assert "se" in got.columns
    pd.testing.assert_frame_equal(got, want.reset_index(), check_dtype=False, rtol=1e-9)
    records = _parquet_records(tmp_path, df, [1000, 1100, 900])
    three = PrbStage.from_spec(spec).run_partitions(records, StageContext(df, spec, "prb"))
    pd.testing.assert_frame_equal(three.tables["weighted_counts"], got, rtol=1e-12)
