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

import numpy as np
import pandas as pd

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
    seg_psu, seg_county = d["seg_psu"], d["seg_county"]
    psu_stratum = d["psu_stratum"]
    seg_stratum = psu_stratum[seg_psu]
    seg_region = d["region_of_stratum"][seg_stratum]
    n_seg, n_psus = len(seg_psu), len(psu_stratum)

    # ---------------------------------------------------------- area effects
    stratum_race = rng.gamma(30.0 * RACE_BY_REGION[d["region_of_stratum"]], 1.0)
    stratum_race /= stratum_race.sum(axis=1, keepdims=True)
    seg_race_p = rng.gamma(1.2 * stratum_race[seg_stratum], 1.0) + 1e-12  # Dirichlet by segment
    seg_race_p /= seg_race_p.sum(axis=1, keepdims=True)
    z_psu = rng.standard_normal((n_psus, 6))  # ses, income, bmi, hypertension, smoker, insured
    z_seg = rng.standard_normal((n_seg, 6))
    z_str = rng.standard_normal((N_STRATA, 3))  # ses, income, insured
    seg_ses = 0.35 * z_str[seg_stratum, 0] + 0.4 * z_psu[seg_psu, 0] + 0.6 * z_seg[:, 0]
    seg_resp = (
        1.2 + 0.25 * z_seg[:, 1] + 0.2 * z_psu[seg_psu, 1]
    )  # response propensity (logit), tied to the income effect

    # ---------------------------------------------------------- households and persons
    hh_size_arr, hh_seg = _households(rng, n, d["seg_size"])
    m = len(hh_size_arr)
    hh_start = np.concatenate([[0], np.cumsum(hh_size_arr)[:-1]])
    hh = np.repeat(np.arange(m), hh_size_arr)
    pos = np.arange(n) - hh_start[hh]  # position in the household: 0 is the head
    size = hh_size_arr[hh]
    seg = hh_seg[hh]
    psu = seg_psu[seg]
    stratum = seg_stratum[seg]

    # household type: 0 single adult, 1 couple, 2 single parent, 3 unrelated adults,
    # 4 two-parent family, 5 one-parent family, 6 multigenerational/other
    u = rng.random(m)
    s = hh_size_arr
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
    head_age = np.minimum(head_age, 90)

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

    # sex: partners of the opposite sex; singles more often women, especially older ones
    p_female = np.where(
        pos == 0,
        np.where(htype == 0, np.where(age >= 65, 0.65, 0.52), np.where(htype == 2, 0.8, 0.5)),
        0.5,
    )
    p_female = np.where(grandparent, 0.65, p_female)
    female = rng.random(n) < p_female
    head_female = female[hh_start][hh]
    female = np.where(partner, ~head_female ^ (rng.random(n) < 0.04), female)

    # race: the household's race from its segment's mix; a few persons differ
    hh_race = _draw(rng, seg_race_p, hh_seg)
    race = np.where(rng.random(n) < 0.95, hh_race[hh], _draw(rng, seg_race_p, seg))

    # marital status by role and age
    married_couple = (pos == 0) & ((htype == 1) | ((htype == 4) & (size >= 2))) | partner
    mclass = np.select(
        [
            age < 18,
            married_couple,
            grandparent,
            (pos == 0) & (htype == 2) | (pos == 0) & (htype == 5),
            age < 30,
            age < 55,
            age < 65,
        ],
        [0, 1, 2, 3, 4, 5, 6],
        7,
    )
    marital_p = np.array(
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
    marital_code = _draw(rng, marital_p, mclass)

    # education: ordered latent score, segment SES and race
    race_edu = np.array([0.2, -0.15, -0.45, 0.55, -0.1])
    latent = 0.6 * seg_ses[seg] + race_edu[race] - 0.006 * (age - 45) + rng.standard_normal(n)
    edu_code = np.searchsorted(np.array([-1.25, -0.25, 0.45]), latent)

    # ---------------------------------------------------------- study variables
    adult = age >= 18
    ses = seg_ses[seg]
    black, hisp, asian = race == 1, race == 2, race == 3
    # income: lognormal body, Pareto tail, zeros; children have no personal income
    age_eff = np.select([age < 25, age < 35, age < 55, age < 65], [-0.55, 0.0, 0.25, 0.1], -0.3)
    edu_eff = np.array([-0.5, -0.15, 0.0, 0.45])[edu_code]
    race_inc = np.array([0.0, -0.2, -0.15, 0.1, -0.1])[race]
    mu = (
        np.log(32000.0)
        + age_eff
        + edu_eff
        + race_inc
        - 0.25 * female
        + 0.3 * ses
        + 0.12 * z_str[stratum, 1]
        + 0.15 * z_psu[psu, 1]
        + 0.2 * z_seg[seg, 1]
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
    income = np.round(np.where(adult, inc, np.where(age >= 16, teen_inc, 0.0)))

    # bmi: adults lognormal around 27.5, children by age
    log_bmi_adult = (
        np.log(27.5)
        + 0.004 * (np.minimum(age, 60) - 40)
        - 0.025 * ses
        + np.array([0.0, 0.05, 0.02, -0.1, 0.03])[race]
        + 0.02 * z_psu[psu, 2]
        + 0.03 * z_seg[seg, 2]
        + 0.19 * rng.standard_normal(n)
    )
    log_bmi_child = np.log(15.5 + 0.3 * np.maximum(age - 4, 0)) + 0.13 * rng.standard_normal(n)
    bmi = np.round(np.clip(np.exp(np.where(adult, log_bmi_adult, log_bmi_child)), 12.0, 75.0), 1)

    # diabetes: age, bmi, race; no area effect (its design effect falls below 1: the cases
    # are concentrated in the oversampled, low-weight domains)
    eta = -5.6 + 0.052 * age + 0.06 * (bmi - 27) + 0.5 * (black | hisp) + 0.4 * asian
    diabetes = (rng.random(n) < _expit(eta)).astype(np.int64)
    eta = (
        -5.6
        + 0.075 * age
        + 0.07 * (bmi - 27)
        + 0.6 * black
        + 0.2 * ~female
        + 0.15 * z_psu[psu, 3]
        + 0.2 * z_seg[seg, 3]
    )
    hypertension = (rng.random(n) < _expit(eta) * (age >= 12)).astype(np.int64)
    eta = (
        -1.7
        + np.array([0.8, 0.4, 0.0, -0.8])[edu_code]
        + 0.3 * ~female
        - 0.025 * np.maximum(age - 40, 0)
        + 0.35 * z_psu[psu, 4]
        + 0.45 * z_seg[seg, 4]
    )
    eta = np.where(adult, eta, -3.5 + 0.4 * z_seg[seg, 4])
    smoker = ((rng.random(n) < _expit(eta)) & (age >= 12)).astype(np.int64)
    eta = (
        2.0
        + 2.5 * (age >= 65)
        + 0.8 * (age < 18)
        - 1.0 * hisp
        + 0.4 * (edu_code == 3)
        + 0.4 * ses
        + 0.4 * z_str[stratum, 2]
        + 0.6 * z_psu[psu, 5]
        + 0.5 * z_seg[seg, 5]
    )
    insured = (rng.random(n) < _expit(eta)).astype(np.int64)
    p_preg = np.select(
        [age < 12, age < 18, age < 25, age < 35, age < 45, age < 50],
        [0.0, 0.01, 0.065, 0.095, 0.035, 0.005],
        0.0,
    )
    pregnant = ((rng.random(n) < p_preg) & female).astype(np.int64)

    # ---------------------------------------------------------- weights
    rate = np.maximum(RACE_RATE[race], np.where(age >= 60, AGE60_RATE, 1.0))  # domain rates
    hh_resp = _expit(seg_resp[hh_seg] - 0.08 * (hh_size_arr - 2) + 0.2 * rng.standard_normal(m))
    nr_adj = 1.0 / np.clip(hh_resp, 0.35, 0.97)
    w = nr_adj[hh] / rate * np.exp(0.05 * rng.standard_normal(n))
    # trim weights above the stratum's 99th percentile (a few records), then scale each stratum
    order = np.lexsort((w, stratum))
    ws, st_sorted = w[order], stratum[order]
    st_n = np.bincount(stratum, minlength=N_STRATA)
    st_first = np.concatenate([[0], np.cumsum(st_n)[:-1]])
    cap = ws[st_first + np.floor(0.99 * (st_n - 1)).astype(np.int64)]
    w = np.minimum(w, cap[stratum])
    del ws, st_sorted
    share = rng.gamma(20.0, 1.0, N_STRATA)
    pop_h = POPULATION * share / share.sum()
    w = w * (pop_h / np.bincount(stratum, weights=w, minlength=N_STRATA))[stratum]

    # ---------------------------------------------------------- labels
    first = np.where(
        female,
        np.asarray(FEMALE_NAMES, dtype=object)[rng.integers(0, len(FEMALE_NAMES), n)],
        np.asarray(MALE_NAMES, dtype=object)[rng.integers(0, len(MALE_NAMES), n)],
    )
    last_hh = rng.integers(0, len(LAST_NAMES), m)
    last = np.asarray(LAST_NAMES, dtype=object)[
        np.where(rng.random(n) < 0.9, last_hh[hh], rng.integers(0, len(LAST_NAMES), n))
    ]
    pid = 10_000_000 + rng.permutation(n)
    n_county = int(seg_county.max()) + 1
    county_labels = np.array([f"c{i + 1:03d}" for i in range(n_county)], dtype=object)

    df = pd.DataFrame(
        {
            "person_id": pd.Series(pid).astype(str).radd("P").to_numpy(dtype=object),
            "name": first + " " + last,
            "stratum": (stratum + 1).astype(np.int64),
            "psu": d["psu_label"][psu].astype(np.int64),
            "segment": (seg + 1).astype(np.int64),
            "household": (hh + 1).astype(np.int64),
            "wt": w.astype(np.float64),
            "age": age,
            "sex": np.where(female, "female", "male").astype(object),
            "race": RACES[race],
            "marital": MARITAL[marital_code],
            "region": REGIONS[seg_region[seg]],
            "county": county_labels[seg_county[seg]],
            "education": np.where(adult, EDUCATION[edu_code], "child").astype(object),
            "hh_size": size.astype(np.int64),
            "income": income.astype(np.float64),
            "bmi": bmi.astype(np.float64),
            "diabetes": diabetes,
            "hypertension": hypertension,
            "smoker": smoker,
            "insured": insured,
            "pregnant": pregnant,
        }
    )
    if replicates:
        df = _with_replicates(df)
    return df


def _with_replicates(df: pd.DataFrame) -> pd.DataFrame:
    """Append JKn replicate weights rw_001..rw_R (one per PSU) after wt."""
    from sdl_design.design import SurveyDesign

    rw = SurveyDesign(df, weight="wt", strata="stratum", psu="psu").with_replicates("jkn")
    rw = pd.DataFrame(np.asarray(rw, dtype=np.float64), index=df.index)
    rw.columns = [f"rw_{i + 1:03d}" for i in range(rw.shape[1])]
    at = df.columns.get_loc("wt") + 1
    return pd.concat([df.iloc[:, :at], rw, df.iloc[:, at:]], axis=1)
