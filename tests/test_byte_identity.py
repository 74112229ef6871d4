"""The demo release is reproducible byte for byte: `puf demo` gives these hashes, in memory
and by partition. A change that alters the public files on purpose updates them and says why in
its commit (the history of the hashes is in git log of this file)."""

import hashlib

import pytest

from flows.cli import main as puf

pytestmark = [pytest.mark.flow, pytest.mark.usefixtures("prefect_server")]

RECORDED = {
    "README.md": "16b04134c41adb33fbecbdefaf40eabfe41b28f753741ebb16843013be88ac1a",
    "codebook.csv": "f7180596ab16759fab15de11987fc84df154e657d033fae3ed4c916a8029bb22",
    "puf.csv": "616907d677f7947ac8408c7c10d178d628555eb05147c2e74b2745113129dc2f",
    "puf.parquet": "92fe97f54b2b26012f9ca5ca06e7828dc20213bb7893525a3da99734b45f2918",
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
