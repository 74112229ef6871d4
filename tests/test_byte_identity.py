"""The demo release is byte-identical to the one recorded before the stage-protocol refactor
(commit 95ef319, `puf demo --n-persons 3000`, same seed). A change that alters the public file
on purpose updates these hashes and says why in its commit."""

import hashlib

import pytest

from flows.cli import main as puf

pytestmark = [pytest.mark.flow, pytest.mark.usefixtures("prefect_server")]

RECORDED = {
    "README.md": "0f71be87baaacea3cc29b96d7fe1c5711079ec2c3ba4aebf4ed30457e77e2ba2",
    "codebook.csv": "f5fd514424f310d742165b9c8e610691f4a4dde55cc8329493384d0d5035169f",
    "puf.csv": "6441cfc47b1b16292fd63b6f77b9ccb88c77204eb1d4e3e462390aea4bdeea67",
    "puf.parquet": "92a00dbf9289df5105d44410a47e7c22efd043b0fc0fdb9a8003248a54881366",
}


def test_demo_public_files_match_the_recorded_hashes(tmp_path):
    assert puf(["demo", "--dir", str(tmp_path), "--n-persons", "3000"]) == 0
    public = tmp_path / "default-survey" / "2026" / "public"
    got = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(public.iterdir())}
    assert got == RECORDED
