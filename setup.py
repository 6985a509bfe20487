"""The one build step pyproject.toml cannot declare: on Linux, the small C library that forwards
MLX's CBLAS calls to the pip-installed OpenBLAS (mac_moesd/machine/cblas_forward.c). It is
optional: without a C compiler the install still succeeds, and MLX keeps its reference BLAS
(``mac-moesd info`` says so, and names the fix)."""

import sys

from setuptools import Extension, setup

forward = Extension("mac_moesd.machine._cblas_forward", ["mac_moesd/machine/cblas_forward.c"], optional=True)
setup(ext_modules=[forward] if sys.platform.startswith("linux") else [])
