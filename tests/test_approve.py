"""The board, the analyst and the operator against a real Prefect server (issue 36): the step
lines in the run's log, the verdict and gate table as artifacts, the pause saying where to look
and how to decide, `puf approve`, and the resume payload deployments/README.md documents."""

import json
import re
import sys
import threading
import time
from pathlib import Path

import helpers
import pytest
import yaml
from helpers import run_until_paused

from flows.cli import main as puf

pytestmark = [pytest.mark.flow, pytest.mark.usefixtures("prefect_server")]

ROOT = Path(__file__).resolve().parents[1]
YEAR = 2041  # a year of its own: `puf approve default-survey 2041` finds this test's run only
STEP = re.compile(r"^\[puf\] \((\d+)/(\d+)\) (.+?)(?: done in [\d.]+ s| \.\.\.)$")


def run_logs(run_id) -> list[str]:
    """The messages of a flow run's log as the server has them (what the UI shows)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import LogSort

    with get_client(sync_client=True) as c:
        logs = c.read_logs(
            log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])),
            sort=LogSort.TIMESTAMP_ASC,
        )
    return [log.message for log in logs]


def wait_for_log(run_id, text: str, wait_s: float = 30.0) -> list[str]:
    """The run's log once a message contains text (logs reach the server in batches)."""
    t0 = time.monotonic()
    while True:
        msgs = run_logs(run_id)
        if any(text in m for m in msgs) or time.monotonic() - t0 > wait_s:
            return msgs
        time.sleep(0.5)


def run_artifacts(run_id) -> dict[str, object]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as c:
        arts = c.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run_id]))
        )
    return {a.key: a for a in arts}


def test_pause_logs_artifacts_and_puf_approve(tmp_path, capsys):
    path = helpers.fast_spec(tmp_path, 1200, **{"release.year": YEAR})
    rel = yaml.safe_load(path.read_text())["release"]
    name, final = rel["name"], tmp_path / rel["name"] / str(YEAR)
    # nothing paused yet: a clear refusal naming what to do
    assert puf(["approve", name, str(YEAR), "--approver", "dora"]) == 2
    err = capsys.readouterr().err
    assert f"no paused run of {name} {YEAR}" in err and "puf run" in err

    th, box, fr = run_until_paused(path, wait_s=120)
    assert fr is not None, box
    msgs = wait_for_log(fr.id, "puf approve")
    # every step line reached the run's log, numbered 1..k without a gap, one total
    matched = [STEP.match(m) for m in msgs if "done in" in m]
    done = [(int(s[1]), int(s[2]), s[3]) for s in matched if s]
    assert [d[0] for d in done] == list(range(1, len(done) + 1)), done
    total = {d[1] for d in done}
    assert len(total) == 1 and [d[2] for d in done][:2] == ["load", "edit validation"]
    assert done[-1][2] == "files" and f"[puf] ({len(done) + 1}/{total.pop()}) approval ..." in msgs
    # the pause: the run's page, the staged report, both ways to decide
    staged = helpers_staged(path, name)
    text = "\n".join(msgs)
    assert f"/runs/flow-run/{fr.id}" in text
    assert str(staged / "internal" / "report.html") in text
    assert "Resume form" in text and f"puf approve {name} {YEAR} --approver WHO" in text
    assert "--reject" in text

    arts = run_artifacts(fr.id)
    base = f"puf-{name}-{YEAR}"
    verdict = arts[f"{base}-verdict"].data
    assert verdict.startswith(f"# {name} {YEAR}: awaiting the review board's decision")
    assert "**Verdict.** Publish: the file is ready to publish" in verdict
    assert "| passed | value | limits | gate |" in verdict
    gates = (staged / "internal" / "gates.csv").read_text().splitlines()[1:]
    assert verdict.count("| True |") == len(gates) > 0
    assert "figure" not in verdict.split("## Gates")[0]  # no in-page link of the HTML report
    assert (staged / "internal" / "report.html").resolve().as_uri() in verdict
    assert "## Worst estimates" in verdict
    worst = json.loads(arts[f"{base}-worst-estimates"].data)
    assert worst and {"variable", "domain", "std_bias"} <= set(worst[0])
    gate_table = json.loads(arts[f"{base}-gates"].data)
    assert len(gate_table) == len(gates)

    capsys.readouterr()
    assert puf(["approve", name, str(YEAR), "--approver", "dora", "--comment", "fine"]) == 0
    out = capsys.readouterr().out
    assert f"approved {name} {YEAR} as dora" in out and str(fr.id) in out
    th.join(120)
    m = box.get("manifest")
    assert m is not None and m.status == "published", box
    assert m.approval.approver == "dora" and m.approval.comment == "fine"
    assert (final / "public" / "puf.parquet").is_file()
    msgs = wait_for_log(fr.id, "publish done")
    n = int(STEP.match(next(x for x in msgs if "publish done" in x))[2])
    assert f"[puf] ({n}/{n}) publish ..." in msgs  # the last step is numbered total


def helpers_staged(path: Path, name: str) -> Path:
    from flows.txn import latest_attempt

    return latest_attempt(path.parent, name, YEAR) / "staged"


def readme_payload() -> dict:
    """The resume payload deployments/README.md gives (the JSON block after 'POST')."""
    text = (ROOT / "deployments" / "README.md").read_text()
    block = re.search(r"POST /api/flow_runs/<id>/resume.*?```(?:json)?\n(.*?)```", text, re.S)
    assert block, "deployments/README.md: no JSON block after POST /api/flow_runs/<id>/resume"
    return json.loads(block[1])


def test_readme_resume_payload_is_accepted_by_the_server():
    """The payload of deployments/README.md, sent as documented (REST), resumes a run paused
    for the release's form (flows.release.ReleaseApproval); the old payload is refused."""
    from prefect import flow
    from prefect.flow_runs import pause_flow_run
    from prefect.settings import PREFECT_API_URL

    from flows.release import ReleaseApproval

    KEY = "approval-form-check"

    @flow(name="approval-form-check")
    def waits() -> dict:
        d = pause_flow_run(
            wait_for_input=ReleaseApproval.with_initial_data(description="check"),
            timeout=60,
            poll_interval=1,
            key=KEY,
        )
        return d.model_dump()

    box: dict = {}
    th = threading.Thread(target=lambda: box.update(out=waits()))
    th.start()
    payload = readme_payload()
    assert set(payload) == {"run_input"}
    fr, t0 = None, time.monotonic()
    while fr is None and time.monotonic() - t0 < 30:
        fr = next((r for r in _paused() if r.state.state_details.pause_key == KEY), None)
        time.sleep(0.3)
    assert fr is not None
    api = PREFECT_API_URL.value()
    old = {"run_input": {"approved": True, "approver": "board"}}  # what the README said before
    res = _resume(f"{api}/flow_runs/{fr.id}/resume", old)
    assert res.get("status") == "REJECT" and "approved" in res["details"]["reason"], res
    res = _resume(f"{api}/flow_runs/{fr.id}/resume", payload)
    assert res.get("status") == "ACCEPT", res
    th.join(60)
    got = box["out"]
    assert {k: got[k] for k in payload["run_input"]} == payload["run_input"]


def _resume(url: str, payload: dict) -> dict:
    """The server's answer to a resume request, asked again while it answers 5xx (the test
    server busy: once, in a clean-clone run with other tests beside it, an answer without a
    verdict); else the status code and text, for the assertion's message."""
    import httpx

    for _ in range(5):
        r = httpx.post(url, json=payload, timeout=30)
        if r.status_code < 500:
            return r.json()
        time.sleep(1.0)
    return {"http": r.status_code, "text": r.text[:500]}


def _paused() -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType

    with get_client(sync_client=True) as c:
        return c.read_flow_runs(
            flow_run_filter=FlowRunFilter(
                state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.PAUSED]))
            )
        )


def test_prints_and_steps_of_a_flow_reach_its_log_and_the_terminal_once(capfd):
    """What the partitioned release flow does with the scan's printed lines (log_prints off,
    prints_to_run_log): on the terminal once and in the run's log; a Progress line likewise."""
    from prefect import flow
    from prefect.runtime import flow_run

    from flows.progress import PROGRESS, prints_to_run_log

    @flow(name="tee-check", log_prints=False)
    def talks() -> str:
        with prints_to_run_log():
            print("[puf partitioned] swap: partition 1/2", file=sys.stderr)
        PROGRESS.say("a step line")
        return flow_run.id

    run_id = talks()
    msgs = wait_for_log(run_id, "a step line", 15)
    assert "[puf partitioned] swap: partition 1/2" in msgs and "[puf] a step line" in msgs
    err = capfd.readouterr().err
    assert err.count("swap: partition 1/2") == 1 and err.count("a step line") == 1
