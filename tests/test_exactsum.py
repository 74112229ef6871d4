"""Order-free group sums (sdl_design.survey.exactsum): brute force with math.fsum (correctly rounded
sums of the exact values), and the property the partitioned path needs: the same bits however
the records are ordered or split."""

import math

import numpy as np
import pytest

from sdl_design.survey import exactsum as X


def _by_group(codes, x, G):
    return np.array([[math.fsum(x[codes == g, j]) for j in range(x.shape[1])] for g in range(G)])


def test_group_sums_are_the_correctly_rounded_exact_sums():
    rng = np.random.default_rng(7)
    n, G = 5000, 13
    # exponents within 20 bits of the bound: every term lies on the 78-bit grid, so the limb
    # sums are the exact sums and their floats the correctly rounded ones (fsum's)
    x = np.c_[
        rng.lognormal(3, 1.5, n).clip(1e-3, 1e3),
        rng.normal(0, 1e4, n),
        rng.choice([1e16, 1.0, -1e16], n),  # cancellation: a float loop loses the 1.0s
    ]
    x[:, 1] = np.where(np.abs(x[:, 1]) < 1.0, 1.0, x[:, 1])
    codes = rng.integers(0, G, n)
    E = X.grid_exponent(np.abs(x).max(axis=0))
    got = X.value(X.limb_sums(codes, x, G, E), E)
    np.testing.assert_array_equal(got, _by_group(codes, x, G))
    total = X.value(X.limb_total(X.limb_sums(codes, x, G, E)), E)
    np.testing.assert_array_equal(total, [math.fsum(x[:, j]) for j in range(3)])


def test_same_bits_in_any_order_and_any_split():
    rng = np.random.default_rng(3)
    n, G = 20_000, 50
    x = np.c_[rng.lognormal(0, 3, n), rng.standard_t(2, n) * 1e5]
    codes = rng.integers(0, G, n)
    E = X.grid_exponent(np.abs(x).max(axis=0))
    whole = X.value(X.limb_sums(codes, x, G, E), E)
    for seed in range(3):
        perm = np.random.default_rng(seed).permutation(n)
        cuts = np.r_[0, np.sort(np.random.default_rng(seed).integers(0, n, 4)), n]
        parts = [
            X.limb_sums(codes[perm][a:b], x[perm][a:b], G, E)
            for a, b in zip(cuts[:-1], cuts[1:], strict=True)
        ]
        total = np.zeros_like(parts[0])
        for p in parts[::-1]:
            total = X.add_limbs_at(total, np.arange(G), p)
        np.testing.assert_array_equal(X.value(total, E), whole)
    # a float loop is not: the same sums in another order differ in their last bits
    s1 = np.bincount(codes, weights=x[:, 1], minlength=G)
    s2 = np.bincount(codes[perm], weights=x[perm, 1], minlength=G)
    assert not np.array_equal(s1, s2)


def test_terms_below_the_grid_are_dropped_and_bad_terms_refused():
    x = np.array([[1.0], [2.0**-80], [2.0**-70]])
    E = X.grid_exponent([1.0])  # 1.0 < 2^1: grid 2^-77
    got = X.value(X.limb_sums(np.zeros(3, dtype=int), x, 1, E), E)
    assert got[0, 0] == 1.0 + 2.0**-70  # 2^-70 is on the grid, 2^-80 is not (rounded down)
    with pytest.raises(ValueError, match="exceeds the bound"):
        X.limb_sums(np.zeros(1, dtype=int), np.array([[4.0]]), 1, E)
    with pytest.raises(ValueError, match="NaN"):
        X.limb_sums(np.zeros(1, dtype=int), np.array([[np.nan]]), 1, E)
    with pytest.raises(ValueError, match="NaN"):
        X.grid_exponent([np.inf])


def test_partitions_sending_only_their_groups_add_to_the_same_bits():
    rng = np.random.default_rng(5)
    n, G = 6000, 400
    x = rng.lognormal(2, 2, (n, 2))
    codes = np.sort(rng.integers(0, G, n))  # sorted: each slice holds a run of the groups
    E = X.grid_exponent(x.max(axis=0))
    whole = X.limb_sums(codes, x, G, E)
    total = np.zeros_like(whole)
    for a, b in ((3000, 6000), (0, 1000), (1000, 3000)):
        present, local = np.unique(codes[a:b], return_inverse=True)
        assert len(present) < G
        total = X.add_limbs_at(total, present, X.limb_sums(local, x[a:b], len(present), E))
    np.testing.assert_array_equal(X.value(total, E), X.value(whole, E))
