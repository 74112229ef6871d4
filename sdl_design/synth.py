"""The embedded default survey: a realistic NHANES-like stratified multistage sample.

Stages: 30 strata (each in one region) -> 2 or 3 PSUs per stratum (one or two counties each)
-> segments (about 20 persons each) -> households (sizes 1-8) -> every person of the household.
Race is clustered by segment; segment and PSU random effects drive income, bmi, diabetes,
hypertension, smoker and insured, so design effects run from below 1 to above 5. Weights are
unequal: black, hispanic, asian and 60+ persons are oversampled (lower weights), household
nonresponse is adjusted, the largest weights are trimmed, and each stratum is scaled to its
population. Everything is vectorized numpy: no loop over persons, households or segments.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from sdl_design.survey.design import SurveyDesign

N_STRATA = 30
POPULATION = 330_000_000.0
PERSONS_PER_SEGMENT = 20  # average segment yield
MIN_SEGMENT = 8  # persons; >= the largest household, so every segment keeps a household

REGIONS = np.array(["northeast", "midwest", "south", "west"], dtype=object)
STRATA_PER_REGION = (5, 7, 11, 7)
RACES = np.array(["white", "black", "hispanic", "asian", "other"], dtype=object)
# sample race composition by region (the oversampled domains are over-represented)
RACE_BY_REGION = np.array(
    [
        [0.45, 0.20, 0.20, 0.10, 0.05],
        [0.55, 0.20, 0.12, 0.06, 0.07],
        [0.30, 0.30, 0.30, 0.05, 0.05],
        [0.30, 0.07, 0.38, 0.18, 0.07],
    ]
)
RACE_RATE = np.array([1.0, 2.2, 2.0, 2.6, 1.2])  # relative sampling rates (oversampling)
AGE60_RATE = 1.8
MARITAL = np.array(["never_married", "married", "widowed", "divorced", "separated"], dtype=object)
# marital status probabilities (columns as MARITAL) by class of role and age (see _marital)
MARITAL_P = np.array(
    [
        [1.00, 0.00, 0.00, 0.00, 0.00],  # under 18
        [0.00, 0.96, 0.00, 0.00, 0.04],  # couples (4% separated but co-resident)
        [0.05, 0.25, 0.55, 0.15, 0.00],  # grandparents
        [0.40, 0.02, 0.05, 0.38, 0.15],  # single parents
        [0.85, 0.04, 0.00, 0.07, 0.04],  # other adults < 30
        [0.42, 0.08, 0.04, 0.36, 0.10],  # 30-54
        [0.20, 0.10, 0.20, 0.42, 0.08],  # 55-64
        [0.10, 0.08, 0.52, 0.26, 0.04],  # 65+
    ]
)
EDUCATION = np.array(["less_hs", "high_school", "some_college", "college"], dtype=object)
HH_SIZE_P = np.array([0.28, 0.34, 0.15, 0.13, 0.06, 0.025, 0.01, 0.005])  # sizes 1..8

FEMALE_NAMES = (
    "Mary Patricia Jennifer Linda Elizabeth Barbara Susan Jessica Sarah Karen Lisa Nancy Betty "
    "Sandra Margaret Ashley Kimberly Emily Donna Michelle Carol Amanda Melissa Deborah Stephanie "
    "Rebecca Sharon Laura Cynthia Amy Kathleen Angela Shirley Brenda Emma Anna Pamela Nicole "
    "Samantha Katherine Christine Helen Debra Rachel Carolyn Janet Maria Catherine Heather Diane"
).split()
MALE_NAMES = (
    "James Robert John Michael David William Richard Joseph Thomas Christopher Charles Daniel "
    "Matthew Anthony Mark Donald Steven Andrew Paul Joshua Kenneth Kevin Brian George Timothy "
    "Ronald Jason Edward Jeffrey Ryan Jacob Gary Nicholas Eric Jonathan Stephen Larry Justin "
    "Scott Brandon Benjamin Samuel Gregory Alexander Patrick Frank Raymond Jack Dennis Jerry"
).split()
LAST_NAMES = (
    "Smith Johnson Williams Brown Jones Garcia Miller Davis Rodriguez Martinez Hernandez Lopez "
    "Gonzalez Wilson Anderson Thomas Taylor Moore Jackson Martin Lee Perez Thompson White Harris "
    "Sanchez Clark Ramirez Lewis Robinson Walker Young Allen King Wright Scott Torres Nguyen Hill "
    "Flores Green Adams Nelson Baker Hall Rivera Campbell Mitchell Carter Roberts Gomez Phillips "
    "Evans Turner Diaz Parker Cruz Edwards Collins Reyes Stewart Morris Morales Murphy Cook Rogers "
    "Gutierrez Ortiz Morgan Cooper Peterson Bailey Reed Kelly Howard Ramos Kim Cox Ward Richardson "
    "Watson Brooks Chavez Wood James Bennett Gray Mendoza Ruiz Hughes Price Alvarez Castillo Sanders"
).split()


def _expit(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _draw(
    rng: np.random.Generator, probs: np.ndarray, rows: np.ndarray | None = None
) -> np.ndarray:
    """One categorical draw per row of probs (or per entry of rows indexing probs): category codes."""
    p = probs if rows is None else probs[rows]
    cum = np.cumsum(p, axis=1)
    cum /= cum[:, -1:]
    u = rng.random(len(p))
    return np.minimum((u[:, None] > cum).sum(axis=1), p.shape[1] - 1)


def _largest_remainder(total: int, share: np.ndarray) -> np.ndarray:
    """Integers >= 0 summing to total, proportional to share (largest-remainder rounding)."""
    raw = total * share / share.sum()
    out = np.floor(raw).astype(np.int64)
    short = total - int(out.sum())
    if short > 0:
        out[np.argsort(-(raw - out), kind="stable")[:short]] += 1
    return out


def _design(rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
    """Strata, PSUs, counties and segments (segment-level arrays, segments ordered by PSU)."""
    region_of_stratum = np.repeat(np.arange(4), STRATA_PER_REGION)
    n_psu = np.where(rng.random(N_STRATA) < 0.2, 3, 2)
    n_psu[rng.choice(N_STRATA, 2, replace=False)] = 3  # at least two 3-PSU strata
    psu_stratum = np.repeat(np.arange(N_STRATA), n_psu)
    psu_label = np.concatenate([np.arange(1, k + 1) for k in n_psu])  # 30 small aranges
    n_psus = len(psu_stratum)
    # counties: one or two per PSU, numbered globally (so nested in PSU and stratum)
    county_per_psu = np.where(rng.random(n_psus) < 0.4, 2, 1)
    county_first = np.concatenate([[0], np.cumsum(county_per_psu)[:-1]])
    # segments per PSU: about n / (20 * PSUs), varying from PSU to PSU
    target = n / (PERSONS_PER_SEGMENT * n_psus)
    k = np.maximum(2, np.rint(target * rng.gamma(16.0, 1 / 16.0, n_psus))).astype(np.int64)
    while MIN_SEGMENT * k.sum() > n:  # small n: fewer segments, never below 2 per PSU
        if k.max() <= 2:
            raise ValueError(
                f"n_persons={n} is too small for the default design; use at least "
                f"{MIN_SEGMENT * 2 * n_psus} persons"
            )
        k = np.maximum(2, k - 1)
    seg_psu = np.repeat(np.arange(n_psus), k)
    n_seg = len(seg_psu)
    # segment sizes (persons): MIN_SEGMENT + a gamma share of the rest
    size_share = rng.gamma(4.0, 1.0, n_seg)
    seg_size = MIN_SEGMENT + _largest_remainder(n - MIN_SEGMENT * n_seg, size_share)
    seg_county = county_first[seg_psu] + (rng.random(n_seg) < 0.5) * (county_per_psu[seg_psu] - 1)
    return {
        "region_of_stratum": region_of_stratum,
        "psu_stratum": psu_stratum,
        "psu_label": psu_label,
        "seg_psu": seg_psu,
        "seg_size": seg_size,
        "seg_county": seg_county,
    }


def _households(rng: np.random.Generator, n: int, seg_size: np.ndarray):
    """Household sizes (summing to n) and the segment of each household (households nested)."""
    sizes = rng.choice(np.arange(1, 9), size=n // 2 + 64, p=HH_SIZE_P)
    cum = np.cumsum(sizes)
    while cum[-1] < n:  # practically never: mean size is about 2.4
        more = rng.choice(np.arange(1, 9), size=n // 2 + 64, p=HH_SIZE_P)
        sizes = np.concatenate([sizes, more])
        cum = np.cumsum(sizes)
    m = int(np.searchsorted(cum, n, side="left")) + 1
    sizes = sizes[:m].copy()
    sizes[-1] -= int(cum[m - 1] - n)  # the last household is cut to reach n exactly
    cum = np.cumsum(sizes)
    # each segment boundary snapped to the next household boundary; segments >= 8 persons and
    # households <= 8 persons keep every segment non-empty
    last_hh = np.searchsorted(cum, np.cumsum(seg_size), side="left")
    hh_seg = np.searchsorted(last_hh, np.arange(m), side="left")
    return sizes, hh_seg


def make_survey(
    n_persons: int = 20000, seed: int = 20261122, replicates: bool = True
) -> pd.DataFrame:
    """The embedded default survey: one row per sampled person (see the module docstring).

    Same n_persons and seed give a byte-identical frame. With replicates=True the JKn replicate
    weights rw_001..rw_R (one per PSU) of the design are appended.
    """
    n = int(n_persons)
    if n < 1:
        raise ValueError(f"n_persons must be a positive integer (got {n_persons})")
    rng = np.random.default_rng(seed)
    d = _design(rng, n)
    area = _area_effects(rng, d)
    hh_size, hh_seg = _households(rng, n, d["seg_size"])
    p = _persons(rng, n, hh_size, hh_seg, d["seg_psu"], area.seg_stratum)
    race = _race(rng, area.seg_race_p, hh_seg, p)
    marital_code = _marital(rng, p)
    edu_code = _education(rng, area, p, race)
    study = _study_variables(rng, area, p, race, edu_code)
    w = _weights(rng, area, p, race, hh_size, hh_seg)
    name = _names(rng, p.female, p.hh, len(hh_size))
    pid = 10_000_000 + rng.permutation(n)
    seg_county = d["seg_county"]
    county_labels = np.array(
        [f"c{i + 1:03d}" for i in range(int(seg_county.max()) + 1)], dtype=object
    )
    seg_region = d["region_of_stratum"][area.seg_stratum]
    df = pd.DataFrame(
        {
            "person_id": pd.Series(pid).astype(str).radd("P").to_numpy(dtype=object),
            "name": name,
            "stratum": (p.stratum + 1).astype(np.int64),
            "psu": d["psu_label"][p.psu].astype(np.int64),
            "segment": (p.seg + 1).astype(np.int64),
            "household": (p.hh + 1).astype(np.int64),
            "wt": w.astype(np.float64),
            "age": p.age,
            "sex": np.where(p.female, "female", "male").astype(object),
            "race": RACES[race],
            "marital": MARITAL[marital_code],
            "region": REGIONS[seg_region[p.seg]],
            "county": county_labels[seg_county[p.seg]],
            "education": np.where(p.adult, EDUCATION[edu_code], "child").astype(object),
            "hh_size": p.size.astype(np.int64),
            **study,
        }
    )
    if replicates:
        df = _with_replicates(df)
    return df


@dataclass
class _Area:
    """Random effects of strata, PSUs and segments (z: ses, income, bmi, hypertension, smoker,
    insured by PSU and segment; ses, income, insured by stratum) and each segment's race mix."""

    seg_stratum: np.ndarray
    seg_race_p: np.ndarray  # (n_seg, races) Dirichlet race shares
    z_psu: np.ndarray  # (n_psus, 6)
    z_seg: np.ndarray  # (n_seg, 6)
    z_str: np.ndarray  # (N_STRATA, 3)
    seg_ses: np.ndarray
    seg_resp: np.ndarray  # household response propensity (logit), tied to the income effect


def _area_effects(rng: np.random.Generator, d: dict[str, np.ndarray]) -> _Area:
    """Race mixes (stratum, then Dirichlet by segment) and normal effects of every area level."""
    seg_psu, psu_stratum = d["seg_psu"], d["psu_stratum"]
    seg_stratum = psu_stratum[seg_psu]
    stratum_race = rng.gamma(30.0 * RACE_BY_REGION[d["region_of_stratum"]], 1.0)
    stratum_race /= stratum_race.sum(axis=1, keepdims=True)
    seg_race_p = rng.gamma(1.2 * stratum_race[seg_stratum], 1.0) + 1e-12  # Dirichlet by segment
    seg_race_p /= seg_race_p.sum(axis=1, keepdims=True)
    z_psu = rng.standard_normal((len(psu_stratum), 6))
    z_seg = rng.standard_normal((len(seg_psu), 6))
    z_str = rng.standard_normal((N_STRATA, 3))
    seg_ses = 0.35 * z_str[seg_stratum, 0] + 0.4 * z_psu[seg_psu, 0] + 0.6 * z_seg[:, 0]
    seg_resp = 1.2 + 0.25 * z_seg[:, 1] + 0.2 * z_psu[seg_psu, 1]
    return _Area(seg_stratum, seg_race_p, z_psu, z_seg, z_str, seg_ses, seg_resp)


@dataclass
class _Persons:
    """Each person's household, design units, role, age and sex."""

    hh: np.ndarray  # household index
    pos: np.ndarray  # position in the household: 0 is the head
    size: np.ndarray  # household size
    seg: np.ndarray
    psu: np.ndarray
    stratum: np.ndarray
    htype: np.ndarray  # household type (see _household_types)
    partner: np.ndarray
    grandparent: np.ndarray
    age: np.ndarray
    female: np.ndarray

    @property
    def adult(self) -> np.ndarray:
        return self.age >= 18


def _household_types(
    rng: np.random.Generator, s: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Type, grandparent present and head's age of each household of size s. Types: 0 single
    adult, 1 couple, 2 single parent, 3 unrelated adults, 4 two-parent family, 5 one-parent
    family, 6 multigenerational/other."""
    m = len(s)
    u = rng.random(m)
    hh_type = np.select(
        [s == 1, (s == 2) & (u < 0.70), (s == 2) & (u < 0.88), s == 2, u < 0.70, u < 0.88],
        [0, 1, 2, 3, 4, 5],
        6,
    )
    has_grandparent = (hh_type >= 4) & (s >= 4) & (rng.random(m) < 0.10)
    uh = rng.random(m)
    head_age = np.select(
        [hh_type == 0, hh_type == 1, hh_type == 3, hh_type == 6],
        [
            np.where(
                uh < 0.3,
                18 + uh / 0.3 * 27,
                np.where(uh < 0.52, 45 + (uh - 0.3) / 0.22 * 20, 65 + (uh - 0.52) / 0.48 * 26),
            ),
            22 + 69 * uh**0.6,
            18 + 73 * uh**1.5,
            25 + 66 * uh,
        ],
        22 + 36 * uh,  # parents
    ).astype(np.int64)
    return hh_type, has_grandparent, np.minimum(head_age, 90)


def _persons(
    rng: np.random.Generator,
    n: int,
    hh_size: np.ndarray,
    hh_seg: np.ndarray,
    seg_psu: np.ndarray,
    seg_stratum: np.ndarray,
) -> _Persons:
    """Every person of every household: role from the household type, age by role, sex."""
    m = len(hh_size)
    hh_start = np.concatenate([[0], np.cumsum(hh_size)[:-1]])
    hh = np.repeat(np.arange(m), hh_size)
    pos = np.arange(n) - hh_start[hh]
    size = hh_size[hh]
    seg = hh_seg[hh]
    hh_type, has_grandparent, head_age = _household_types(rng, hh_size)
    htype = hh_type[hh]
    h_age = head_age[hh]
    partner = (pos == 1) & ((htype == 1) | ((htype == 4) & (size >= 2)))
    grandparent = has_grandparent[hh] & (pos == size - 1)
    other_adult = ((htype == 3) | (htype == 6)) & (pos >= 1) & ~grandparent
    child = (pos >= 1) & ~partner & ~grandparent & ~other_adult
    up = rng.random(n)
    max_child = np.clip(h_age - 18, 1, 30)
    age = np.select(
        [pos == 0, partner, grandparent, other_adult, child],
        [
            h_age,
            np.clip(h_age + np.rint(3.5 * rng.standard_normal(n)), 18, 90),
            62 + np.floor(29 * up),
            np.where(htype == 6, np.floor(91 * up), 18 + np.floor(73 * up)),
            np.floor(up * max_child),
        ],
    ).astype(np.int64)
    age = np.clip(age, 0, 90)
    female = _sex(rng, pos, htype, age, partner, grandparent, hh_start[hh])
    psu = seg_psu[seg]
    stratum = seg_stratum[seg]
    return _Persons(hh, pos, size, seg, psu, stratum, htype, partner, grandparent, age, female)


def _sex(
    rng: np.random.Generator,
    pos: np.ndarray,
    htype: np.ndarray,
    age: np.ndarray,
    partner: np.ndarray,
    grandparent: np.ndarray,
    head: np.ndarray,
) -> np.ndarray:
    """Female indicator: partners of the opposite sex of the head (head: the head's row);
    singles more often women, especially older ones."""
    p_female = np.where(
        pos == 0,
        np.where(htype == 0, np.where(age >= 65, 0.65, 0.52), np.where(htype == 2, 0.8, 0.5)),
        0.5,
    )
    p_female = np.where(grandparent, 0.65, p_female)
    female = rng.random(len(pos)) < p_female
    head_female = female[head]
    return np.where(partner, ~head_female ^ (rng.random(len(pos)) < 0.04), female)


def _race(
    rng: np.random.Generator, seg_race_p: np.ndarray, hh_seg: np.ndarray, p: _Persons
) -> np.ndarray:
    """The household's race from its segment's mix; a few persons differ."""
    hh_race = _draw(rng, seg_race_p, hh_seg)
    return np.where(rng.random(len(p.hh)) < 0.95, hh_race[p.hh], _draw(rng, seg_race_p, p.seg))


def _marital(rng: np.random.Generator, p: _Persons) -> np.ndarray:
    """Marital status code by role and age (rows of MARITAL_P)."""
    head, htype = p.pos == 0, p.htype
    married_couple = head & ((htype == 1) | ((htype == 4) & (p.size >= 2))) | p.partner
    mclass = np.select(
        [
            p.age < 18,
            married_couple,
            p.grandparent,
            head & (htype == 2) | head & (htype == 5),
            p.age < 30,
            p.age < 55,
            p.age < 65,
        ],
        [0, 1, 2, 3, 4, 5, 6],
        7,
    )
    return _draw(rng, MARITAL_P, mclass)


def _education(rng: np.random.Generator, area: _Area, p: _Persons, race: np.ndarray) -> np.ndarray:
    """Education code: ordered latent score from segment SES, race and age."""
    race_edu = np.array([0.2, -0.15, -0.45, 0.55, -0.1])
    latent = (
        0.6 * area.seg_ses[p.seg]
        + race_edu[race]
        - 0.006 * (p.age - 45)
        + rng.standard_normal(len(p.age))
    )
    return np.searchsorted(np.array([-1.25, -0.25, 0.45]), latent)


def _study_variables(
    rng: np.random.Generator, area: _Area, p: _Persons, race: np.ndarray, edu_code: np.ndarray
) -> dict[str, np.ndarray]:
    """income, bmi and the health indicators, in the frame's column order."""
    income = _income(rng, area, p, race, edu_code)
    bmi = _bmi(rng, area, p, race)
    return {
        "income": income.astype(np.float64),
        "bmi": bmi.astype(np.float64),
        **_conditions(rng, area, p, race, edu_code, bmi),
    }


def _income(
    rng: np.random.Generator, area: _Area, p: _Persons, race: np.ndarray, edu_code: np.ndarray
) -> np.ndarray:
    """Lognormal body, Pareto tail, zeros; children have no personal income."""
    n, age = len(p.age), p.age
    ses = area.seg_ses[p.seg]
    age_eff = np.select([age < 25, age < 35, age < 55, age < 65], [-0.55, 0.0, 0.25, 0.1], -0.3)
    edu_eff = np.array([-0.5, -0.15, 0.0, 0.45])[edu_code]
    race_inc = np.array([0.0, -0.2, -0.15, 0.1, -0.1])[race]
    mu = (
        np.log(32000.0)
        + age_eff
        + edu_eff
        + race_inc
        - 0.25 * p.female
        + 0.3 * ses
        + 0.12 * area.z_str[p.stratum, 1]
        + 0.15 * area.z_psu[p.psu, 1]
        + 0.2 * area.z_seg[p.seg, 1]
    )
    body = np.exp(mu + 0.75 * rng.standard_normal(n))
    tail = 120_000.0 * (1.0 + rng.pareto(1.6, n))
    p_tail = _expit(-4.3 + 0.9 * (edu_code == 3) + 0.5 * ses)
    inc = np.where(rng.random(n) < p_tail, tail, body)
    p_zero = np.where(age >= 65, 0.04, _expit(-2.2 - 0.3 * (edu_code - 1)))
    inc = np.where(rng.random(n) < p_zero, 0.0, inc)
    teen_inc = np.where(
        rng.random(n) < 0.5, 0.0, np.exp(np.log(4000.0) + 0.8 * rng.standard_normal(n))
    )
    return np.round(np.where(p.adult, inc, np.where(age >= 16, teen_inc, 0.0)))


def _bmi(rng: np.random.Generator, area: _Area, p: _Persons, race: np.ndarray) -> np.ndarray:
    """Adults lognormal around 27.5, children by age."""
    n, age = len(p.age), p.age
    log_bmi_adult = (
        np.log(27.5)
        + 0.004 * (np.minimum(age, 60) - 40)
        - 0.025 * area.seg_ses[p.seg]
        + np.array([0.0, 0.05, 0.02, -0.1, 0.03])[race]
        + 0.02 * area.z_psu[p.psu, 2]
        + 0.03 * area.z_seg[p.seg, 2]
        + 0.19 * rng.standard_normal(n)
    )
    log_bmi_child = np.log(15.5 + 0.3 * np.maximum(age - 4, 0)) + 0.13 * rng.standard_normal(n)
    return np.round(np.clip(np.exp(np.where(p.adult, log_bmi_adult, log_bmi_child)), 12.0, 75.0), 1)


def _conditions(
    rng: np.random.Generator,
    area: _Area,
    p: _Persons,
    race: np.ndarray,
    edu_code: np.ndarray,
    bmi: np.ndarray,
) -> dict[str, np.ndarray]:
    """diabetes, hypertension, smoker, insured, pregnant (0/1). Diabetes has no area effect (its
    design effect falls below 1: the cases are concentrated in the oversampled, low-weight
    domains)."""
    n, age, female = len(p.age), p.age, p.female
    z_psu, z_seg, seg = area.z_psu[p.psu], area.z_seg[p.seg], p.seg
    black, hisp, asian = race == 1, race == 2, race == 3
    eta = -5.6 + 0.052 * age + 0.06 * (bmi - 27) + 0.5 * (black | hisp) + 0.4 * asian
    diabetes = (rng.random(n) < _expit(eta)).astype(np.int64)
    eta = (
        -5.6
        + 0.075 * age
        + 0.07 * (bmi - 27)
        + 0.6 * black
        + 0.2 * ~female
        + 0.15 * z_psu[:, 3]
        + 0.2 * z_seg[:, 3]
    )
    hypertension = (rng.random(n) < _expit(eta) * (age >= 12)).astype(np.int64)
    eta = (
        -1.7
        + np.array([0.8, 0.4, 0.0, -0.8])[edu_code]
        + 0.3 * ~female
        - 0.025 * np.maximum(age - 40, 0)
        + 0.35 * z_psu[:, 4]
        + 0.45 * z_seg[:, 4]
    )
    eta = np.where(p.adult, eta, -3.5 + 0.4 * area.z_seg[seg, 4])
    smoker = ((rng.random(n) < _expit(eta)) & (age >= 12)).astype(np.int64)
    eta = (
        2.0
        + 2.5 * (age >= 65)
        + 0.8 * (age < 18)
        - 1.0 * hisp
        + 0.4 * (edu_code == 3)
        + 0.4 * area.seg_ses[seg]
        + 0.4 * area.z_str[p.stratum, 2]
        + 0.6 * z_psu[:, 5]
        + 0.5 * z_seg[:, 5]
    )
    insured = (rng.random(n) < _expit(eta)).astype(np.int64)
    p_preg = np.select(
        [age < 12, age < 18, age < 25, age < 35, age < 45, age < 50],
        [0.0, 0.01, 0.065, 0.095, 0.035, 0.005],
        0.0,
    )
    pregnant = ((rng.random(n) < p_preg) & female).astype(np.int64)
    return {
        "diabetes": diabetes,
        "hypertension": hypertension,
        "smoker": smoker,
        "insured": insured,
        "pregnant": pregnant,
    }


def _weights(
    rng: np.random.Generator,
    area: _Area,
    p: _Persons,
    race: np.ndarray,
    hh_size: np.ndarray,
    hh_seg: np.ndarray,
) -> np.ndarray:
    """Oversampling of the race and 60+ domains, household nonresponse adjustment, trimming at
    the stratum's 99th percentile, then each stratum scaled to its population."""
    n, stratum = len(p.age), p.stratum
    rate = np.maximum(RACE_RATE[race], np.where(p.age >= 60, AGE60_RATE, 1.0))  # domain rates
    hh_resp = _expit(
        area.seg_resp[hh_seg] - 0.08 * (hh_size - 2) + 0.2 * rng.standard_normal(len(hh_size))
    )
    nr_adj = 1.0 / np.clip(hh_resp, 0.35, 0.97)
    w = nr_adj[p.hh] / rate * np.exp(0.05 * rng.standard_normal(n))
    ws = w[np.lexsort((w, stratum))]
    st_n = np.bincount(stratum, minlength=N_STRATA)
    st_first = np.concatenate([[0], np.cumsum(st_n)[:-1]])
    cap = ws[st_first + np.floor(0.99 * (st_n - 1)).astype(np.int64)]
    w = np.minimum(w, cap[stratum])
    share = rng.gamma(20.0, 1.0, N_STRATA)
    pop_h = POPULATION * share / share.sum()
    return w * (pop_h / np.bincount(stratum, weights=w, minlength=N_STRATA))[stratum]


def _names(rng: np.random.Generator, female: np.ndarray, hh: np.ndarray, m: int) -> np.ndarray:
    """First name by sex and last name of the household (10% of persons have their own)."""
    n = len(female)
    first = np.where(
        female,
        np.asarray(FEMALE_NAMES, dtype=object)[rng.integers(0, len(FEMALE_NAMES), n)],
        np.asarray(MALE_NAMES, dtype=object)[rng.integers(0, len(MALE_NAMES), n)],
    )
    last_hh = rng.integers(0, len(LAST_NAMES), m)
    last = np.asarray(LAST_NAMES, dtype=object)[
        np.where(rng.random(n) < 0.9, last_hh[hh], rng.integers(0, len(LAST_NAMES), n))
    ]
    return first + " " + last


def jkn_replicate_columns(d: SurveyDesign, rows: slice = slice(None)) -> dict[str, np.ndarray]:
    """with_replicates("jkn")'s replicate weights rw_001..rw_R of the records in rows, a
    column at a time (the same products w * factor), without its n x R factor matrix: a file
    of many records is written a slice of them at a time."""
    h, g, w = d.h[rows], d.g[rows], d.w[rows]
    scale = d.n_h / (d.n_h - 1.0)
    rw = {}
    for r in range(d.n_psu):
        hh = d.psu_h[r]
        f = np.where(h == hh, scale[hh], 1.0)
        f[g == r] = 0.0
        rw[f"rw_{r + 1:03d}"] = w * f
    return rw


def _with_replicates(df: pd.DataFrame) -> pd.DataFrame:
    """Append JKn replicate weights rw_001..rw_R (one per PSU) after wt."""

    d = SurveyDesign(df, weight="wt", strata="stratum", psu="psu")
    if (d.n_h < 2).any():  # the error with_replicates gives
        return d.with_replicates("jkn")
    rw = jkn_replicate_columns(d)
    at = df.columns.get_loc("wt") + 1
    cols = {c: df[c] for c in df.columns[:at]} | rw | {c: df[c] for c in df.columns[at:]}
    return pd.DataFrame(cols, index=df.index, copy=False)
