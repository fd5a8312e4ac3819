"""python -m lmspd.engine.kernels: build the kernels now, where the configuration puts them
(``engine.kernel_dir``), so the first engine start does not spend its 10 s on it: an install
or deploy script, CI."""

import logging
import sys

from lmspd.config import load_config
from lmspd.engine.kernels import KernelUnavailable, cache_root, load

logging.basicConfig(level=logging.INFO, format="%(message)s")
try:
    print(f"lmspd kernels: {load(cache_root(load_config().engine.kernel_dir)).__file__}")
except KernelUnavailable as exc:
    sys.exit(f"lmspd kernels unavailable: {exc}")
