"""The one driver (flows/driver.py): the same stages on a MemoryStore and a PartitionStore give
the same results; a stage that says it only measures the records and changes them stops the
run in both stores."""

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_design_optional import _weights_only, _weights_only_spec

from flows.driver import MemoryStore, PartitionStore, StageRun
from sdl_design.engine import partitions as P
from sdl_design.engine.records import IN_MEMORY, Passes, Run, passes_result
from sdl_design.spec import parse_spec
from sdl_design.stages.topcode import TopcodeStage


def _write(p, data):
    df = P.read_partition(p, None, None)
    return P._write_partition(df.assign(w=df["w"] * 2), p, data)


class _Rewrites(Passes):
    """Says it only measures the records, and writes them (doubled weights)."""

    name, replications, reads_only = "rewrites", 0, True

    def run_partitions(self, records, ctx):
        records.run_map(_write, records.parts, records.data, what="rewrite")
        return passes_result(self.name, {"n": records.n})


class _Drops(_Rewrites):
    """Says it only measures the records, and drops a column from the public file."""

    name = "drops"

    def run_partitions(self, records, ctx):
        return passes_result(self.name, {"n": records.n}, drop_public=["w"])


def _case(tmp_path):
    df = _weights_only().assign(stratum=lambda d: d.pid % 6)
    data = _weights_only_spec(xi=0.45, se_ratio=[0.7, 1.4])
    data["design"]["strata"] = "stratum"
    spec = parse_spec(data)
    path = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pandas(df, preserve_index=False), path, row_group_size=300)
    return df.reset_index(drop=True), spec, path


def _stores(df, spec, path, tmp_path):
    parts = P.plan_partitions(path)
    assert len(parts) > 1
    run = Run(IN_MEMORY, parts, {}, pd.DataFrame())
    return {
        "memory": MemoryStore(df),
        "partitions": PartitionStore(run, parts, list(df.columns), tmp_path / "run"),
    }


@pytest.mark.parametrize("liar", [_Rewrites, _Drops])
def test_a_stage_that_only_measures_and_changes_the_release_stops_the_run(tmp_path, liar):
    df, spec, path = _case(tmp_path)
    for name, store in _stores(df, spec, path, tmp_path).items():
        driver = StageRun(spec, [liar()], store)
        with pytest.raises(RuntimeError, match="only measures the records"):
            driver.run_stages()
        assert not driver.results, name


def test_the_same_stage_on_either_store_gives_the_same_records_and_result(tmp_path):
    """Top-coding on the frame held in memory and on Parquet partitions of it: the same
    records after it (the memory store's under the frame's labels) and the same metrics."""
    df, spec, path = _case(tmp_path)
    out = {}
    for name, store in _stores(df, spec, path, tmp_path).items():
        driver = StageRun(spec, [TopcodeStage.from_spec(spec)], store)
        driver.run_stages()
        (result,) = driver.results
        assert driver.timings["topcode"] > 0
        if name == "memory":
            records = store.df
        else:
            records = pd.concat(P.read_partition(p, None, None) for p in store.parts)
        metrics = {k: v for k, v in result.metrics.items() if not k.endswith("seconds")}
        out[name] = (records.reset_index(drop=True), metrics)
    pd.testing.assert_frame_equal(out["memory"][0], out["partitions"][0], check_dtype=False)
    assert out["memory"][1] == out["partitions"][1]
    assert not out["memory"][0]["income"].equals(df["income"])  # the stage coded something


class _Doubles(_Rewrites):
    """Writes the records with doubled weights (and says so)."""

    name, reads_only = "doubles", False


def test_a_release_store_deletes_a_stages_records_once_the_next_stage_wrote_its_own(tmp_path):
    """keep False (the release's store): after top-coding then a stage that rewrites the
    records, top-coding's records are gone, the last stage's and the input are not, and the
    records are those a store that keeps every stage's gives."""
    df, spec, path = _case(tmp_path)
    out = {}
    for keep in (True, False):
        run = Run(IN_MEMORY, P.plan_partitions(path), {}, pd.DataFrame())
        folder = tmp_path / f"keep-{keep}"
        store = PartitionStore(run, run.inputs, list(df.columns), folder, keep=keep)
        StageRun(spec, [TopcodeStage.from_spec(spec), _Doubles()], store).run_stages()
        assert (folder / "topcode" / "data").exists() == keep
        assert any((folder / "doubles" / "data").glob("*.parquet"))
        out[keep] = pd.concat(P.read_partition(p, None, None) for p in store.parts)
    assert path.exists()
    pd.testing.assert_frame_equal(out[True], out[False])
    assert (out[False]["w"] == 2 * df["w"].to_numpy()).all()
