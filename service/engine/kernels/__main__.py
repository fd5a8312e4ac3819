"""python -m lmspd.engine.kernels: build the kernels now (install and deploy scripts, CI), so
the first engine start does not spend its 20 s on it."""

import logging
import sys

from . import KernelUnavailable, load

logging.basicConfig(level=logging.INFO, format="%(message)s")
try:
    print(f"lmspd kernels: {load().__file__}")
except KernelUnavailable as exc:
    sys.exit(f"lmspd kernels unavailable: {exc}")
