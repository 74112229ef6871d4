"""The demo release is reproducible byte for byte: `puf demo` gives these hashes, in memory
and by partition. A change that alters the public files on purpose updates them and says why in
its commit (the history of the hashes is in git log of this file)."""

import hashlib

import pytest

from flows.cli import main as puf

pytestmark = [pytest.mark.flow, pytest.mark.usefixtures("prefect_server")]

RECORDED = {
    "README.md": "b3592e1724ccac0ac7f8862d9225a225bee53aa2babf7749d31d2879ccf6e260",
    "codebook.csv": "ebdbcfaf046cbba66348121329ae09f0e48860d329e98ffdc71375bbbcc7bbe3",
    "puf.csv": "fe645eb78f39b41de4bcbce96ca0d738e8d09b116ef2946e86cea3843a811841",
    "puf.parquet": "7a1c0748a779974f85b266b32bd2bc8903118458afceab25ae758e97cef5f81d",
    "replicate_scales.csv": "f76a524c104ea80ef4675450b6ef4a1b37ce05aa352337d6165a4fa805161c2f",
}


def test_demo_public_files_match_the_recorded_hashes(tmp_path):
    assert puf(["demo", "--dir", str(tmp_path)]) == 0
    public = tmp_path / "default-survey" / "2026" / "public"
    got = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(public.iterdir())}
    assert got == RECORDED


def test_demo_by_partition_publishes_the_recorded_hashes(tmp_path, capsys):
    """`puf run SPEC --partitions 4` on the demo's survey in row groups of 5,000 records (4
    partitions) publishes the in-memory release's files, byte for byte (the one engine: the
    same stages by partition)."""
    import pyarrow.parquet as pq

    from flows.cli import write_demo_spec
    from sdl_design.spec import load_spec

    path = write_demo_spec(tmp_path)
    src = load_spec(path).release.input
    pq.write_table(pq.read_table(src), src, row_group_size=5000)
    assert puf(["run", str(path), "--partitions", "4", "--approve", "ana"]) == 0
    assert "partition 4/4 (records 15000-19999)" in capsys.readouterr().err
    public = tmp_path / "default-survey" / "2026" / "public"
    got = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(public.iterdir())}
    assert got == RECORDED
