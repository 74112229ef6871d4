"""Issue 15, leaks (items 5-9, 12) and issue 13 item 3: every column classified, only declared
columns published, rows shuffled, the year in the draws, unused levels dropped, formula cells
neutralized, no replicate zero pattern that gives away the original PSU, BLAS-thread-independent
results, and the CSV writer."""

from __future__ import annotations

import numpy as np
import pandas as pd

from flows.public_files import write_csv


def test_csv_writer_is_byte_identical_to_pandas(tmp_path):
    """polars writes what pandas.to_csv writes, on every type and awkward string a file has."""
    rng = np.random.default_rng(1)
    n = 2000
    chars = list("ab ,\"\n\r\t=+-@'é;|")
    strs = ["".join(rng.choice(chars, rng.integers(0, 6))) for _ in range(n)]
    df = pd.DataFrame(
        {
            "f": rng.standard_normal(n) * 10.0 ** rng.integers(-8, 18, n),
            "i": rng.integers(-5, 5, n),
            "s": strs,
            "o": pd.Series(strs, dtype=object).where(rng.random(n) > 0.1, None),
            "c": pd.Categorical(rng.choice(["x", "y", ""], n)),
            "b": rng.random(n) > 0.5,
            "I": pd.Series(rng.integers(0, 3, n)).astype("Int64").mask(rng.random(n) < 0.2),
            "fn": np.where(rng.random(n) < 0.2, np.nan, rng.random(n)),
            "d": pd.date_range("2020-01-01", periods=n, freq="h"),  # pandas writes these
        }
    )
    write_csv(df, tmp_path / "a.csv")
    df.to_csv(tmp_path / "b.csv", index=False, lineterminator="\n")
    assert (tmp_path / "a.csv").read_bytes() == (tmp_path / "b.csv").read_bytes()
    nodate = df.drop(columns="d")
    write_csv(nodate, tmp_path / "c.csv")  # the polars path itself
    assert (tmp_path / "c.csv").read_bytes() == nodate.to_csv(
        index=False, lineterminator="\n"
    ).encode("utf-8")
