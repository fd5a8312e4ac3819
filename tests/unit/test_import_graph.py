"""The package's import graph: imports run one way, down the rooms, with no circles.

cli → api → core → prompting → messages → chat → responses → engine → models → store → ground
(errors, config, logs, metrics; the client library beside them). Each room's ``__init__``
says what lives there. Every import counts, also one inside a function: a lazy import that
runs up, or closes a circle, is as much a tangle as one at the top."""

from __future__ import annotations

import ast
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[2] / "service"
ORDER = ("ground", "store", "models", "engine", "responses", "chat", "messages", "prompting", "core", "api", "cli")
GROUND = {"errors", "config", "logs", "metrics", "client", "migrations"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SOURCE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["lmspd", *parts])


MODULES = {module_name(p): p for p in sorted(SOURCE.rglob("*.py"))}


def room(module: str) -> str:
    top = module.split(".")[1] if "." in module else "ground"
    return "ground" if top in GROUND else top


def imports(module: str) -> dict[str, int]:
    """The lmspd modules ``module`` imports, each with the line of its first import."""
    tree = ast.parse(MODULES[module].read_text())
    found: dict[str, int] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{module}:{node.lineno}: imports are absolute (from lmspd...)"
            base = node.module or ""
            if base == "lmspd" or base.startswith("lmspd."):
                for alias in node.names:  # ``from lmspd.x import y``: the module y, or x itself
                    target = f"{base}.{alias.name}"
                    found.setdefault(target if target in MODULES else base, node.lineno)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "lmspd" or alias.name.startswith("lmspd."):
                    found.setdefault(alias.name, node.lineno)
    return found


GRAPH = {m: imports(m) for m in MODULES}


def test_every_room_is_known_and_documented() -> None:
    rooms = {room(m) for m in MODULES}
    assert rooms <= set(ORDER), rooms - set(ORDER)
    for module, path in MODULES.items():
        if path.name == "__init__.py":
            assert ast.get_docstring(ast.parse(path.read_text())), f"{module} says nothing of what lives there"


Graph = dict[str, dict[str, int]]


def upward(graph: Graph) -> list[str]:
    return [
        f"{module}:{line} imports {target} ({room(module)} → {room(target)})"
        for module, targets in graph.items()
        for target, line in targets.items()
        if ORDER.index(room(target)) > ORDER.index(room(module))
    ]


def circle(graph: Graph) -> list[str] | None:
    """The first import circle found, as the path around it, or None. (A package's
    ``__init__`` runs before its modules: an edge to a package is an edge to what its
    ``__init__`` imports, so a circle through a package shows here too.)"""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in graph.get(module, {}):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state and (found := visit(target)):
                return found
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state and (found := visit(module)):
            return found
    return None


def test_imports_run_down_the_rooms() -> None:
    found = upward(GRAPH)
    assert not found, "\n".join(found)


def test_the_client_library_and_mlx_internals_stand_alone() -> None:
    for module, targets in GRAPH.items():
        if module.startswith("lmspd.client"):
            assert all(t.startswith("lmspd.client") for t in targets), (module, targets)
        if module.startswith("lmspd.engine.upstream"):
            assert not targets, (module, targets)


def test_no_circles() -> None:
    assert circle(GRAPH) is None, " → ".join(circle(GRAPH) or [])


def test_the_checks_catch_an_upward_import_and_a_circle() -> None:
    assert upward({"lmspd.store.db": {"lmspd.core.operations": 3}}) == [
        "lmspd.store.db:3 imports lmspd.core.operations (store → core)"
    ]
    assert upward({"lmspd.core.operations": {"lmspd.store.db": 3}, "lmspd.metrics": {"lmspd.errors": 1}}) == []
    graph = {"lmspd.api.app": {"lmspd.api.openapi": 1}, "lmspd.api.openapi": {"lmspd.api.app": 9}}
    assert circle(graph) == ["lmspd.api.app", "lmspd.api.openapi", "lmspd.api.app"]
    assert circle({"lmspd.api.app": {"lmspd.api.openapi": 1}, "lmspd.api.openapi": {}}) is None
