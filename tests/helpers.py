"""Shared test data and helpers: paper 000's worked example, the default spec's path, an HTML
parser for the release and monitoring reports. Found by the tests through pytest's rootdir
import (tests/ is on sys.path), from any current directory."""

from __future__ import annotations

from html.parser import HTMLParser
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SPEC = ROOT / "flows" / "default_spec.yaml"
PNG = b"\x89PNG\r\n\x1a\n"


def set_dotted(data: dict, changes: dict) -> None:
    """Set each dotted key of changes ('stages.prb.theta': value) in a spec's YAML data."""
    for dotted, value in changes.items():
        node = data
        *head, last = dotted.split(".")
        for h in head:
            node = node[h]
        node[last] = value


def fast_spec(tmp: Path, n_persons: int = 3000, **changes) -> Path:
    """The demo spec on n_persons without the slow treatments (the lifecycle or publication is
    under test, not the methods); design labels published so the gates that remain hold; its
    registry in tmp; changes: dotted keys set."""
    import yaml

    from flows.cli import write_demo_spec

    path = write_demo_spec(tmp, n_persons=n_persons)
    data = yaml.safe_load(path.read_text())
    for s in ("massc", "prb", "swap"):
        data["stages"][s] = None
    data["gates"]["xi"] = None
    data["design"]["publish_design_labels"] = True
    data["release"]["registry"] = f"sqlite:///{tmp / 'registry.db'}"
    set_dotted(data, changes)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def paper000_table1() -> pd.DataFrame:
    """Paper 000, Table 1: obs 1..10, age category (1: 12-16, 2: 17-20, 3: 21-24, 4: 25-29),
    gender, binge drinking (alc)."""
    return pd.DataFrame(
        {
            "age": [4, 2, 2, 1, 4, 1, 3, 2, 3, 3],
            "gender": ["F", "F", "F", "M", "F", "F", "M", "M", "M", "M"],
            "alc": ["N", "Y", "Y", "Y", "N", "Y", "N", "Y", "Y", "Y"],
        },
        index=pd.RangeIndex(1, 11, name="obs"),
    )


class Parsed(HTMLParser):
    """Element ids, <img> attributes, every src/href, text and table-row count of an HTML page."""

    def __init__(self, text: str):
        super().__init__()
        self.ids, self.imgs, self.srcs, self.text, self.rows = [], [], [], [], 0
        self.feed(text)
        self.close()

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if "id" in a:
            self.ids.append(a["id"])
        if tag == "img":
            self.imgs.append(a)
        if "src" in a or "href" in a:
            self.srcs.append(a.get("src") or a.get("href"))
        if tag == "tr":
            self.rows += 1

    def handle_data(self, data):
        self.text.append(data)


# The tables each stage puts in StageResult.tables (sdl_design stages) on the default spec, as
# a release writes them to internal/<stage>/<table>.csv. test_report builds its stage outputs
# with these names; test_release_flow checks them against a real release.
STAGE_TABLES = {
    "risk": ["profiles", "by_stratum", "by_profile_size"],
    "swap": [
        "pairs",
        "se_ratios",
        "se_ratio_summary",
        "se_ratio_summary_baseline",
        "se_ratio_summary_replicate",
        "matching_variance",
    ],
    "prb": [
        "blocks",
        "risk_by_block",
        "identification_risk",
        "weighted_counts",
        "tvd",
        "domains_not_kept",
        "transitions",
        "changed_by_variable",
    ],
    "massc": [
        "donor_levels",
        "moments",
        "rates",
        "delta",
        "delta_profiles",
        "epsilon_formula",
        "study_totals",
        "replicate_calibration",
        "weight_factors",
        "epsilon_replications",
        "calibration_domains",
    ],
    "topcode": ["thresholds"],
    "final": ["se_ratios", "se_ratio_summary"],
    "assess": ["domain_estimates", "model_coefficients", "worst_estimates", "attacks"],
}
# the report's sections (element ids), in order
SECTIONS = [
    "verdict",
    "leaves",
    "disclosure-risk",
    "validity",
    "gates",
    "approval",
    "summary",
    "se-ratios",
    "stages",
    "provenance",
]


def county_key_spec():
    """The default spec with county back among the keys (89 counties: many sample uniques), the
    earlier higher sensitivity scores and no declared utility domains (every key and every pair
    of keys): the high-risk setting several method tests were written for."""
    import yaml

    from sdl_design.spec import parse_spec

    data = yaml.safe_load(DEFAULT_SPEC.read_text())
    data["variables"]["keys"].append("county")
    data["stages"]["prb"]["variables"].insert(5, "county")
    data["stages"]["prb"]["cells"] = None  # the keys of C: the cells these tests were written for
    data["variables"]["other"] = {"keep": ["education", "pregnant"]}
    sens = {s["name"]: s for s in data["variables"]["sensitive"]}  # the earlier, higher scores
    sens["hypertension"]["sensitivity"] = {1: 0.7, 0: 0.0}
    sens["income"]["sensitivity"] = dict(
        zip(sens["income"]["sensitivity"], [0.5, 0.3, 0.1, 0.1, 0.5, 1.0], strict=True)
    )
    data.pop("utility", None)
    return parse_spec(data)


def paused_run(spec_path=None):
    """The paused flow run on the test server (the first; of spec_path when given), or None."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType

    with get_client(sync_client=True) as c:
        runs = c.read_flow_runs(
            flow_run_filter=FlowRunFilter(
                state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.PAUSED]))
            )
        )
    if spec_path is not None:  # not a run another test left paused
        runs = [r for r in runs if r.parameters.get("spec_path") == str(spec_path)]
    return runs[0] if runs else None


def run_until_paused(spec_path, wait_s: float = 300.0, flow=None):
    """Start flow(spec_path) (default release_flow) without an approver in a thread and wait
    for its pause: (thread, box, paused run or None); box gets 'manifest' or 'error' when the
    flow ends."""
    import threading
    import time

    from flows.release import release_flow

    flow = flow or release_flow
    box: dict = {}

    def run():
        try:
            box["manifest"] = flow(spec_path=str(spec_path), approval_poll_s=1)
        except Exception as e:  # noqa: BLE001 - the test inspects it
            box["error"] = e

    th = threading.Thread(target=run)
    th.start()
    fr = None
    t0 = time.monotonic()
    while time.monotonic() - t0 < wait_s:
        fr = paused_run(spec_path)
        if fr or not th.is_alive():
            break
        time.sleep(0.5)
    return th, box, fr


# a small valid spec as a dict (tests/test_spec.py, tests/test_messages.py)
MINI_SPEC = {
    "release": {"name": "mini", "year": 2026, "seed": 7},
    "design": {"weight": "w", "strata": "h", "psu": "p"},
    "variables": {
        "direct_identifiers": ["id"],
        "keys": [{"name": "age", "bins": [0, 18, 65, 120]}, "sex"],
        "sensitive": [{"name": "dia", "sensitivity": {1: 1.0, 0: 0.0}}],
        "study": ["inc"],
    },
    "edits": [{"rule": "between", "column": "age", "min": 0, "max": 120}],
    "stages": {"prb": {"xi": 0.395, "variables": ["age", "sex"]}},
}


def flat(result) -> dict:
    """A stage's result by partition as one dict: its metrics and facts (files written, rates
    by stratum), params, notes and tables."""
    return {
        **result.metrics,
        **result.facts,
        "params": result.params,
        "notes": result.notes,
        "tables": result.tables,
    }
