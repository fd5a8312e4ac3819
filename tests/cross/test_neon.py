"""The NEON matvec against the portable one, bit for bit, from an x86-64 machine.

kernels_check.cpp links no MLX library (its headers only), so it builds for another target: for
arm64 with a cross compiler, run under qemu, where both are installed (``apt install
g++-aarch64-linux-gnu qemu-user``), so the NEON kernel is held to the portable kernel's bits on a
machine that has none. This machine's own SIMD kernel is checked through the built extension
(tests/engine/test_kernels.py). A tier of its own (about 75 s on two cores: three targets, every
count of rows in a block its own instantiation); missing tools skip it, and fail it under CI=true.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import mlx.core
import pytest

from lmspd.engine import kernels

CHECK = Path(__file__).with_name("kernels_check.cpp")
CROSS = "aarch64-linux-gnu-g++"


ARCHS = ["armv8-a", "armv8.2-a+fp16", "armv8.6-a+fp16+bf16"]
MISSING = shutil.which(CROSS) is None or shutil.which("qemu-aarch64") is None
needs_cross = pytest.mark.skipif(MISSING and not os.environ.get("CI"), reason="no arm64 cross compiler and qemu")


@pytest.fixture(scope="module")
def binaries(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The harness for each target, compiled at once (each takes ~25 s of one core: every count
    of rows in a block is its own instantiation)."""
    include = Path(mlx.core.__file__).parent / "include"
    work = tmp_path_factory.mktemp("neon")
    outs = {arch: work / f"check-{arch}" for arch in ARCHS}
    base = [CROSS, "-std=c++20", "-O2", "-static", f"-I{kernels.SOURCE.parent}", "-isystem", str(include), str(CHECK)]
    procs = {
        arch: subprocess.Popen([*base, f"-march={arch}", "-o", str(out)], stderr=subprocess.PIPE, text=True)
        for arch, out in outs.items()
    }
    for arch, proc in procs.items():
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{arch}: {err[-2000:]}"
    return outs


@pytest.mark.parametrize("arch", ARCHS)
@needs_cross
def test_the_neon_kernel_gives_the_portable_bits(binaries: dict[str, Path], arch: str) -> None:
    """Three arm64 targets: 16-bit scales as MLX's own structs, as __fp16, as __bf16."""
    done = subprocess.run(["qemu-aarch64", str(binaries[arch])], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.split() == ["neon", "297", "0"]
