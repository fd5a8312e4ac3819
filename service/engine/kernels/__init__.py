"""lmspd's compiled CPU kernels (a header per family of primitives, ``bindings.cpp`` the Python
module that includes them all), built where they run.

The kernels are an MLX extension: C++ primitives that join MLX's lazy graph like its own
ops. An extension must match the MLX it is loaded into (headers, libmlx, nanobind's ABI) and
is compiled for the CPU at hand, so no wheel can carry one; the engine compiles it the first
time a model wants it (about 30 s on two cores) and every later start loads the cached build.
The cache key covers everything the build depends on (the MLX it links, by path and version;
nanobind; the Python ABI; the CPU), so an upgrade, another virtual environment or another CPU
rebuilds instead of loading a mismatched binary.

Building needs a C++17 compiler (``c++``, or ``$CXX``) and the Python headers
(``apt install g++ python3-dev``); nanobind comes from PyPI with lmspd. Without them the
engine says why once and runs the other weight dtypes. Linux only: on a Mac, Metal's own
quantized kernels are fast.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from types import ModuleType

log = logging.getLogger("lmspd.engine.kernels")

SOURCE = Path(__file__).with_name("bindings.cpp")  # the one translation unit
# Every header beside it, found rather than listed, so a new one is in the build key from the
# start: a build made before an edit to any of them is never loaded after it.
HEADERS = tuple(sorted(SOURCE.parent.glob("*.h")))
MODULE = "quantized_ext"  # the NB_MODULE name in bindings.cpp
BUILD_PREFIX = ".build-"  # a build in progress (or one a killed process left behind)


class KernelUnavailable(Exception):
    """The kernels cannot be built or loaded here; the message says why."""


_loaded: ModuleType | None = None


def cache_root(configured: str = "") -> Path:
    """Where builds are kept: ``engine.kernel_dir`` when configured, else $LMSPD_KERNEL_DIR,
    else the user's cache directory."""
    if configured or (configured := os.environ.get("LMSPD_KERNEL_DIR", "")):
        return Path(configured).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "lmspd" / "kernels"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.split(":")[0].strip() in ("model name", "CPU part", "Features"):
                return line
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str:
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        raise KernelUnavailable(f"no C++ compiler ('{cxx}' is not on PATH; apt install g++)")
    return cxx


def _paths() -> dict[str, Path]:
    import mlx.core
    import nanobind

    mlx_dir = Path(mlx.core.__file__).parent
    nb = Path(nanobind.include_dir()).parent
    paths = {
        "python": Path(sysconfig.get_paths()["include"]),
        "nanobind": nb,
        "mlx_include": mlx_dir / "include",
        "mlx_lib": mlx_dir / "lib",
    }
    if not (paths["python"] / "Python.h").exists():
        raise KernelUnavailable(f"no Python headers in {paths['python']} (apt install python3-dev)")
    return paths


def build_key() -> str:
    import mlx.core as mx
    import nanobind

    parts = [
        SOURCE.read_bytes(),
        *(h.read_bytes() for h in HEADERS),
        # The build links this libmlx by path: another environment's MLX, even the same
        # version, builds its own (two libmlx copies in one process would not interoperate).
        str(Path(mx.__file__).resolve().parent).encode(),
        getattr(mx, "__version__", "").encode(),
        nanobind.__version__.encode(),
        str(sysconfig.get_config_var("EXT_SUFFIX")).encode(),
        platform.machine().encode(),
        _cpu_model().encode(),
    ]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def _kernel_flags(paths: dict[str, Path]) -> list[str]:
    """The kernels' own flags, after the C++ standard and the flags nanobind's runtime shares."""
    # NB_DOMAIN=mlx: MLX's Python module is built in nanobind's "mlx" domain, and mx.array
    # is only recognised by extensions in the same domain.
    return ["-march=native", "-DNB_DOMAIN=mlx", "-isystem", str(paths["mlx_include"])]


def header_checks() -> list[list[str]]:
    """A command per header that compiles it alone (syntax only, the kernels' flags): each
    header includes what it uses, so any one can be included first, or by itself."""
    cxx, paths = _compiler(), _paths()
    flags = [cxx, "-std=c++20", f"-I{paths['python']}", f"-I{paths['nanobind'] / 'include'}", *_kernel_flags(paths)]
    return [[*flags, "-fsyntax-only", "-x", "c++", "-include", str(h), os.devnull] for h in HEADERS]


def _commands(
    cxx: str, paths: dict[str, Path], out: Path, work: Path, source: Path | None = None
) -> tuple[list[list[str]], list[str]]:
    """Two compiles (nanobind's runtime, the kernels) and the link: the flags nanobind's own
    CMake build uses, without needing CMake."""
    nb = paths["nanobind"]
    common = [
        "-O3",
        "-DNDEBUG",
        "-fPIC",
        "-fvisibility=hidden",
        "-ffunction-sections",
        "-fdata-sections",
        "-fno-stack-protector",
        f"-I{paths['python']}",
        f"-I{nb / 'include'}",
    ]
    runtime = [cxx, "-std=c++17", *common, "-DNB_BUILD", "-DNB_COMPACT_ASSERTIONS", "-fno-strict-aliasing"]
    runtime += [f"-I{nb / 'ext' / 'robin_map' / 'include'}", "-c", str(nb / "src" / "nb_combined.cpp")]
    kernels = [cxx, "-std=c++20", *common, *_kernel_flags(paths), "-c", str(source or SOURCE)]
    # The kernels first: a broken source fails fast, without waiting for nanobind's runtime.
    compiles = [[*kernels, "-o", str(work / "kernels.o")], [*runtime, "-o", str(work / "nanobind.o")]]
    link = [cxx, "-shared", "-Wl,--gc-sections", str(work / "kernels.o"), str(work / "nanobind.o")]
    link += [f"-Wl,-rpath,{paths['mlx_lib']}", str(paths["mlx_lib"] / "libmlx.so"), "-o", str(out)]
    return compiles, link


def _run_all(commands: list[list[str]]) -> None:
    """Run the commands at once; the first to fail stops the others and says why."""
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for c in commands]
    try:
        for proc in procs:
            output, _ = proc.communicate()
            if proc.returncode != 0:
                raise KernelUnavailable(f"the kernels did not compile: {output.strip()[-2000:]}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def preflight() -> None:
    """Raise KernelUnavailable when this machine cannot build the kernels (builds nothing)."""
    if not sys.platform.startswith("linux"):
        raise KernelUnavailable("lmspd's CPU kernels are built on Linux only")
    _compiler()
    try:
        _paths()
    except ImportError as exc:
        raise KernelUnavailable(f"cannot import {exc.name}") from exc


def build(root: Path | None = None) -> Path:
    """The built extension's path, compiling it first unless the cache has it."""
    preflight()
    root = root or cache_root()
    key = build_key()
    target = root / key / f"{MODULE}{sysconfig.get_config_var('EXT_SUFFIX')}"
    if target.exists():
        return target
    cxx, paths = _compiler(), _paths()
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(root / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another engine building the same key: wait for it
        if target.exists():
            return target
        # Holding the lock, any build directory here is one a killed build left behind.
        for stale in target.parent.glob(f"{BUILD_PREFIX}*"):
            shutil.rmtree(stale, ignore_errors=True)
        log.info("building lmspd's quantized CPU kernels into %s (once per MLX version)", target.parent)
        start = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix=BUILD_PREFIX, dir=target.parent) as tmp:  # removed on error too
            work = Path(tmp)
            compiles, link = _commands(cxx, paths, work / target.name, work)
            _run_all(compiles)
            _run_all([link])
            os.replace(work / target.name, target)  # complete or absent, never half-written
        log.info("built the kernels in %.1f s", time.perf_counter() - start)
    return target


def build_source(source: Path, out_dir: Path) -> Path:
    """Build another copy of the kernels' sources (``source``: its bindings.cpp, or an older
    revision's quantized.cpp; the headers beside it) into out_dir, uncached: ``bench.matvec
    --against`` times a git revision's kernels beside these ones in one process."""
    preflight()
    target = out_dir / f"{MODULE}{sysconfig.get_config_var('EXT_SUFFIX')}"
    compiles, link = _commands(_compiler(), _paths(), target, out_dir, source)
    _run_all(compiles)
    _run_all([link])
    return target


def _self_check(ext: ModuleType) -> None:
    """One small product against MLX's own dequantize, so a binary that loads but does not
    interoperate (another nanobind ABI) is refused here rather than mid-generation."""
    import mlx.core as mx

    w = mx.arange(64 * 32, dtype=mx.float32).reshape(64, 32) / 1000
    q, s, b = mx.quantize(w, 32, 4)
    x = mx.ones((1, 32))
    want = x @ mx.dequantize(q, s, b, 32, 4).T
    got = ext.quantized_matvec(x, q, s, b, 32, 4)
    if not mx.allclose(got, want, atol=1e-4).item() or not mx.array_equal(
        ext.dequantize(q, s, b, 32, 4), mx.dequantize(q, s, b, 32, 4)
    ):
        raise KernelUnavailable("the built kernels disagree with MLX's dequantize")


def load(root: Path | None = None) -> ModuleType:
    """The kernels' module, built and checked on first use (raises KernelUnavailable)."""
    global _loaded
    if _loaded is None:
        _loaded = load_path(build(root))
    return _loaded


def load_path(path: Path) -> ModuleType:
    """The kernels' module built at path, loaded and checked (raises KernelUnavailable)."""
    loader = importlib.machinery.ExtensionFileLoader(MODULE, str(path))
    spec = importlib.util.spec_from_file_location(MODULE, path, loader=loader)
    if spec is None:
        raise KernelUnavailable(f"cannot load {path}")
    ext = importlib.util.module_from_spec(spec)
    try:
        loader.exec_module(ext)
        _self_check(ext)
    except (ImportError, TypeError, ValueError) as exc:
        raise KernelUnavailable(f"the built kernels at {path} do not load: {exc}") from exc
    return ext


def built(root: Path | None = None) -> Path | None:
    """The cached build for this MLX and CPU, if there is one (builds nothing)."""
    try:
        path = (root or cache_root()) / build_key() / f"{MODULE}{sysconfig.get_config_var('EXT_SUFFIX')}"
    except ImportError:
        return None
    return path if path.exists() else None
