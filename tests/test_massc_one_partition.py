"""MASSC's passes on the records held in memory (one partition, their scratch folders held in
memory too) give the stage's frame kernel's release bit for bit, both on one BLAS thread as
the driver runs stages: the groundwork of running the in-memory release's MASSC through
them."""

from __future__ import annotations

import pandas as pd
import pytest
import yaml
from helpers import DEFAULT_SPEC

from sdl_design.blas import single_blas_thread
from sdl_design.engine import partitions as part
from sdl_design.engine.records import run_in_memory
from sdl_design.spec import parse_spec
from sdl_design.stage import StageContext
from sdl_design.stages.massc import MasscStage, massc_by_partition
from sdl_design.synth import make_survey


@pytest.mark.parametrize("delta_max", [None, 0.05])
def test_massc_passes_in_memory_are_the_frame_kernels_release(delta_max, figures_drawn):
    """The default spec's MASSC (without its replications, which the flow runs) on 3,000
    persons, with and without meet_delta's revisions: the retained records with their
    calibrated weight and replicate weights are the frame kernel's bit for bit, and so are
    its metrics, params, tables (delta by profile too), notes and figure; the
    selections and the substituted file were held in memory and are let go with the records."""
    data = yaml.safe_load(DEFAULT_SPEC.read_text())
    data["stages"]["massc"]["replications"] = 0
    data["utility"]["domains"] = ["sex", "region"]  # (every key declared: no record has a donor)
    if delta_max is not None:
        data.setdefault("gates", {})["delta_max"] = delta_max
    spec = parse_spec(data)
    df = make_survey(n_persons=3000, seed=5)
    ctx = StageContext(df, spec, "massc")
    stage = MasscStage.from_spec(spec)
    before = set(part._HELD)
    with single_blas_thread():  # (the calibration's X'WX: its bits depend on BLAS threads)
        want = stage.run(df, ctx)
        got = run_in_memory(stage, df, ctx, lambda s, records, c: massc_by_partition(records, c))
    assert set(part._HELD) == before  # the scratch folders, the records' own: released
    assert len(got.data) == len(want.data) < len(df)  # MASSC's subsample
    pd.testing.assert_frame_equal(got.data, want.data, check_exact=True)
    for c in want.data.select_dtypes("number").columns:  # the bits
        assert got.data[c].to_numpy().tobytes() == want.data[c].to_numpy().tobytes(), c
    # the result: the frame kernel's metrics, params, tables, notes and figure
    assert set(want.metrics) <= set(got.metrics)
    assert want.metrics["n_substituted"] > 0 and len(want.metrics) > 30
    for k in sorted(set(want.metrics) & set(got.metrics)):
        assert got.metrics[k] == want.metrics[k], k
    assert got.params == want.params and "cost_a" in got.params
    names = ("rates", "delta", "delta_profiles", "epsilon_formula", "study_totals")
    for name in (*names, "weight_factors"):
        pd.testing.assert_frame_equal(got.tables[name], want.tables[name], check_exact=True)
    assert want.tables["delta_profiles"]["delta_p"].iloc[0] == want.metrics["delta_profile_max"]
    assert got.report_tables == want.report_tables
    assert got.notes == want.notes and len(want.notes) >= 6  # the report's, word for word
    # the weight factors' histogram: from the distinct factors and their counts by partition,
    # the same picture (bytes) as from every record's factor
    png = want.figures["weight_factors"]
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and got.figures == want.figures
    if delta_max is not None:
        assert want.metrics["n_delta_revisions"] > 0
