"""The PRB stage: post-randomization of keys in weight-homogeneous blocks, risk bounded by xi."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from sdl_design.describe import (
    Describes,
    NumberColumn,
    RiskRow,
    Tunable,
    cite,
    finite,
    share_text,
)
from sdl_design.engine.records import Passes, Records, passes_result
from sdl_design.spec import KeySpec, PrbSection, ReleaseSpec
from sdl_design.stage import StageContext, StageResult
from sdl_design.stages.prb import passes as pprb
from sdl_design.stages.prb.method import (
    _carried_domain_notes,
    _domain_notes,
    _prb_matrices,
    _prb_notes,
    _prb_vars,
    _risk_figures,
    cells_ladder,
    identification_risk_gate,
    partition_ladder,
    prb_cells,
    risk_by_block,
    units_domains_not_kept,
    units_risk,
)


class PrbStage(Passes, Describes):
    """Stage: PRB post-randomization of the set C in weight-homogeneous blocks (paper 002
    section 4), the NZY baseline beside it, exact risk (eq. 2.2) gated at xi, Tables 3/4/6.
    Cells on the keys' published coding, partition sets refined by utility.domains; the records
    moved across a declared domain cell are counted (n_moved_across_domains, domains_not_kept)."""

    name = "prb"
    treated_share = "share_changed"
    treated_words = "Post-randomization (PRB) changed the keys of {share} of records."
    tune_measures = {"prb_max_risk": "max_risk"}

    @classmethod
    def preflight_numbers(cls, spec: ReleaseSpec) -> list[NumberColumn]:
        """The partition variables cut into bins."""
        part = spec.stages.prb.partition
        return [NumberColumn(f"stages.prb.partition.{c}", c) for c, b in part.items() if b]

    @classmethod
    def risk_rows(cls, result: StageResult | None) -> list[RiskRow]:
        """The largest exact identification risk of a post-randomized record, held to xi."""
        value = None if result is None else finite(result.metrics, "max_risk")
        what = "largest exact identification risk of a post-randomized record (paper 002, eq. 2.2)"
        return [RiskRow(what, value, "PRB did not run", limit="xi")]

    @classmethod
    def _changed(cls, result: StageResult) -> dict[str, str]:
        """The variables PRB changed in some record, each with how many ('12 records (0.4%)';
        '0.4% of records' when the count was not kept)."""
        ch = result.tables.get("changed_by_variable")
        if ch is None or not len(ch):
            return {}
        counts = ch["n_changed"] if "n_changed" in ch.columns else None
        out = {}
        for i, (v, share) in enumerate(zip(ch["variable"], ch["share_changed"], strict=True)):
            if counts is None and share > 0:
                out[str(v)] = f"{share_text(share)} of records"
            elif counts is not None and counts.iloc[i] > 0:
                out[str(v)] = f"{int(counts.iloc[i]):,} records ({share_text(share)})"
        return out

    @classmethod
    def public_no_effect(cls, result: StageResult, des: dict[str, Any]) -> str | None:
        """PRB that changed no record's keys: one sentence (why, when no block was formed)."""
        if int(result.metrics.get("n_changed", 0)) > 0 or cls._changed(result):
            return None
        why = (
            ": no record's key combination was held by only one or two records"
            if not result.metrics.get("n_blocks")
            else ": every record kept its key values"
        )
        return f"Post-randomization of the keys (PRB) of {cite('002')} changed no record{why}."

    @classmethod
    def public_method(cls, result: StageResult, des: dict[str, Any]) -> list[str]:
        """Post-randomization with its transition probabilities (eq. 2.1), for the variables
        whose probabilities are not the identity."""
        p, m = result.params, result.metrics
        L = [
            f"### Post-randomization of the keys (PRB): {cite('002')}",
            "",
            f"Records in key cells (combinations of {', '.join(p.get('cells', []))}) held by one "
            "or two records were grouped in blocks of similar weight; within a block each record "
            "kept its cell with probability 1 - theta/t_j and moved to each of the m - 1 other "
            "cells with probability theta/((m-1) t_j) (t_j: the records of its cell in the "
            f"block; theta = {p.get('theta', float('nan')):.6f}; at least m0 = {p.get('m0')} "
            f"cells per block). A record that moved took all of {', '.join(_prb_vars(result))} "
            f"from a record of its new cell. {int(m.get('n_changed', 0)):,} records "
            f"({share_text(m.get('share_changed', 0.0))}) changed; the exact identification "
            f"risk of every block is at most xi = {p.get('xi')}.",
        ]
        changed = cls._changed(result)
        if len(_prb_vars(result)) > 1 and changed:
            L += ["", "Records whose value changed: "]
            L[-1] += "; ".join(f"`{v}` {n}" for v, n in changed.items()) + "."
        tr = result.tables.get("transitions")
        if tr is None or not len(tr):
            return [*L, ""]
        moved = tr[tr["original"] != tr["published"]].groupby("variable")["p"].max()
        keep = [v for v, pv in moved.items() if pv > 0]
        same = [v for v in dict.fromkeys(tr["variable"]) if v not in keep]
        L += [
            "",
            "Transition probabilities for inference (P[a, b] = P(published = b | original = a), "
            "weighted by the design weight, on each variable's published coding; a "
            "misclassification model or the estimator T_original = (P')^-1 T_published of "
            "weighted category totals uses them). Diagonal by category (the share of each "
            "category's weight left unchanged):",
            "",
            *_prb_matrices(tr[tr["variable"].isin(keep)]),
        ]
        if same:
            L += ["", f"{', '.join(f'`{v}`' for v in same)}: P is the identity (never moved)."]
        return [*L, ""]

    @classmethod
    def public_treatments(cls, result: StageResult, des: dict[str, Any]) -> dict[str, list[str]]:
        """Each variable PRB changed in some record: how many records."""
        theta = result.params.get("theta", float("nan"))
        return {
            v: [f"post-randomized by PRB of {cite('002')}, theta {theta:.4f}: {n} changed"]
            for v, n in cls._changed(result).items()
        }

    @classmethod
    def does(cls, spec: ReleaseSpec, column: str = "", side: str = "upper") -> str:
        """PRB post-randomizes the cells' keys in weight-homogeneous blocks."""
        prb = spec.stages.prb
        cells = prb.cells or [c for c in prb.variables if c in spec.variables.key_names]
        return f"PRB post-randomizes the keys ({', '.join(cells)}) in weight-homogeneous blocks"

    @classmethod
    def tunables(cls, spec: ReleaseSpec, original: pd.DataFrame | None) -> list[Tunable]:
        """The cells taking more of the intruder's key, a finer partition, the tuned theta."""
        does = cls.does(spec)

        def cells(o: Any, v: Any) -> str:
            added = ", ".join(c for c in v["cells"] if c not in (o["cells"] or []))
            return (
                f"{does}; the cells take {added} of the intruder's key too: its uniques are "
                "post-randomized as well"
            )

        def partition(o: Any, v: Any) -> str:
            return (
                f"{does}, inside the sets of a finer partition (adds "
                f"{', '.join(c for c in v if c not in o)}): those columns keep their published "
                "values"
            )

        def tuned(o: Any, v: Any) -> str:
            if v:
                return (
                    f"{does} with the tuned theta, h*(theta) = xi (paper 002 section 6), kept "
                    "where the exact risk check passes"
                )
            return f"{does} with theta0(xi) instead of the tuned theta"

        return [
            Tunable("stages.prb", cells_ladder(spec, original), False, cells, +1),
            Tunable("stages.prb.partition", partition_ladder(spec), False, partition),
            Tunable("stages.prb.tuned", [not spec.stages.prb.tuned], False, tuned),
        ]

    def __init__(self, section: PrbSection, spec: ReleaseSpec):
        self.section, self.spec = section, spec

    @classmethod
    def from_spec(cls, spec: ReleaseSpec) -> PrbStage | None:
        section = spec.stages.active("prb")
        return None if section is None else cls(section, spec)

    def cells(self) -> list[KeySpec]:
        """The cell variables in their published coding (sdl_design.stages.prb.method.prb_cells)."""
        return prb_cells(self.spec, self.section)

    @classmethod
    def summary_lines(cls, result: StageResult) -> list[str]:
        """Records changed, the largest identification risk."""
        m = result.metrics
        return [
            f"  prb         : {int(m['n_changed'])} of {int(m['n_units'])} singleton/doubleton "
            f"records changed; max identification risk {m['max_risk']:.4f}"
        ]

    def run_partitions(self, records: Records, ctx: StageContext) -> StageResult:
        """PRB (stages.prb.method) by partition (in memory: one partition): pass 1 counts
        each partition's cells of X_C and lists its partition sets, pass 2 gathers the
        singleton/doubleton units; the driver forms the blocks and draws IFPR with the stage's
        Generator (then the other method beside it at the same theta); every worker writes its
        records with the moved ones' values of C replaced (edit rules checked). Then the exact
        identification risk (eq. 2.2) gated at xi, and the tables: transitions, weighted counts
        (Tables 1/4), TVD (Table 6), risk by block and tau (Table 3), domains not kept."""
        spec, parts, run_map = ctx.spec, records.parts, records.run_map
        req, st = pprb.prb_stage_request(spec)
        first = run_map(pprb.prb_pass1, parts, spec, req, what="prb pass 1")
        tables = pprb.combine_prb_pass1(first, req)
        records.lap("pass1")
        units = run_map(pprb.prb_pass2, parts, spec, req, tables, what="prb pass 2")
        records.lap("pass2")
        rng = ctx.rng()
        new, plan = pprb.prb_plan(req, st.xi, st.tuned, tables, units, rng)
        base = pprb.prb_baseline(req, st.xi, tables, plan, rng)
        records.lap("plan")
        m = plan["metrics"]
        records.say(
            f"PRB changed {int(m['n_changed'])} of {int(m['n_units'])} singleton/doubleton "
            f"records; max exact identification risk {m['max_risk']:.4f} (xi {st.xi})"
        )
        files = run_map(pprb.prb_apply, parts, spec, req, new, records.data, what="prb")
        records.lap("apply")
        # the public README's tables: the transition probabilities (the category sums by
        # partition, in block sums) and the records each variable of C changed
        trq = pprb.prb_transition_request(tables, plan, req)
        sums = run_map(
            pprb.prb_transition_pass, parts, spec, req, tables, trq, what="prb transitions"
        )
        docs = pprb.prb_doc_tables(trq, sums, records.n, plan, new, req)
        records.lap("transitions")
        other = "nzy" if st.method == "prb" else "prb"
        cq = pprb.prb_counts_request(spec, records.columns, tables, {st.method: new, other: base})
        got = run_map(pprb.prb_counts_pass, parts, spec, req, cq, what="prb counts")
        counts, tv = pprb.prb_count_tables(got, cq, spec, st.method)
        records.lap("counts")
        return self._result(records, plan, tables, req, docs, counts, tv, other, files)

    def _result(
        self,
        records: Records,
        plan: dict[str, Any],
        tables: pprb.PrbTables,
        req: Any,
        docs: dict[str, pd.DataFrame],
        counts: pd.DataFrame,
        tv: pd.DataFrame,
        other: str,
        files: list[str],
    ) -> StageResult:
        """The stage's result from the plan and the partitions' tables."""
        st, spec = self.section, self.spec
        m, u, risk = plan["metrics"], plan["units"], plan["risk"]
        cell, dest = u["__cell"].to_numpy(), plan["dest"]
        n_across, not_kept = units_domains_not_kept(
            plan["part"], cell, dest, tables.cells[req.names], req.domains
        )
        carried = [c for c in st.variables if c not in req.names]
        notes = _prb_notes(st, plan, list(req.names), carried, spec.gates.xi or st.xi)
        notes += _domain_notes(not_kept, int(m["m0"]))
        notes.append(f"{n_across} records moved across a declared domain cell boundary")
        notes += _carried_domain_notes(carried, req.domains)
        metrics = {
            **m,
            "share_changed": m["n_changed"] / max(records.n, 1),
            "n_moved_across_domains": float(n_across),
            f"tvd_mean_{st.method}": float(tv[st.method].mean()) if len(tv) else 0.0,
            f"tvd_mean_{other}": float(tv[other].mean()) if len(tv) else 0.0,
        }
        out = {
            "blocks": pd.DataFrame({"row": u["__row"].to_numpy(), "block": plan["block"]}),
            "risk_by_block": risk_by_block(risk).reset_index(),
            "identification_risk": units_risk(
                tables.cells["__t"].to_numpy(), cell, dest
            ).reset_index(names="row"),
            "weighted_counts": counts.reset_index(),
            "tvd": tv,
            "domains_not_kept": not_kept,
            **docs,
        }
        params = {
            "xi": st.xi,
            "theta": m["theta"],
            "m0": int(m["m0"]),
            "method": st.method,
            "cells": list(req.names),
            "domains": [" x ".join(d) for d in req.domains],
        }
        result = passes_result(
            self.name,
            {**metrics, "files": [Path(f).name for f in files]},
            records,
            params=params,
            tables=out,
            gates=[identification_risk_gate(m["max_risk"], spec.gates.xi or st.xi)],
            notes=notes,
            report_tables=[
                "identification_risk",
                "risk_by_block",
                "weighted_counts",
                "tvd",
                *(["domains_not_kept"] if len(not_kept) else []),
            ],
        )
        result.figures = _risk_figures(risk, spec.gates.xi or st.xi)
        return result
