"""sdl_design pins the CPU kernels before numpy loads (sdl_design.cpu): OpenBLAS's Haswell
kernels and numpy's dispatch without AVX-512, so that the demo's bytes (test_byte_identity)
are the same on an AVX-512 and an AVX2 machine. Each case runs in a fresh interpreter."""

import os
import platform
import subprocess
import sys

import pytest

from sdl_design.cpu import AVX512, _has_avx2, cpu_flags

pytestmark = [
    pytest.mark.flow,  # subprocess runs
    pytest.mark.skipif(
        platform.machine().lower() not in ("x86_64", "amd64") or not _has_avx2(),
        reason="the pins are for x86-64 machines with AVX2",
    ),
]

PROBE = (
    "import os, numpy\n"
    "from numpy._core._multiarray_umath import __cpu_features__ as f\n"
    "print(os.environ.get('OPENBLAS_CORETYPE'), f.get('X86_V4'), "
    "numpy.__config__.CONFIG['Build Dependencies']['blas']['name'])\n"
)


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    base = {
        k: v
        for k, v in os.environ.items()
        if k not in ("OPENBLAS_CORETYPE", "NPY_DISABLE_CPU_FEATURES")
    }
    return subprocess.run(
        [sys.executable, "-W", "error::RuntimeWarning", "-c", code],
        env={**base, **env},
        capture_output=True,
        text=True,
    )


def _avx512() -> bool:
    return "avx512f" in cpu_flags()


def test_importing_sdl_design_first_pins_the_kernels():
    out = _run("import sdl_design\n" + PROBE)
    assert out.returncode == 0, out.stderr
    coretype, v4, blas = out.stdout.split()
    assert coretype == "Haswell" and v4 == "False" and "openblas" in blas
    assert os.environ.get("NPY_DISABLE_CPU_FEATURES", AVX512) == AVX512  # this process's too


def test_a_value_in_the_environment_is_kept():
    out = _run("import sdl_design\n" + PROBE, OPENBLAS_CORETYPE="Zen")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == "Zen"


def test_numpy_loaded_first_on_an_avx512_machine_is_warned_about():
    """Too late to pin: on an AVX-512 CPU the import warns, naming the fix."""
    out = _run("import numpy\nimport sdl_design\n")
    assert (out.returncode != 0) == _avx512()
    if _avx512():
        assert "import sdl_design first, or set OPENBLAS_CORETYPE=Haswell" in out.stderr
