"""The demo release is reproducible byte for byte: `puf demo --n-persons 3000` gives these
hashes. They were recorded before the stage-protocol refactor (commit 95ef319) and the refactor
kept them; issue 11 changed the public file on purpose (PRB cells on the published coding within
the declared domains; MASSC composed against the original on the sampling-error scale; the
default spec's utility domains, county not published and its sensitivity scores), and the
hashes below are those of that change, then of issue 13's public README and codebook (the
methods that ran with their parameters, variance recipes, labels and top-code flags) and issue
15's leaks (release year in the seed derivation, records shuffled, formula cells quoted, one BLAS
thread per stage: the same on any CPU count). A change that alters the public file on purpose
updates them and says why in its commit."""

import hashlib

import pytest

from flows.cli import main as puf

pytestmark = [pytest.mark.flow, pytest.mark.usefixtures("prefect_server")]

RECORDED = {
    "README.md": "523f66ad3b249b607c9b7d5b4e3d2ded6faf6595bdf8c0f99174e954ef8adbed",
    "codebook.csv": "f15b45b779abe10dd2328cf478b1f4cc45b2925da4ab2ca2dd00d743cc5abbe8",
    "puf.csv": "89d7ed662d34c64581f091e244e53390dd942f606b5874f73352f5389d6c88f7",
    "puf.parquet": "a60921562697688614e46694ce7aacabc8d24fc78eb9cbcf4470683d7aa5fa72",
}


def test_demo_public_files_match_the_recorded_hashes(tmp_path):
    assert puf(["demo", "--dir", str(tmp_path), "--n-persons", "3000"]) == 0
    public = tmp_path / "default-survey" / "2026" / "public"
    got = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(public.iterdir())}
    assert got == RECORDED
