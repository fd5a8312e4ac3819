"""An optimized BLAS for MLX's CPU backend on Linux.

The ``mlx[cpu]`` wheel bundles the reference BLAS: single-threaded textbook loops, so a dense
float32 matmul (all of prefill) runs ~30x slower than it can. The engine process therefore
loads the system's OpenBLAS with ``RTLD_GLOBAL`` before it imports MLX: the dynamic linker
resolves ``libmlx``'s ``cblas_*``/LAPACK symbols in the global scope first, so OpenBLAS's
win over the bundled ones, for that process only (the server and other programs are
untouched, no ``LD_PRELOAD`` leaks into children). ``weight_dtype = "auto"`` then measures the
candidates with it, and keeps float32 when that is faster.

Only the engine process calls :func:`load`; it must run before anything imports ``mlx``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys
from pathlib import Path

log = logging.getLogger("lmspd.engine.blas")

# Where Debian/Ubuntu (``apt install libopenblas0-pthread``), Fedora and Arch put OpenBLAS.
_KNOWN = (
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)
NONE = "none"


def find(setting: str = "auto") -> str | None:
    """The BLAS library the engine would load for ``setting``: ``auto`` (OpenBLAS if the
    system has it, Linux only: on macOS MLX already uses Accelerate), ``none``, or a path."""
    if setting == NONE:
        return None
    if setting != "auto":
        return setting
    if not sys.platform.startswith("linux"):
        return None
    for candidate in _KNOWN:
        if Path(candidate).is_file():
            return candidate
    found = ctypes.util.find_library("openblas")
    return found


def load(setting: str = "auto") -> str:
    """Load the BLAS for ``setting`` into this process's global symbol scope; returns what is
    in use, for the logs and ``lmspd doctor`` ("reference (bundled with mlx)" when none)."""
    path = find(setting)
    if "mlx.core" in sys.modules and path is not None:  # too late: MLX already bound its symbols
        log.error("MLX was imported before the BLAS could be loaded; using the reference BLAS")
        return "reference (bundled with mlx)"
    if path is None:
        return "reference (bundled with mlx)"
    try:
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError as exc:
        if setting != "auto":  # the operator named it: say so loudly, but keep serving
            log.error("BLAS %s could not be loaded (%s); using the reference BLAS", path, exc)
        return "reference (bundled with mlx)"
    return path
