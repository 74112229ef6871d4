"""What the analyst reads: the codebook and the public README (variance estimation, methods)."""

from __future__ import annotations

import pandas as pd

from sdl_design.spec import ReleaseSpec


def codebook(puf: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for c in puf.columns:
        s = puf[c]
        num = pd.api.types.is_numeric_dtype(s)
        vals = pd.unique(s.dropna())
        rows.append(
            {
                "variable": c,
                "type": "numeric" if num else "categorical",
                "dtype": str(s.dtype),
                "n_missing": int(s.isna().sum()),
                "n_distinct": int(len(vals)),
                "min": float(s.min()) if num and len(vals) else None,
                "max": float(s.max()) if num and len(vals) else None,
                "categories": "" if num or len(vals) > 60 else "; ".join(sorted(map(str, vals))),
            }
        )
    return pd.DataFrame(rows)


def variance_notes(
    spec: ReleaseSpec, masked_design: bool, replicate_method: str | None, n_rep: int
) -> str:
    d = spec.design
    lines = [
        f"# {spec.release.name} {spec.release.year}: public-use file",
        "",
        "Files: `puf.parquet` and `puf.csv` (the same records), `codebook.csv` (one row per variable).",
        "",
        "## Estimating variances",
        "",
        f"- Weight: `{d.weight}`. Every estimate must use it.",
    ]
    if masked_design:
        lines += [
            f"- Design variables: `{d.strata}` (pseudo-stratum) and `{d.psu}` (pseudo-PSU). They are masked:",
            "  whole segments were swapped between PSUs to protect geography, chosen so that variance",
            "  estimates change as little as possible. Use them as ordinary strata and PSUs with",
            "  with-replacement (ultimate cluster) Taylor linearization:",
            f"  R survey: `svydesign(ids=~{d.psu}, strata=~{d.strata}, weights=~{d.weight}, nest=TRUE)`;",
            f"  Stata: `svyset {d.psu} [pw={d.weight}], strata({d.strata})`;",
            f"  SUDAAN: `design=wr; nest {d.strata} {d.psu}; weight {d.weight}`.",
        ]
    if n_rep:
        scale = {
            "jkn": "JKn (delete one pseudo-PSU; scale (n_h-1)/n_h per replicate)",
            "jk1": "JK1 (scale (R-1)/R)",
            "brr": "BRR (scale 1/R)",
            "fay": f"Fay BRR with rho = {d.replicate_weights.rho if d.replicate_weights else ''} (scale 1/(R(1-rho)^2))",
            "sdr": "successive difference replication (scale 4/R)",
            "bootstrap": "bootstrap (scale 1/R)",
        }.get(replicate_method or "", replicate_method or "")
        lines += [
            f"- Replicate weights: {n_rep} columns, method {scale}; centre the replicate estimates on",
            "  the full-sample estimate (R survey: `mse = TRUE`).",
        ]
    lines += [
        "",
        "## Disclosure limitation applied",
        "",
        "Key variables may have been perturbed (post-randomization, substitution) and some records",
        "subsampled, with weights calibrated so that totals of the calibration controls are preserved.",
        "Extreme values are top-coded as the codebook shows. Do not attempt to identify any person.",
    ]
    return "\n".join(lines) + "\n"
