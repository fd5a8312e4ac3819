"""The wheel's layout: every package of the source tree is installed (as ``lmspd.*``) with its
data files. ``.ci/wheel`` proves the installed result serves; this catches a new subpackage or
SQL file left out of ``pyproject.toml`` before any wheel is built."""

from __future__ import annotations

import tomllib
from fnmatch import fnmatch
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_source_package_is_in_the_wheel() -> None:
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    source = {
        ".".join(("lmspd", *init.parent.relative_to(ROOT / "service").parts)).rstrip(".")
        for init in (ROOT / "service").rglob("__init__.py")
    }
    migrations = {
        ".".join(("lmspd", *init.parent.relative_to(ROOT).parts)) for init in (ROOT / "migrations").rglob("__init__.py")
    }
    assert migrations == {"lmspd.migrations", "lmspd.migrations.postgresql"}  # SQLite's, PostgreSQL's
    assert set(setuptools["packages"]) == source | migrations
    assert setuptools["package-dir"] == {"lmspd": "service", "lmspd.migrations": "migrations"}


def test_every_data_file_is_package_data() -> None:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    non_python = {p.relative_to(ROOT) for p in (ROOT / "service").rglob("*") if p.is_file()}
    # A README beside the code is for its readers (engine/upstream/README.md), not package data.
    non_python = {p for p in non_python if p.suffix not in (".py", ".pyc") and p.name != "README.md"}
    # SQL files, the C++ kernels' source and header (built on the user's machine, so shipped as
    # source) and the web console's assets (lmspd/api/static, docs/console.md).
    assert {p.suffix for p in non_python} == {".sql", ".cpp", ".h", ".html", ".js", ".css", ".svg"}
    for path in non_python:
        # Declared by the nearest package above it, as a glob relative to that package's folder.
        parts = path.relative_to("service").parts
        declared = False
        for cut in range(len(parts) - 1, -1, -1):
            package = ".".join(("lmspd", *parts[:cut]))
            if package in data or cut == 0:
                relative = "/".join(parts[cut:])
                declared = any(fnmatch(relative, glob) for glob in data.get(package, []))
                break
        assert declared, path
    assert data["lmspd.migrations"] == data["lmspd.migrations.postgresql"] == ["*.sql"]
