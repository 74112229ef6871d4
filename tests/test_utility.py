"""Broad characteristics for the SE checks: the domains are the caller's, none are built in."""

from __future__ import annotations

import numpy as np
import pandas as pd

from sdl_design.spec import KeySpec
from sdl_design.utility import broad_characteristics, domain_mean_se


def frame(n: int = 240, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    return pd.DataFrame(
        {
            "years": rng.integers(0, 90, n),
            "gender": rng.choice(["f", "m"], n),
            "parish": [f"p{i:03d}" for i in rng.integers(0, 40, n)],  # 40 categories
            "y": rng.normal(size=n),
            "w": rng.uniform(1, 3, n),
            "st": np.repeat([0, 1], n // 2),
            "psu": np.tile(np.repeat([0, 1, 2], n // 6), 2),
        }
    )


def test_no_domains_unless_asked():
    df = frame()
    chars = broad_characteristics(df, exclude=["w", "st", "psu"])
    assert chars.domains == [] and chars.domain_vars == ["years", "y"]
    # a survey whose columns happen to be called sex and age gets none either
    chars = broad_characteristics(df.rename(columns={"gender": "sex", "years": "age"}))
    assert chars.domains == []


def test_domains_from_keys():
    df = frame()
    keys = [KeySpec(name="years", bins=[0, 18, 65, 91]), KeySpec(name="gender"), "parish"]
    chars = broad_characteristics(df, exclude=["w", "st", "psu"], domains=keys)
    # parish has 40 > max_categories categories: left out; the first two keys are crossed
    assert chars.domains == ["_dom_years", "_dom_gender", "_dom_years:gender"]
    band = np.select([df.years < 18, df.years < 65], ["0-18", "18-65"], "65-91")
    assert (chars.extra["_dom_years"] == band).all()
    assert (chars.extra["_dom_years:gender"] == pd.Series(band) + ":" + df.gender).all()
    t = domain_mean_se(df, chars, "w", "st", "psu").set_index(["variable", "domain"])
    # a domain mean is the weighted mean within the domain
    d = (band == "18-65") & (df.gender == "f").to_numpy()
    expect = np.average(df.y[d], weights=df.w[d])
    assert np.isclose(t.loc[("y", "years:gender=18-65:f"), "estimate"], expect)
    assert not t.index.get_level_values("domain").str.startswith("parish").any()
    chars = broad_characteristics(df, domains=keys, max_categories=50, cross=False)
    assert chars.domains == ["_dom_years", "_dom_gender", "_dom_parish"]
