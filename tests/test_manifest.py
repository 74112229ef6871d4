"""The typed manifest: reads the manifests the untyped flow wrote, writes the same JSON keys."""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from pydantic import ValidationError

from flows import registry as reg
from flows.manifest import Manifest
from flows.publish import write_json
from sdl_design.spec import load_spec
from sdl_design.stage import StageResult

# manifest.json of the demo release written by the untyped flow (commit d53687e), trimmed:
# 21 of its 104 metrics, 8 of its 21 gates, the first note of each stage
OLD = Path(__file__).parent / "data" / "manifest_2026.json"
DEFAULT_SPEC = Path(__file__).parents[1] / "flows" / "default_spec.yaml"


def old() -> dict:
    return json.loads(OLD.read_text())


def keys(d, prefix=""):
    """Every key path of a JSON object (lists of objects: the keys of their items)."""
    out = set()
    items = d.items() if isinstance(d, dict) else []
    for k, v in items:
        out.add(prefix + k)
        if isinstance(v, dict) and k not in (
            "parameters",
            "params",
            "metrics",
            "outputs",
            "timings_s",
        ):
            out |= keys(v, prefix + k + ".")
        if isinstance(v, list) and v and isinstance(v[0], dict):
            for item in v:
                out |= keys(item, prefix + k + "[].")
    return out


def test_reads_and_rewrites_a_manifest_of_the_untyped_flow(tmp_path):
    m = Manifest.model_validate(old())
    assert m.release.release_id == "default-survey-2026-1a0b29be" and m.status == "published"
    assert m.parameters.gates.delta_max == 0.25 and m.parameters.gates.se_ratio == [0.8, 1.25]
    assert m.parameters.gates.max_unique_share is None
    assert m.parameters.release.seed == 20261122
    assert m.parameters.stage("massc")["replications"] == 10 and m.parameters.stage("x") == {}
    assert m.metrics["massc.delta"] == old()["metrics"]["massc.delta"]
    assert m.counts.n_output == 16563 and m.timings_s["massc"] == 8.536
    assert m.approval.approver == "demo" and m.gates[3].threshold == "<= 0.395"
    assert [s.name for s in m.stages] == ["risk", "swap", "prb", "massc", "topcode", "final"]
    # dumped again: the same JSON, plus the one new key (each stage's metric names, [] here)
    again = m.to_json()
    assert [s.pop("metrics") for s in again["stages"]] == [[]] * 6
    assert again == old()
    # written and read back through manifest.json: the same manifest
    write_json(tmp_path / "manifest.json", m.to_json())
    assert Manifest.model_validate_json((tmp_path / "manifest.json").read_text()) == m


def test_new_has_the_keys_of_the_untyped_manifest():
    spec = load_spec(DEFAULT_SPEC)
    m = Manifest.new(spec, "s" * 64, "i" * 64)
    rid = hashlib.sha256(("s" * 64 + "i" * 64 + "2026").encode()).hexdigest()[:8]
    assert m.release.release_id == f"default-survey-2026-{rid}"
    assert m.status == "drafted" and m.reason is None and m.hashes.outputs == {}
    assert m.approval.required is True and m.approval.decision is None
    assert m.parameters.gates.xi == spec.gates.xi
    assert m.parameters.release.seed == spec.release.seed
    assert "pandas" in m.versions
    m.counts.n_input, m.counts.n_output = 20000, 16563
    m.timings_s["load"] = 0.5
    m.absorb(StageResult("risk", None, params={"keys": ["age"]}, metrics={"n": 1.0}))
    m.set_gates(pd.DataFrame({"name": ["g"], "passed": [True], "value": [0.0], "threshold": ["0"]}))
    new = m.to_json()
    for s in new["stages"]:
        s.pop("metrics")
    assert keys(new) == keys(old())
    # a drafted release has no counts yet: the key holds an empty object, as it did
    assert Manifest.new(spec, "s", "i").to_json()["counts"] == {}


def test_absorb_and_gates():
    m = Manifest.model_validate(old())
    r = StageResult(
        "extra",
        None,
        params={"n": np.int64(3), "rates": (0.1, np.float64(0.2)), "nan": float("nan")},
        metrics={"share": np.float64(0.25), "count": np.int64(7)},
        notes=["did it"],
    )
    m.absorb(r)
    assert m.metrics["extra.share"] == 0.25 and m.metrics["extra.count"] == 7.0
    assert m.stages[-1].metrics == ["share", "count"] and m.stages[-1].notes == ["did it"]
    p = m.to_json()["parameters"]["extra"]
    assert p["n"] == 3 and p["rates"] == [0.1, 0.2] and np.isnan(p["nan"])
    assert json.loads(json.dumps(m.to_json()))["parameters"]["extra"]["rates"] == [0.1, 0.2]
    with pytest.raises(ValueError, match="clashes"):
        m.absorb(StageResult("gates", None))
    frame = pd.DataFrame(
        {
            "name": ["a", "b"],
            "passed": [np.bool_(True), np.bool_(False)],
            "value": [np.float64(0.1), np.int64(2)],
            "threshold": ["<= 0.25", 1.5],
        }
    )
    m.set_gates(frame)
    assert [g.model_dump() for g in m.gates] == [
        {"name": "a", "passed": True, "value": 0.1, "threshold": "<= 0.25"},
        {"name": "b", "passed": False, "value": 2.0, "threshold": "1.5"},
    ]
    assert m.n_failed_gates == 1


def test_invalid_manifests_named():
    bad = copy.deepcopy(old())
    bad["status"] = "done"
    with pytest.raises(ValidationError, match="status"):
        Manifest.model_validate(bad)
    m = Manifest.model_validate(old())
    with pytest.raises(ValidationError, match="status"):
        m.status = "done"
    with pytest.raises(ValidationError, match="release_id"):
        Manifest.model_validate({"release": {"name": "x", "year": 2020}})


def test_registry_keeps_the_typed_manifest(tmp_path, monkeypatch):
    monkeypatch.delenv(reg.ENV_URL, raising=False)
    url = reg.registry_url(tmp_path)
    m = Manifest.model_validate(old())
    m.metrics["broken.metric"] = float("nan")
    ratios = reg.se_ratio_tables(
        [
            StageResult("risk", None, tables={"se_ratios": pd.DataFrame()}),  # not declared
            StageResult(
                "final",
                None,
                tables={
                    "by_char": pd.DataFrame(
                        {"characteristic": ["x", "y"], "ratio": [1.0, 0.9], "deff": [1.5, 3.0]}
                    )
                },
                se_ratio_table="by_char",
            ),
        ]
    )
    assert list(ratios) == ["final"]
    rid = reg.record_release(m, ratios, url=url)
    back = reg.read_manifest(rid, url=url)
    assert np.isnan(back.metrics.pop("broken.metric")) and np.isnan(m.metrics.pop("broken.metric"))
    assert back == m
    shown = reg.show_release(rid, url=url)
    assert shown["se_ratios"] == {"final": 2} and shown["approver"] == "demo"
    assert shown["metrics"]["massc.delta"] == pytest.approx(old()["metrics"]["massc.delta"])
    assert reg.load_releases(url)["manifest"].iloc[0].release.release_id == rid
