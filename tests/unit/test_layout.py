"""The repository's layout holds: bench/ is benchmarks only, and the code the tests, benchmarks
and CI share is harness/, imported from the repository root (harness/__init__.py)."""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.models import ROOT


@functools.cache
def _parse(path: Path) -> ast.Module:
    """Each file parsed once for all the checks (the trees are only read)."""
    return ast.parse(path.read_text(), str(path))


def _sources(*folders: str) -> Iterator[tuple[Path, ast.Module]]:
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*.py")):
            yield path, _parse(path)


def _imported(tree: ast.Module) -> Iterator[str]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module


@pytest.mark.parametrize("folder", ["tests", "harness"])
def test_tests_and_harness_never_import_bench(folder: str) -> None:
    found = [
        f"{path.relative_to(ROOT)}: {name}"
        for path, tree in _sources(folder)
        for name in _imported(tree)
        if name == "bench" or name.startswith("bench.")
    ]
    assert found == []


def test_nothing_edits_sys_path() -> None:
    """Every module is found by its package from the root, never by a path put on ``sys.path``."""
    found = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for path, tree in _sources("bench", "tests", "harness")
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr == "path"
        and isinstance(node.value, ast.Name)
        and node.value.id == "sys"
    ]
    assert found == []


def test_one_free_port() -> None:
    defined = [
        str(path.relative_to(ROOT))
        for path, tree in _sources("bench", "tests", "harness")
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef) and node.name.lstrip("_") == "free_port"
    ]
    assert defined == ["harness/server.py"]
