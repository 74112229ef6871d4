"""MASSC (Singh 2009, paper 000): micro-agglomeration, substitution, subsampling, calibration.

- Risk strata U/D/T/O (risk.py), optionally merged (e.g. D, T, O -> NU as in the worked example):
  `strata`.
- Substitution partners (Step II): nearest donor profile on keys and main sensitive variables,
  distances standardized by Rao's quadratic entropy p' Lambda p of the donor set, at least one
  key changed, donors restricted to records sharing given columns: `donors`.
- Study variables z and their moments (section 2.4, eq. 8a, 8b): `moments`.
- Optimal rates psi_h (eq. 9 under the bias constraint 8a) and phi_h (eq. 10 under the variance
  constraint 8b), SLSQP from a feasible point found by a monotone 1-D search: `rates`.
- Stratified SRSWOR (systematic selection on a random order: exact inclusion rates), or nested
  within PSUs with probabilities proportional to the stratum rates (section 5); the whole run
  and its calibration (Step IV): `treatment`.
- Post-treatment risk delta (eq. 3-6) and information loss epsilon (eq. 7, 8a, 8b): `measures`.

Composed after earlier stages (issue 11): strata, costs, delta and epsilon use the original
file's keys and values of the same records (matched by index label); partners stay inside the
declared-domain cells; the loss budgets are shares of each total's original sampling variance
by default; a stratum of negligible risk is left untreated while delta allows (`treatment`).
"""

from sdl_design.massc.common import KeyLike, MasscError, MasscInfeasible
from sdl_design.massc.donors import Donors, find_donors, substitute
from sdl_design.massc.measures import (
    DeltaMeasures,
    delta_measures,
    epsilon_from_replications,
    information_loss,
)
from sdl_design.massc.moments import StudyVariables, ZMoments, ZParts, study_variables, z_moments
from sdl_design.massc.rates import Rates, optimal_phi, optimal_psi
from sdl_design.massc.strata import massc_strata
from sdl_design.massc.treatment import (
    DeltaRevision,
    MasscConfig,
    MasscPlan,
    MasscTreatment,
    OriginalMargins,
    calibrate_treated,
    disclosure_cost,
    domain_cells,
    domain_margins,
    massc_plan,
    massc_treat,
    meet_delta,
    original_rows,
    rates_table,
    replication_seed,
    select,
)

__all__ = [
    "DeltaMeasures",
    "DeltaRevision",
    "Donors",
    "KeyLike",
    "MasscConfig",
    "MasscError",
    "MasscInfeasible",
    "MasscPlan",
    "MasscTreatment",
    "OriginalMargins",
    "Rates",
    "StudyVariables",
    "ZMoments",
    "ZParts",
    "calibrate_treated",
    "delta_measures",
    "disclosure_cost",
    "domain_cells",
    "domain_margins",
    "epsilon_from_replications",
    "find_donors",
    "information_loss",
    "massc_plan",
    "massc_strata",
    "massc_treat",
    "meet_delta",
    "original_rows",
    "optimal_phi",
    "optimal_psi",
    "rates_table",
    "replication_seed",
    "select",
    "study_variables",
    "substitute",
    "z_moments",
]
