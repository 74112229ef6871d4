"""Edit rules: the spec's rule models, their evaluation on a frame and the failure they raise.

This is the one implementation of edit rules. Each rule says which records break it
(`violations`, pandas) and describes itself as one column expectation (`expectation`, free of
Great Expectations), which expectations/suites.py turns into the GX edit suite.

Missing values (the declared missing-value policy, README "Missing values"): a rule checks the
values that are there. A record whose checked column is missing (NaN, or a declared missing code
read as missing) passes the rule unless the rule says `missing: fail`; `not_null` is the rule
whose whole point is that a missing value fails. The input and every output check (PRB, MASSC,
the public file) use this one definition.
"""

from __future__ import annotations

import math
import operator
import re
from abc import abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import numpy as np
import pandas as pd
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# The one operator table: pandas Series and GX row-condition Columns both overload these.
OPS: dict[str, Callable[[Any, Any], Any]] = {
    "<": operator.lt,
    "<=": operator.le,
    ">": operator.gt,
    ">=": operator.ge,
    "==": operator.eq,
    "!=": operator.ne,
}

Clause = tuple[str, str, Any]  # (column, op, value); op: a key of OPS, "in", "not in",
# "is null" or "not null" (value None)

_COND = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*(<=|>=|==|!=|<|>|not\s+in\b|in\b)\s*(.+?)\s*$")
_NUMBER = re.compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?$")
_NULLS = ("null", "none", "~")


def _scalar(token: str, part: str) -> Any:
    """One value of a condition: 'quoted' or "quoted" text, true/false, null, a number, else
    the bare word as text (yes, no, on and off are text, never booleans; a number with a
    leading zero such as 0001 is text too)."""
    t = token.strip()
    if len(t) >= 2 and t[0] == t[-1] and t[0] in "'\"":
        return t[1:-1]
    if not t or any(c in t for c in "[]{},'\""):
        raise ValueError(f"cannot read the value {t!r} in condition {part!r}; quote text values")
    low = t.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in _NULLS:
        return None
    if _NUMBER.match(t):
        digits = t.lstrip("+-")
        if len(digits) > 1 and digits[0] == "0" and digits[1].isdigit():
            return t
        return int(t) if re.fullmatch(r"[-+]?\d+", t) else float(t)
    return t


def _items(inner: str, part: str) -> list[Any]:
    """The values of '[a, 'b', 3]' (commas inside quotes are kept)."""
    items, cur, quote = [], "", None
    for ch in inner:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == ",":
            items.append(cur)
            cur = ""
            continue
        cur += ch
    if cur.strip() or items:
        items.append(cur)
    values = [_scalar(x, part) for x in items]
    if not values:
        raise ValueError(f"condition {part!r}: the list is empty; give at least one value")
    if any(v is None for v in values):
        raise ValueError(
            f"condition {part!r}: a list may not hold null; test missing values on their own "
            "clause (column == null)"
        )
    return values


def _value(raw: str, part: str) -> Any:
    raw = raw.strip()
    if raw.startswith("["):
        if not raw.endswith("]"):
            raise ValueError(f"condition {part!r}: the list is not closed with ']'")
        return _items(raw[1:-1], part)
    return _scalar(raw, part)


def parse_condition(text: str) -> list[Clause]:
    """'age < 15 and sex == "male"' -> [(column, op, value), ...]; clauses joined by 'and'.

    Values: 'quoted' text, true/false, numbers, bare words as text (`consent == yes` compares
    with the text "yes"), lists. `x == [1, 2]` means x in the list (`!=`: not in it);
    `x == null` holds where x is missing (`!=`: where it is not)."""
    clauses = []
    for part in re.split(r"\s+and\s+", text.strip()):
        m = _COND.match(part)
        if not m:
            raise ValueError(
                f"cannot read condition {part!r}: write 'column op value' with op one of "
                "< <= > >= == != in, not in, joined by 'and' (e.g. \"age < 15 and sex == 'male'\")"
            )
        col, op, raw = m.groups()
        op = " ".join(op.split())
        if raw[0] in "<>=!":
            raise ValueError(
                f"cannot read condition {part!r}: the operator is not one of < <= > >= == != in"
            )
        value = _value(raw, part)
        if isinstance(value, list):
            if op in ("==", "in"):
                op = "in"
            elif op in ("!=", "not in"):
                op = "not in"
            else:
                raise ValueError(
                    f"condition {part!r}: a list can only be compared with ==, !=, in or not in"
                )
        elif op in ("in", "not in"):
            raise ValueError(f"'{op}' needs a list, e.g. \"{col} {op} [1, 2]\"")
        elif value is None:
            if op not in ("==", "!="):
                raise ValueError(
                    f"condition {part!r}: a missing value has no order; write {col} == null "
                    f"(records where {col} is missing) or {col} != null"
                )
            op = "is null" if op == "==" else "not null"
        clauses.append((col, op, value))
    return clauses


def clause_hits(s: pd.Series, op: str, value: Any) -> pd.Series:
    """Where one clause holds on column s (a missing value satisfies only '!=', 'not in' and
    '== null'; a comparison that gives a missing result does not hold)."""
    if op == "in":
        hit = s.isin(value)
    elif op == "not in":
        hit = ~s.isin(value)
    elif op == "is null":
        hit = s.isna()
    elif op == "not null":
        hit = s.notna()
    else:
        hit = OPS[op](s, value)
    return hit.fillna(False).astype(bool)


def condition_mask(df: pd.DataFrame, text: str | None) -> pd.Series:
    """Rows where a 'when' condition holds (all rows when there is none; a missing value never
    satisfies a clause except through '!=', 'not in' and '== null')."""
    mask = pd.Series(True, index=df.index)
    for col, op, value in parse_condition(text) if text else []:
        if col not in df.columns:
            raise KeyError(f"edit condition names column '{col}', which is not in the data")
        mask &= clause_hits(df[col], op, value)
    return mask


@dataclass(frozen=True)
class Expectation:
    """An edit rule as one column expectation, without GX.

    kind: between (kwargs min_value, max_value), in_set (value_set), not_null, or true (every
    value of the boolean column `derived(df)` is True). The expectation applies to the records
    where all `when` clauses hold. missing_breaks: a record whose `column` is missing breaks the
    rule too (GX column expectations skip missing values and count them apart).
    """

    kind: Literal["between", "in_set", "not_null", "true"]
    column: str | None
    kwargs: dict[str, Any] = field(default_factory=dict)
    when: list[Clause] = field(default_factory=list)
    missing_breaks: bool = False
    derived: Callable[[pd.DataFrame], pd.Series] | None = None


class _Edit(BaseModel):
    model_config = ConfigDict(extra="forbid")

    when: str | None = None
    # a record whose checked column is missing: passes the rule ("pass", default) or breaks it
    missing: Literal["pass", "fail"] = "pass"

    @field_validator("when")
    @classmethod
    def _when_parses(cls, v: str | None) -> str | None:
        if v is not None:
            parse_condition(v)
        return v

    def clauses(self) -> list[Clause]:
        """The parsed 'when' condition (empty: the rule applies to every record)."""
        return parse_condition(self.when) if self.when else []

    def columns(self) -> list[str]:
        """Columns the rule names: the checked ones first, then those of 'when'."""
        return [c for c, _, _ in self.clauses()]

    def describe(self) -> str:
        """The rule in words, e.g. "marital in ['never_married'] when age < 15"."""
        return self._check_text() + (f" when {self.when}" if self.when else "")

    def label(self, i: int) -> str:
        """Short human name of the rule as edits[i] of the spec."""
        return f"edit[{i}] {self.describe()}"

    def violations(self, df: pd.DataFrame) -> pd.Series:
        """True where a record breaks the rule: 'when' holds and the check does not."""
        return condition_mask(df, self.when) & ~self.holds(df)

    def holds(self, df: pd.DataFrame) -> pd.Series:
        """True where the record passes the check itself, 'when' aside: the check on the values
        that are there; a missing checked value passes unless `missing: fail`."""
        ok = self.check(df)
        if self.missing == "pass":
            ok = ok | self.missing_mask(df)
        return ok.astype(bool)

    def missing_mask(self, df: pd.DataFrame) -> pd.Series:
        """True where a checked column of the record is missing."""
        return df[self.columns()[0]].isna()

    @abstractmethod
    def check(self, df: pd.DataFrame) -> pd.Series:
        """True where the record's values pass the check (a missing value does not)."""

    @abstractmethod
    def expectation(self) -> Expectation:
        """The rule as one column expectation (expectations/suites.py runs it in GX)."""

    @abstractmethod
    def _check_text(self) -> str: ...


class BetweenRule(_Edit):
    rule: Literal["between"]
    column: str
    min: float | None = None
    max: float | None = None

    @model_validator(mode="after")
    def _bounds(self) -> BetweenRule:
        if self.min is None and self.max is None:
            raise ValueError("between needs min, max or both")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"min ({self.min}) is above max ({self.max})")
        return self

    def columns(self) -> list[str]:
        return [self.column, *super().columns()]

    def _check_text(self) -> str:
        if self.min is not None and self.max is not None:
            return f"{self.column} between {self.min:g} and {self.max:g}"
        if self.min is not None:
            return f"{self.column} >= {self.min:g}"
        return f"{self.column} <= {self.max:g}"

    def check(self, df: pd.DataFrame) -> pd.Series:
        """Numeric (a non-numeric value fails), within [min, max]."""
        s = pd.to_numeric(df[self.column], errors="coerce")
        ok = s.notna()
        if self.min is not None:
            ok &= s >= self.min
        if self.max is not None:
            ok &= s <= self.max
        return ok.astype(bool)

    def expectation(self) -> Expectation:
        return Expectation(
            "between",
            self.column,
            {"min_value": self.min, "max_value": self.max},
            self.clauses(),
            missing_breaks=self.missing == "fail",
        )


class InSetRule(_Edit):
    rule: Literal["in_set"]
    column: str
    values: list[str | int | float | bool] = Field(min_length=1)

    def columns(self) -> list[str]:
        return [self.column, *super().columns()]

    def _check_text(self) -> str:
        return f"{self.column} in {self.values}"

    def check(self, df: pd.DataFrame) -> pd.Series:
        """One of the values (a missing value is one only when NaN is listed)."""
        return df[self.column].isin(self.values).astype(bool)

    def expectation(self) -> Expectation:
        nan_allowed = any(isinstance(v, float) and math.isnan(v) for v in self.values)
        return Expectation(
            "in_set",
            self.column,
            {"value_set": list(self.values)},
            self.clauses(),
            missing_breaks=self.missing == "fail" and not nan_allowed,
        )


class NotNullRule(_Edit):
    rule: Literal["not_null"]
    column: str
    missing: Literal["fail"] = "fail"  # the rule's point: a missing value fails

    def columns(self) -> list[str]:
        return [self.column, *super().columns()]

    def _check_text(self) -> str:
        return f"{self.column} not null"

    def check(self, df: pd.DataFrame) -> pd.Series:
        return df[self.column].notna()

    def expectation(self) -> Expectation:
        return Expectation("not_null", self.column, {}, self.clauses())


class CompareRule(_Edit):
    rule: Literal["compare"]
    column_a: str
    op: Literal["<", "<=", ">", ">=", "==", "!="]
    column_b: str

    def columns(self) -> list[str]:
        return [self.column_a, self.column_b, *super().columns()]

    def _check_text(self) -> str:
        return f"{self.column_a} {self.op} {self.column_b}"

    def check(self, df: pd.DataFrame) -> pd.Series:
        """column_a op column_b (a missing value on either side fails the comparison)."""
        a, b = df[self.column_a], df[self.column_b]
        return OPS[self.op](a, b).fillna(False).astype(bool) & a.notna() & b.notna()

    def missing_mask(self, df: pd.DataFrame) -> pd.Series:
        return df[self.column_a].isna() | df[self.column_b].isna()

    def expectation(self) -> Expectation:
        return Expectation("true", None, {}, self.clauses(), derived=self.holds)


EditRule = Annotated[
    BetweenRule | InSetRule | NotNullRule | CompareRule, Field(discriminator="rule")
]


# ---------------------------------------------------------------- evaluation on a frame


def edit_masks(df: pd.DataFrame, rules: Sequence[_Edit]) -> dict[int, pd.Series]:
    """Rule index -> boolean Series, True where the record breaks that rule."""
    return {i: rule.violations(df).rename(f"edit_{i}") for i, rule in enumerate(rules)}


def failing_rows(df: pd.DataFrame, rules: Sequence[_Edit]) -> pd.DataFrame:
    """One row per (rule, record) failure: columns rule (index), column, row (df index label)."""
    parts = []
    for i, bad in edit_masks(df, rules).items():
        if bad.any():
            rows = bad.index[bad.to_numpy()]
            parts.append(pd.DataFrame({"rule": i, "column": rules[i].columns()[0], "row": rows}))
    if not parts:
        return pd.DataFrame({"rule": np.array([], dtype=int), "column": [], "row": []})
    return pd.concat(parts, ignore_index=True)


def failure_counts(df: pd.DataFrame, rules: Sequence[_Edit]) -> dict[int, int]:
    """Rule index -> number of failing records (rules with none are left out)."""
    return {i: int(m.sum()) for i, m in edit_masks(df, rules).items() if m.any()}


def rule_failures(
    df: pd.DataFrame, rules: Sequence, ids: np.ndarray | None = None, examples: int = 5
) -> list:
    """Per rule: (failing records, the ids of the first `examples` of them; ids: one per
    record, default the index labels), or the reason it cannot be evaluated (text)."""
    out: list = []
    ids = df.index.to_numpy() if ids is None else np.asarray(ids)
    for rule in rules:
        try:
            bad = np.asarray(rule.violations(df).to_numpy(), dtype=bool)
        except Exception as e:  # noqa: BLE001 - reported as the rule's result
            out.append(f"could not be evaluated: {type(e).__name__}: {e}")
            continue
        out.append((int(bad.sum()), ids[bad][:examples].tolist()))
    return out


def combine_rule_failures(partials: Sequence[list], examples: int = 5) -> list:
    """rule_failures of the whole input from its partitions' (in partition order)."""
    out = []
    for per_rule in zip(*partials, strict=True):
        text = next((p for p in per_rule if isinstance(p, str)), None)
        if text is not None:
            out.append(text)
            continue
        n = sum(p[0] for p in per_rule)
        out.append((n, [e for p in per_rule for e in p[1]][:examples]))
    return out


FAILURE_COLUMNS = ["rule", "label", "column", "count", "examples"]
DEFAULT_HINT = (
    "treat the variables each rule ties together as one: add them to the PRB set C, or to the "
    "MASSC key-related columns (or restrict donors on them)"
)


class EditFailure(RuntimeError):
    """A treated file breaks edit rules. `table`: one row per broken rule with columns rule
    (index in spec.edits), label, column, count and examples (up to 5 row labels)."""

    def __init__(self, stage: str, table: pd.DataFrame, hint: str = DEFAULT_HINT):
        self.stage, self.table, self.hint = stage, table, hint
        broken = "; ".join(
            f"edits[{r.rule}]{r.label.removeprefix(f'edit[{r.rule}]')} ({r.count} records)"
            for r in table.itertuples()
        )
        super().__init__(f"{stage} breaks edit rules: {broken}: {hint}")

    def __reduce__(self):  # picklable across Dask workers despite the extra arguments
        return type(self), (self.stage, self.table, self.hint)


def edit_failures(df: pd.DataFrame, rules: Sequence[_Edit]) -> pd.DataFrame:
    """The broken rules of df: FAILURE_COLUMNS, one row per rule with at least one failure."""
    rows = []
    for i, bad in edit_masks(df, rules).items():
        n = int(bad.sum())
        if n:
            rows.append(
                {
                    "rule": i,
                    "label": rules[i].label(i),
                    "column": rules[i].columns()[0],
                    "count": n,
                    "examples": bad.index[bad.to_numpy()][:5].tolist(),
                }
            )
    return pd.DataFrame(rows, columns=FAILURE_COLUMNS)


def check_edits(
    df: pd.DataFrame, rules: Sequence[_Edit], stage: str, hint: str = DEFAULT_HINT
) -> None:
    """Raise EditFailure naming each rule df breaks and its count ("PRB output breaks ...")."""
    table = edit_failures(df, rules)
    if len(table):
        raise EditFailure(stage, table, hint)
