"""factorize: pd.factorize remembered for Arrow-backed columns, equal to it in every case."""

import gc

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from sdl_design import codes
from sdl_design.codes import factorize


def _text(n: int, seed: int) -> pd.Series:
    rng = np.random.default_rng(seed)
    v = rng.choice(np.array(["b", "a", "dd", "c", None], dtype=object), n)
    return pd.Series(pd.array(v, dtype="string[pyarrow]"), name="k")


def _same(got: tuple, want: tuple) -> bool:
    """The same codes (values and dtype) and the same uniques."""
    return (
        np.array_equal(got[0], want[0])
        and got[0].dtype == want[0].dtype
        and list(pd.Index(got[1]).astype(object)) == list(pd.Index(want[1]).astype(object))
    )


@pytest.mark.parametrize("sort", [False, True])
@pytest.mark.parametrize("sentinel", [False, True])
def test_factorize_is_pd_factorize_remembered(sort: bool, sentinel: bool) -> None:
    s = _text(20_000, 1)
    want = pd.factorize(s, sort=sort, use_na_sentinel=sentinel)
    first = factorize(s, sort=sort, use_na_sentinel=sentinel)
    n = len(codes._remembered)
    first[0][:] = 99  # a caller's change to its codes does not reach the remembered ones
    frame = pd.DataFrame({"k": s, "x": np.arange(len(s))})
    again = factorize(frame["k"], sort=sort, use_na_sentinel=sentinel)  # another wrapper
    assert len(codes._remembered) == n  # the same buffers: remembered, not recomputed
    assert _same(again, want)
    assert _same(
        factorize(s.array, sort=sort, use_na_sentinel=sentinel),
        pd.factorize(s.array, sort=sort, use_na_sentinel=sentinel),
    )


def test_factorize_tells_slices_and_contents_apart() -> None:
    s = _text(30_000, 2)
    factorize(s)
    tail = s.iloc[10_000:].reset_index(drop=True)  # the same buffers at another offset
    assert _same(factorize(tail), pd.factorize(tail))
    other = _text(30_000, 3)
    assert _same(factorize(other), pd.factorize(other))
    chunked = pd.Series(
        pd.arrays.ArrowStringArray(
            pa.chunked_array([pa.array(["x"] * 5000), pa.array(["y"] * 5000)])
        )
    )
    assert _same(factorize(chunked), pd.factorize(chunked))


def test_factorize_forgets_a_freed_array() -> None:
    s = _text(10_000, 4)
    factorize(s)
    n = len(codes._remembered)
    del s
    gc.collect()
    assert len(codes._remembered) == n - 1


def test_factorize_passes_other_values_through() -> None:
    x = np.random.default_rng(5).integers(0, 7, 10_000)
    assert _same(factorize(x, sort=True), pd.factorize(x, sort=True))
    small = _text(100, 6)
    n = len(codes._remembered)
    assert _same(factorize(small), pd.factorize(small))
    assert len(codes._remembered) == n
