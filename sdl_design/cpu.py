"""One set of floating-point kernels on every x86-64 machine with AVX2, so that a release's
bytes do not depend on the CPU it ran on.

OpenBLAS picks its kernels by CPU (SkylakeX kernels on an AVX-512 machine, Haswell kernels on
an AVX2 one) and numpy dispatches its loops (exp, log, sorts) to AVX-512 code where it can;
both change the last bits of sums and functions, and a release's calibrated weights and
published files with them (the demo's puf.csv differs between an AVX-512 AMD EPYC and an AVX2
machine). pin_kernels, run when sdl_design is first imported, asks both for their AVX2 code
(OPENBLAS_CORETYPE=Haswell; NPY_DISABLE_CPU_FEATURES with the AVX-512 groups) before numpy
loads; a value already set in the environment is kept. Other architectures (ARM) run their
own kernels: their bytes may differ from x86-64's.
"""

from __future__ import annotations

import os
import platform
import sys
import warnings
from importlib.metadata import PackageNotFoundError, version

AVX512 = "X86_V4 AVX512_ICL AVX512_SPR"  # numpy >= 2.4's AVX-512 dispatch groups


def cpu_flags() -> set[str]:
    """The CPU's flags (Linux's /proc/cpuinfo; empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return set()
    return set(line.partition(":")[2].split())


def _has_avx2() -> bool:
    return "avx2" in cpu_flags()


def _numpy_at_least(major: int, minor: int) -> bool:
    try:
        parts = version("numpy").split(".")
        return (int(parts[0]), int(parts[1])) >= (major, minor)
    except (PackageNotFoundError, ValueError, IndexError):
        return False


def _runs_avx512() -> bool:
    """The loaded numpy dispatches to AVX-512 loops, or its OpenBLAS was loaded unpinned on
    an AVX-512 CPU."""
    try:
        from numpy._core._multiarray_umath import __cpu_features__ as f
    except ImportError:  # numpy < 2
        return False
    return bool(f.get("AVX512F")) and (
        bool(f.get("X86_V4")) or os.environ.get("OPENBLAS_CORETYPE") is None
    )


def pin_kernels() -> dict[str, str]:
    """Set the kernel pins (returned) unless numpy is already loaded; then warn when it runs
    AVX-512 loops, naming the fix."""
    if platform.machine().lower() not in ("x86_64", "amd64") or not _has_avx2():
        return {}
    if "numpy" in sys.modules:
        if _runs_avx512():
            warnings.warn(
                "numpy was imported before sdl_design and runs AVX-512 kernels: a release's "
                "bytes may then differ from one run on another CPU; import sdl_design first, or "
                f"set OPENBLAS_CORETYPE=Haswell NPY_DISABLE_CPU_FEATURES='{AVX512}'",
                RuntimeWarning,
                stacklevel=2,
            )
        return {}
    pins = {"OPENBLAS_CORETYPE": "Haswell"}
    if _numpy_at_least(2, 4):  # older numpy names its groups otherwise
        pins["NPY_DISABLE_CPU_FEATURES"] = AVX512
    for k, v in pins.items():
        os.environ.setdefault(k, v)
    return pins
