"""The house's rules for the shape of the code, beside its import graph (test_import_graph.py).

- An interface is explicit: a ``typing.Protocol``, or an ``abc.ABC`` whose ``@abstractmethod``
  has no body. No base class carries a stub that raises ``NotImplementedError`` for a method a
  subclass supplies, anywhere in ``service/`` (a Protocol's may).
- Parts are composed, not one class split by inheritance or grown into a facade (issue 43): no
  function in ``service/`` runs over 80 lines, no class there has over 25 public methods, and
  no class in ``service/engine/`` declares an attribute that only some other class assigns."""

from __future__ import annotations

import ast
import functools
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[2] / "service"
ENGINE = SOURCE / "engine"
MAX_FUNCTION_LINES = 80
MAX_PUBLIC_METHODS = 25
# Classes whose declared attributes are assigned from outside, and why.
ASSIGNED_ELSEWHERE = {
    # mlx-lm's own modules, re-classed in place: install() gives each its new attributes.
    ("upstream/decode_block.py", "DecodeBlockAttention"),
    ("upstream/decode_block.py", "DecodeBlock"),
}
# Bases and decorators whose class-level annotations are fields, not attributes a method assigns.
FIELD_BASES = {"Protocol", "Struct", "NamedTuple", "TypedDict"}
FIELD_DECORATORS = {"dataclass"}

Function = ast.FunctionDef | ast.AsyncFunctionDef


@functools.cache
def parse(path: Path) -> ast.Module:
    """Each file parsed once for all the checks (the trees are only read)."""
    return ast.parse(path.read_text(), filename=str(path))


def where(path: Path, root: Path) -> str:
    return str(path.relative_to(root))


def last_name(node: ast.expr) -> str:
    """``Protocol`` of ``Protocol``, ``typing.Protocol``, ``Protocol[T]`` and ``dataclass(...)``."""
    if isinstance(node, ast.Subscript | ast.Call):
        node = node.value if isinstance(node, ast.Subscript) else node.func
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


def is_protocol(cls: ast.ClassDef) -> bool:
    return any(last_name(base) == "Protocol" for base in cls.bases)


def not_implemented_line(node: ast.AST) -> int | None:
    """The line of ``raise NotImplementedError`` (called or not); None for any other node."""
    if isinstance(node, ast.Raise) and node.exc is not None and last_name(node.exc) == "NotImplementedError":
        return node.lineno
    return None


def not_implemented_raises(tree: ast.AST, in_protocol: bool = False) -> Iterator[int]:
    """The lines of each ``raise NotImplementedError`` outside a Protocol class."""
    for node in ast.iter_child_nodes(tree):
        if not in_protocol and (line := not_implemented_line(node)) is not None:
            yield line
        inside = in_protocol or (isinstance(node, ast.ClassDef) and is_protocol(node))
        yield from not_implemented_raises(node, inside)


def length(function: Function) -> int:
    return (function.end_lineno or function.lineno) - function.lineno + 1


def long_functions(tree: ast.AST, limit: int = MAX_FUNCTION_LINES) -> Iterator[tuple[str, int]]:
    for node in ast.walk(tree):
        if isinstance(node, Function) and length(node) > limit:
            yield node.name, length(node)


def wide_classes(tree: ast.AST, limit: int = MAX_PUBLIC_METHODS) -> Iterator[tuple[str, int]]:
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            public = [f for f in node.body if isinstance(f, Function) and not f.name.startswith("_")]
            if len(public) > limit:
                yield node.name, len(public)


def self_assigned(cls: ast.ClassDef) -> set[str]:
    """The attributes the class's own methods assign (``self.name = ...``, ``+=``, annotated)."""
    names: set[str] = set()
    for method in cls.body:
        if not isinstance(method, Function):
            continue
        for node in ast.walk(method):
            targets = node.targets if isinstance(node, ast.Assign) else []
            if isinstance(node, ast.AnnAssign | ast.AugAssign):
                targets = [node.target]
            names.update(
                t.attr
                for t in targets
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
            )
    return names


def unassigned_attributes(tree: ast.AST) -> Iterator[tuple[str, str]]:
    """(class, attribute) for each attribute a class declares (``name: T`` in its body) but
    none of its own methods assigns: one that only a subclass, or some other object, would."""
    for cls in ast.walk(tree):
        if not isinstance(cls, ast.ClassDef):
            continue
        fields = {last_name(b) for b in cls.bases} & FIELD_BASES
        if fields or {last_name(d) for d in cls.decorator_list} & FIELD_DECORATORS:
            continue
        declared = [
            n.target.id
            for n in cls.body
            if isinstance(n, ast.AnnAssign) and n.value is None and isinstance(n.target, ast.Name)
        ]
        assigned = self_assigned(cls)
        yield from ((cls.name, name) for name in declared if name not in assigned)


def findings(root: Path, check: Callable[[ast.Module], Iterable[object]]) -> list[str]:
    """What ``check`` finds in each module under ``root``, each named by its file."""
    return [f"{where(path, root)}: {found}" for path in sorted(root.rglob("*.py")) for found in check(parse(path))]


def test_no_not_implemented_stubs_outside_a_protocol() -> None:
    found = findings(SOURCE, lambda tree: (f"line {line}" for line in not_implemented_raises(tree)))
    assert not found, (
        "raise NotImplementedError outside a Protocol (make the interface a Protocol or an ABC): " + ", ".join(found)
    )


def test_functions_are_short() -> None:
    found = findings(SOURCE, lambda tree: (f"{name} has {lines} lines" for name, lines in long_functions(tree)))
    assert not found, f"over {MAX_FUNCTION_LINES} lines: " + ", ".join(found)


def test_classes_are_narrow() -> None:
    found = findings(SOURCE, lambda tree: (f"{name} has {n} public methods" for name, n in wide_classes(tree)))
    assert not found, f"over {MAX_PUBLIC_METHODS} public methods: " + ", ".join(found)


def test_engine_classes_assign_what_they_declare() -> None:
    found = [
        f"{where(path, ENGINE)}: {cls}.{name}"
        for path in sorted(ENGINE.rglob("*.py"))
        for cls, name in unassigned_attributes(parse(path))
        if (where(path, ENGINE), cls) not in ASSIGNED_ELSEWHERE
    ]
    assert not found, "declared but assigned by no method of the class: " + ", ".join(found)


def test_the_checks_catch_what_they_are_for() -> None:
    stubs = ast.parse(
        "class Base:\n"
        "    def f(self) -> None:\n"
        "        raise NotImplementedError\n"
        "class Port(typing.Protocol):\n"
        "    def g(self) -> None:\n"
        "        raise NotImplementedError()\n"
        "class Abstract(abc.ABC):\n"
        "    @abc.abstractmethod\n"
        "    def h(self) -> None: ...\n"
        "def free() -> None:\n"
        "    raise NotImplementedError('later')\n"
    )
    assert list(not_implemented_raises(stubs)) == [3, 11]
    long = ast.parse("def f():\n" + "    x = 1\n" * 80 + "def g():\n" + "    x = 1\n" * 79)
    assert list(long_functions(long)) == [("f", 81)]
    wide = ast.parse(
        "class W:\n" + "".join(f"    def m{i}(self): ...\n" for i in range(26)) + "    def _p(self): ...\n"
    )
    assert list(wide_classes(wide)) == [("W", 26)]
    assert list(wide_classes(ast.parse("class N:\n    def m(self): ...\n"))) == []
    split = ast.parse(
        "class Half:\n"
        "    models: dict[str, int]\n"
        "    budget: int\n"
        "    def __init__(self) -> None:\n"
        "        self.budget = 0\n"
        "@dataclass\n"
        "class Row:\n"
        "    name: str\n"
        "class Message(msgspec.Struct):\n"
        "    text: str\n"
    )
    assert list(unassigned_attributes(split)) == [("Half", "models")]
