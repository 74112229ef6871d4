"""Block sums (sdl_design.survey.blocksum): the same bits for any partitioning of the file, bincount's
bits for a file of one block, and the sum to rounding (math.fsum)."""

import math

import numpy as np
import pytest

from sdl_design.survey.blocksum import BLOCK, block_partial, combine_partials, group_sum


def _terms(n, G, seed, keep=0.7):
    """Terms of a subset of n records (as a masked column gives): rows, group codes, values
    spread over 12 orders of magnitude with cancellations."""
    rng = np.random.default_rng(seed)
    rows = np.flatnonzero(rng.random(n) < keep)
    codes = rng.integers(0, G, len(rows))
    x = rng.standard_normal(len(rows)) * 10.0 ** rng.integers(-6, 7, len(rows))
    return rows, codes, x


def _by_partition(rows, codes, x, G, n, cuts):
    bounds = [0, *cuts, n]
    parts = []
    for a, b in zip(bounds, bounds[1:], strict=False):
        i, j = np.searchsorted(rows, [a, b])
        parts.append(block_partial(codes[i:j], x[i:j], G, a, b, rows[i:j]))
    return combine_partials(parts, G, n)


def test_one_block_is_bincount_to_the_bit():
    rows, codes, x = _terms(BLOCK, 5, 1)
    got = group_sum(codes, x, 5, BLOCK, rows)
    assert got.tobytes() == np.bincount(codes, weights=x, minlength=5).tobytes()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_any_partitioning_gives_the_same_bits(seed):
    """Cuts inside blocks, on block edges, partitions inside one block and empty of terms:
    the sums equal the in-memory ones bit for bit, where adding the partitions' bincounts
    does not."""
    n, G = 3 * BLOCK + 1234, 7
    rows, codes, x = _terms(n, G, seed)
    whole = group_sum(codes, x, G, n, rows)
    rng = np.random.default_rng(seed + 10)
    cut_sets = [
        [BLOCK, 2 * BLOCK],
        [17, 18, 500, BLOCK - 1, BLOCK + 1, 2 * BLOCK + 7],
        sorted(rng.choice(np.arange(1, n), 40, replace=False).tolist()),
        [5, 6, 7, 8, 9],  # partitions of one record, some of them without a term
    ]
    for cuts in cut_sets:
        assert _by_partition(rows, codes, x, G, n, cuts).tobytes() == whole.tobytes(), cuts
    naive = sum(
        np.bincount(codes[(rows >= a) & (rows < b)], x[(rows >= a) & (rows < b)], G)
        for a, b in zip([0, *cut_sets[2]], [*cut_sets[2], n], strict=False)
    )
    assert naive.tobytes() != whole.tobytes()  # a plain sum of partial sums differs
    for g in range(G):  # and the sum is the sum, to rounding
        exact = math.fsum(x[codes == g])
        assert whole[g] == pytest.approx(exact, rel=1e-9, abs=1e-9 * np.abs(x).max())


def test_one_block_file_by_partition_is_bincount():
    n, G = 3000, 4
    rows, codes, x = _terms(n, G, 5)
    got = _by_partition(rows, codes, x, G, n, [450, 900, 1350, 1800, 2250, 2700])
    assert got.tobytes() == np.bincount(codes, weights=x, minlength=G).tobytes()


def test_partitions_numbering_groups_their_own_way_give_the_same_bits():
    """Each partition numbers the groups it holds its own way (first appearance in it, only
    those present): mapped to the file's numbering by combine_local, the sums are group_sum's
    bits, with cuts inside blocks."""
    from sdl_design.survey.blocksum import combine_local

    n, G = 2 * BLOCK + 999, 9
    rows, codes, x = _terms(n, G, 4)
    whole = group_sum(codes, x, G, n, rows)
    bounds = [0, 300, BLOCK + 5, BLOCK + 6, 2 * BLOCK - 2, n]
    parts, ids = [], []
    for a, b in zip(bounds, bounds[1:], strict=False):
        i, j = np.searchsorted(rows, [a, b])
        local, present = np.unique(codes[i:j], return_inverse=True)  # local numbering
        perm = np.random.default_rng(a).permutation(len(local))  # in any order
        parts.append(block_partial(perm[present], x[i:j], len(local), a, b, rows[i:j]))
        ids.append(local[np.argsort(perm)])
    assert combine_local(parts, ids, G, n).tobytes() == whole.tobytes()


def test_block_partials_of_several_columns_are_each_columns_bits():
    """BlockBins.of_columns (one sparse product for every column of a row-major X, a bincount
    per column of a column-major one) gives each column's BlockPartial bit for bit, a
    partition cut inside a block; combined, each column's sums are group_sum's of the whole
    file."""
    from sdl_design.survey.blocksum import block_bins

    n, G = 2 * BLOCK + 777, 13
    rows, codes, _ = _terms(n, G, 6)
    X = np.random.default_rng(6).lognormal(3.0, 2.0, size=(len(rows), 5))
    cut = int(np.searchsorted(rows, BLOCK + 11))
    parts = []
    for i, j, a, b in ((0, cut, 0, BLOCK + 11), (cut, len(rows), BLOCK + 11, n)):
        bins = block_bins(codes[i:j], G, a, b, rows[i:j])
        many = bins.of_columns(X[i:j])
        by_column = bins.of_columns(np.asfortranarray(X[i:j]))
        # the rows of a larger matrix, scaled: X[take] * scale's bits, either layout
        take = np.arange(i, j)
        scale = np.random.default_rng(7).lognormal(0.0, 0.5, j - i)
        want = bins.of_columns(X[take] * scale[:, None])
        for layout in (np.ascontiguousarray, np.asfortranarray):
            taken = bins.of_columns(layout(X), take, scale)
            for k in range(X.shape[1]):
                assert taken[k].sums.tobytes() == want[k].sums.tobytes()
                assert taken[k].cont_x.tobytes() == want[k].cont_x.tobytes()
        for k in range(X.shape[1]):
            assert by_column[k].sums.tobytes() == many[k].sums.tobytes()
            one = bins.of(X[i:j, k])
            assert many[k].sums.tobytes() == one.sums.tobytes()
            assert many[k].cont_x.tobytes() == one.cont_x.tobytes() and many[k].cont == one.cont
        parts.append(many)
    for k in range(X.shape[1]):
        got = combine_partials([p[k] for p in parts], G, n)
        assert got.tobytes() == group_sum(codes, X[:, k], G, n, rows).tobytes()


def test_the_accumulator_holds_one_open_block_and_refuses_parts_out_of_order():
    """BlockAccumulator adds each block to its total once a later one has begun: after any
    part it holds at most the block the next part may continue (G numbers), and a part that
    continues a block already added is refused, not added out of order."""
    from sdl_design.survey.blocksum import BlockAccumulator

    n, G = 5 * BLOCK + 99, 4
    rows, codes, x = _terms(n, G, 3)
    bounds = [0, 70, BLOCK + 5, 3 * BLOCK + 1, 3 * BLOCK + 2, 5 * BLOCK, n]
    parts = []
    for a, b in zip(bounds, bounds[1:], strict=False):
        i, j = np.searchsorted(rows, [a, b])
        parts.append(block_partial(codes[i:j], x[i:j], G, a, b, rows[i:j]))
    acc = BlockAccumulator(G, n)
    for p in parts:
        acc.add(p)
        assert len(acc.open) <= 1 and all(v.shape == (G,) for v in acc.open.values())
    assert acc.total().tobytes() == group_sum(codes, x, G, n, rows).tobytes()
    late = BlockAccumulator(G, n)
    late.add(parts[2])  # blocks 2 and 3 begun: block 1, which parts[2] continued, is added
    with pytest.raises(ValueError, match="out of order"):
        late.add(parts[2])
