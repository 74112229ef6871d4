"""deployments/prefect.yaml without a server: YAML loads, entrypoints resolve, parameters validate,
schedules parse; broken definitions are reported by field."""

from __future__ import annotations

import copy
import importlib.util
from datetime import UTC, datetime
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

_spec = importlib.util.spec_from_file_location("puf_register", ROOT / "deployments" / "register.py")
register = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(register)


@pytest.fixture(scope="module")
def cfg():
    return register.load_config()


def test_definitions_are_valid(cfg):
    assert register.check(cfg) == []


def test_one_deployment_per_survey_spec(cfg):
    specs = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "flows").glob("*spec*.yaml"))
    deployed = sorted(d["parameters"]["spec_path"] for d in cfg["deployments"])
    assert deployed == specs == ["flows/default_spec.yaml"]
    names = [d["name"] for d in cfg["deployments"]]
    assert len(set(names)) == len(names)
    for d in cfg["deployments"]:
        assert d["entrypoint"] == "flows/release.py:release_flow"
        assert d["work_pool"]["name"] == "puf-release-pool"


def test_yearly_schedule(cfg):
    (s,) = cfg["deployments"][0]["schedules"]
    runs = register.next_runs(s, 3, start=datetime(2026, 11, 22, tzinfo=UTC))
    assert [(r.year, r.month, r.day, r.hour) for r in runs] == [
        (2027, 2, 1, 6),
        (2028, 2, 1, 6),
        (2029, 2, 1, 6),
    ]
    assert all(r.utcoffset().total_seconds() == 0 for r in runs)


def test_runner_deployment_built_offline(cfg):
    (dep,) = register.runner_deployments(cfg)
    assert dep.name == "default-survey"
    assert dep.schedules[0].schedule.cron == "0 6 1 2 *"
    props = set(dep._parameter_openapi_schema.properties)
    assert {"spec_path", "approve", "year", "runner", "dask_address"} <= props
    assert dep.parameters["spec_path"] == "flows/default_spec.yaml"
    assert dep.entrypoint.endswith("flows/release.py:release_flow")


def test_broken_definitions_reported(cfg):
    bad = copy.deepcopy(cfg)
    d = bad["deployments"][0]
    d["parameters"]["year"] = "next year"  # not an int
    d["schedules"] = [{"cron": "61 6 1 2 *", "timezone": "UTC"}]
    d["wrk_pool"] = d.pop("work_pool")  # typo
    problems = register.check(bad)
    text = "\n".join(problems)
    assert "unknown keys ['wrk_pool']" in text
    assert "work_pool.name: missing" in text
    assert "parameters" in text and "year" in text
    assert "schedules[0].cron '61 6 1 2 *'" in text
    bad = copy.deepcopy(cfg)
    bad["deployments"][0]["entrypoint"] = "flows/nope.py:release_flow"
    assert "entrypoint" in register.check(bad)[0]
    bad = copy.deepcopy(cfg)
    bad["deployments"][0]["parameters"]["spec_path"] = "flows/missing.yaml"
    assert "spec_path flows/missing.yaml" in "\n".join(register.check(bad))
    bad = copy.deepcopy(cfg)
    bad["deployments"][0]["schedules"] = [{"cronn": "0 6 1 2 *"}]  # the CLI's schema rejects it
    assert register.check(bad)[0].startswith("prefect.yaml:")
