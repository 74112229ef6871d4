"""The MASSC stage: substitution, subsampling, calibration and replications (paper 000), in
memory and by partition.

MASSC (Singh 2009, paper 000): micro-agglomeration, substitution, subsampling, calibration.

- Risk strata U/D/T/O (sdl_design.risk), optionally merged (e.g. D, T, O -> NU as in the worked
  example): `strata`.
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
- The release's run of them (config, result, replications, gates): `stage`; the preflight's
  checks: `checks`; the errors, key specs and codes: `common`.
- Its passes, for one partition or many: `passes` (Steps I-III and delta), `substrata`
  (k-means substrata), `calibration_passes` (Step IV and the replications).

Composed after earlier stages (issue 11): strata, costs, delta and epsilon use the original
file's keys and values of the same records (matched by index label); partners stay inside the
declared-domain cells; the loss budgets are shares of each total's original sampling variance
by default; a stratum of negligible risk is left untreated while delta allows (`treatment`).
The method's names are imported from these modules (this package's own namespace is the
stage's: a method module importing it would import the stage)."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pandas as pd

from sdl_design.describe import (
    REPLICATES,
    RISK_DELTA,
    Describes,
    NumberColumn,
    Tunable,
    cite,
    fmt,
    more_less,
    share_text,
    unchanged,
)
from sdl_design.engine import partitions as part
from sdl_design.engine.cache import array_bytes
from sdl_design.engine.exchange import Exchange
from sdl_design.engine.partitions import MEMORY
from sdl_design.engine.records import Passes, Records, passes_result
from sdl_design.spec import ReleaseSpec
from sdl_design.stage import StageContext, StageResult
from sdl_design.stages.massc import calibration_passes as pcal
from sdl_design.stages.massc import passes as pms
from sdl_design.stages.massc.checks import control_problems, subsampling_problems
from sdl_design.stages.massc.stage import (
    TreatmentCounts,
    _massc_substituted,
    delta_gates,
    loss_metrics,
    massc_config,
    massc_notes,
    massc_params,
    numeric_study,
    rates_metrics,
    study_totals_table,
    weight_factor_figure,
)
from sdl_design.stages.massc.substrata import ITERATIONS, SubstrataModel, SubstrataPlan
from sdl_design.stages.massc.treatment import MasscConfig, cost_from, revise_rates


def massc_by_partition(records: Records, ctx: StageContext) -> StageResult:
    """MASSC, Steps I-IV, as passes over the records' partitions (one in memory; the
    whole-frame composition in tests/massc_reference.py gives the same bits on one). The donor search: pass 1 lists each partition's search profiles; the driver
    searches donor profiles with the MASSC stage's Generator; each record draws its donor
    record, which the partition holding it sends back (worker to worker, not through the
    driver); the substituted file tilde (with the donor's row in __donor: confidential) goes
    to donors/. The risk strata (the scan's profile counts), the moments of eq. 8a, the
    original's totals and Taylor variances and the costs by partition in block sums
    (sdl_design.survey.blocksum); psi on the driver. The selections at psi and at phi (records
    exchanged to the partition that owns their group) with phi from the moments of z*, delta,
    and meet_delta's revisions while delta is above gates.delta_max. Step IV: the retained
    records' weight and replicate weights calibrated to the original's totals (three passes,
    sdl_design.stages.massc.calibration_passes) and written to data/; the replications of the whole
    treatment (their own selections, the weight's calibration and study totals) and the
    empirical epsilon."""

    spec, columns, parts, run_map = ctx.spec, records.columns, records.parts, records.run_map
    req = pms.massc_request(spec, columns)
    search, files, rng = _massc_donors(records, ctx, req)
    m, zvars, scores, sums = _massc_moments(records, ctx, req, rng)
    psi, cost = pms.massc_psi(spec, columns, sums)
    records.lap("psi")
    records.say("substitution rates psi " + _by_stratum(m.labels, psi.rates))
    # Steps II-III: substitution at psi (select), phi from the moments of z*, subsampling;
    # while delta is above gates.delta_max, meet_delta's revisions (revise_rates)
    cfg = massc_config(spec, pd.DataFrame(columns=list(columns)))
    groups = pms.select_groups(run_map(pms.select_pass1, parts, m, what="groups"))
    chosen = (records.scratch("select_psi"), records.scratch("select_phi"))
    records.run.selected = chosen[1]
    donors = records.scratch("donors", confidential=True)
    run = _MasscPasses(spec, req, parts, run_map, m, zvars, scores, donors, chosen, groups, rng)
    done = run.treatment(pms.RatesPlan(sums.moments, psi, cost), cfg, sums)
    il, epsilon = pms.massc_loss(done.tr, done.plan, sums)
    records.lap("treatment")
    # Step IV: the retained records' weight and replicate weights calibrated to the
    # original's totals (calibrate_treated's, bit for bit), written to data/
    creq = pcal.calibration_request(spec, columns)
    treated = pcal.Treated(donors, chosen, np.asarray(done.tr.phi.rates, dtype=float))
    cal, cal_tables, cal_metrics, factors = run.calibration(creq, treated, records.data)
    records.lap("calibration")
    n_reps = int(spec.stages.massc.replications)
    if n_reps:
        eps_rep, rep_table = _massc_replications(run, creq, treated, done, sums, records)
        cal_tables["epsilon_replications"] = rep_table
        cal_metrics["epsilon_empirical"] = eps_rep
        cal_metrics["n_replications"] = float(n_reps)
    records.lap("replications")
    _say_massc_treatment(records, run, done, epsilon, cal, cal_metrics)
    counts, params, gates = _massc_counts(run, search, sums, done, (epsilon, il), cal_metrics)
    moments = done.plan.moments
    tables = {
        **_with_realized(pms.massc_tables(search, sums, done.plan, done.tr, done.dm, il), run),
        "delta_profiles": done.dm.top_profiles(run.m),
        "study_totals": study_totals_table(
            done.cfg, moments.labels, sums.truth, sums.sampling_var, moments
        ),
        **cal_tables,
    }
    return passes_result(
        "massc",
        {**counts, "files": [Path(f).name for f in files], **cal_metrics},
        records,
        params=params,
        gates=gates,
        tables=tables,
        report_tables=["rates", "delta", "delta_profiles", "epsilon_formula", *cal_tables],
        notes=_massc_notes(run, search, done, il, {**counts, **cal_metrics}, tables),
        figures={"weight_factors": weight_factor_figure(*factors)},
    )


def _with_realized(tables: dict[str, pd.DataFrame], run: _MasscPasses) -> dict[str, pd.DataFrame]:
    """The tables with the rates' realized counts by stratum (one pass: rates_table's)."""
    got = run.run_map(
        pms.realized_pass, run.parts, run.m, run.donors, run.chosen, what="massc rates by stratum"
    )
    counts = np.sum(got, axis=0)
    names = ("n_no_donor", "n_substituted", "n_retained")
    tables["rates"] = tables["rates"].assign(**dict(zip(names, counts, strict=True)))
    return tables


def _massc_notes(
    run: _MasscPasses,
    search: pms.DonorPlan,
    done: _Treatment,
    il: pd.DataFrame,
    metrics: dict[str, Any],
    tables: dict[str, pd.DataFrame],
) -> list[str]:
    """MasscStage.run's notes from the treatment made by partition."""
    rates = tables["rates"]
    n, tr = run.n_rows, done.tr
    counts = TreatmentCounts(
        n, tr.n_substituted, n - tr.n_retained, search.by_level, search.n_no_donor_domain
    )
    measured = (done.dm, metrics, done.revisions, il)
    return massc_notes(run.spec, (done.cfg, done.plan, tr.phi, rates), counts, measured, tables)


def _by_stratum(labels: list[str], rates: Any) -> str:
    """A stratum's rate after its label, for the progress lines ("U 0.05, D 0.1")."""
    return ", ".join(f"{h} {p:.4g}" for h, p in zip(labels, rates, strict=True))


def _massc_donors(
    records: Records, ctx: StageContext, req: pms.MasscRequest
) -> tuple[pms.DonorPlan, list, np.random.Generator]:
    """Step I, the donor search: the partitions' search profiles (pass 1), the driver's
    search of donor profiles with the MASSC stage's Generator, and the exchange in which each
    record draws its donor record from the partition that holds it; the substituted file
    goes to donors/ (confidential). The plan, the files written and the Generator (to be
    drawn on by the selections)."""
    spec, parts, run_map = ctx.spec, records.parts, records.run_map
    tables = run_map(pms.donor_pass1, parts, spec, req, what="massc donors pass 1")
    records.lap("pass1")
    rng = ctx.rng()
    search = pms.donor_plan(tables, req, rng)
    records.lap("search")
    n_has = _with_donor(search)
    records.say(f"{n_has} records have a donor ({search.n_profiles} search profiles)")
    receive = partial(pms.donor_receive, folder=records.scratch("donors", confidential=True))
    files = run_map.exchange(
        pms.donor_send, pms.donor_serve, receive, parts, spec, req, search, what="massc donors"
    )
    records.lap("exchange")
    return search, files, rng


def _massc_moments(
    records: Records, ctx: StageContext, req: pms.MasscRequest, rng: np.random.Generator
) -> tuple[pms.MasscInputs, Any, np.ndarray, pms.PlanSums]:
    """The risk strata (the scan's profile counts; k-means substrata by passes with the
    stage's Generator), the study variables z and the sensitive risk scores; the moments of
    eq. 8a, the original's totals and Taylor variances and the costs' sums by partition,
    combined in block sums. The records' inputs, z, the scores and the plan's sums."""
    spec, parts, run_map, run = ctx.spec, records.parts, records.run_map, records.run
    profiles = run.scan["profiles"]
    labels = pms.massc_strata_labels(profiles, req)
    zvars = pms.massc_study_variables(profiles, req)
    scores = part.profile_scores(profiles, req.sensitive) if req.sensitive else np.zeros(0)
    m = pms.MasscInputs(spec, req, run.inputs, profiles, labels)
    if req.substrata is not None:
        model = _massc_substrata(records, m, rng)
        m = replace(m, labels=list(model.labels), substrata=model)
        records.say("MASSC strata " + ", ".join(model.labels))
    donors = records.scratch("donors", confidential=True)
    partials = run_map(
        pms.moments_pass, parts, m, run.psus, zvars, scores, donors, what="massc moments"
    )
    sums = pms.combine_moments(partials, zvars, m.labels, run.psus, parts[-1].stop)
    records.lap("moments")
    return m, zvars, scores, sums


def _massc_substrata(
    records: Records, m: pms.MasscInputs, rng: np.random.Generator
) -> SubstrataModel:
    """k-means substrata of the risk strata (sdl_design.stages.massc.substrata): the means and
    records per stratum, the spread and the drawn start, Lloyd passes until the centroids stop."""
    run_map, parts = records.run_map, records.parts
    plan = SubstrataPlan(m.req.substrata, tuple(m.labels), parts[-1].stop)
    plan.moments(run_map(pms.substrata_moments_pass, parts, m, what="massc substrata means"))
    ranks = plan.draw(rng)
    got = run_map(pms.substrata_spread_pass, parts, m, plan.mean, ranks, what="massc substrata")
    centroids = plan.start(got, rng)
    for i in range(ITERATIONS):  # (counts: of the records' nearest centroids)
        got = run_map(pms.substrata_lloyd_pass, parts, m, plan, centroids, what="massc k-means")
        moved, counts = plan.step(centroids, got)
        still = all(
            a is None or np.array_equal(a, b) for a, b in zip(centroids, moved, strict=True)
        )
        if still or i == ITERATIONS - 1:
            break
        centroids = moved
    records.lap("substrata")
    return plan.model(centroids, counts)


@dataclass
class _MasscPasses:
    """MASSC's passes after the moments, on the substituted file (donors/) and the original:
    the selections at psi and phi with the stage's Generator (d(1), d(2) in chosen), the
    moments of z*, delta and the calibrations of Step IV (of the release's treatment or a
    batch of replications in the same passes)."""

    spec: ReleaseSpec
    req: pms.MasscRequest
    parts: list
    run_map: Exchange
    m: pms.MasscInputs
    zvars: Any  # the study variables z (pms.massc_study_variables)
    scores: np.ndarray  # the input's key profiles' risk scores (sensitive variables)
    donors: str  # the substituted file tilde
    chosen: tuple[str, str]  # the selections' folders: at psi (d(1)), at phi (d(2))
    groups: pd.DataFrame  # the selection groups (pms.select_groups)
    rng: np.random.Generator  # the MASSC stage's, past the donor search

    @property
    def n_rows(self) -> int:
        """The records of the input (and of the substituted file)."""
        return self.parts[-1].stop

    def select_plan(self, rates: np.ndarray, rng: np.random.Generator) -> pms.SelectPlan:
        """The selection of the groups at rates by stratum, drawn from rng."""
        return pms.select_plan(self.groups, rates, rng, self.n_rows, len(self.parts))

    def selections(self, plans: list, folders: list[str], what: str) -> list[int]:
        """Several selections in one exchange: the records each keeps."""
        sels = pms.Selections(plans, folders)
        got = self.run_map.exchange(
            pms.select_send, pms.select_serve, pms.select_receive, self.parts, self.m, sels,
            what=what,
        )  # fmt: skip
        return [sum(c[r] for c in got) for r in range(len(plans))]

    def select(self, rates: np.ndarray, where: str) -> int:
        """One selection at rates with the stage's Generator: the records it keeps."""
        plan = self.select_plan(rates, self.rng)
        name = Path(where.split(":")[1] if where.startswith(MEMORY) else where).name
        return self.selections([plan], [where], f"massc selection ({name})")[0]

    def treat(self, p: pms.RatesPlan, c: MasscConfig) -> pms.PartitionedTreatment:
        """Substitution at psi, phi (eq. 10) from the moments of z*, subsampling at phi."""
        self.select(p.psi.rates, self.chosen[0])
        treated = self.run_map(
            pms.treated_pass, self.parts, self.m, self.zvars, self.donors, self.chosen[0],
            what="massc moments of z*",
        )  # fmt: skip
        phi, mom_t, n_sub = pms.massc_phi(c, treated, self.zvars, p.moments, p.cost, self.n_rows)
        return pms.PartitionedTreatment(phi, n_sub, self.select(phi.rates, self.chosen[1]), mom_t)

    def measure(self, tr: pms.PartitionedTreatment, risk_basis: str) -> pms.PartitionedDelta:
        """delta (eq. 3) of the treated file (tr's selections in chosen): its B(2) key
        profiles, then the records' risk on risk_basis."""
        req, parts, donors, chosen = self.req, self.parts, self.donors, self.chosen
        found = self.run_map(
            pms.delta_pass1, parts, self.spec, req, donors, chosen, what="massc B(2) profiles"
        )
        b2 = part.combine_profiles(found)
        s2 = part.profile_scores(b2, req.sensitive) if req.sensitive else np.zeros(0)
        got = self.run_map(
            pms.delta_pass2, parts, self.m, self.scores, b2, s2, risk_basis, donors, chosen,
            what="massc delta",
        )  # fmt: skip
        return pms.combine_delta(got, self.n_rows, self.m)

    def treatment(self, rplan: pms.RatesPlan, cfg: MasscConfig, sums: pms.PlanSums) -> _Treatment:
        """Steps II-III at psi, then meet_delta's revisions (revise_rates) while delta is
        above gates.delta_max."""
        measure = partial(self.measure, risk_basis=cfg.risk_basis)
        tr = self.treat(rplan, cfg)
        dm = measure(tr)
        if self.spec.gates.delta_max is None:
            return _Treatment(cfg, rplan, tr, dm, [])
        return _Treatment(
            *revise_rates(
                rplan, tr, cfg, dm, self.spec.gates.delta_max, self.treat, measure,
                lambda c: cost_from(sums.cost_sums, sums.moments.N, c)[0],
            )
        )  # fmt: skip

    def calibrations(
        self, creq: pcal.CalibrationRequest, trs: list[pcal.Treated], what: str
    ) -> list[tuple]:
        """Step IV of several treatments in the same passes: (plan, factors) of each."""
        parts, m, n_rows = self.parts, self.m, self.n_rows
        got = self.run_map(pcal.retained_count, parts, trs, what=f"{what}: retained records")
        offsets = [pcal.retained_offsets(parts, [c[r] for c in got]) for r in range(len(trs))]
        first = self.run_map(
            pcal.calibration_pass1, parts, m, creq, trs, offsets, what=f"{what}: pass 1"
        )
        plans = [
            pcal.calibration_plan([f[r] for f in first], creq, n_rows, offsets[r])
            for r in range(len(trs))
        ]
        todo = [r for r, p in enumerate(plans) if creq.controls or p.margins]
        if not todo:
            return [(p, None) for p in plans]
        second = self.run_map(
            pcal.calibration_pass2, parts, m, creq, [trs[r] for r in todo],
            [plans[r] for r in todo], [list(plans[r].margins) for r in todo],
            what=f"{what}: pass 2",
        )  # fmt: skip
        out = [(p, None) for p in plans]
        for k, r in enumerate(todo):
            again = partial(self._pass2_again, creq, trs[r], plans[r], what)
            first_sums = [s[k] for s in second]
            cal = pcal.calibrate_by_partition(plans[r], creq, again, n_rows, first_sums)
            out[r] = (plans[r], cal)
        return out

    def _pass2_again(
        self,
        creq: pcal.CalibrationRequest,
        tr: pcal.Treated,
        plan: pcal.CalibrationPlan,
        what: str,
        kept: list[str],
    ) -> list:
        """One treatment's calibration pass 2 again, after a domain is dropped."""
        got = self.run_map(
            pcal.calibration_pass2, self.parts, self.m, creq, [tr], [plan], [kept],
            what=f"{what}: pass 2 again",
        )  # fmt: skip
        return [g[0] for g in got]

    def calibration(
        self, creq: pcal.CalibrationRequest, treated: pcal.Treated, data: str
    ) -> tuple[pcal.CalibrationFactors | None, dict[str, pd.DataFrame], dict[str, float], tuple]:
        """Step IV of the release's treatment: the retained records' weight and replicate
        weights calibrated, written to data (the records' folder); the factors, the tables, the
        metrics and the records' adjustment factors w g / (w / phi) (distinct, with counts)."""
        ((cplan, cal),) = self.calibrations(creq, [treated], "massc calibration")
        applied = self.run_map(
            pcal.calibration_apply, self.parts, self.m, creq, treated, cplan, cal, data,
            what="massc calibration",
        )  # fmt: skip
        cal_tables, cal_metrics = pcal.calibration_summary(cplan, creq, cal, applied)
        adj, counts = (np.concatenate([a["adj"][i] for a in applied]) for i in (0, 1))
        values, at = np.unique(adj, return_inverse=True)  # the factors over the partitions
        factors = (values, np.bincount(at.ravel(), weights=counts, minlength=len(values)))
        return cal, cal_tables, cal_metrics, factors


class _Treatment(NamedTuple):
    """MASSC's treatment after meet_delta's revisions (revise_rates' result): the config, the
    rates plan (its psi, eq. 9), the treatment (phi, eq. 10; d(1), d(2)), its delta (eq. 3)
    and the revisions."""

    cfg: MasscConfig
    plan: pms.RatesPlan
    tr: pms.PartitionedTreatment
    dm: pms.PartitionedDelta
    revisions: list


def _massc_replications(
    run: _MasscPasses,
    creq: pcal.CalibrationRequest,
    treated: pcal.Treated,
    done: _Treatment,
    sums: pms.PlanSums,
    records: Records,
) -> tuple[float, pd.DataFrame]:
    """The replications of the whole treatment (massc_replications), a batch in the same
    passes: each draws its two selections from its own Generator (one exchange for the
    batch) and calibrates the weight only, to the controls and the declared domains the
    release's weight alone keeps; the empirical epsilon and its table from their study
    totals."""
    n_reps = int(run.spec.stages.massc.replications)
    wreq = pcal.weight_only(creq)
    if wreq.domains:
        ((wplan, wcal),) = run.calibrations(wreq, [treated], "massc replications' domains")
        wreq = pcal.replication_request(wreq, wplan.table if wcal is None else wcal.table)
    batch = pcal.replications_at_once(run.n_rows)  # the memory of their exchanges
    # one partition (records in this process): two batches at a time, each half the size
    # (a replication's numbers depend on its index alone: the same bits in any batch)
    lanes = min(2, os.cpu_count() or 1) if len(run.parts) == 1 else 1
    if lanes > 1:
        batch = max(1, min(batch, -(-n_reps // lanes)))
    batches = [range(lo, min(lo + batch, n_reps)) for lo in range(0, n_reps, batch)]
    with ThreadPoolExecutor(lanes, thread_name_prefix="puf-massc-replications") as pool:
        got = pool.map(lambda b: _replication_batch(run, wreq, treated, done, b, records), batches)
        estimates = [e for batch_estimates in got for e in batch_estimates]
    records.drop_scratch("replications")  # their selections: original-to-masked maps
    return pcal.replication_epsilon(estimates, sums.truth, run.zvars)


def _replication_batch(
    run: _MasscPasses,
    wreq: pcal.CalibrationRequest,
    treated: pcal.Treated,
    done: _Treatment,
    reps: range,
    records: Records,
) -> list[np.ndarray]:
    """A batch of replications in the same passes: their selections at psi and phi (one
    exchange), the weight's calibration and each one's study totals."""
    n_reps = int(run.spec.stages.massc.replications)
    plans, folders, rtrs = [], [], []
    for r in reps:
        gen = pcal.replication_generator(run.spec, r)
        where = f"replications/r{r:03d}"
        rchosen = (records.scratch(f"{where}/select_psi"), records.scratch(f"{where}/select_phi"))
        plans += [
            run.select_plan(done.plan.psi.rates, gen),
            run.select_plan(done.tr.phi.rates, gen),
        ]
        folders += list(rchosen)
        rtrs.append(pcal.Treated(run.donors, rchosen, treated.phi))
    what = f"massc replications {reps[0] + 1}-{reps[-1] + 1} of {n_reps}"
    run.selections(plans, folders, f"{what}: selections")
    cals = run.calibrations(wreq, rtrs, what)
    return _replication_totals(run, wreq, rtrs, cals, what)


def _replication_totals(
    run: _MasscPasses, wreq: pcal.CalibrationRequest, rtrs: list, cals: list, what: str
) -> list[np.ndarray]:
    """Each replication's study totals, each partition's partials added as they arrive, in
    maps of as many replications as pcal.totals_at_once lets be held (measured on the first
    map, of one replication): the same bits in any grouping."""
    out: list[np.ndarray] = []
    k, size = 0, 1
    while k < len(rtrs):
        chunk = range(k, min(k + size, len(rtrs)))
        totals = [pcal.replication_totals_of(run.zvars, cals[i][0].n2) for i in chunk]
        seen = [0]

        def fold(got: list, totals: list = totals, seen: list = seen) -> None:
            seen[0] += array_bytes(got)
            for t, q in zip(totals, got, strict=True):
                t.add(q)

        run.run_map(
            pcal.replication_totals, run.parts, run.m, wreq, [rtrs[i] for i in chunk],
            [cals[i][0] for i in chunk], [cals[i][1] for i in chunk], run.zvars,
            what=f"{what}: totals", fold=fold,
        )  # fmt: skip
        if k == 0:
            size = pcal.totals_at_once(seen[0], len(run.parts))
        out += [run.zvars.totals_from(t.totals()) for t in totals]
        k = chunk.stop
    return out


def _say_massc_treatment(
    records: Records,
    run: _MasscPasses,
    done: _Treatment,
    epsilon: float,
    cal: pcal.CalibrationFactors | None,
    cal_metrics: dict[str, float],
) -> None:
    """The progress lines of Step IV and of the treatment."""
    records.say(
        f"calibrated to the controls and {len(cal.kept) if cal else 0} domain margin(s): "
        f"weight factors {cal_metrics['calibration_factor_min']:.3f} to "
        f"{cal_metrics['calibration_factor_max']:.3f}"
    )
    tr, n_rows = done.tr, run.n_rows
    records.say(
        f"{tr.n_substituted} records substituted, {n_rows - tr.n_retained} sampled out; phi "
        + _by_stratum(run.m.labels, tr.phi.rates)
        + f"; delta {done.dm.delta:.4f} after {len(done.revisions)} revision(s); "
        f"epsilon {epsilon:.4f}"
    )


def _with_donor(search: pms.DonorPlan) -> int:
    """The records whose search profile has a donor profile."""
    return int(search.size[search.donor_p >= 0].sum())


def _massc_counts(
    run: _MasscPasses,
    search: pms.DonorPlan,
    sums: pms.PlanSums,
    done: _Treatment,
    loss: tuple[float, pd.DataFrame],
    cal_metrics: dict[str, float],
) -> tuple[dict[str, Any], dict[str, Any], list]:
    """The MASSC stage's counts, rates by stratum (psi, phi), delta and the information loss
    (loss: epsilon and its table), as MasscStage.run's metrics; its params; its gates."""
    labels, n_rows, n_has = run.m.labels, run.n_rows, _with_donor(search)
    psi, phi, tr = done.plan.psi, done.tr.phi, done.tr
    epsilon, il = loss
    by_appearance = done.dm.by_appearance.set_index("appearance")["delta_bar"]
    counts = {
        "n_with_donor": n_has,
        "n_no_donor": float(n_rows - n_has),
        "n_no_donor_domain": float(search.n_no_donor_domain),
        "share_substituted": tr.n_substituted / n_rows,
        "n_profiles": search.n_profiles,
        "strata": {h: int(n) for h, n in zip(labels, sums.moments.N, strict=True)},
        "psi": {h: float(p) for h, p in zip(labels, psi.rates, strict=True)},
        "psi_method": psi.method,
        "phi": {h: float(p) for h, p in zip(labels, phi.rates, strict=True)},
        "phi_method": phi.method,
        "n_substituted": tr.n_substituted,
        "n_subsampled_out": n_rows - tr.n_retained,
        "delta": done.dm.delta,
        "epsilon_formula": epsilon,
        "epsilon": max(epsilon, cal_metrics.get("epsilon_empirical", epsilon)),
        "n_delta_revisions": len(done.revisions),
        "budget_scale": done.cfg.budget_scale,
        **{f"delta_{a}": float(by_appearance[a]) for a in "udto"},
        "delta_profile_max": float(done.dm.profiles["delta_p"].max()),
        **loss_metrics(il),
        "share_retained": tr.n_retained / n_rows,
        "n_donor_profiles": float(search.n_profiles),
        **rates_metrics(labels, psi, phi),
    }
    params = massc_params(run.spec, done.cfg, labels, psi, phi, done.plan.cost)
    return counts, params, delta_gates(run.spec, done.dm.delta)


class MasscStage(Passes, Describes):
    """Stage: MASSC (spec.stages.massc), written once as its passes (massc_by_partition), with
    `replications` replications of the whole treatment for the empirical epsilon."""

    name = "massc"
    treated_share = "share_substituted"
    treated_words = "Substitution (MASSC) replaced the keys of {share} of records."
    report_measures = {RISK_DELTA: "delta"}
    tune_measures = {"massc_delta": "delta"}

    @classmethod
    def preflight_numbers(cls, spec: ReleaseSpec) -> list[NumberColumn]:
        """The study variables (numbers or true/false), the substrata's variables and the
        calibration controls cut into bins."""
        v, massc = spec.variables, spec.stages.massc
        out = [
            NumberColumn(f"variables.study[{i}]", c, bool_ok=True) for i, c in enumerate(v.study)
        ]
        if massc.substrata:
            out += [
                NumberColumn(f"stages.massc.substrata.variables[{i}]", c)
                for i, c in enumerate(massc.substrata.variables)
            ]
        return out + [
            NumberColumn(f"stages.massc.calibration.controls[{i}].bins", k.name)
            for i, k in enumerate(massc.calibration.controls)
            if k.bins
        ]

    @classmethod
    def preflight_data(cls, spec: ReleaseSpec, df: pd.DataFrame) -> list[str]:
        """Strata subsampling could leave with one PSU; controls missing a record's value."""
        return subsampling_problems(spec, df) + control_problems(spec, df)

    @classmethod
    def key_frequencies(cls, result: StageResult) -> dict[str, pd.Series]:
        """The survey records by how often their original key combination appears in the
        published file (the delta table's appearance u/d/t/o)."""
        b = result.tables.get("delta")
        if b is None or not {"appearance", "n_records"} <= set(b.columns):
            return {}
        what = (
            "survey records whose original key combination appears 1, 2, 3, 4+ times in the "
            "published file"
        )
        counts = b.assign(stratum=b["appearance"].str.upper()).set_index("stratum")["n_records"]
        return {what: counts}

    @classmethod
    def _acted(cls, result: StageResult) -> dict[str, bool]:
        """What MASSC changed: substituted (a record took a donor's values), subsampled (records
        removed, or weights divided by a rate below 1), calibrated (a calibration factor other
        than 1), replicates (a recalibrated replicate weight changed)."""
        m, p = result.metrics, result.params
        rc = result.tables.get("replicate_calibration")
        g = [] if rc is None else [*rc.get("g_min", []), *rc.get("g_max", [])]
        factors = (m.get("calibration_factor_min"), m.get("calibration_factor_max"))
        return {
            "substituted": int(m.get("n_substituted", 0)) > 0,
            "subsampled": int(m.get("n_subsampled_out", 0)) > 0
            or any(float(v) < 1 - 1e-12 for v in (p.get("phi") or {}).values()),
            "calibrated": not all(unchanged(f) for f in factors),
            "replicates": not all(unchanged(float(v)) for v in g),
        }

    @classmethod
    def public_no_effect(cls, result: StageResult, des: dict[str, Any]) -> str | None:
        """MASSC that substituted and removed no record and left every weight as it was."""
        if any(cls._acted(result).values()):
            return None
        return (
            f"Substitution, subsampling and calibration (MASSC) of {cite('000')} changed nothing: "
            "no record was substituted or removed, and the calibration left every weight as "
            "it was."
        )

    @classmethod
    def public_method(cls, result: StageResult, des: dict[str, Any]) -> list[str]:
        """The parts of MASSC that changed the file: substitution, subsampling, calibration."""
        p, m, a = result.params, result.metrics, cls._acted(result)
        cal, w = p.get("calibration") or {}, des["weight"]
        named = {"substitution": "substituted", "subsampling": "subsampled"}
        parts = [k for k, did in named.items() if a[did]]
        parts += ["calibration"] if a["calibrated"] or a["replicates"] else []
        head = ", ".join(parts[:-1]) + (" and " if len(parts) > 1 else "") + parts[-1]
        text = ""
        if a["substituted"] or a["subsampled"]:
            text += (
                "Records were grouped by risk: U, D, T, O = the record's key combination is held "
                "by 1, 2, 3, or 4 and more records. "
            )
        if a["substituted"]:
            text += _massc_substituted(m, p)
        if a["subsampled"]:
            rates = ", ".join(f"{h} {v:.3f}" for h, v in (p.get("phi") or {}).items())
            text += (
                f"{int(m.get('n_subsampled_out', 0)):,} records were removed by subsampling at "
                f"the retention rates {rates} ({p.get('selection', '')}); the weight `{w}` of "
                "the others was divided by their rate. "
            )
        if a["calibrated"]:
            controls = [
                c["name"] if isinstance(c, dict) else str(c) for c in cal.get("controls", [])
            ]
            text += (
                f"The weight `{w}` was calibrated ({cal.get('method', '?')}"
                + (f", bounds {cal['bounds']}" if cal.get("bounds") else "")
                + ") so that the weighted totals of "
                + (", ".join(f"`{c}`" for c in controls) or "no control")
                + " equal those of the original file"
                + (" (and of the declared domains)" if cal.get("domain_margins") else "")
                + f"; calibration factors {cls._factors(m)}. "
            )
        return [
            f"### {head[0].upper()}{head[1:]} (MASSC): {cite('000')}",
            "",
            text + cls._replicates_said(des, a),
            "",
        ]

    @classmethod
    def _factors(cls, m: dict[str, float]) -> str:
        """The calibration factors' range ('0.863 to 1.098'; more digits when they round to 1)."""
        lo, hi = m.get("calibration_factor_min", float("nan")), m.get("calibration_factor_max", 0)
        three = f"{lo:.3f} to {hi:.3f}"
        return f"{fmt(lo)} to {fmt(hi)}" if three == "1.000 to 1.000" else three

    @classmethod
    def _replicates_said(cls, des: dict[str, Any], a: dict[str, bool]) -> str:
        """What became of the replicate weights: recalibrated, or replaced by a later stage."""
        if cls.name in des.get("replaced_after", ()):
            return (
                "The published replicate weights were built after this treatment, from the "
                "final weight; they are not recalibrated."
            )
        if a["calibrated"] or a["subsampled"] or a["replicates"]:
            return (
                "Each replicate weight was recalibrated the same way, so replicate variances "
                "include the calibration."
            )
        return ""

    @classmethod
    def public_treatments(cls, result: StageResult, des: dict[str, Any]) -> dict[str, list[str]]:
        """The substituted columns, the weight (divided by the rate, calibrated) and the
        recalibrated replicates: those MASSC changed."""
        m, p, a = result.metrics, result.params, cls._acted(result)
        out: dict[str, list[str]] = {}
        if a["substituted"]:
            said = (
                f"substituted by MASSC of {cite('000')}: {int(m['n_substituted']):,} records "
                f"({share_text(m.get('share_substituted', 0.0))}) took a donor's values"
            )
            out = {c: [said] for c in p.get("substitute_columns") or []}
        done = ["divided by the MASSC retention rate"] if a["subsampled"] else []
        if a["calibrated"]:
            method = (p.get("calibration") or {}).get("method", "?")
            done.append(f"calibrated ({method}) to the original totals; factors {cls._factors(m)}")
        if done:
            out[des["weight"]] = [" and ".join(done)]
        if cls.name not in des.get("replaced_after", ()) and (done or a["replicates"]):
            out[REPLICATES] = ["; each recalibrated as the full-sample weight"]
        return out

    @classmethod
    def does(cls, spec: ReleaseSpec, column: str = "", side: str = "upper") -> str:
        """MASSC substitutes key values from donors and subsamples records."""
        return "MASSC substitutes key values from donors and subsamples records"

    @classmethod
    def tunables(cls, spec: ReleaseSpec, original: pd.DataFrame | None) -> list[Tunable]:
        """Epsilon, psi_max and phi_min on coarse ladders; substrata off, or on the numeric
        study variables of the original."""
        does = cls.does(spec)
        out = [
            Tunable(
                "stages.massc.epsilon",
                [0.05, 0.1, 0.15, 0.2, 0.3],
                True,
                more_less(
                    does,
                    "a larger target RRMSE allows higher substitution and subsampling rates, a "
                    "lower delta",
                    "a smaller target RRMSE keeps substitution and subsampling rates lower, "
                    "better estimates",
                ),
                +1,
            ),
            Tunable(
                "stages.massc.psi_max",
                [0.05, 0.1, 0.15, 0.2, 0.25],
                True,
                more_less(
                    does,
                    "a higher cap on the substitution rates (more key values may be substituted)",
                    "a lower cap on the substitution rates (fewer key values substituted)",
                ),
                +1,
            ),
            Tunable(
                "stages.massc.phi_min",
                [0.5, 0.7, 0.9],
                True,
                more_less(
                    does,
                    "a higher floor on the retention rates (fewer records sampled out, smaller "
                    "SEs)",
                    "a lower floor on the retention rates (more records may be sampled out)",
                ),
                -1,
            ),
        ]
        num = numeric_study(spec, original)
        if spec.stages.massc.substrata is not None:
            out.append(
                Tunable(
                    "stages.massc.substrata",
                    [None],
                    False,
                    lambda o, v: f"{does}, without substrata",
                )
            )
        elif num:

            def substrata(o: Any, v: Any) -> str:
                return (
                    f"{does}, within k-means substrata on {', '.join(v['variables'])}: donors "
                    "closer in the study variables"
                )

            out.append(Tunable("stages.massc.substrata", [{"variables": num}], False, substrata))
        return out

    def __init__(self, spec: ReleaseSpec):
        self.spec = spec

    @classmethod
    def from_spec(cls, spec: ReleaseSpec) -> MasscStage | None:
        return None if spec.stages.active("massc") is None else cls(spec)

    def check_partitions(self, spec: ReleaseSpec, columns: list[str]) -> None:
        """What the partitioned path refuses in the spec (PartitionError naming the field)."""
        pcal.check_massc(spec, columns)

    @classmethod
    def summary_lines(cls, result: StageResult) -> list[str]:
        """Donors and rates, substitution and subsampling, the calibration, the empirical
        epsilon when measured."""
        m = {**result.metrics, **result.facts}
        strata = ", ".join(f"{h} {n}" for h, n in m["strata"].items())
        rates = {k: ", ".join(f"{h} {p:.4g}" for h, p in m[k].items()) for k in ("psi", "phi")}
        out = [
            f"  massc       : {int(m['n_with_donor'])} records have a donor "
            f"({int(m['n_profiles'])} search profiles); the substituted values in "
            f"internal/massc/donors/ (confidential); risk strata {strata}; moments of eq. 8a "
            f"in massc/moments.csv; psi {rates['psi']} (massc/rates.csv)",
            f"                {int(m['n_substituted'])} records substituted, "
            f"{int(m['n_subsampled_out'])} sampled out; phi {rates['phi']}; delta "
            f"{m['delta']:.4f} after {int(m['n_delta_revisions'])} revision(s)",
            f"                calibrated: {m['calibration_factor_min']:.3f} to "
            f"{m['calibration_factor_max']:.3f} x the weight / phi; "
            f"{int(m.get('calibration_domains_kept', 0))} domain margin(s) kept, "
            f"{int(m.get('calibration_domains_dropped', 0))} dropped; weight total "
            f"{m['weight_sum_ratio']:.6f} x the input's; the retained records in massc/data/ "
            "(massc/calibration_domains.csv, weight_factors.csv)",
        ]
        if "epsilon_empirical" in m:
            out.append(
                f"                epsilon {m['epsilon']:.4f}: formula (eq. 7) "
                f"{m['epsilon_formula']:.4f}, empirical {m['epsilon_empirical']:.4f} over "
                f"{int(m['n_replications'])} replications of the whole treatment "
                "(massc/epsilon_replications.csv)"
            )
        return out

    def run_partitions(self, records: Records, ctx: StageContext) -> StageResult:
        """MASSC's passes, Steps I-IV and the replications, on the records held in memory (one
        partition) or in Parquet partitions: massc_by_partition."""
        return massc_by_partition(records, ctx)
