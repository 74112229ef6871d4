"""Edit rules of the spec evaluated with pandas (same semantics as the Great Expectations suite)."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from sdl_design.spec import BetweenRule, CompareRule, InSetRule, NotNullRule, parse_condition

_OPS = {
    "<": operator.lt,
    "<=": operator.le,
    ">": operator.gt,
    ">=": operator.ge,
    "==": operator.eq,
    "!=": operator.ne,
}


def condition_mask(df: pd.DataFrame, text: str | None) -> pd.Series:
    """Rows where a 'when' condition holds (all rows when there is none)."""
    mask = pd.Series(True, index=df.index)
    if not text:
        return mask
    for col, op, value in parse_condition(text):
        if col not in df.columns:
            raise KeyError(f"edit condition names column '{col}', which is not in the data")
        s = df[col]
        hit = s.isin(value) if op == "in" else _OPS[op](s, value)
        mask &= hit.fillna(False).astype(bool)
    return mask


def edit_masks(df: pd.DataFrame, rules: Sequence[Any]) -> dict[int, pd.Series]:
    """Rule index -> boolean Series, True where the record breaks that rule."""
    out: dict[int, pd.Series] = {}
    for i, rule in enumerate(rules):
        applies = condition_mask(df, rule.when)
        if isinstance(rule, BetweenRule):
            s = pd.to_numeric(df[rule.column], errors="coerce")
            ok = s.notna()
            if rule.min is not None:
                ok &= s >= rule.min
            if rule.max is not None:
                ok &= s <= rule.max
        elif isinstance(rule, InSetRule):
            ok = df[rule.column].isin(rule.values)
        elif isinstance(rule, NotNullRule):
            ok = df[rule.column].notna()
        elif isinstance(rule, CompareRule):
            ok = _OPS[rule.op](df[rule.column_a], df[rule.column_b]).fillna(False)
        else:
            raise TypeError(f"edits[{i}]: unknown edit rule {rule!r}")
        out[i] = (applies & ~ok.astype(bool)).rename(f"edit_{i}")
    return out


def failing_rows(df: pd.DataFrame, rules: Sequence[Any]) -> pd.DataFrame:
    """One row per (rule, record) failure: columns rule (index), column, row (df index label)."""
    parts = []
    for i, bad in edit_masks(df, rules).items():
        if bad.any():
            rule = rules[i]
            col = getattr(rule, "column", None) or getattr(rule, "column_a", None)
            rows = bad.index[bad.to_numpy()]
            parts.append(pd.DataFrame({"rule": i, "column": col, "row": rows}))
    if not parts:
        return pd.DataFrame({"rule": np.array([], dtype=int), "column": [], "row": []})
    return pd.concat(parts, ignore_index=True)


def failure_counts(df: pd.DataFrame, rules: Sequence[Any]) -> dict[int, int]:
    """Rule index -> number of failing records (rules with none are left out)."""
    return {i: int(m.sum()) for i, m in edit_masks(df, rules).items() if m.any()}


class EditFailure(RuntimeError):
    """Records break edit rules after (or before) a treatment; `counts`: rule index -> records."""

    def __init__(self, where: str, counts: dict[int, int], rules: Sequence[Any]):
        self.counts = counts
        parts = "; ".join(f"edits[{i}] ({n} records)" for i, n in counts.items())
        super().__init__(
            f"{where} breaks edit rules {parts}: add the variables these rules tie to the "
            "treated variables, or partition on them"
        )


def check_edits(df: pd.DataFrame, rules: Sequence[Any], where: str) -> None:
    """Raise EditFailure when any record of df breaks an edit rule."""
    bad = failure_counts(df, rules)
    if bad:
        raise EditFailure(where, bad, rules)
