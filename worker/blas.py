"""Put OpenBLAS under MLX's CPU backend on Linux.

The `mlx[cpu]` wheel bundles the reference (netlib) BLAS, about 40x slower at
matmul than OpenBLAS. Loading OpenBLAS with RTLD_GLOBAL before `mlx.core` is
imported makes MLX's BLAS symbols resolve to it, with identical results. On
macOS MLX runs on Metal and Accelerate, and nothing here applies.
"""

from __future__ import annotations

import ctypes
import platform
import sys
from pathlib import Path


def openblas_path() -> Path | None:
    if sys.platform != "linux":
        return None
    path = Path(f"/usr/lib/{platform.machine()}-linux-gnu/openblas-pthread/libblas.so.3")
    return path if path.exists() else None


def load_fast_blas() -> str:
    """Load OpenBLAS if present; return which BLAS MLX will run on, for the log.

    Must run before anything imports mlx.
    """
    if sys.platform == "darwin":
        return "Metal/Accelerate (macOS)"
    if "mlx.core" in sys.modules:
        raise RuntimeError("load_fast_blas() must run before mlx is imported")
    path = openblas_path()
    if path is None:
        return "reference BLAS bundled with mlx (slow; install Debian's libopenblas0-pthread)"
    ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    return f"OpenBLAS ({path})"
