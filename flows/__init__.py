"""Prefect flows of a release; sdl_design first, so that the CPU kernels are pinned before
numpy loads (sdl_design.cpu)."""

import sdl_design  # noqa: F401
