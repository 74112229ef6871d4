"""MASSC benchmark: 1,000,000 records of the default survey with 80 replicate weights.

Target on 2 cores: donor search (6 keys, 3 sensitive variables, search on distinct profiles)
< 60 s. Also timed: optimal psi (eq. 9), substitution + optimal phi (eq. 10) + subsampling,
delta measures. Calibration is timed in bench/calibration.py.

Run: .venv/bin/python bench/massc.py [n_records]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import sdl_design  # noqa: F401 (first: the CPU kernels pinned before numpy loads)

# isort: split

import numpy as np

from sdl_design.rng import stage_rng
from sdl_design.spec import load_spec
from sdl_design.stages.massc.donors import find_donors
from sdl_design.stages.massc.measures import delta_measures, information_loss
from sdl_design.stages.massc.stage import massc_config
from sdl_design.stages.massc.treatment import massc_plan, massc_treat
from sdl_design.synth import make_survey

SPEC = Path(__file__).resolve().parents[1] / "flows" / "default_spec.yaml"


def main(n: int = 1_000_000, n_rep: int = 80) -> None:
    spec = load_spec(SPEC)
    t = time.perf_counter()
    df = make_survey(n, seed=20261122, replicates=False)
    rng = np.random.default_rng(1)
    w = df["wt"].to_numpy()
    for r in range(n_rep):  # replicate-weight columns (not used by the donor search)
        df[f"rw_{r + 1:03d}"] = w * rng.uniform(0.0, 2.0, n)
    print(
        f"records {len(df):,}, columns {df.shape[1]}; data built in {time.perf_counter() - t:.1f} s"
    )
    cfg = massc_config(spec, df)

    t = time.perf_counter()
    d = find_donors(
        df, cfg.keys, cfg.sensitive, cfg.importance, cfg.restrictions, stage_rng(1, "m")
    )
    t_donor = time.perf_counter() - t
    print(
        f"donor search: {t_donor:.1f} s (target < 60 s); {d.n_profiles:,} search profiles; "
        f"records by keys changed {d.by_level}; without donor {(d.donor < 0).sum()}"
    )

    rng = stage_rng(1, "massc")
    t = time.perf_counter()
    plan = massc_plan(df, cfg, rng)
    t_plan = time.perf_counter() - t
    print(
        f"plan (strata + donor search + z moments + optimal psi): {t_plan:.1f} s; "
        f"strata {plan.labels}, psi {np.round(plan.psi.rates, 4)} ({plan.psi.method}), "
        f"{len(plan.zvars.labels)} study totals"
    )
    t = time.perf_counter()
    tr = massc_treat(df, plan, cfg, rng)
    print(
        f"substitution + optimal phi + subsampling: {time.perf_counter() - t:.1f} s; "
        f"phi {np.round(tr.phi.rates, 4)} ({tr.phi.method}); substituted {tr.substituted.sum():,}, "
        f"sampled out {(~tr.retained).sum():,}"
    )
    t = time.perf_counter()
    dm = delta_measures(df, tr.b1, tr.substituted, tr.retained, cfg.keys, cfg.sensitive)
    il = information_loss(tr.moments, plan.psi.rates, tr.phi.rates)
    print(
        f"delta + epsilon: {time.perf_counter() - t:.1f} s; delta {dm.delta:.4f} "
        f"{ {k: round(v, 4) for k, v in dm.metrics.items()} }, epsilon (8a+8b) "
        f"{np.nanmax(il['rrmse']):.4f}"
    )
    # a harder file: independent keys (county not nested in region), so many more profiles
    rng = np.random.default_rng(2)
    hard = df[["wt", "diabetes", "hypertension", "income"]].copy()
    for col, k in (("sex", 2), ("race", 5), ("marital", 5), ("region", 4), ("county", 25)):
        hard[col] = np.array([f"{col[0]}{i}" for i in range(k)], dtype=object)[
            rng.choice(k, n, p=rng.dirichlet(np.full(k, 1.0)))
        ]
    hard["age"] = rng.integers(0, 91, n)
    t = time.perf_counter()
    d2 = find_donors(hard, cfg.keys, cfg.sensitive, cfg.importance, [], stage_rng(1, "m"))
    t_hard = time.perf_counter() - t
    print(
        f"donor search, independent keys: {t_hard:.1f} s; {d2.n_profiles:,} search profiles; "
        f"records by keys changed {d2.by_level}"
    )
    print(f"PASS donor search < 60 s: {max(t_donor, t_hard) < 60}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000)
