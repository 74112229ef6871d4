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
    "README.md": "7723fd0d80d650ffe542cdbe869fd35add1451aa9430269a705b9516945e60af",
    "codebook.csv": "33cbfb7d06f1480fea2b7a48d53d5c03f2831bcc1fbe8f535dca8522bab3ea1b",
    "puf.csv": "80ef57dfe9db37d3b2710961ed7c4832c733d267e4a37fc7a67e6da8f47fb0af",
    "puf.parquet": "3d0f2ead3f072001ffdc4ea833bb956405208013ce010744a0ebb2e0be4e1156",
}


def test_demo_public_files_match_the_recorded_hashes(tmp_path):
    assert puf(["demo", "--dir", str(tmp_path), "--n-persons", "3000"]) == 0
    public = tmp_path / "default-survey" / "2026" / "public"
    got = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(public.iterdir())}
    assert got == RECORDED
