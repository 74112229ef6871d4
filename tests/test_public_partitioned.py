"""The public data files written by partition (flows.public_files.write_public_by_partition)
are the release writer's bytes: puf.parquet as pyarrow writes the whole public frame (its row
groups; sdl_design.io.parquet_options), puf.csv as pandas.to_csv writes it, for the records in
the release's public order."""

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from flows.cli import write_demo_spec
from flows.public_files import (
    PARQUET_ROWS,
    neutralize_formulas,
    public_frame,
    write_public_by_partition,
    write_public_files,
)
from sdl_design.engine.exchange import mapper
from sdl_design.engine.partitions import plan_partitions
from sdl_design.io import parquet_options, read_input
from sdl_design.spec import load_spec
from sdl_design.stage import design_columns


@pytest.fixture(scope="module")
def survey(tmp_path_factory):
    """The default survey (3,000 persons, row groups of 450) with what the public writers
    decide over the whole file: education categorical with a category no record has, one
    tiny bmi (3e-05: repr, not polars' 0.00003, in every chunk's CSV) in the sixth row group
    only, and region values a spreadsheet would run as a formula."""
    folder = tmp_path_factory.mktemp("public_partitioned")
    path = write_demo_spec(folder, n_persons=3000)
    spec = load_spec(path)
    df = pd.read_parquet(spec.release.input)
    cats = sorted(df["education"].dropna().unique()) + ["doctorate (none)"]
    df["education"] = pd.Categorical(df["education"], categories=cats)
    df.loc[2500, "bmi"] = 3e-05
    df.loc[df.index % 101 == 3, "region"] = "=1+1"
    src = folder / "input.parquet"
    pq.write_table(pa.Table.from_pandas(df, preserve_index=False), src, row_group_size=450)
    data = yaml.safe_load(path.read_text())
    data["release"]["input"] = str(src)
    path.write_text(yaml.safe_dump(data))
    spec = load_spec(path)
    whole, _ = read_input(spec)
    return spec, whole


@pytest.mark.parametrize("rows", [PARQUET_ROWS, 700], ids=["one-group", "groups-of-700"])
def test_public_files_by_partition_are_the_release_writers_bytes(
    survey, tmp_path, monkeypatch, rows
):
    """7 partitions (by row group) into row groups of `rows` records (each written in slices
    of 256: its Arrow batches and CSV chunks): puf.parquet and puf.csv equal, byte for byte,
    what the release writes from the whole frame (write_public_files, or pyarrow with the
    same row groups), and the CSV is pandas.to_csv's."""
    import flows.public_files as pf

    monkeypatch.setattr(pf, "PUBLIC_SLICE", 256)
    spec, whole = survey
    cols = list(whole.columns)
    masked, drop = True, ["segment"]
    built = design_columns(spec.design, cols)
    parts = plan_partitions(spec.release.input, 7)
    assert len(parts) == 7
    with mapper("thread", None, 1, "partitioned") as run_map:
        got = write_public_by_partition(
            run_map, parts, spec, cols, masked, drop, built, tmp_path / "puf", rows
        )
    puf = public_frame(whole, spec, masked, drop, built)
    assert got["records"] == len(puf) == 3000 and got["columns"] == puf.shape[1]
    assert "segment" not in puf.columns and "person_id" not in puf.columns
    assert not (tmp_path / "puf" / ".work").exists()  # the pieces held each record's row
    if rows == PARQUET_ROWS:
        ref = write_public_files(puf, tmp_path / "ref", "notes")
        assert got["files"]["puf.parquet"] == ref["public/puf.parquet"]
        assert got["files"]["puf.csv"] == ref["public/puf.csv"]
        want_parquet = (tmp_path / "ref" / "puf.parquet").read_bytes()
    else:
        sink = pa.BufferOutputStream()
        table = pa.Table.from_pandas(puf, preserve_index=False)
        pq.write_table(table, sink, row_group_size=700, **parquet_options(table.schema))
        want_parquet = sink.getvalue().to_pybytes()
    assert (tmp_path / "puf" / "puf.parquet").read_bytes() == want_parquet
    md = pq.ParquetFile(tmp_path / "puf" / "puf.parquet").metadata
    assert [md.row_group(i).num_rows for i in range(md.num_row_groups)] == (
        [3000] if rows == PARQUET_ROWS else [700, 700, 700, 700, 200]
    )
    # dictionary pages for the columns that are not floats, none for the floats
    floats = {c for c in puf.columns if pd.api.types.is_float_dtype(puf[c])}
    assert {spec.design.weight, "rw_001", "income"} <= floats and "age" not in floats
    for g in range(md.num_row_groups):
        chunks = [md.row_group(g).column(i) for i in range(md.num_columns)]
        assert {c.path_in_schema for c in chunks if not c.has_dictionary_page} == floats
    text = neutralize_formulas(puf).to_csv(index=False, lineterminator="\n")
    assert (tmp_path / "puf" / "puf.csv").read_text() == text
    # what the writers decided over the whole file held in every part of it
    back = pd.read_parquet(tmp_path / "puf" / "puf.parquet")
    assert list(back["education"].cat.categories) == sorted(whole["education"].dropna().unique())
    assert ",3e-05," in text and "'=1+1" in text
    # the public order is not the input's
    assert not np.array_equal(back["age"].to_numpy(), whole["age"].to_numpy())


def test_readme_and_codebook_by_partition_are_the_release_writers_bytes(
    survey, tmp_path, monkeypatch
):
    """With the stage results (here none: the spec's design), README.md and codebook.csv
    written from 5 row groups of 700 records (value sets of more than 40 values counted in 8
    hash buckets) are what write_public_files writes from variance_notes and the whole frame;
    run.json's digests are those files'."""
    import hashlib

    import flows.public_files as pf
    from flows.public_docs import variance_notes

    monkeypatch.setattr(pf, "SMALL", 40)
    monkeypatch.setattr(pf, "BUCKET_VALUES", 3000 * 80 // 4)
    spec, whole = survey
    cols = list(whole.columns)
    masked, drop = True, ["segment"]
    built = design_columns(spec.design, cols)
    parts = plan_partitions(spec.release.input, 7)
    with mapper("thread", None, 1, "partitioned") as run_map:
        got = write_public_by_partition(
            run_map, parts, spec, cols, masked, drop, built, tmp_path / "puf", 700, results=[]
        )
    assert sorted(got["files"]) == [
        "README.md",
        "codebook.csv",
        "puf.csv",
        "puf.parquet",
        "replicate_scales.csv",
    ]
    puf = public_frame(whole, spec, masked, drop, built)
    ref = write_public_files(puf, tmp_path / "ref", variance_notes(spec, [], puf))
    for name in ("README.md", "codebook.csv", "replicate_scales.csv"):
        data = (tmp_path / "puf" / name).read_bytes()
        assert data == (tmp_path / "ref" / name).read_bytes(), name
        assert got["files"][name] == ref[f"public/{name}"] == hashlib.sha256(data).hexdigest()
    cb = pd.read_csv(tmp_path / "puf" / "codebook.csv").set_index("variable")
    assert cb.loc["wt", "n_distinct"] == puf["wt"].nunique() > 40  # counted in the buckets
    assert cb.loc["income", "min"] == puf["income"].min()
    assert cb.loc["education", "values"].split("; ") == sorted(puf["education"].dropna().unique())
    assert "70 replicate weights" in (tmp_path / "puf" / "README.md").read_text()


def test_growing_file_digest_is_the_files_sha256(tmp_path):
    """A file hashed while it is appended to, in uneven pieces (some not announced, the last
    announced by hexdigest alone), has hashlib's sha256 of its bytes; a size past the file's
    end is an error, not a digest of fewer bytes."""
    import hashlib

    from sdl_design.io import GrowingFileDigest

    rng = np.random.default_rng(5)
    path = tmp_path / "growing.csv"
    digest, whole = GrowingFileDigest(path), b""
    with open(path, "wb") as f:
        for i, k in enumerate([1, 0, 5_000_000, 17, 4_194_304, 3, 999]):
            piece = rng.bytes(k)
            f.write(piece)
            f.flush()
            whole += piece
            if i % 3 != 2:
                digest.written(len(whole))
    assert digest.hexdigest() == hashlib.sha256(whole).hexdigest()
    short = GrowingFileDigest(path)
    short.written(len(whole) + 1)
    with pytest.raises(OSError, match="ends at"):
        short.hexdigest()


def test_the_chunks_and_pieces_are_deleted_as_the_public_files_take_them(tmp_path):
    """_join: puf.csv is the chunks in order and its sha256 theirs, each chunk deleted once
    copied; _write_parquet: puf.parquet holds the pieces' records in order, a row group each,
    each piece deleted once written (the disk holds the public records once, not twice)."""
    import hashlib

    from flows.public_files import _join, _write_parquet

    chunks = []
    for g, text in enumerate(["a,b\n1,2\n", "3,4\n", "5,6\n"]):
        chunks.append(tmp_path / f"c{g}.csv")
        chunks[-1].write_text(text)
    digest = _join(chunks, tmp_path / "puf.csv")
    want = b"a,b\n1,2\n3,4\n5,6\n"
    assert (tmp_path / "puf.csv").read_bytes() == want
    assert digest == hashlib.sha256(want).hexdigest()
    assert not any(c.exists() for c in chunks)
    frames = [pd.DataFrame({"x": np.arange(3.0) + 3 * g, "k": list("abc")}) for g in range(3)]
    made = []
    for g, df in enumerate(frames):
        path = tmp_path / f"r{g}.arrow"
        table = pa.Table.from_pandas(df, preserve_index=False)
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
            w.write_table(table)
        made.append((str(path),))
    _write_parquet(made, tmp_path / "puf.parquet")
    got = pq.ParquetFile(tmp_path / "puf.parquet")
    assert got.metadata.num_row_groups == 3
    pd.testing.assert_frame_equal(got.read().to_pandas(), pd.concat(frames, ignore_index=True))
    assert not any((tmp_path / f"r{g}.arrow").exists() for g in range(3))
