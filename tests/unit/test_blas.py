"""Which BLAS the engine loads for each ``engine.blas`` setting."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from lmspd.engine.upstream import blas


def test_none_and_an_explicit_path() -> None:
    assert blas.find("none") is None
    assert blas.find("/opt/blas/libmyblas.so") == "/opt/blas/libmyblas.so"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="OpenBLAS is looked for on Linux only")
def test_auto_finds_the_system_openblas_when_there_is_one() -> None:
    found = blas.find("auto")
    installed = [p for p in blas._KNOWN if Path(p).is_file()]
    if installed:
        assert found == installed[0]
    else:
        assert found is None or "openblas" in found
