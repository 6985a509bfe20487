"""mac-moesd: does speculative decoding pay off for this MoE model on this Mac?"""

from mac_moesd.machine import blas as _blas

__version__ = "0.1.0"

# Before anything imports mlx: on Linux, make MLX's CPU backend call OpenBLAS (see blas.py).
_blas.preload()
