"""The demo release is reproducible byte for byte: `puf demo --n-persons 3000` gives these
hashes. They were recorded before the stage-protocol refactor (commit 95ef319) and the refactor
kept them; issue 11 changed the public file on purpose (PRB cells on the published coding within
the declared domains; MASSC composed against the original on the sampling-error scale; the
default spec's utility domains, county not published and its sensitivity scores), and the
hashes below are those of that change, then of issue 13's public README and codebook (the
methods that ran with their parameters, variance recipes, labels and top-code flags) and issue
15's leaks (release year in the seed derivation, records shuffled, formula cells quoted, one BLAS
thread per stage: the same on any CPU count). puf.parquet's hash changed with issue 14's
Parquet options (no dictionary pages for float columns): the same table, read back and written
with pyarrow's defaults, gives the hash before it (a609215...). A change that alters the public
file on purpose updates them and says why in its commit."""

import hashlib

import pytest

from flows.cli import main as puf

pytestmark = [pytest.mark.flow, pytest.mark.usefixtures("prefect_server")]

RECORDED = {
    "README.md": "523f66ad3b249b607c9b7d5b4e3d2ded6faf6595bdf8c0f99174e954ef8adbed",
    "codebook.csv": "f15b45b779abe10dd2328cf478b1f4cc45b2925da4ab2ca2dd00d743cc5abbe8",
    "puf.csv": "89d7ed662d34c64581f091e244e53390dd942f606b5874f73352f5389d6c88f7",
    "puf.parquet": "81d1f014514c1d15bd1647400f00c05af389ca2c7029a75d15ff4ef258f9bb9e",
}


def test_demo_public_files_match_the_recorded_hashes(tmp_path):
    assert puf(["demo", "--dir", str(tmp_path), "--n-persons", "3000"]) == 0
    public = tmp_path / "default-survey" / "2026" / "public"
    got = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(public.iterdir())}
    assert got == RECORDED
