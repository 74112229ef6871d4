"""MASSC's passes on the records held in memory (one partition, their scratch folders held in
memory too) against the stage's frame kernel: the groundwork of running the in-memory
release's MASSC through them. Measured here: the same retained records, values and metrics;
the calibrated weight and replicate weights to 1e-14 (measured: 1.6e-15), where by Parquet
partitions they are the frame kernel's bits (tests/test_partition.py): the difference to find
before the switch."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import yaml
from helpers import DEFAULT_SPEC

from sdl_design.engine import partitions as part
from sdl_design.engine.records import run_in_memory
from sdl_design.spec import parse_spec
from sdl_design.stage import StageContext
from sdl_design.stages.massc import MasscStage, massc_by_partition
from sdl_design.synth import make_survey


@pytest.mark.parametrize("delta_max", [None, 0.05])
def test_massc_passes_in_memory_are_the_frame_kernels_release(delta_max):
    """The default spec's MASSC (without its replications, which the flow runs) on 3,000
    persons, with and without meet_delta's revisions: the retained records with their
    calibrated weight and replicate weights are the frame kernel's bit for bit, and so are
    the counts and delta (the calibration's metrics to 1e-12); the selections and the substituted file
    were held in memory and are let go with the records. The weight and replicate weights
    to 1e-14 relative, every other column bit for bit."""
    data = yaml.safe_load(DEFAULT_SPEC.read_text())
    data["stages"]["massc"]["replications"] = 0
    if delta_max is not None:
        data.setdefault("gates", {})["delta_max"] = delta_max
    spec = parse_spec(data)
    df = make_survey(n_persons=3000, seed=5)
    ctx = StageContext(df, spec, "massc")
    stage = MasscStage.from_spec(spec)
    want = stage.run(df, ctx)
    before = set(part._HELD)
    got = run_in_memory(stage, df, ctx, lambda s, records, c: massc_by_partition(records, c))
    assert set(part._HELD) == before  # the scratch folders, the records' own: released
    assert len(got.data) == len(want.data) < len(df)  # MASSC's subsample
    assert got.data.index.equals(want.data.index)  # the records d(2) kept
    weights = [spec.design.weight, *spec.replicate_columns(df)]
    pd.testing.assert_frame_equal(
        got.data.drop(columns=weights), want.data.drop(columns=weights), check_exact=True
    )
    for c in weights:
        np.testing.assert_allclose(got.data[c], want.data[c], rtol=1e-14, atol=0, err_msg=c)
    common = set(got.metrics) & set(want.metrics)
    assert {"n_substituted", "n_subsampled_out", "delta", "n_delta_revisions"} <= common
    for k in sorted(common):  # counts exact, the rest to 1e-12 (the calibration's rounding)
        exact = k.startswith("n_") or k == "delta"
        assert got.metrics[k] == (
            want.metrics[k] if exact else pytest.approx(want.metrics[k], rel=1e-12)
        ), k
    if delta_max is not None:
        assert want.metrics["n_delta_revisions"] > 0
