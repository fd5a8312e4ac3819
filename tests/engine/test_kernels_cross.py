"""The NEON matvec against the portable one, bit for bit, from an x86-64 machine.

kernels_check.cpp links no MLX library (its headers only), so it builds for another target: for
arm64 with a cross compiler, run under qemu, where both are installed (``apt install
g++-aarch64-linux-gnu qemu-user``), so the NEON kernel is held to the portable kernel's bits on a
machine that has none. This machine's own SIMD kernel is checked through the built extension
(test_kernels.py).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import mlx.core
import pytest

from lmspd.engine import kernels

CHECK = Path(__file__).with_name("kernels_check.cpp")
CROSS = "aarch64-linux-gnu-g++"


def _build_and_run(cxx: str, flags: list[str], out: Path, runner: list[str]) -> str:
    include = Path(mlx.core.__file__).parent / "include"
    cmd = [cxx, "-std=c++20", "-O2", *flags, f"-I{kernels.SOURCE.parent}", "-isystem", str(include), str(CHECK)]
    subprocess.run([*cmd, "-o", str(out)], check=True, capture_output=True, timeout=120)
    done = subprocess.run([*runner, str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.parametrize("arch", ["armv8-a", "armv8.2-a+fp16", "armv8.6-a+fp16+bf16"])
@pytest.mark.skipif(
    shutil.which(CROSS) is None or shutil.which("qemu-aarch64") is None, reason="no arm64 cross compiler and qemu"
)
def test_the_neon_kernel_gives_the_portable_bits(tmp_path: Path, arch: str) -> None:
    """Three arm64 targets: 16-bit scales as MLX's own structs, as __fp16, as __bf16."""
    out = _build_and_run(CROSS, [f"-march={arch}", "-static"], tmp_path / "check", ["qemu-aarch64"])
    assert out.split() == ["neon", "297", "0"]
