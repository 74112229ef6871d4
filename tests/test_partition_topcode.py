"""Top-coding by partition (sdl_design/stages/topcode/passes.py) against the in-memory top-coding
(topcode_frame, TopcodeStage's): the same records and thresholds table, bit for bit, on
files cut into partitions inside groups and blocks."""

import itertools

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sdl_design.engine import partitions as P
from sdl_design.spec import TopcodeRule
from sdl_design.stages.topcode import passes as T
from sdl_design.stages.topcode.method import topcode_frame, weighted_percentile
from sdl_design.survey import blocksum


def _local_map(fn, parts, *args, what=""):
    return [fn(p, *args) for p in parts]


def _file(tmp_path, df, sizes, files=False):
    """df as a Parquet file of row groups of these sizes (files: a folder of files of these
    sizes), and its partitions (one each where no block boundary lies near)."""
    table = pa.Table.from_pandas(df, preserve_index=False)
    bounds = np.cumsum([0, *sizes])
    assert bounds[-1] == len(df)
    if files:
        path = tmp_path / "input"
        path.mkdir()
        for i, (a, b) in enumerate(itertools.pairwise(bounds)):
            pq.write_table(table.slice(a, b - a), path / f"{i:02d}.parquet")
    else:
        path = tmp_path / "input.parquet"
        with pq.ParquetWriter(path, table.schema) as w:
            for a, b in itertools.pairwise(bounds):
                w.write_table(table.slice(a, b - a))
    return P.plan_partitions(path)


def _survey(n, rng, unit_weights=False):
    x = rng.lognormal(10, 1, n)
    x[rng.random(n) < 0.03] = np.nan
    w = np.ones(n) if unit_weights else rng.uniform(50, 500, n)
    grp = rng.choice(["a", "b", "c"], n)
    k = rng.integers(0, 1000, n)  # an integer column (no missing value)
    return pd.DataFrame({"x": x, "w": w, "grp": grp, "k": k, "z": rng.normal(size=n)})


def _by_partition(tmp_path, df, sizes, rules, files=False):
    parts = _file(tmp_path, df, sizes, files)
    treq = T.TopcodeRequest(
        "w", tuple((c, TopcodeRule.model_validate(r)) for c, r in rules.items())
    )
    out = T.run_topcode(_local_map, parts, None, treq, str(tmp_path / "out"))
    (tmp_path / "out").mkdir(exist_ok=True)
    return pd.read_parquet(tmp_path / "out"), out


RULES = {
    "x": {
        "upper": {"percentile": 99.5, "replace": "mean"},
        "lower": {"min_count": 3},
        "by": ["grp"],
    },
    "k": {"upper": {"percentile": 90}},
    "z": {"upper": {"value": 1.5, "replace": "mean"}, "lower": {"percentile": 2}},
}


@pytest.mark.parametrize("cuts", ["row groups", "blocks", "files"])
@pytest.mark.parametrize("unit_weights", [False, True], ids=["weights", "unit_weights"])
def test_topcode_by_partition_is_the_stages_to_the_bit(tmp_path, monkeypatch, unit_weights, cuts):
    """Weighted percentiles by group and alone, a fixed value, the k-th most extreme value,
    both sides, mean and threshold replacements, a column with missing values, an integer
    column kept integer: on 7 partitions of unequal size cut inside blocks of 64 records (or
    moved to their boundaries; or files of those sizes, the partitions then spanning files),
    the coded records and the thresholds table equal topcode_frame's on the whole file, bit
    for bit. With unit weights cumulative weights land on q W exactly: those groups' values
    are gathered and the stage's rule decides."""
    monkeypatch.setattr(blocksum, "BITS", 6)
    monkeypatch.setattr(blocksum, "BLOCK", 64)
    if cuts == "row groups":  # plan_partitions' move to a block boundary off
        monkeypatch.setattr(P, "_block_aligned", lambda ends: ends)
    rng = np.random.default_rng(11 + unit_weights)
    df = _survey(3000, rng, unit_weights)
    (tmp_path / "out").mkdir()
    sizes = [100, 650, 50, 900, 300, 700, 300]
    got, out = _by_partition(tmp_path, df, sizes, RULES, files=cuts == "files")
    parts = P.plan_partitions(tmp_path / ("input" if cuts == "files" else "input.parquet"))
    # one partition per row group: ends 100, 750, 800, 1,700, 2,000 and 2,700, moved to
    # 128, 768, 832, 1,728, 1,984 and 2,688
    starts = [p.start for p in parts]
    assert starts == (
        [0, 100, 750, 800, 1700, 2000, 2700]
        if cuts == "row groups"
        else [0, 128, 768, 832, 1728, 1984, 2688]
    )
    assert blocksum.split_blocks(starts) == (6 if cuts == "row groups" else 0)
    if cuts == "files":
        assert [len(p.pieces) for p in parts] == [2, 2, 2, 2, 1, 2, 2]
    want, table = topcode_frame(df, RULES, "w")
    pd.testing.assert_frame_equal(got, want, check_exact=True)
    assert got["k"].dtype == df["k"].dtype  # coded at a data value: stays an integer
    pd.testing.assert_frame_equal(out["table"], table, check_exact=True, check_dtype=False)
    assert (table["n_coded"] > 0).all()
    assert (out["groups_gathered"] > 0) == unit_weights


def test_topcode_by_partition_asks_for_more_candidates_when_the_tail_is_light(tmp_path):
    """The records with the largest values weigh almost nothing: the weighted 99th percentile
    lies far below the most extreme 2% that a first round sends, so pass 1 runs again with
    twice as many candidates until it reaches the crossing; the threshold is the weighted
    percentile (an independent sort)."""
    rng = np.random.default_rng(5)
    n = 4000
    x = rng.normal(size=n)
    w = np.where(x > np.quantile(x, 0.9), 1e-6, rng.uniform(1, 2, n))
    df = pd.DataFrame({"x": x, "w": w})
    (tmp_path / "out").mkdir()
    got, out = _by_partition(tmp_path, df, [1000] * 4, {"x": {"upper": {"percentile": 99}}})
    assert out["rounds"] > 1
    want, table = topcode_frame(df, {"x": {"upper": {"percentile": 99}}}, "w")
    pd.testing.assert_frame_equal(got, want, check_exact=True)
    assert out["table"]["threshold"].iloc[0] == weighted_percentile(x, w, 99)
    order = np.argsort(x)
    cw = np.cumsum(w[order])
    assert out["table"]["threshold"].iloc[0] == x[order][np.searchsorted(cw, 0.99 * cw[-1])]
