"""The partitioned release published (flows.release.publish_partitioned, `puf run --partitions`):
the same release as the release flow's, its public files byte for byte; a failed gate
publishes nothing; the records after each stage never outlive the attempt."""

from __future__ import annotations

import json

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from helpers import fast_spec, run_until_paused

from expectations.suites import GateFailed
from flows import registry as reg
from flows.cli import main as puf
from flows.publish import sha256_file
from flows.release import publish_partitioned
from flows.txn import PARTITIONED
from sdl_design.spec import SpecError, load_spec


def _spec(tmp_path, **changes):
    """helpers.fast_spec (3,000 persons, no swap, PRB or MASSC: the publication is under
    test; design labels published so that the gates hold) with its input in row groups of 450
    (7 partitions); changes: dotted keys set."""
    path = fast_spec(tmp_path, **changes)
    src = load_spec(path).release.input
    pq.write_table(pa.Table.from_pandas(pd.read_parquet(src)), src, row_group_size=450)
    data = yaml.safe_load(path.read_text())
    rel = data["release"]
    final = tmp_path / rel["name"] / str(rel["year"])
    return path, final, rel["registry"], rel["name"], rel["year"]


def _disk(final):
    return {f"public/{p.name}": sha256_file(p) for p in sorted((final / "public").iterdir())}


@pytest.mark.flow
@pytest.mark.usefixtures("prefect_server")
def test_partitioned_release_publishes_the_release_flows_files(tmp_path, capsys):
    """The release flow publishes the spec; `puf partitioned --publish --approve` then
    publishes it again by partition: the same release id, the same four public files byte for
    byte, the same gates and verdicts; the registry's current release is the partitioned one
    with the files on disk, its record holds the final stage's SE table and the assessment,
    and no record after a stage is left in the attempt's folder."""
    from flows.release import release_flow

    path, final, url, name, year = _spec(tmp_path)
    first = release_flow(spec_path=str(path), approve="board")
    assert first.status == "published"
    memory = dict(first.hashes.outputs)
    assert set(memory) == {
        f"public/{f}"
        for f in ("README.md", "codebook.csv", "puf.csv", "puf.parquet", "replicate_scales.csv")
    }
    kept = {k: (final / k).read_bytes() for k in memory}
    assert (
        puf(["partitioned", str(path), "--partitions", "7", "--publish", "--approve", "ana"]) == 0
    )
    out = capsys.readouterr().out
    assert f"release {first.release.release_id}: published (approved by ana)" in out
    row = reg.current_release(name, year, url)
    assert row["release_id"] == first.release.release_id
    assert row["output_hashes"] == memory == _disk(final)
    for k, data in kept.items():
        assert (final / k).read_bytes() == data, k
    manifest = json.loads((final / "internal" / "manifest.json").read_text())
    assert manifest["status"] == "published" and manifest["approval"]["approver"] == "ana"
    gates = [(g["name"], g["passed"]) for g in manifest["gates"]]
    assert gates == [(g.name, g.passed) for g in first.gates] and all(p for _, p in gates)
    assert manifest["counts"] == {"n_input": 3000, "n_output": 3000}
    assert not [k for k in manifest["metrics"] if k.endswith("seconds")]  # (timings_s)
    assert manifest["timings_s"]["scan"] > 0 and manifest["timings_s"]["final"] > 0
    assert (final / "internal" / "final" / "se_ratios.csv").exists()
    assert (final / "internal" / "assess" / "domain_estimates.csv").exists()
    assert manifest["metrics"]["final.n_characteristics"] == pytest.approx(
        first.metrics["final.n_characteristics"]
    )
    attempts = list((tmp_path / name / "internal" / str(year) / "attempts").iterdir())
    assert len(attempts) == 2 and not any((a / PARTITIONED).exists() for a in attempts)


@pytest.mark.flow  # a whole release chain by partition
def test_partitioned_release_with_a_failed_gate_publishes_nothing(tmp_path):
    """With a pseudo design drawn once (no variance-preserving choice) at 3,000 records the
    10th percentile of the SE ratios is below its bound: GateFailed naming the fix, no public
    folder, the attempt recorded as rejected with its gates, the records after each stage
    deleted. Without an approver the run is refused before any work."""
    one_draw = {"design.pseudo": {"candidates": 1, "psus_per_stratum": 2}}
    path, final, url, name, year = _spec(
        tmp_path, **{"design.publish_design_labels": False, **one_draw}
    )
    with pytest.raises(SpecError, match="approval.required"):
        publish_partitioned(path, None, partitions=7)
    with pytest.raises(GateFailed) as ei:
        publish_partitioned(path, "ana", partitions=7)
    failed = ei.value.results.loc[~ei.value.results["passed"], "name"].tolist()
    assert "utility: 10th percentile of published/original SE ratios" in failed
    assert "fix: the pseudo design" in ei.value.one_line()
    assert not final.exists()
    attempts = reg.read_attempts(name, year, url=url)
    assert attempts["state"].tolist() == ["rejected"]
    folder = next((tmp_path / name / "internal" / str(year) / "attempts").iterdir())
    assert not (folder / PARTITIONED).exists() and not (folder / "staged" / "public").exists()
    record = json.loads((folder / "staged" / "internal" / "manifest.json").read_text())
    assert record["status"] == "rejected"
    assert {g["name"] for g in record["gates"] if not g["passed"]} == set(failed)
    # an input that breaks an edit rule: rejected after the scan, as the release flow does
    src = load_spec(path).release.input
    df = pd.read_parquet(src)
    df.loc[[5, 700], "age"] = 95  # the demo's rule age <= 90
    pq.write_table(pa.Table.from_pandas(df), src, row_group_size=450)
    with pytest.raises(GateFailed, match="edit validation failed"):
        publish_partitioned(path, "ana", partitions=7)
    attempts = reg.read_attempts(name, year, url=url)
    assert attempts["state"].tolist() == ["rejected", "rejected"] and not final.exists()


def test_recovery_deletes_the_records_of_a_crashed_partitioned_attempt(tmp_path):
    """An attempt that died while it ran (state running, its partitioned records in its
    folder): the next run's recovery deletes those records and fails the attempt."""
    from flows.manifest import Manifest
    from flows.txn import Transaction

    path, final, url, name, year = _spec(tmp_path)
    spec = load_spec(path)
    with Transaction.begin(spec) as t:
        t.open(Manifest.new(spec, "s", "i"))
        records = t.folder / PARTITIONED / "massc" / "data"
        records.mkdir(parents=True)
        (records / "part-000000000000.parquet").write_bytes(b"records")
    # (the process died here: the attempt is still running)
    with Transaction.begin(spec):
        pass
    assert not (t.folder / PARTITIONED).exists()
    assert reg.read_attempts(name, year, url=url)["state"].tolist() == ["failed"]


@pytest.mark.flow
@pytest.mark.usefixtures("prefect_server")
def test_partitioned_release_flow_pauses_for_the_board(tmp_path, capfd):
    """Without an approver the partitioned release flow stages the release and pauses for the
    board: rejected, nothing is published and the attempt is recorded as the board's
    rejection; run again and approved, it is published by partition (the approver recorded)."""
    from functools import partial

    from prefect.flow_runs import resume_flow_run

    from flows.release import ReleaseRejected, release_flow

    path, final, url, name, year = _spec(tmp_path)
    run = partial(release_flow, partitions=3)
    for decision in ("rejected", "approved"):
        th, box, fr = run_until_paused(path, wait_s=120, flow=run)
        assert fr is not None, box
        assert not final.exists()  # staged, not published, while the board decides
        resume_flow_run(
            fr.id, run_input={"decision": decision, "approver": "board", "comment": "seen"}
        )
        th.join(120)
        if decision == "rejected":
            assert isinstance(box.get("error"), ReleaseRejected), box
            assert not final.exists()
            assert reg.read_attempts(name, year, url=url)["state"].tolist() == ["rejected"]
    manifest = box["manifest"]
    assert manifest.status == "published" and manifest.approval.approver == "board"
    assert reg.current_release(name, year, url)["output_hashes"] == _disk(final)
    assert len(_disk(final)) == 5  # with replicate_scales.csv
    # every stage's passes say their progress on the terminal, the stages' tasks' too (a task
    # of a flow with log_prints would turn them into log records below the quiet level)
    err = capfd.readouterr().err
    for what in ("topcode pass 1", "final: key profiles", "assess pass 1, released"):
        assert f"[puf partitioned] {what}: partition 3/3" in err, what
