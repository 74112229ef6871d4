"""ReleaseSpec: the YAML release spec as a pydantic model. Every error names the field and the fix."""

from __future__ import annotations

import re
from collections.abc import Sequence
from datetime import datetime
from numbers import Number
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import numpy as np
import pandas as pd
import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from sdl_design.edits import EditRule
from sdl_design.edits import parse_condition as parse_condition  # re-exported
from sdl_design.leaks import column_problems
from sdl_design.messages import did_you_mean, rows_text, yaml_error_text
from sdl_design.messages import short_list as _short
from sdl_design.survey.design import (
    UNIT_WEIGHT,
    BootstrapConvention,
    ReplicateMethod,
    resolve_replicates,
)
from sdl_design.survey.glm import parse_formula

# a spec's YAML, aliases expanded, at most this many nodes (an alias bomb is refused, not run)
SPEC_NODES_MAX = 200_000
# and at most this many bytes and edit rules (a hostile spec is refused before any work)
SPEC_BYTES_MAX = 2_000_000
EDITS_MAX = 5_000
# missing columns given a "did you mean" (each compares its name with every column of the file)
SUGGESTIONS_MAX = 50


class SpecError(ValueError):
    """A release spec (or the data it names) is not usable; `problems` lists 'field: what and fix'."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("release spec is not valid:\n" + "\n".join(f"  - {p}" for p in problems))

    def __reduce__(self):  # picklable (Dask workers) with its problems, not its message
        return type(self), (self.problems,)


def _allows_bool(annotation: Any) -> bool:
    """Whether a field's type admits a boolean (bool itself, Any, or a union holding either)."""
    if annotation is bool or annotation is Any:
        return True
    return any(_allows_bool(a) for a in get_args(annotation))


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, v: Any, info: ValidationInfo) -> Any:
        """`seed: true` is not the number 1: a boolean only where the field is a boolean."""
        if isinstance(v, bool) and info.field_name in cls.model_fields:
            if not _allows_bool(cls.model_fields[info.field_name].annotation):
                raise ValueError(f"{str(v).lower()} is a boolean here; write the value itself")
        return v


# ---------------------------------------------------------------- release, design, variables


class ReleaseSection(_Strict):
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    year: int = Field(ge=1900, le=2200)
    input: Path | None = None  # None: the embedded default survey (sdl_design.synth)
    output_dir: Path = Path("releases")
    seed: int = Field(ge=0)
    encoding: str = "utf-8"  # of a CSV input (a BOM is fine); e.g. latin-1, cp1252
    registry: str | None = (
        None  # SQLAlchemy URL; default PUF_REGISTRY_URL or <output_dir>/registry.db
    )

    @field_validator("encoding")
    @classmethod
    def _known_codec(cls, v: str) -> str:
        import codecs

        try:
            codecs.lookup(v)
        except LookupError:
            raise ValueError(
                f"{v!r} is not an encoding Python knows; give e.g. utf-8, latin-1 or cp1252"
            ) from None
        return v

    @field_validator("name")
    @classmethod
    def _safe_folder(cls, v: str) -> str:
        """The name is a folder under output_dir: no '/', and no leading dot ('.', '..', hidden)."""
        if v.startswith("."):
            raise ValueError(
                f"{v!r} cannot be a release folder name (it starts with a dot); start it with a "
                "letter or digit, e.g. 'my-survey'"
            )
        return v


class ReplicateSpec(_Strict):
    """The producer's replicate weights and how their variance is formed, as R's svrepdesign:
    V = scale * sum_r rscales_r (theta_r - centre)^2. Without scale and rscales the method's
    (brr 1/R, fay 1/(R(1-rho)^2), jk1 (R-1)/R, sdr 4/R, jkn (n_h-1)/n_h of the stratum of the
    deleted PSU: declare design.strata, or give rscales), bootstrap by its convention:
    `bootstrap: rao-wu` (n_h - 1 PSUs drawn and rescaled, R's svrepdesign(type="bootstrap")
    and subbootweights: scale 1/(R-1)) or `canty-davison` (n_h drawn, R's bootweights and
    as.svrepdesign(type="bootstrap"): nbar/((nbar-1)(R-1)), nbar the harmonic mean of the
    PSUs per stratum of design.strata/psu); not declared: 1/R. A producer who publishes the
    scale gives `scale` (and `rscales` when they differ by replicate) instead. mse: centre on
    the full-sample estimate (true, the default) or on the replicates' mean (false, R's
    default option survey.replicates.mse)."""

    columns: str | list[str]  # a glob such as "rw_*" or an explicit list
    method: ReplicateMethod
    rho: float | None = Field(default=None, ge=0.0, lt=1.0)
    bootstrap: BootstrapConvention | None = None
    scale: float | None = Field(default=None, gt=0.0)
    rscales: list[float] | None = None
    mse: bool = True

    @field_validator("method", mode="before")
    @classmethod
    def _method_any_case(cls, v: Any) -> Any:
        return v.lower() if isinstance(v, str) else v  # R's "JKn", Stata's "BRR"

    @model_validator(mode="after")
    def _fay_needs_rho(self) -> ReplicateSpec:
        if self.method == "fay" and self.rho is None:
            raise ValueError("method 'fay' needs rho (e.g. rho: 0.3)")
        if self.bootstrap is not None and self.method != "bootstrap":
            raise ValueError(
                f"bootstrap: {self.bootstrap} describes bootstrap replicates, not "
                f"{self.method}; drop it or declare method: bootstrap"
            )
        if self.bootstrap is not None and (self.scale is not None or self.rscales is not None):
            raise ValueError(
                "bootstrap: give the convention (rao-wu or canty-davison) or the scale and "
                "rscales the producer publishes, not both"
            )
        if self.scale is not None and self.method in ("brr", "fay", "sdr"):
            raise ValueError(
                f"scale: {self.method}'s scale is fixed by the method (as R's svrepdesign); "
                "drop scale, or give rscales"
            )
        if self.rscales is not None and any(not (r >= 0) for r in self.rscales):
            raise ValueError("rscales: give one number >= 0 per replicate")
        return self

    def resolve(self, columns: list[str]) -> list[str]:
        """Replicate weight columns present in the data, in data order."""
        return resolve_replicates(columns, self.columns)


class PseudoDesignSection(_Strict):
    """The variance design built for the public file when no stage masks the design and the
    original labels are not published (sdl_design.pseudo): pseudo strata (groups of at least two
    original strata, sorted by label, split at random into sub-strata) and psus_per_stratum
    pseudo PSUs in each (original PSUs, or records when each record is its own PSU, dealt at
    random within their original stratum), at least min_units original PSUs in each pseudo PSU,
    at most max_psus pseudo PSUs (JKn: one replicate each), and replicate weights of the pseudo
    design. psus_per_stratum None: chosen with the dealing when the design has PSUs (candidates),
    10 when each record is its own PSU (more degrees of freedom per replicate)."""

    enabled: bool = True
    strata: str = "pseudo_stratum"  # column of the pseudo strata when design.strata is not given
    psu: str = "pseudo_psu"  # column of the pseudo PSUs when design.psu is not given
    psus_per_stratum: int | None = Field(default=None, ge=2, le=50)
    max_psus: int = Field(default=100, ge=2, le=2000)
    min_units: int = Field(default=2, ge=1)  # original PSUs (or records) per pseudo PSU
    # dealings drawn (of each size when psus_per_stratum is None) when the units are original
    # PSUs: the one whose variances of the study variables' domain means are closest to the
    # original design's is kept (1: the first draw, 2 pseudo PSUs a stratum)
    candidates: int = Field(default=300, ge=1, le=1000)
    replicate_method: Literal["jkn", "bootstrap"] = "jkn"
    replicates: int = Field(default=100, ge=2, le=1000)  # bootstrap only
    # the pseudo design's replicate columns: prefix and number (None: pseudo_<method>_)
    replicate_prefix: str | None = Field(default=None, min_length=1)


class DesignSection(_Strict):
    """The design as it comes: strata, PSU and segment are each optional (no strata: one
    stratum; no PSU: each record is its own PSU). A weights-only file: `design: {weight: w}`.
    An unweighted (equal-probability) file: `design: {weight: null}` or `{unweighted: true}`:
    every record weighs 1 (with no strata and no psu, a simple random sample with replacement,
    as R's svydesign(ids=~1) without weights). The spec then names the weight UNIT_WEIGHT
    ("unit_weight", a reserved name), a column of ones that reading the input adds
    (sdl_design.io.type_input) so that every stage sees a weight column and the public file
    carries it as its weight (ones, unless a stage adjusts the weights), and declares the
    weights normalised (they sum to the sample size, not to the population)."""

    weight: str
    strata: str | None = None
    psu: str | None = None
    segment: str | None = None
    household: str | None = None
    replicate_weights: ReplicateSpec | None = None
    publish_design_labels: bool = False  # publish original strata/PSU labels when no masking runs
    pseudo: PseudoDesignSection = PseudoDesignSection()
    # the weights sum to the sample size (or to 1), not to the population: declared, the release
    # goes on (the log-linear risk then takes the sample for the population); else an error
    weights_normalised: bool = False
    # finite population correction and two-stage variance, as R's svydesign(id=~psu+ssu,
    # fpc=~fpc+fpc2): fpc the PSUs in the stratum's population (or the sampling fraction when
    # every value is <= 1), ssu the second-stage unit (nested in psu), fpc2 the SSUs in the
    # PSU's population; lonely_psu R's survey.lonely.psu for a stratum with a single PSU
    fpc: str | None = None
    ssu: str | None = None
    fpc2: str | None = None
    lonely_psu: Literal["fail", "remove", "adjust", "average", "certainty"] = "fail"

    @model_validator(mode="before")
    @classmethod
    def _unit_weight(cls, data: Any) -> Any:
        """weight: null or unweighted: true -> the weight UNIT_WEIGHT (ones) and the weights
        normalised; no weight at all -> an error naming both ways. `unweighted` is read here
        and not kept as a field: the weight's name says it (the `unweighted` property)."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        unweighted = data.pop("unweighted", None)
        if unweighted is not None and not isinstance(unweighted, bool):
            raise ValueError(f"unweighted: give true or false, not {unweighted!r}")
        if unweighted is not True and "weight" not in data:
            raise ValueError(
                "weight: name the weight column (design.weight: <column>), or declare an "
                "unweighted file with weight: null (or unweighted: true): every record then "
                "weighs 1, a simple random sample unless strata or psu are given"
            )
        weight = data.get("weight")
        if unweighted is True and weight not in (None, UNIT_WEIGHT):
            raise ValueError(
                f"unweighted: true with weight: {weight}; give the weight column or declare "
                "the file unweighted, not both"
            )
        if unweighted is False and weight in (None, UNIT_WEIGHT):
            raise ValueError(
                "unweighted: false with no weight column; name the weight column, or declare "
                "the file unweighted (weight: null alone, or unweighted: true)"
            )
        if weight in (None, UNIT_WEIGHT) or unweighted is True:
            if data.get("weights_normalised") is False:
                raise ValueError(
                    "weights_normalised: an unweighted file's weights (all 1) sum to the sample "
                    "size; drop weights_normalised: false"
                )
            data |= {"weight": UNIT_WEIGHT, "weights_normalised": True}
        return data

    @property
    def unweighted(self) -> bool:
        """Whether the file is unweighted (weight: null): its weight is UNIT_WEIGHT, ones."""
        return self.weight == UNIT_WEIGHT

    @model_validator(mode="after")
    def _segment_in_psu(self) -> DesignSection:
        if self.segment is not None and self.psu is None:
            raise ValueError(
                "segment needs psu: segments are nested in PSUs; name the psu column or drop segment"
            )
        if self.ssu is not None and self.psu is None:
            raise ValueError(
                "ssu needs psu: second-stage units are nested in PSUs; name the psu column or "
                "drop ssu"
            )
        if self.fpc2 is not None and self.ssu is None:
            raise ValueError(
                "fpc2 needs ssu: it counts the second-stage units of a PSU; name the ssu column "
                "or drop fpc2"
            )
        if self.fpc2 is not None and self.fpc is None:
            raise ValueError(
                "fpc2 needs fpc: without the first-stage fpc the PSUs are ultimate clusters and "
                "fpc2 changes nothing; name the fpc column or drop fpc2"
            )
        return self


class KeySpec(_Strict):
    """A key variable, optionally coarsened: bins (left-closed intervals) or a category map.
    The public file carries a coarsened key in that coding (global recoding), the coding every
    risk measure reads; publish: detail publishes the values, and then nothing may coarsen it."""

    name: str
    bins: list[float] | None = None
    map: dict[str, str] | None = None
    publish: Literal["coded", "detail"] = "coded"

    @model_validator(mode="after")
    def _one_recode(self) -> KeySpec:
        if self.bins is not None and self.map is not None:
            raise ValueError("give either bins or map for a key, not both")
        if self.publish == "detail" and (self.bins is not None or self.map is not None):
            raise ValueError(
                f"key '{self.name}': publish: detail publishes its exact values, so its risk is "
                "measured on them: remove bins/map, or publish it coded (drop publish: detail)"
            )
        if self.bins is not None and (len(self.bins) < 2 or np.any(np.diff(self.bins) <= 0)):
            raise ValueError("bins must be at least two strictly increasing numbers")
        return self


def _names_as_keys(v: Any) -> Any:
    """A key list may give a bare name for a key without recode: 'sex' -> {name: sex}."""
    if isinstance(v, list):
        return [{"name": k} if isinstance(k, str) else k for k in v]
    return v


KeySpecs = Annotated[list[KeySpec], BeforeValidator(_names_as_keys)]


_NUMERIC_TEXT = re.compile(r"^\s*[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?\s*$")


def category_label(v: Any) -> str:
    """The label that matches a data value with a sensitivity key: 1, 1.0, '1' and '1.0' all
    give '1'; 0.5 and '0.5' give '0.5'; True gives 'True'; a missing value gives 'nan'."""
    if isinstance(v, (bool, np.bool_)):
        return str(bool(v))
    if isinstance(v, str):
        if not _NUMERIC_TEXT.match(v):
            return v
        v = float(v)
    if isinstance(v, Number) and not isinstance(v, complex):
        f = float(v)
        if np.isnan(f):
            return "nan"
        return str(int(f)) if f.is_integer() else repr(f)
    if v is None or v is pd.NA or v is pd.NaT:
        return "nan"
    return str(v)


class SensitiveSpec(_Strict):
    name: str
    sensitivity: dict[str | int | float, Annotated[float, Field(ge=0.0, le=1.0)]]
    bins: list[float] | None = None  # continuous variable: categories are the bin labels


class OtherColumns(_Strict):
    """Columns that are neither keys, study, sensitive, design nor identifiers: published as
    they are (keep) or never published (drop, e.g. fine geography)."""

    keep: list[str] = []
    drop: list[str] = []


class VariablesSection(_Strict):
    direct_identifiers: list[str] = []
    keys: KeySpecs = Field(min_length=1)
    sensitive: list[SensitiveSpec] = []
    study: list[str] = []
    other: OtherColumns = OtherColumns()
    # declared missing codes per column: values read as missing (NaN), e.g.
    # {hinctnta: [77, 88], income: ["", "NA?"]}; NaN in the file is missing whatever is declared
    missing: dict[str, list[str | int | float]] = {}

    @property
    def key_names(self) -> list[str]:
        return [k.name for k in self.keys]


class IntruderSection(_Strict):
    """What the intruder is assumed to know besides the declared keys (sdl_design.attack): every
    other published column with at most max_levels values (and every text column), and the
    published design labels, unless said here why an intruder cannot know it."""

    unknown: dict[str, str] = {}  # published column -> why an intruder cannot know it
    max_levels: int = Field(default=25, ge=2, le=10_000)
    # why an intruder cannot map the published strata/PSUs to places (None: they are known)
    design_labels_unknown: str | None = None

    @model_validator(mode="after")
    def _reasons(self) -> IntruderSection:
        blank = [c for c, why in self.unknown.items() if not str(why).strip()]
        if blank:
            raise ValueError(
                f"unknown: {blank} need a reason why an intruder cannot know them "
                "(e.g. smoker: self-reported in the interview, in no register)"
            )
        if self.design_labels_unknown is not None and not self.design_labels_unknown.strip():
            raise ValueError("design_labels_unknown: say why, or remove it")
        return self


# edit rules (EditRule): sdl_design/edits.py

# ---------------------------------------------------------------- stages


class SwapSection(_Strict):
    enabled: bool = True
    rate: float = Field(gt=0.0, le=1.0)
    matching: list[str] = Field(min_length=1)
    method: Literal["2b", "2a"] = "2b"
    cumulative: bool = False  # eq. 6b instead of 6a
    max_share: float = Field(default=0.5, gt=0.0, le=1.0)
    scope: Literal["any", "same_stratum", "cross_stratum"] = "any"
    replicate_method: ReplicateMethod | None = None  # default: the design's replicate method
    rho: float | None = Field(default=None, ge=0.0, lt=1.0)

    @model_validator(mode="after")
    def _rate_within_share(self) -> SwapSection:
        if self.rate > self.max_share + 1e-12:
            raise ValueError(
                f"rate {self.rate:g} is above max_share {self.max_share:g}: no PSU may swap more "
                "than max_share of its segments; lower rate or raise max_share"
            )
        return self


class PrbSection(_Strict):
    enabled: bool = True
    xi: float = Field(gt=1 / 3, lt=0.5)
    variables: list[str] = Field(min_length=1)  # the set C
    # the variables of C whose cross-classification defines the cells of X_C, each key in its
    # published coding (bins/map: as the intruder sees it); None (default): the keys in C.
    # The other variables of C (tied to the keys by edit rules) are carried: a unit that moves
    # takes all of C's values from one record of the destination cell.
    cells: list[str] | None = None
    # partition sets: bins on the raw values, or None for the column as in the cells (a key in
    # its published coding); refined by the declared domains (utility.domains) among the cells
    partition: dict[str, list[float] | None] = {}
    method: Literal["prb", "nzy"] = "prb"
    tuned: bool = False  # h*(theta) = xi (paper 002 section 6)

    @model_validator(mode="after")
    def _cells_in_c(self) -> PrbSection:
        extra = [c for c in self.cells or [] if c not in self.variables]
        if extra:
            raise ValueError(f"cells {extra} are not in variables (the set C); add them there")
        return self


class CalibrationSpec(_Strict):
    method: Literal["logit", "linear", "raking", "poststratify"] = "logit"
    bounds: tuple[float, float] | None = None
    controls: KeySpecs = []
    infeasible_policy: Literal["widen", "rake"] = "widen"
    # also calibrate to the original's weighted counts of every declared domain
    # (utility.domain_list, keys in their published coding); cells with fewer than
    # domain_min_records retained records are pooled per domain and reported
    domain_margins: bool = True
    domain_min_records: int = Field(default=30, ge=1)

    @model_validator(mode="after")
    def _bounds_ok(self) -> CalibrationSpec:
        if self.method == "logit" and self.bounds is None:
            raise ValueError(
                "method 'logit' needs bounds [L, U] with 0 < L < 1 < U (e.g. [0.5, 2.0])"
            )
        if self.bounds is not None and not (0 < self.bounds[0] < 1 < self.bounds[1]):
            raise ValueError(f"bounds {list(self.bounds)} must satisfy 0 < L < 1 < U")
        return self


class Substrata(_Strict):
    """Split each risk stratum into up to k substrata by k-means on study variables (Step I)."""

    variables: list[str] = Field(min_length=1)  # numeric study variables, standardized
    k: int = Field(default=2, ge=2, le=20)
    min_records: int = Field(default=30, ge=2)  # fewer clusters where a stratum is small


class MasscSection(_Strict):
    enabled: bool = True
    strata_merge: dict[Literal["U", "D", "T", "O"], str] = {}  # e.g. {D: NU, T: NU, O: NU}
    substrata: Substrata | None = None
    psi_max: float = Field(default=0.25, gt=0.0, le=0.25)
    phi_min: float = Field(default=0.5, ge=0.5, lt=1.0)
    # Budgets of the bias (8a) and variance (8b) constraints of each study total theta_z:
    # - "sampling" (default): (8a) <= bias_share * V_z and (8b) <= variance_share * V_z, V_z the
    #   Taylor sampling variance of theta_z in the original design: the treatment adds at most
    #   these shares of the sampling variance, whatever the size of the file;
    # - "relative" (paper 000, eq. 7): (8a) <= alpha_share * epsilon^2 * theta_z^2 and
    #   (8b) <= (1 - alpha_share) * epsilon^2 * theta_z^2.
    loss_scale: Literal["sampling", "relative"] = "sampling"
    bias_share: float = Field(default=0.05, gt=0.0, le=1.0)
    variance_share: float = Field(default=0.05, gt=0.0, le=1.0)
    epsilon: float = Field(default=0.15, gt=0.0, lt=1.0)  # relative: target max RRMSE
    alpha_share: float = Field(default=0.5, gt=0.0, lt=1.0)  # relative: alpha = share * eps^2
    # strata whose disclosure cost a_h (mean over the stratum of r_k / F_k, eq. 9/10) is at
    # most this get no treatment (psi 0, phi 1) while delta allows: treatment follows risk.
    # When delta exceeds gates.delta_max they are treated, then the budgets are raised
    negligible_risk: float = Field(default=0.01, ge=0.0, lt=1.0)
    importance: dict[str, float] = {}  # distance weights for donor search
    donor_restrictions: list[str] = []  # donors must share these columns
    calibration: CalibrationSpec = CalibrationSpec(method="raking")
    replications: int = Field(default=20, ge=0, le=1000)


class Bound(_Strict):
    percentile: float | None = Field(default=None, gt=0.0, lt=100.0)
    value: float | None = None
    min_count: int | None = Field(default=None, ge=1)
    replace: Literal["threshold", "mean"] = "threshold"

    @model_validator(mode="after")
    def _exactly_one(self) -> Bound:
        given = [k for k in ("percentile", "value", "min_count") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(
                f"give exactly one of percentile, value, min_count (got {given or 'none'})"
            )
        return self


class TopcodeRule(_Strict):
    upper: Bound | None = None
    lower: Bound | None = None
    by: list[str] = []

    @model_validator(mode="after")
    def _something(self) -> TopcodeRule:
        if self.upper is None and self.lower is None:
            raise ValueError("give upper, lower or both")
        return self


class TopcodeSection(_Strict):
    """Top/bottom-coding rules by column: `topcode: {income: {upper: ...}, enabled: true}`."""

    enabled: bool = True
    columns: dict[str, TopcodeRule] = {}

    @model_validator(mode="before")
    @classmethod
    def _columns_inline(cls, v: Any) -> Any:
        if isinstance(v, dict) and "columns" not in v:
            rest = {k: r for k, r in v.items() if k != "enabled"}
            return {**({"enabled": v["enabled"]} if "enabled" in v else {}), "columns": rest}
        return v


class RiskSection(_Strict):
    enabled: bool = True
    loglinear: bool = True
    interactions: bool | list[tuple[str, str]] = False  # two-way terms of the log-linear model


class StagesSection(_Strict):
    risk: RiskSection = RiskSection()
    swap: SwapSection | None = None
    prb: PrbSection | None = None
    massc: MasscSection | None = None
    topcode: TopcodeSection = TopcodeSection()

    def active(self, name: str) -> Any:
        """The section of stage `name` when it is present and enabled, else None."""
        section = getattr(self, name, None)
        if section is None or not getattr(section, "enabled", True):
            return None
        if isinstance(section, TopcodeSection) and not section.columns:
            return None
        return section


class ModelSpec(_Strict):
    """An analysis model the release must keep: a survey-weighted GLM."""

    formula: str
    family: Literal["gaussian", "binomial", "quasibinomial", "poisson"] = "gaussian"

    @field_validator("formula")
    @classmethod
    def _parses(cls, v: str) -> str:
        parse_formula(v)
        return v

    def columns(self) -> list[str]:
        return parse_formula(self.formula).variables


class UtilitySection(_Strict):
    """What analysts will do with the file: estimates by domain and models, kept and gated.
    A domain is a column (a key uses its published coding) or a list of columns (a crossing);
    None: every key and every pair of keys."""

    domains: list[str | list[str]] | None = None
    models: list[ModelSpec] = []

    def domain_list(self, keys: list[str]) -> list[list[str]]:
        if self.domains is None:
            return [[k] for k in keys] + [[a, b] for i, a in enumerate(keys) for b in keys[i + 1 :]]
        return [[d] if isinstance(d, str) else list(d) for d in self.domains]


class UtilityGates(_Strict):
    """Analytic validity of the published file against the original (Karr overlap of 95% CIs,
    standardized bias in original SEs, model coefficients)."""

    overlap_median_min: float = Field(default=0.9, ge=0.0, le=1.0)
    overlap_p5_min: float = Field(default=0.5, ge=0.0, le=1.0)
    share_beyond_2se_max: float = Field(default=0.05, ge=0.0, le=1.0)
    model_overlap_min: float = Field(default=0.5, ge=0.0, le=1.0)


class GatesSection(_Strict):
    delta_max: float | None = Field(default=None, gt=0.0, le=1.0)
    epsilon_max: float | None = Field(default=None, gt=0.0)
    xi: float | None = Field(default=None, gt=1 / 3, lt=0.5)
    se_ratio: tuple[float, float] | None = None
    max_unique_share: float | None = Field(default=None, gt=0.0, le=1.0)
    # share of original PSUs that records' sets of zero replicate weights give away
    max_psu_recoverable: float = Field(default=0.5, ge=0.0, le=1.0)
    utility: UtilityGates = UtilityGates()

    @field_validator("se_ratio")
    @classmethod
    def _ratio(cls, v: tuple[float, float] | None) -> tuple[float, float] | None:
        if v is not None and not (0 < v[0] < 1 < v[1]):
            raise ValueError(f"se_ratio {list(v)} must be [low, high] with 0 < low < 1 < high")
        return v


class ApprovalSection(_Strict):
    required: bool = True
    timeout_s: int = Field(default=7 * 24 * 3600, ge=1)


class ReleaseSpec(_Strict):
    release: ReleaseSection
    design: DesignSection
    variables: VariablesSection
    edits: list[EditRule] = Field(default=[], max_length=EDITS_MAX)
    stages: StagesSection = StagesSection()
    gates: GatesSection = GatesSection()
    utility: UtilitySection = UtilitySection()
    approval: ApprovalSection = ApprovalSection()
    intruder: IntruderSection = IntruderSection()

    @model_validator(mode="after")
    def _stages_have_their_design(self) -> ReleaseSpec:
        """A stage that needs design columns the spec does not declare is an error naming it."""
        swap = self.stages.swap
        if swap is not None and swap.enabled:
            need = [
                f"design.{f}" for f in ("strata", "psu", "segment") if not getattr(self.design, f)
            ]
            if need:
                raise ValueError(
                    f"stages.swap.enabled: the segment swap needs {', '.join(need)} (segments "
                    "nested in PSUs nested in strata); declare them, or set stages.swap.enabled: "
                    "false (the public file then gets a pseudo design, design.pseudo)"
                )
        return self

    # ------------------------------------------------------------ checks against the data
    def columns_named(self) -> dict[str, str]:
        """Every column the spec names -> the field that names it."""
        named: dict[str, str] = {}
        d = self.design
        for f in ("weight", "strata", "psu", "segment", "household"):
            if getattr(d, f):
                named[getattr(d, f)] = f"design.{f}"
        if d.replicate_weights and isinstance(d.replicate_weights.columns, list):
            for i, c in enumerate(d.replicate_weights.columns):
                named[c] = f"design.replicate_weights.columns[{i}]"
        v = self.variables
        for i, c in enumerate(v.direct_identifiers):
            named[c] = f"variables.direct_identifiers[{i}]"
        for i, k in enumerate(v.keys):
            named[k.name] = f"variables.keys[{i}]"
        for i, s in enumerate(v.sensitive):
            named[s.name] = f"variables.sensitive[{i}].name"
        for i, c in enumerate(v.study):
            named[c] = f"variables.study[{i}]"
        for part in ("keep", "drop"):
            for i, c in enumerate(getattr(v.other, part)):
                named.setdefault(c, f"variables.other.{part}[{i}]")
        for i, e in enumerate(self.edits):
            for c in e.columns():
                named.setdefault(c, f"edits[{i}]")
        s = self.stages
        if s.swap:
            for i, c in enumerate(s.swap.matching):
                named.setdefault(c, f"stages.swap.matching[{i}]")
        if s.prb:
            for i, c in enumerate(s.prb.variables):
                named.setdefault(c, f"stages.prb.variables[{i}]")
            for c in s.prb.partition:
                named.setdefault(c, f"stages.prb.partition.{c}")
            for i, c in enumerate(s.prb.cells or []):
                named.setdefault(c, f"stages.prb.cells[{i}]")
        if s.massc:
            for i, k in enumerate(s.massc.calibration.controls):
                named.setdefault(k.name, f"stages.massc.calibration.controls[{i}]")
            for c in s.massc.donor_restrictions:
                named.setdefault(c, "stages.massc.donor_restrictions")
            for i, c in enumerate(s.massc.substrata.variables if s.massc.substrata else []):
                named.setdefault(c, f"stages.massc.substrata.variables[{i}]")
        for c in self.intruder.unknown:
            named.setdefault(c, f"intruder.unknown.{c}")
        for i, dom in enumerate(self.utility.domains or []):
            for c in [dom] if isinstance(dom, str) else dom:
                named.setdefault(c, f"utility.domains[{i}]")
        for i, m in enumerate(self.utility.models):
            for c in m.columns():
                named.setdefault(c, f"utility.models[{i}].formula")
        for col, rule in s.topcode.columns.items():
            named.setdefault(col, f"stages.topcode.{col}")
            for c in rule.by:
                named.setdefault(c, f"stages.topcode.{col}.by")
        return named

    def unpublished_columns(self, masked_design: bool, drop: Sequence[str] = ()) -> list[str]:
        """The columns that may never be published: direct identifiers, segment, household, the
        stages' drop_public columns, and the original strata/PSU unless the design is masked or
        the spec publishes its labels (internal '__' columns are never published either)."""
        d = self.design
        v = self.variables
        gone = set(v.direct_identifiers) | set(v.other.drop) | {d.segment, d.household} | set(drop)
        if not masked_design and not d.publish_design_labels:
            gone |= {d.strata, d.psu}
        return sorted(c for c in gone if c)

    def classification(self, columns: Sequence[str]) -> dict[str, str]:
        """Each column of the data the spec classifies -> its class: key, study, sensitive,
        weight, strata, psu, segment, household, replicate, identifier, keep or drop
        (issue 13 item 3). A column missing from the result is unclassified."""
        d, v = self.design, self.variables
        out: dict[str, str] = {}
        for c in v.other.keep:
            out[c] = "keep"
        for c in self.replicate_columns(list(columns)):
            out[c] = "replicate"
        for f in ("weight", "strata", "psu", "segment", "household"):
            if getattr(d, f):
                out[getattr(d, f)] = f
        for c in v.study:
            out[c] = "study"
        for s in v.sensitive:
            out[s.name] = "sensitive"
        for c in v.key_names:
            out[c] = "key"
        for c in v.other.drop:
            out[c] = "drop"
        for c in v.direct_identifiers:
            out[c] = "identifier"
        present = set(map(str, columns))
        return {c: k for c, k in out.items() if c in present}

    def published_columns(
        self,
        columns: Sequence[str],
        masked_design: bool,
        drop: Sequence[str] = (),
        design_columns: Sequence[str] = (),
    ) -> list[str]:
        """The columns a public file carries, in data order: keys, study, sensitive, other.keep,
        the weight and replicate weights, strata/PSU when masked or published by the spec, and
        the design_columns a stage built for the public file (pseudo strata, PSUs, replicates);
        never an unclassified, unpublished or internal '__' column."""
        cls = self.classification(columns)
        gone = set(self.unpublished_columns(masked_design, drop)) - set(design_columns)
        ok = {"key", "study", "sensitive", "keep", "weight", "replicate", "strata", "psu"}
        built = set(design_columns)
        return [
            c
            for c in columns
            if (cls.get(str(c)) in ok or c in built)
            and c not in gone
            and not str(c).startswith("__")
        ]

    def replicate_columns(self, df: pd.DataFrame | Sequence[str]) -> list[str]:
        """The replicate weight columns of a frame (or of a list of column names)."""
        rw = self.design.replicate_weights
        cols = df.columns if isinstance(df, pd.DataFrame) else df
        return rw.resolve(list(cols)) if rw else []

    def absent_columns(
        self, columns: Sequence[str], only: Sequence[str] | None = None
    ) -> list[str]:
        """'field: column 'sexx' is not in the input file (did you mean 'sex'?); ...' for each
        column the spec names (or each of `only`) that the input's columns lack."""
        named = self.columns_named()
        have = set(map(str, columns))
        wanted = list(named) if only is None else list(dict.fromkeys(only))
        out = []
        for i, col in enumerate(c for c in wanted if c not in have):
            hint = did_you_mean(col, columns) if i < SUGGESTIONS_MAX else ""
            out.append(
                f"{named.get(col, 'release.input')}: column '{col}' is not in the input "
                f"file{hint}; fix the name or add the column (columns: {_short(columns)})"
            )
        return out

    def check_data(self, df: pd.DataFrame) -> None:
        """Raise SpecError listing every way the data does not fit the spec."""
        problems: list[str] = []
        if len(df) == 0:
            raise SpecError(
                ["release.input: the input file has no records; point it at the survey file"]
            )
        reserved = [str(c) for c in df.columns if str(c).startswith("__")]
        if reserved:
            problems.append(
                f"release.input: columns {_short(reserved)} begin with '__', which the release "
                "keeps for its own working columns (they would vanish from the public file); "
                "rename them in the input"
            )
        problems += self.absent_columns(list(df.columns))
        d = self.design
        if d.replicate_weights and isinstance(d.replicate_weights.columns, str):
            if not self.replicate_columns(df):
                problems.append(
                    f"design.replicate_weights.columns: pattern '{d.replicate_weights.columns}' "
                    "matches no column; fix the pattern or remove replicate_weights"
                )
        design_cols = [c for c in (d.strata, d.psu, d.segment) if c and c in df.columns]
        for c in design_cols:
            miss = df[c].isna().to_numpy()
            if miss.any():
                problems.append(
                    f"design: column '{c}' is missing in {_rows(miss)}; every record needs its "
                    "design label: correct those records or drop them first"
                )
        problems += self._value_problems(df)
        if d.strata in df.columns and (d.psu in df.columns or d.psu is None):
            n_psu = (
                df.groupby(d.strata, observed=True)[d.psu].nunique()
                if d.psu
                else df.groupby(d.strata, observed=True).size()  # each record its own PSU
            )
            single = n_psu[n_psu < 2]
            if len(single):
                problems.append(
                    f"design.strata: {len(single)} strata have a single PSU "
                    f"({_short(single.index)}); collapse each with a neighbouring stratum"
                )
        for i, s in enumerate(self.variables.sensitive):
            if s.name not in df.columns:
                continue
            listed = {category_label(k) for k in s.sensitivity}
            if s.bins is None:
                seen = {category_label(v) for v in pd.unique(df[s.name].dropna())}
                missing = sorted(seen - listed)
                if missing:
                    problems.append(
                        f"variables.sensitive[{i}].sensitivity: categories {missing[:8]} of "
                        f"'{s.name}' have no sensitivity score; add them"
                    )
            miss = df[s.name].isna().to_numpy()
            if miss.any() and "nan" not in listed:
                problems.append(
                    f"variables.sensitive[{i}].sensitivity: '{s.name}' is missing in "
                    f"{_rows(miss)}; score the missing values as a category of their own "
                    "(add `nan: <score>` to its sensitivity map)"
                )
        problems += self.column_problems(df)
        if problems:
            raise SpecError(problems)

    def column_problems(self, df: pd.DataFrame) -> list[str]:
        """Leaks the columns would open (issue 13 item 3, issue 15 items 5-7): unclassified
        columns, replicate weights the pattern misses, a published column that determines a
        dropped design label, a published column tied by an edit rule to a PRB-treated one."""

        return column_problems(self, df)

    def _value_problems(self, df: pd.DataFrame) -> list[str]:
        """Values the release cannot use, one message per column and kind: weights and replicate
        weights numeric, present, finite, below 1e15, weight > 0 and replicates >= 0; numeric
        keys and study variables finite and below 1e15 (missing values follow the missing-value
        policy); weights that sum to the sample size (normalised) unless declared."""
        d, v = self.design, self.variables
        out: list[str] = []
        reps = [c for c in self.replicate_columns(df) if c in df.columns]
        weights = ([d.weight] if d.weight in df.columns else []) + reps
        for c in weights:
            field = "design.weight" if c == d.weight else "design.replicate_weights"
            s = df[c]
            if not pd.api.types.is_numeric_dtype(s) or pd.api.types.is_bool_dtype(s):
                x = pd.to_numeric(s, errors="coerce")
                bad = (x.isna() & s.notna()).to_numpy()
                out.append(
                    f"{field}: column '{c}' is not numeric ({_rows(bad, s)}); "
                    "give the weights as numbers"
                )
                continue
            x = _floats(s)
            if _within(x, positive=c == d.weight):
                continue  # no value to name
            out += _finite(field, c, x, "weight", missing_ok=False)
            ok = np.isfinite(x) & (np.abs(x) <= MAX_VALUE)
            if c == d.weight and (ok & (x == 0)).any():
                out.append(self._zero_weights(ok & (x == 0)))
            low = ok & (x < 0)
            if low.any():
                need = "> 0" if c == d.weight else ">= 0"
                out.append(
                    f"{field}: column '{c}' has values that are not {need} ({_rows(low, s)}); "
                    f"every {'weight' if c == d.weight else 'replicate weight'} must be {need}"
                )
        numeric = [k.name for k in v.keys] + list(v.study) + [s.name for s in v.sensitive]
        fields = self.columns_named()
        for c in dict.fromkeys(numeric):
            if c not in df.columns or c in weights:
                continue
            s = df[c]
            if pd.api.types.is_numeric_dtype(s) and not pd.api.types.is_bool_dtype(s):
                x = _floats(s)
                if not _within(x, missing_ok=True):
                    out += _finite(fields.get(c, c), c, x, "value", missing_ok=True)
        if d.weight in df.columns and not d.weights_normalised and len(df) > 1:
            w = pd.to_numeric(df[d.weight], errors="coerce").to_numpy(dtype=float)
            total = float(np.nansum(np.where(np.isfinite(w), w, np.nan)))
            n = len(df)
            if abs(total / n - 1.0) <= 0.01 or abs(total - 1.0) <= 0.01:
                scale = "the sample size" if abs(total / n - 1.0) <= 0.01 else "1"
                out.append(
                    f"design.weight: the weights of '{d.weight}' sum to {total:.6g}, about "
                    f"{scale} ({n} records): they look normalised, not population-scale. The "
                    "log-linear risk estimates population frequencies from the weights and would "
                    "take the sample for the population (every sample unique a population "
                    "unique). Give weights that sum to the population size (multiply them and "
                    "the replicate weights by N / sum of weights), or declare "
                    "design.weights_normalised: true to release with these weights anyway"
                )
        return out

    def _zero_weights(self, zero: np.ndarray) -> str:
        """Records of weight 0: what they are and the two ways on (drop them, with the command
        that does it on this input, or release with a weight that covers them)."""
        w, n = self.design.weight, int(zero.sum())
        src = Path(self.release.input or "INPUT.parquet")
        dst = src.with_name(f"{src.stem}-{w}-positive{src.suffix}")
        if src.suffix.lower() == ".csv":  # read as text: codes such as 0001 stay as they are
            enc = (
                "" if self.release.encoding == "utf-8" else f", encoding={self.release.encoding!r}"
            )
            read = f"pd.read_csv({str(src)!r}, dtype=str, keep_default_na=False{enc})"
            keep = f"pd.to_numeric(d[{w!r}]) > 0"
            write = f"to_csv({str(dst)!r}, index=False{enc})"
        else:
            read, keep = f"pd.read_parquet({str(src)!r})", f"d[{w!r}] > 0"
            write = f"to_parquet({str(dst)!r}, index=False)"
        return (
            f"design.weight: column '{w}' is 0 in {n} record{'s' * (n > 1)} ({_rows(zero)}). A "
            "weight of 0 puts a record outside the population the weight estimates (NHANES gives "
            "its MEC weight 0, on purpose, to persons interviewed but not examined); the release "
            "cannot keep such records (they would count in no estimate, variance or risk "
            'measure). Either (1) drop them before the release: python -c "import pandas as pd; '
            f'd = {read}; d[{keep}].{write}" and point release.input at {dst.name} (written '
            "beside the input); or (2) if they belong in the public file, name in design.weight "
            "a weight that covers them (NHANES: the interview weight, with its replicate weights)"
        )


MAX_VALUE = 1e15  # a weight or study value beyond this is a code or an overflow, not a value


def _rows(mask: np.ndarray, values: pd.Series | None = None) -> str:

    return rows_text(mask, values)


def _floats(s: pd.Series) -> np.ndarray:
    """s as floats, missing as NaN (a float64 column's values as they are, not copied)."""
    return s.to_numpy() if s.dtype == np.float64 else s.to_numpy(dtype=float, na_value=np.nan)


def _within(x: np.ndarray, positive: bool | None = None, missing_ok: bool = False) -> bool:
    """Whether no value of x needs a message: finite (missing allowed when missing_ok), within
    MAX_VALUE, and > 0 (positive True) or >= 0 (False). Two reductions and no temporary (71
    weight columns of 1M records: 5.5 s of the checks' ten passes each before)."""
    if not len(x):
        return False
    lo, hi = (np.fmin.reduce(x), np.fmax.reduce(x)) if missing_ok else (x.min(), x.max())
    if not (-MAX_VALUE <= lo and hi <= MAX_VALUE):  # (NaN: False)
        return False
    return True if positive is None else bool(lo > 0 if positive else lo >= 0)


def _finite(field: str, col: str, x: np.ndarray, what: str, missing_ok: bool) -> list[str]:
    """Messages for missing (unless allowed), infinite and implausibly large values of x."""
    out = []
    nan, inf = np.isnan(x), np.isinf(x)
    huge = np.isfinite(x) & (np.abs(x) > MAX_VALUE)
    fix = "correct those values" + (
        " (or declare the code under variables.missing if it means no value)" if missing_ok else ""
    )
    if nan.any() and not missing_ok:
        out.append(
            f"{field}: column '{col}' is missing in {_rows(nan)}; every {what} must be given: "
            "correct those records or drop them first"
        )
    if inf.any():
        out.append(f"{field}: column '{col}' is infinite in {_rows(inf)}; {fix}")
    if huge.any():
        out.append(
            f"{field}: column '{col}' has values beyond {MAX_VALUE:g} in absolute value "
            f"({_rows(huge, pd.Series(x))}): a code or an overflow, not a {what}; {fix}"
        )
    return out


_FIXES = {
    "missing": "required; add it",
    "greater_than": "too small",
    "less_than": "too large",
    "greater_than_equal": "too small",
    "less_than_equal": "too large",
}


def _fields_at(model: Any, loc: Sequence[Any]) -> list[str]:
    """The fields of the model a validation error's location ends in (ReleaseSpec's section,
    a stage, an edit rule of the rule the location names...); [] when it is no model."""
    origin, args = get_origin(model), get_args(model)
    if origin is Annotated:
        return _fields_at(args[0], loc)
    if origin in (Union, UnionType):
        members = [a for a in args if a is not type(None)]
        for m in members:  # a discriminated union names its member: edits.0.between.colum
            tags = [f.annotation for f in getattr(m, "model_fields", {}).values()]
            if loc and any(get_origin(t) is Literal and loc[0] in get_args(t) for t in tags):
                return _fields_at(m, loc[1:])
        return next((f for m in members if (f := _fields_at(m, loc))), [])
    if origin in (list, tuple):
        return _fields_at(args[0], loc[1:]) if loc and isinstance(loc[0], int) else []
    if origin is dict:
        return _fields_at(args[1], loc[1:]) if loc else []
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        return []
    if not loc:
        return list(model.model_fields)
    field = model.model_fields.get(str(loc[0]))
    return _fields_at(field.annotation, loc[1:]) if field is not None else []


def _unknown_key(loc: tuple[Any, ...]) -> str:
    """Why a key is refused and what to write: the field it likely misspells, else the fields
    its section has."""
    parts = [p for p in loc if not str(p).startswith(("function-", "tagged-union"))]
    fields = _fields_at(ReleaseSpec, parts[:-1])
    hint = did_you_mean(str(parts[-1]), fields) if parts else ""
    if hint:
        return f"unknown key{hint}; fix its spelling, or remove it"
    known = f" (keys here: {', '.join(fields)})" if fields else ""
    return f"unknown key; remove it or check its spelling{known}"


def _format_validation(err: ValidationError) -> list[str]:
    out = []
    for e in err.errors():
        parts = [str(p) for p in e["loc"] if not str(p).startswith(("function-", "tagged-union"))]
        if parts[:3] == ["stages", "topcode", "columns"]:  # written inline in the YAML
            del parts[2]
        loc = ".".join(parts)
        hint = _FIXES.get(e["type"], "")
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":  # "Extra inputs are not permitted" says less
            msg = _unknown_key(e["loc"])
        if not loc and (
            m := re.match(r"^([A-Za-z_][\w.\[\]]*): ", msg)
        ):  # a model check naming its field
            loc, msg = m.group(1), msg[m.end() :]
        out.append(f"{loc or '<spec>'}: {msg}" + (f" ({hint})" if hint and hint not in msg else ""))
    return out


def spec_problems(spec: ReleaseSpec) -> list[str]:
    """Settings that are each valid but contradict one another ('field: what and fix')."""
    out = []
    prb, gates = spec.stages.active("prb"), spec.gates
    if prb is not None and gates.xi is not None and gates.xi < prb.xi:
        out.append(
            f"gates.xi: {gates.xi:g} is below stages.prb.xi ({prb.xi:g}); PRB bounds the "
            "identification risk by stages.prb.xi, so the gate would fail after the whole run: "
            f"lower stages.prb.xi to at most {gates.xi:g}, or raise gates.xi"
        )
    if spec.stages.active("massc") is not None and not spec.variables.sensitive:
        out.append(
            "variables.sensitive: MASSC (stages.massc) needs at least one sensitive variable with "
            "its sensitivity scores (its disclosure costs come from GenMASSC risk scores, e.g. "
            "{name: diabetes, sensitivity: {1: 1.0, 0: 0.0}}); add one, or set "
            "stages.massc.enabled: false"
        )
    return out + _gate_problems(spec)


def _gate_problems(spec: ReleaseSpec) -> list[str]:
    """Gates set for a stage that is off and that the published file cannot measure: the
    release would run whole and fail on them (issue 34 item 7). gates.xi with PRB off stays:
    the assessment's attacks measure the re-identification of the published file whatever
    stages ran. gates.delta_max with MASSC off stays when sensitive variables are declared
    (delta of the published file: the GenMASSC scores of the records published with their
    original keys); without any, delta scores every record 1 and only counts the records no
    stage changed, which without MASSC's substitution and subsampling stays far above any
    limit (1.0 when nothing changes a key: the NMIHS run of issue 34)."""
    out = []
    massc_off = spec.stages.active("massc") is None
    if spec.gates.delta_max is not None and massc_off and not spec.variables.sensitive:
        off = "stages.massc.enabled: false" if spec.stages.massc is not None else "no stages.massc"
        out.append(
            f"gates.delta_max: MASSC is off ({off}) and variables.sensitive is empty, so "
            "delta would score every record 1 and be the share of records published with "
            "their original keys (1.0 when no stage changes a key): the gate would fail "
            "after the whole run; drop gates.delta_max (gates.xi and "
            "gates.max_unique_share gate the re-identification of the published file), or "
            "declare a sensitive variable with its sensitivity scores and enable MASSC"
        )
    return out


def seed_warnings(seed: int) -> list[str]:
    """Why a release seed is guessable: under 32 bits of entropy, or a date (YYYYMMDD,
    YYMMDD or a year). The seed orders and draws every treatment; one that can be guessed
    lets an intruder re-run the draws."""
    text = str(seed)
    out = []
    if seed < 2**32:
        out.append(f"release.seed has under 32 bits ({seed.bit_length()} bits)")
    for fmt in ("%Y%m%d", "%y%m%d", "%Y"):
        try:
            datetime.strptime(text, fmt)
        except ValueError:
            continue
        out.append("release.seed reads as a date")
        break
    if out:
        out.append(
            "draw a seed an intruder cannot guess, e.g. python -c 'import secrets; "
            "print(secrets.randbits(64))', and keep it confidential"
        )
    return out


def with_year(spec: ReleaseSpec, year: int | None) -> ReleaseSpec:
    """The spec with release.year replaced (a --year override), validated like the YAML's."""
    if year is None:
        return spec
    try:
        ReleaseSection.model_validate({**spec.release.model_dump(), "year": year})
    except ValidationError as err:
        raise SpecError(
            [p.replace("year:", "release.year (--year):", 1) for p in _format_validation(err)]
        ) from None
    spec.release.year = year
    return spec


class _SpecLoader(yaml.SafeLoader):
    """YAML as the spec means it: only true/false are booleans (yes, no, on, off stay text, as
    in YAML 1.2), and a key given twice in one mapping is an error, not the last one winning."""


_SpecLoader.yaml_implicit_resolvers = {
    first: [r for r in resolvers if r[0] != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_SpecLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool",
    re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
    list("tTfF"),
)


def _expanded_nodes(node: yaml.Node, memo: dict[int, int] | None = None) -> int:
    """The nodes of the YAML tree with every alias expanded, each shared node counted once per
    use but walked once (an alias bomb of 9 levels is counted in microseconds)."""
    memo = {} if memo is None else memo
    if id(node) in memo:
        return memo[id(node)]
    memo[id(node)] = 1  # a recursive alias counts once
    if isinstance(node, yaml.MappingNode):
        n = 1 + sum(_expanded_nodes(k, memo) + _expanded_nodes(v, memo) for k, v in node.value)
    elif isinstance(node, yaml.SequenceNode):
        n = 1 + sum(_expanded_nodes(v, memo) for v in node.value)
    else:
        n = 1
    memo[id(node)] = n
    return n


def _duplicate_keys(
    node: yaml.Node, path: str = "", seen_nodes: set[int] | None = None
) -> list[str]:
    """Keys given twice in a mapping of the composed YAML tree, with their lines (a node shared
    through aliases is checked once)."""
    seen_nodes = set() if seen_nodes is None else seen_nodes
    if id(node) in seen_nodes:
        return []
    seen_nodes.add(id(node))
    out: list[str] = []
    if isinstance(node, yaml.MappingNode):
        seen: dict[Any, int] = {}
        for k, v in node.value:
            key = k.value if isinstance(k, yaml.ScalarNode) else None
            here = f"{path}.{key}" if path else str(key)
            if key is not None and key != "<<":
                line = k.start_mark.line + 1
                if key in seen:
                    out.append(
                        f"{here}: the key '{key}' is given twice (lines {seen[key]} and {line}); "
                        "keep one"
                    )
                else:
                    seen[key] = line
            out += _duplicate_keys(v, here, seen_nodes)
    elif isinstance(node, yaml.SequenceNode):
        for i, v in enumerate(node.value):
            out += _duplicate_keys(v, f"{path}[{i}]", seen_nodes)
    return out


def read_spec_yaml(text: str) -> Any:
    """The spec's YAML text as Python data (see _SpecLoader); SpecError on a duplicated key."""
    if len(text) > SPEC_BYTES_MAX:
        raise SpecError(
            [
                f"<spec>: the file has {len(text):,} characters, more than a spec needs "
                f"({SPEC_BYTES_MAX:,} at most); check that the right file is given"
            ]
        )
    loader = _SpecLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        n = _expanded_nodes(node)
        if n > SPEC_NODES_MAX:
            raise SpecError(
                [
                    f"<spec>: its aliases expand to {n:,} YAML nodes (at most "
                    f"{SPEC_NODES_MAX:,}); write the values out or remove the aliases (&, *)"
                ]
            )
        dup = _duplicate_keys(node)
        if dup:
            raise SpecError(dup)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def parse_spec(data: dict[str, Any], base_dir: Path | None = None) -> ReleaseSpec:
    """Validate a spec mapping; relative paths are resolved against base_dir."""
    if not isinstance(data, dict):
        raise SpecError(
            ["<spec>: the YAML file must be a mapping with release, design, variables, ..."]
        )
    try:
        spec = ReleaseSpec.model_validate(data)
    except ValidationError as err:
        raise SpecError(_format_validation(err)) from None
    problems = spec_problems(spec)
    if problems:
        raise SpecError(problems)
    if base_dir is not None:
        rel = spec.release
        if rel.input is not None and not rel.input.is_absolute():
            rel.input = (base_dir / rel.input).resolve()
        if not rel.output_dir.is_absolute():
            rel.output_dir = (base_dir / rel.output_dir).resolve()
    return spec


def load_spec(path: str | Path) -> ReleaseSpec:
    """Read and validate a YAML release spec."""
    path = Path(path)
    if not path.is_file():
        raise SpecError([f"<spec>: no file at {path}; give the path of a release spec YAML"])
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        raise SpecError(
            [
                f"<spec>: {path} is not UTF-8 text (byte {e.start} cannot be decoded); save it "
                "as UTF-8 (any editor's 'save with encoding')"
            ]
        ) from None
    try:
        data = read_spec_yaml(text)
    except yaml.YAMLError as e:  # the faulty line (not always the one YAML marks), shown
        raise SpecError([yaml_error_text(text, e, str(path))]) from None
    return parse_spec(data, base_dir=path.parent.resolve())
