"""The demo release is reproducible byte for byte: `puf demo` gives these
hashes. They were recorded before the stage-protocol refactor (commit 95ef319) and the refactor
kept them; issue 11 changed the public file on purpose (PRB cells on the published coding within
the declared domains; MASSC composed against the original on the sampling-error scale; the
default spec's utility domains, county not published and its sensitivity scores), and the
hashes below are those of that change, then of issue 13's public README and codebook (the
methods that ran with their parameters, variance recipes, labels and top-code flags) and issue
15's leaks (release year in the seed derivation, records shuffled, formula cells quoted, one BLAS
thread per stage: the same on any CPU count). puf.parquet's hash changed with issue 14's
Parquet options (no dictionary pages for float columns): the same table, read back and written
with pyarrow's defaults, gives the hash before it (a609215...). Issue 32 changed them on purpose:
the keys published in their coding, the rows sorted by the published values, PRB cells on the
intruder's key, the demo at its own size (20,000 persons: on 3,000 the intruder's key makes
most records unique and the SE-ratio gates refuse the release) and a 64-bit release seed. A
change that alters the public file on purpose updates them and says why in its commit."""

import hashlib

import pytest

from flows.cli import main as puf

pytestmark = [pytest.mark.flow, pytest.mark.usefixtures("prefect_server")]

RECORDED = {
    "README.md": "affcd40ca29e17ac9f6c43b23fb5e3c472dbaa9df89880f74e8e3227805f6c33",
    "codebook.csv": "d334f4b6dbb822862038f55be053a9b790a7a8ea75d29818e09719ef7fd1a564",
    "puf.csv": "616907d677f7947ac8408c7c10d178d628555eb05147c2e74b2745113129dc2f",
    "puf.parquet": "92fe97f54b2b26012f9ca5ca06e7828dc20213bb7893525a3da99734b45f2918",
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
