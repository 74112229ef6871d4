"""The release's attack on its own public file: the intruder's key, exact and nearest-neighbour
matching, the record map, the published coding of the keys and the public order."""

from __future__ import annotations

import itertools

import numpy as np
import pandas as pd
import pytest

from flows.public_files import public_records, record_map
from sdl_design.attack import (
    attack_battery,
    compact_columns,
    concat_columns,
    exact_match,
    individual_risk,
    intruder_key,
    nearest_neighbour,
    profiles,
)
from sdl_design.keys import publish_coding
from sdl_design.spec import KeySpec, SpecError, parse_spec

AGE_BINS = [0, 18, 35, 65, 91]


def _spec(keys=None, intruder=None, **extra):
    data = {
        "release": {"name": "t", "year": 2026, "input": None, "output_dir": "out", "seed": 7},
        "design": {"weight": "w", "strata": "h", "psu": "p"},
        "variables": {
            "keys": keys or [{"name": "age", "bins": AGE_BINS}, "sex"],
            "sensitive": [{"name": "y", "sensitivity": {0: 0.0, 1: 1.0}}],
            "study": ["inc"],
            "other": {"keep": ["edu", "hhs"]},
        },
        "stages": {},
        "gates": {"xi": 0.45},
        **extra,
    }
    if intruder is not None:
        data["intruder"] = intruder
    return parse_spec(data)


def _file(n=400, seed=1):
    rng = np.random.default_rng(seed)
    return pd.DataFrame(
        {
            "h": rng.integers(0, 4, n),
            "p": rng.integers(0, 2, n),
            "w": rng.uniform(50, 150, n),
            "age": rng.integers(0, 91, n),
            "sex": rng.choice(["f", "m"], n),
            "edu": rng.choice(["a", "b", "c"], n),
            "hhs": rng.integers(1, 7, n),
            "inc": rng.gamma(2.0, 20_000.0, n).round(2),
            "y": rng.integers(0, 2, n),
        }
    )


def _brute_force(orig_keys: list[tuple], pub_keys: list[tuple], link: list[int]) -> tuple:
    """The exact-match attack record by record, in plain Python: each sample unique of the
    original, the published records with its key, a claim when there is exactly one."""
    uniques = [i for i, k in enumerate(orig_keys) if orig_keys.count(k) == 1]
    claims = correct = 0
    for i in uniques:
        hits = [r for r, k in enumerate(pub_keys) if k == orig_keys[i]]
        if len(hits) == 1:
            claims += 1
            correct += link[hits[0]] == i
    return len(uniques), claims, correct


def test_exact_match_equals_brute_force():
    """exact_match's share and precision equal the attack run record by record on a small file
    with perturbed keys and dropped records."""
    rng = np.random.default_rng(3)
    orig = _file(300, seed=3)
    keep = np.sort(rng.choice(len(orig), 260, replace=False))
    pub = orig.iloc[keep].copy()
    flip = rng.random(len(pub)) < 0.3  # a perturbation: some sexes and ages changed
    pub.loc[flip, "sex"] = np.where(pub.loc[flip, "sex"] == "f", "m", "f")
    pub.loc[rng.random(len(pub)) < 0.2, "age"] = rng.integers(0, 91)
    pub = pub.sample(frac=1.0, random_state=5)  # published order: nothing to do with the input
    link = orig.index.get_indexer(pub.index)
    cols = ["age", "sex", "edu", "hhs"]
    keys = {"age": KeySpec(name="age", bins=AGE_BINS)}
    po, pr = profiles(orig, pub, cols, keys)
    got = exact_match(po, pr, link)

    def coded(df):
        b = np.searchsorted(AGE_BINS, df["age"].to_numpy(), side="right")
        return list(zip(b.tolist(), df["sex"], df["edu"], df["hhs"], strict=True))

    n_u, n_c, n_ok = _brute_force(coded(orig), coded(pub), link.tolist())
    assert n_u > 20 and n_c > 10  # the small file has uniques and claims to count
    assert got["sample_uniques"] == n_u and got["claimed"] == n_c and got["correct"] == n_ok
    assert got["share"] == pytest.approx(n_ok / n_u) and got["precision"] == pytest.approx(
        n_ok / n_c
    )


def test_nearest_neighbour_equals_brute_force():
    """nearest_neighbour links each original record to the nearest published record of its key
    cell (standardized distance), as a loop over the records does."""
    orig = _file(120, seed=8)
    pub = orig.sample(frac=1.0, random_state=2)
    pub["inc"] = pub["inc"] * np.random.default_rng(1).uniform(0.9, 1.1, len(pub))
    link = orig.index.get_indexer(pub.index)
    po, pr = profiles(orig, pub, ["sex", "edu"])
    xo, xr = orig[["inc"]].to_numpy(float), pub[["inc"]].to_numpy(float)
    got = nearest_neighbour(po, pr, link, xo, xr)
    sd = xo[:, 0].std()
    right = 0
    for i in range(len(orig)):
        cand = [r for r in range(len(pub)) if pr[r] == po[i]]
        d = [((xo[i, 0] - xr[r, 0]) / sd) ** 2 for r in cand]
        right += link[cand[int(np.argmin(d))]] == i
    assert got["share"] == pytest.approx(right / len(orig)) and got["attacked"] == 1.0


def test_nearest_neighbour_in_blocks_of_pairs_is_the_same(monkeypatch):
    """The pairs taken a block of original records at a time (blocks of at most 7, 50 or
    1,000,000 pairs; a record with more pairs than a block: a block alone) give the same
    shares; _pair_blocks' blocks hold whole records and at most that many pairs."""
    import sdl_design.attack as attack

    orig = _file(400, seed=3)
    pub = orig.sample(frac=1.0, random_state=5)
    pub["inc"] = pub["inc"] * np.random.default_rng(2).uniform(0.8, 1.2, len(pub))
    link = orig.index.get_indexer(pub.index)
    po, pr = profiles(orig, pub, ["sex", "edu"])
    xo, xr = orig[["inc"]].to_numpy(float), pub[["inc"]].to_numpy(float)
    got = {}
    for block in (7, 50, 1_000_000):
        monkeypatch.setattr(attack, "NN_PAIRS_BLOCK", block)
        got[block] = nearest_neighbour(po, pr, link, xo, xr)
    assert got[7] == got[50] == got[1_000_000]
    assert 0 < got[7]["share"] < 1 and got[7]["attacked"] == 1.0
    size = np.array([3, 9, 1, 1, 4, 20, 2, 2, 2])
    bounds = attack._pair_blocks(size, 8)
    assert bounds.tolist() == [0, 1, 2, 5, 6, 9]  # 3 | 9 | 1 1 4 | 20 | 2 2 2
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        assert b - a == 1 or size[a:b].sum() <= 8


def test_individual_risk_is_the_expectation_of_one_over_F():
    """Benedetti-Franconi's risk for f = 1 and 2 is E(1/F | f) under the negative binomial
    F - f ~ NB(f, p): the series summed term by term."""
    for f, p in itertools.product((1, 2), (0.02, 0.2, 0.7)):
        F = np.arange(f, 20_000)
        from scipy.stats import nbinom

        series = float((nbinom.pmf(F - f, f, p) / F).sum())
        got = individual_risk(np.array([f]), np.array([f / p]))[0]
        assert got == pytest.approx(series, rel=1e-9)


def test_keys_published_in_the_coding_the_risk_reads():
    """A binned key leaves in its bins (public file and attack alike); publish: detail leaves the
    exact values and the attack reads them; bins with publish: detail is refused."""
    orig = _file()
    spec = _spec()
    puf, rows = public_records(orig, spec, masked_design=True)
    assert set(puf["age"].astype(str)) <= {"0-18", "18-35", "35-65", "65-91"}
    detail = _spec(keys=[{"name": "age", "publish": "detail"}, "sex"])
    puf_d, _ = public_records(orig, detail, masked_design=True)
    assert np.array_equal(np.sort(puf_d["age"].to_numpy()), np.sort(orig["age"].to_numpy()))
    for s, p in ((spec, puf), (detail, puf_d)):
        key = intruder_key(s, p, ["h", "p"], ["w"])
        link = orig.index.get_indexer(public_records(orig, s, True)[1])
        m, _ = attack_battery(orig, p, link, key, ["h", "p"], "w", ["y"])
        # the number an outsider measures on the published file: exact match at its detail
        cols = [c for c in key.columns]
        po, pr = profiles(orig, p, cols, {k.name: k for k in s.variables.keys})
        assert m["reid_share"] == exact_match(po, pr, link)["share"]
    assert m["reid_share"] > 0.9  # exact age published: nearly every unique found
    with pytest.raises((SpecError, ValueError), match="publish: detail"):
        _spec(keys=[{"name": "age", "bins": AGE_BINS, "publish": "detail"}, "sex"])


def test_intruder_key_takes_every_published_column_an_intruder_may_know():
    orig = _file()
    spec = _spec(intruder={"unknown": {"edu": "asked in the interview only"}})
    key = intruder_key(spec, orig, ["h", "p"], ["w"])
    assert key.known == ["hhs"] and key.design == ["h", "p"]
    assert set(key.unknown) == {"edu", "y"} and key.continuous == ["inc"]
    assert key.informed == ["w"]  # the insider's nearest neighbour on the original weights
    hidden = _spec(intruder={"design_labels_unknown": "relabelled at random"})
    assert intruder_key(hidden, orig, ["h", "p"], ["w"]).design == []
    # the original labels published (no masking): places an intruder knows, whatever is said
    assert intruder_key(hidden, orig, ["h", "p"], ["w"], original_labels=True).design == ["h", "p"]
    with pytest.raises((SpecError, ValueError), match="reason"):
        _spec(intruder={"unknown": {"edu": " "}})


def test_record_map_is_exact_and_the_order_is_the_published_values():
    """Every public row maps to one input row holding its values; the rows are sorted by the
    published values (design labels first), whatever the order of the input."""
    orig = _file()
    spec = _spec()
    kept = orig.drop(index=[3, 10, 50])
    puf, rows = public_records(kept, spec, True, labels=["h", "p"])
    rm = record_map(orig.index, rows)
    assert rm["public_row"].isna().sum() == 3 and rm["public_row"].dropna().is_unique
    back = orig.iloc[rm.dropna()["input_row"].to_numpy()]
    at = rm.dropna()["public_row"].to_numpy(dtype=int)
    assert np.allclose(puf.loc[at, "inc"].to_numpy(), back["inc"].to_numpy())
    coded = publish_coding(back, spec.variables.keys)
    assert (puf.loc[at, "age"].astype(str).to_numpy() == coded["age"].astype(str).to_numpy()).all()
    shuffled, _ = public_records(
        kept.sample(frac=1.0, random_state=9), spec, True, labels=["h", "p"]
    )
    pd.testing.assert_frame_equal(puf, shuffled)
    key = list(zip(puf["h"], puf["p"], puf["w"], strict=True))
    assert key == sorted(key)


def test_a_guessable_seed_draws_a_warning():
    from sdl_design.spec import seed_warnings

    assert any("date" in w for w in seed_warnings(20261122))
    assert any("32 bits" in w for w in seed_warnings(123456))
    assert seed_warnings(1710067952095484995) == []


def test_design_label_attack_is_gated_only_when_the_labels_are_known():
    """Records alike on every column but their design cell: no unique on the intruder's key,
    every record unique with the design labels, which the intruder reads through the map from
    original to published labels (relabelled here). The gate's worst share is 1 when the labels
    are in the key and 0 when the spec declares them unknown; the attack is reported both ways."""
    n = 40
    orig = pd.DataFrame(
        {
            "h": np.repeat(np.arange(20), 2), "p": np.tile([0, 1], 20), "w": 100.0,
            "age": 30, "sex": "f", "edu": "a", "hhs": 2, "inc": 1000.0, "y": 0,
        }
    )  # fmt: skip
    pub = orig.sample(frac=1.0, random_state=1)
    pub["h"] = pub["h"] + 100  # published labels: a one-to-one map of the original ones
    link = orig.index.get_indexer(pub.index)
    got = {}
    for name, intr in (("known", None), ("hidden", {"design_labels_unknown": "relabelled"})):
        s = _spec(intruder=intr)
        key = intruder_key(s, pub, ["h", "p"], ["w"])
        got[name], _ = attack_battery(orig, pub, link, key, ["h", "p"], "w", ["y"])
    k, h = got["known"], got["hidden"]
    assert k["reid_share"] == h["reid_share"] == 0.0 and k["reid_sample_uniques"] == 0
    assert k["reid_share_design"] == h["reid_share_design"] == 1.0
    assert k["reid_sample_uniques_design"] == n and k["reid_precision_design"] == 1.0
    assert k["reid_share_worst"] == 1.0 and h["reid_share_worst"] == 0.0


def _messy(n: int, seed: int) -> pd.DataFrame:
    """A partition with missing text, a text design label, a coded key and a text sensitive."""
    rng = np.random.default_rng(seed)
    f = _file(n, seed).assign(h=lambda d: "s" + d["h"].astype(str))
    f["edu"] = pd.Series(rng.choice(["a", "b", "c", None], n), dtype="str")
    f["sex"] = f["sex"].astype(object)
    f["y"] = rng.choice(["no", "yes", "maybe"], n)
    f["hhs"] = f["hhs"] * (1000 if seed % 2 else 1)  # int8 in one partition, int16 in another
    return f


def test_compact_columns_end_to_end_hold_the_same_values_in_less_memory():
    """Partitions made compact (categories, small integers) and put end to end read value for
    value as pd.concat of the partitions as read, in a quarter of the memory or less."""
    parts = [_messy(500 + 37 * i, i) for i in range(4)]
    parts[2]["edu"] = pd.Series([None] * len(parts[2]), dtype=object)  # no category at all
    whole = pd.concat(parts, ignore_index=True)
    got = concat_columns([compact_columns(p) for p in parts])
    assert list(got.columns) == list(whole.columns) and len(got) == len(whole)
    for c in whole.columns:
        a, b = whole[c].astype(object), got[c].astype(object)
        assert (a.isna() == b.isna()).all() and (a[a.notna()] == b[a.notna()]).all(), c
    assert got["hhs"].dtype == np.int16 and got["p"].dtype == np.int8
    assert isinstance(got["sex"].dtype, pd.CategoricalDtype)
    assert got.memory_usage(deep=True).sum() * 4 < whole.memory_usage(deep=True).sum()


@pytest.mark.parametrize("mapped", [False, True])
def test_the_battery_reads_compact_columns_as_the_columns_read(mapped):
    """attack_battery on the partitions made compact gives every metric and table row that it
    gives on the columns as read: text keys by their categories (with a key's map applied to
    them), missing values a category of their own, text design labels and sensitive values."""
    keys = [{"name": "age", "bins": AGE_BINS}, "sex"]
    if mapped:
        keys.append({"name": "edu", "map": {"a": "ab", "b": "ab"}})
    s = _spec(keys=keys)
    orig = _messy(400, 5)
    pub = orig.sample(frac=0.9, random_state=2)
    pub["inc"] = pub["inc"] * np.random.default_rng(3).uniform(0.9, 1.1, len(pub))
    link = orig.index.get_indexer(pub.index)
    parts = np.array_split(np.arange(len(pub)), 3)
    cpub = concat_columns([compact_columns(pub.iloc[i]) for i in parts])
    corig = concat_columns([compact_columns(orig.iloc[i]) for i in np.array_split(orig.index, 2)])
    want = attack_battery(orig, pub, link, intruder_key(s, pub, ["h", "p"], ["w"]), ["h", "p"],
                          "w", ["y"])  # fmt: skip
    key = intruder_key(s, cpub, ["h", "p"], ["w"])
    got = attack_battery(corig, cpub, link, key, ["h", "p"], "w", ["y"])
    assert key.known == ["edu", "hhs"] or mapped
    assert want[0] == got[0] and want[0]["reid_sample_uniques"] > 0 < want[0]["nn_share"]
    pd.testing.assert_frame_equal(want[1], got[1])
