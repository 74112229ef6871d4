"""The statistics of a release (no Prefect, no Great Expectations). Importing it first pins
the CPU kernels (sdl_design.cpu), so that a release's bytes do not depend on the CPU."""

from sdl_design.cpu import pin_kernels

pin_kernels()
