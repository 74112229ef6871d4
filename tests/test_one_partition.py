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
from sdl_design.stages.topcode.method import topcode_frame


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

    table = pa.Table.from_pandas(df, preserve_index=False)
    path = tmp_path / "in.parquet"
    with pq.ParquetWriter(path, table.schema) as w:
        for a, b in zip(np.cumsum([0, *sizes[:-1]]), np.cumsum(sizes), strict=True):
            w.write_table(table.slice(a, b - a))
    parts = P.plan_partitions(path)
    assert len(parts) == len(sizes)
    (tmp_path / "out" / "data").mkdir(parents=True)
    records = Records(Run(IN_MEMORY, parts, {}, pd.DataFrame()), parts, list(df), tmp_path / "out")
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
