"""The partition cache (sdl_design.engine.cache) and the lookups the partitioned passes repeat:
a read served from the cache is the read from the file (values, types, columns, index), a
file written again or a spec that types a column otherwise is not served the old entry,
the least recently used values go first beyond the budget; profile_rows and the
calibration's row ids equal a brute-force dictionary lookup."""

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sdl_design.engine import cache as C
from sdl_design.engine import partitions as P
from sdl_design.spec import KeySpec
from sdl_design.stages.massc import calibration_passes as pcal


def test_least_recently_used_values_go_first_beyond_the_budget():
    cache = C.PartitionCache(budget=100)
    cache.put("a", "A", 40)
    cache.put("b", "B", 40)
    assert cache.get("a") == "A"  # a is now the most recently used
    cache.put("c", "C", 40)  # 120 > 100: b goes
    assert cache.get("b") is None and cache.get("a") == "A" and cache.get("c") == "C"
    assert cache.nbytes == 80
    cache.put("d", "D", 101)  # alone over the budget: not kept, nothing dropped
    assert cache.get("d") is None and cache.nbytes == 80
    cache.put("a", "A2", 10)  # replaced: its size counted once
    assert cache.get("a") == "A2" and cache.nbytes == 50
    cache.clear()
    assert cache.nbytes == 0 and cache.get("c") is None


def test_budget_from_the_environment(monkeypatch):
    monkeypatch.setenv(C.CACHE_ENV, "0")
    calls = []
    assert C.cached("k", lambda: calls.append(1) or 7, lambda v: 8) == 7
    assert C.cached("k", lambda: calls.append(1) or 7, lambda v: 8) == 7
    assert len(calls) == 2  # budget 0: nothing kept
    monkeypatch.setenv(C.CACHE_ENV, "1.5")
    assert C.budget_bytes() == int(1.5 * 2**20)
    monkeypatch.setenv(C.CACHE_ENV, "lots")
    with pytest.raises(ValueError, match="PUF_PARTITION_CACHE_MB='lots'"):
        C.budget_bytes()


def _frame(n: int, seed: int) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    return pd.DataFrame(
        {
            "w": rng.uniform(1, 9, n),
            "income": rng.integers(0, 99, n).astype(float),
            "code": pd.Series(rng.choice(["1", "2", "9"], n), dtype="str"),  # text, numeric
            "region": pd.Series(rng.choice(["n", "s", None], n), dtype="str"),
            "flag": rng.random(n) < 0.5,
        }
    )


def _spec(missing: dict):
    from sdl_design.spec import ReleaseSpec

    return ReleaseSpec.model_validate(
        {
            "release": {"name": "t", "year": 2026, "seed": 12345},
            "design": {"weight": "w"},
            "variables": {
                "keys": [{"name": "region"}],
                "study": ["income", "code"],
                "missing": missing,
            },
        }
    )


def _same(a: pd.DataFrame, b: pd.DataFrame) -> None:
    pd.testing.assert_frame_equal(a, b, check_exact=True)
    assert list(a.dtypes) == list(b.dtypes)


def test_a_cached_read_is_the_files_read(tmp_path, monkeypatch):
    path = tmp_path / "in.parquet"
    pq.write_table(
        pa.Table.from_pandas(_frame(900, 1), preserve_index=False), path, row_group_size=300
    )
    (part, *_) = P.plan_partitions(path, 2)
    spec = _spec({"income": [98], "code": ["9"]})
    C.CACHE.clear()
    monkeypatch.setenv(C.CACHE_ENV, "0")
    asks = (("income", "region"), ("code",), None)
    fresh = {cols: P.read_partition(part, cols and list(cols), spec) for cols in asks}
    raw = P.read_partition(part, ["income"])
    monkeypatch.setenv(C.CACHE_ENV, "64")
    for cols, want in fresh.items():
        first = P.read_partition(part, cols and list(cols), spec)
        hits = C.CACHE.hits
        again = P.read_partition(part, cols and list(cols), spec)
        assert C.CACHE.hits > hits  # served from the cache
        _same(first, want)
        _same(again, want)
    coded = (raw["income"] == 98).to_numpy()
    assert coded.any() and fresh[asks[0]]["income"][coded].isna().all()  # 98: missing
    _same(P.read_partition(part, ["income"]), raw)  # no spec: as stored
    # another spec types the column otherwise: not served the first spec's entry
    other = P.read_partition(part, ["income"], _spec({}))
    monkeypatch.setenv(C.CACHE_ENV, "0")
    _same(other, P.read_partition(part, ["income"], _spec({})))
    C.CACHE.clear()


def test_a_file_written_again_is_read_again(tmp_path, monkeypatch):
    monkeypatch.setenv(C.CACHE_ENV, "64")
    path = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pandas(_frame(500, 1), preserve_index=False), path)
    (part,) = P.plan_partitions(path)
    before = P.read_partition(part, ["w", "income"])
    tmp = tmp_path / "new.parquet"  # the same path, other records (written and renamed, as
    pq.write_table(pa.Table.from_pandas(_frame(500, 2), preserve_index=False), tmp)
    tmp.replace(path)  # a stage writes its partitions)
    after = P.read_partition(part, ["w", "income"])
    assert not np.array_equal(before["w"].to_numpy(), after["w"].to_numpy())
    _same(after, _frame(500, 2)[["w", "income"]])
    C.CACHE.clear()


def _brute_rows(df: pd.DataFrame, keys: list[KeySpec], table: pd.DataFrame) -> np.ndarray:
    """profile_rows by a dictionary of label tuples (a missing value one label)."""

    def norm(x):
        return "<NA>" if x is None or (isinstance(x, float) and np.isnan(x)) else x

    names = [k.name for k in keys]
    labels = []
    for k in keys:
        c, lv = P.key_levels(df[k.name], k)
        labels.append([norm(x) for x in lv[c]])
    where = {}
    for i, row in enumerate(table[names].itertuples(index=False)):
        where.setdefault(tuple(norm(x) for x in row), i)
    return np.array([where.get(t, -1) for t in zip(*labels, strict=True)], dtype=np.int64)


@pytest.mark.parametrize("room", [2**62, 7])  # 7: the codes compacted after every key
def test_profile_rows_is_a_dictionary_lookup(monkeypatch, room):
    monkeypatch.setattr(P, "PROFILE_ROOM", room)
    rng = np.random.default_rng(3)
    n = 4000
    df = pd.DataFrame(
        {
            "age": rng.integers(0, 90, n).astype(float),
            "sex": rng.choice(["m", "f", None], n),
            "hh": rng.integers(1, 7, n),
            "reg": pd.Series(rng.choice(["a", "b", "c", "d"], n), dtype="str"),
        }
    )
    df.loc[rng.random(n) < 0.05, "age"] = np.nan
    keys = [
        KeySpec(name="age", bins=[0, 18, 35, 65, 200]),
        KeySpec(name="sex"),
        KeySpec(name="hh"),
        KeySpec(name="reg"),
    ]
    half = P.profile_counts(df.iloc[: n // 3], keys)  # lacks some of the records' profiles
    got = P.profile_rows(df, keys, half, missing_ok=True)
    want = _brute_rows(df, keys, half)
    assert (want < 0).any() and np.array_equal(got, want)
    whole = P.profile_counts(df, keys)
    assert np.array_equal(P.profile_rows(df, keys, whole), _brute_rows(df, keys, whole))
    with pytest.raises(P.PartitionError, match="not in the table"):
        P.profile_rows(df, keys, half)
    with pytest.raises(P.PartitionError, match="more than once"):
        P.profile_rows(df, keys, pd.concat([whole, whole.iloc[:1]], ignore_index=True))


def test_row_ids_number_distinct_rows_by_first_appearance():
    rng = np.random.default_rng(5)
    a = pd.DataFrame({"x": rng.choice(["a", "b", None], 60), "y": rng.integers(0, 4, 60) * 1.0})
    b = pd.DataFrame(
        {"x": pd.Series(rng.choice(["a", "c"], 90), dtype="str"), "y": rng.integers(0, 5, 90)}
    )
    b.loc[::7, "y"] = np.nan
    got = np.concatenate(pcal._row_ids([a, b]))
    seen: dict = {}
    rows = pd.concat([a.astype(object), b.astype(object)], ignore_index=True)
    want = [
        seen.setdefault(tuple("<NA>" if pd.isna(v) else v for v in r), len(seen))
        for r in rows.itertuples(index=False)
    ]
    assert np.array_equal(got, np.array(want))
