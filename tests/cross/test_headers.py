"""The kernels are a library (docs/engine.md, "The kernels' sources"): each header includes what
it uses, so any one of them compiles first, or alone (syntax only, with the build's flags). A
compile of every header, about a minute on two cores: a step of its own in .ci/run, beside the
cross builds, not in the inner loop."""

from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from lmspd.engine import kernels


def test_each_header_compiles_on_its_own() -> None:
    checks = {Path(c[c.index("-include") + 1]).name: c for c in kernels.header_checks()}
    assert {"pool.h", "arrays.h", "quantized.h", "decode_block.h"} <= set(checks)
    with ThreadPoolExecutor(2) as pool:
        done = {name: pool.submit(subprocess.run, c, capture_output=True, text=True) for name, c in checks.items()}
    failed = {name: d.result().stderr[-1500:] for name, d in done.items() if d.result().returncode}
    assert not failed, failed
