"""The default survey at a size whose replicate weights do not fit in memory twice (the ACS's
15,000,000 persons: 8.4 GB of replicate weights alone), written as bench/release.py's input:
the persons generated whole without replicate weights, the JKn replicate weights (one per PSU,
the same products as make_survey's) computed and written a slice of records at a time.

Usage: python bench/large_input.py N FOLDER [rows_per_group] (default 1,048,576), then e.g.
PUF_BENCH_DASK_ONLY=1 python bench/partitioned.py FOLDER/default_spec.yaml. Prints the time and
this process's peak memory. Run it with PYTHONPATH set to the checkout.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import sdl_design  # noqa: F401 (first: the CPU kernels pinned before numpy loads)

# isort: split

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from flows.cli import default_spec_text
from sdl_design.survey.design import SurveyDesign
from sdl_design.synth import jkn_replicate_columns, make_survey


def write_large_survey(n: int, folder: Path, rows: int = 1 << 20) -> Path:
    """folder/input/default_survey.parquet (n persons, row groups of `rows`) and
    folder/default_spec.yaml pointing at it, as write_demo_spec writes them; the spec's path."""
    (folder / "input").mkdir(parents=True, exist_ok=True)
    survey = make_survey(n, replicates=False)
    d = SurveyDesign(survey, weight="wt", strata="stratum", psu="psu")
    at = survey.columns.get_loc("wt") + 1
    path = folder / "input" / "default_survey.parquet"
    writer = None
    try:
        for a in range(0, n, rows):
            part = survey.iloc[a : a + rows]
            rw = jkn_replicate_columns(d, slice(a, a + rows))
            cols = {c: part[c].to_numpy() for c in survey.columns[:at]} | rw
            cols |= {c: part[c].to_numpy() for c in survey.columns[at:]}
            table = pa.table(cols)
            if writer is None:
                writer = pq.ParquetWriter(path, table.schema)
            writer.write_table(table, row_group_size=rows)
            print(f"  {min(a + rows, n):,} of {n:,} records written", flush=True)
    finally:
        if writer is not None:
            writer.close()
    data = yaml.safe_load(default_spec_text())
    data["release"]["input"] = "input/default_survey.parquet"
    data["release"]["output_dir"] = "."
    spec = folder / "default_spec.yaml"
    spec.write_text(yaml.safe_dump(data, sort_keys=False))
    return spec


def main() -> None:
    n, folder = int(sys.argv[1]), Path(sys.argv[2])
    rows = int(sys.argv[3]) if len(sys.argv) > 3 else 1 << 20
    t0 = time.perf_counter()
    spec = write_large_survey(n, folder, rows)
    with open("/proc/self/status") as f:
        peak = next(int(x.split()[1]) for x in f if x.startswith("VmHWM:")) / 2**20
    print(f"{spec}: {n:,} records in {time.perf_counter() - t0:.1f} s, peak {peak:.2f} GiB")


if __name__ == "__main__":
    main()
