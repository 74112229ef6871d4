"""The demo release is byte-identical to the one recorded before the stage-protocol refactor
(commit 95ef319, `puf demo --n-persons 3000`, same seed). A change that alters the public file
on purpose updates these hashes and says why in its commit. Updated by issue 11 (PRB cells on
the published coding of the keys, partition refined by the declared domains)."""

import hashlib

import pytest

from flows.cli import main as puf

pytestmark = [pytest.mark.flow, pytest.mark.usefixtures("prefect_server")]

RECORDED = {
    "README.md": "0f71be87baaacea3cc29b96d7fe1c5711079ec2c3ba4aebf4ed30457e77e2ba2",
    "codebook.csv": "e58c38e103eb9c018a4d044267093b5f1f676ab86d9c693500ad242e65b3777b",
    "puf.csv": "b31464ef67bf2735e972d927d3f55aa53ac6a958c186502cd8fa8975d0d91cbe",
    "puf.parquet": "38147652c66ca807c9878cc1f2c870b358e98b468fe80d61ff86eb7837efb598",
}


def test_demo_public_files_match_the_recorded_hashes(tmp_path):
    assert puf(["demo", "--dir", str(tmp_path), "--n-persons", "3000"]) == 0
    public = tmp_path / "default-survey" / "2026" / "public"
    got = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(public.iterdir())}
    assert got == RECORDED
