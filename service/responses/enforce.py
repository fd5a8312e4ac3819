"""Which JSON schemas constrained decoding can enforce, and at what cost: a schema's grammar
(llguidance, in lmspd's one layout), the budget a request's schemas must fit, and the checks
that answer 400 naming the field, the keyword or the limit.

Intake runs :func:`check_directives` in a worker thread, before any task exists
(:meth:`lmspd.core.operations.Core.submit`); :mod:`lmspd.prompting.grammar` builds whole
grammars on the same layout. In order, each bounded by the one before:

1. the budget (:class:`SchemaBudget`): tools per request, nodes and characters over all the
   request's schemas, and nesting depth; a walk that stops as soon as one is exceeded;
2. what llguidance's parser cannot do per decode step (an object with more optional
   properties than its parser's row holds) and schemas with no finite instance
   (:func:`finite_instances`: ``{"$ref": "#"}``, a required property that is the schema
   itself, definitions that refer to each other with no way out);
3. llguidance's own validation, with the engine's parser limits.

llguidance is imported on first use, so the server starts without it.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

from lmspd.engine.constraint import parser_limits
from lmspd.errors import InvalidRequestError
from lmspd.responses.tools import CustomGrammar, Directives, FunctionTool, JsonSchemaFormat, customs

if TYPE_CHECKING:
    from lmspd.config import ResponsesConfig

# One canonical spacing: what json.dumps writes and chat templates show models, and a
# bounded choice at every separator (free whitespace lets a weak model ramble).
_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_UNIMPLEMENTED = re.compile(r'Unimplemented keys: \["([^"]+)"')
# llguidance's parser keeps an object's optional properties open at its first key (4 Earley
# items each, 7 more) in one row of at most 2,000 items (its max_items_in_row): past 498 the
# grammar validates but fails at that key, in the middle of a response. Refused at intake.
# (Other shapes fill a row differently, e.g. anyOf of several wide objects; one that still
# overflows fails its request with an error: lmspd.engine.constraint.GrammarMask.failure.)
MAX_OPTIONAL_PROPERTIES = 498

Path = tuple[str | int, ...]


class SchemaError(InvalidRequestError):
    """A request's tools or schemas that decoding cannot enforce, or that exceed the budget;
    ``param`` names the field within the Responses request (a surface that nests the request
    names it as it holds it)."""


@dataclass(frozen=True)
class SchemaBudget:
    """What one request's tools and schemas may hold (``[responses]`` in the config)."""

    max_tools: int = 128
    max_nodes: int = 2000  # JSON objects, arrays and array entries, over all the request's schemas
    max_chars: int = 100_000  # characters of their keys and strings
    max_depth: int = 64  # JSON nesting of one schema

    @classmethod
    def of(cls, config: ResponsesConfig) -> SchemaBudget:
        return cls(config.max_tools, config.max_schema_nodes, config.max_schema_chars, config.max_schema_depth)


def with_layout(schema: Mapping[str, Any]) -> dict[str, Any]:
    return {**schema, "x-guidance": {**_LAYOUT, **schema.get("x-guidance", {})}}


def json_schema_grammar(schema: Mapping[str, Any]) -> str:
    from llguidance import LLMatcher

    return str(LLMatcher.grammar_from_json_schema(with_layout(schema)))


def check(grammar: str, param: str) -> None:
    """400 naming the schema keyword (or the reason) the grammar cannot enforce."""
    from llguidance import LLMatcher

    error = LLMatcher.validate_grammar(grammar, limits=parser_limits())
    if error:
        found = _UNIMPLEMENTED.search(error)
        where = f"{param}.{found.group(1)}" if found else param
        what = f"keyword '{found.group(1)}' cannot be enforced" if found else error.strip().splitlines()[0]
        raise SchemaError(f"{param}: {what} by constrained decoding", param=where)


def check_lark(lark: str, param: str) -> None:
    from llguidance import LLMatcher

    check(str(LLMatcher.grammar_from_lark(lark)), param)


def check_directives(parsed: Directives, budget: SchemaBudget) -> None:
    """Intake's check of a request's tools and schemas, in a worker thread: the budget over all
    of them (each tool is rendered into the prompt), then every schema decoding will enforce."""
    options, fmt = parsed.tools, parsed.text_format
    if len(options.tools) > budget.max_tools:
        raise SchemaError(
            f"tools has {len(options.tools)} entries, more than {budget.max_tools} (responses.max_tools)",
            param="tools",
        )
    schemas = [
        (f"{options.param(t)}.parameters", t.parameters)
        for t in options.tools
        if isinstance(t, FunctionTool) and t.parameters
    ]
    if isinstance(fmt, JsonSchemaFormat):
        schemas.insert(0, ("text.format.schema", fmt.schema))
    # A custom tool's grammar is rendered and compiled like a schema: its text counts too.
    grammars = [
        (f"{options.param(t)}.format.definition", t.format)
        for t in customs(options.tools)
        if isinstance(t.format, CustomGrammar)
    ]
    left = (budget.max_nodes, budget.max_chars)
    for param, schema in [*schemas, *((p, g.definition) for p, g in grammars)]:
        left = _measure(schema, param, left, budget)
    for param, custom in grammars:
        check_custom_grammar(custom, param)
    if isinstance(fmt, JsonSchemaFormat):
        check_schema(fmt.schema, "text.format.schema")
    if options.constrained:
        for tool in options.callable:
            if isinstance(tool, FunctionTool) and tool.parameters is not None:
                check_schema(tool.parameters, f"{options.param(tool)}.parameters")


def check_custom_grammar(custom: CustomGrammar, param: str) -> None:
    """400 unless llguidance compiles a custom tool's grammar, within the engine's parser limits:
    alone, and nested as the call grammar nests a Lark one (lmspd.prompting.grammar.custom_input;
    alone first, so a definition cannot close the nesting and add rules outside it)."""
    from llguidance import LLMatcher

    if custom.syntax == "regex":
        grammars = [LLMatcher.grammar_from_regex(custom.definition)]
    else:
        nested = f"%llguidance {{}}\nstart: nested\nnested: %lark {{\n{custom.definition}\n}}\n"
        grammars = [LLMatcher.grammar_from_lark(custom.definition), LLMatcher.grammar_from_lark(nested)]
    for grammar in grammars:
        error = LLMatcher.validate_grammar(grammar, limits=parser_limits())
        if error:
            first = error.strip().splitlines()[0]
            raise SchemaError(f"{param}: the {custom.syntax} grammar does not compile: {first}", param=param)


def check_schema(schema: Mapping[str, Any], param: str) -> None:
    """One schema (within the budget already): what llguidance cannot do per step, no finite
    instance, then llguidance's own validation."""
    doc = _Schema(schema)
    _check_rows(doc, param)
    _check_finite(doc, param)
    check(json_schema_grammar(schema), param)


def _measure(schema: Any, param: str, left: tuple[int, int], budget: SchemaBudget) -> tuple[int, int]:
    """What is left of the budget (nodes, characters) after ``schema``; 400 as soon as it is
    spent or the schema nests deeper than allowed. Nodes are objects, arrays and the entries
    of arrays (an enum's values); characters, those of every key and string (patterns, enum
    values, names, descriptions). Iterative, and it stops as soon as a limit is passed."""
    nodes, chars = left
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, str):
            chars -= len(node)
        elif isinstance(node, dict | list):
            nodes -= 1 if isinstance(node, dict) else 1 + len(node)
            if depth > budget.max_depth:
                raise SchemaError(
                    f"{param}: the schema nests deeper than {budget.max_depth} levels (responses.max_schema_depth)",
                    param=param,
                )
            if isinstance(node, dict):
                chars -= sum(len(k) for k in node)
            stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
        if nodes < 0:
            raise SchemaError(
                f"{param}: the request's schemas hold more than {budget.max_nodes} objects, arrays and "
                "array entries (responses.max_schema_nodes)",
                param=param,
            )
        if chars < 0:
            raise SchemaError(
                f"{param}: the request's schemas hold more than {budget.max_chars} characters of names and "
                "strings (responses.max_schema_chars)",
                param=param,
            )
    return nodes, chars


# --- finite instances -------------------------------------------------------------------------

_SCALARS = ("string", "number", "integer", "boolean", "null")
_TYPES = ("object", "array", *_SCALARS)
# A requirement holds when one of its alternatives does; an alternative, when all its
# (subschema, path) pairs have a finite instance.
Requirement = list[list[tuple[Any, Path]]]


def _subschemas(node: dict[str, Any]) -> Iterator[tuple[Any, Path]]:
    """The subschemas an instance of ``node`` may be made of (not ``$defs``: those count
    where a ``$ref`` uses them; not ``not``, whose instances are none of its own)."""
    for key in ("properties", "patternProperties", "dependentSchemas"):
        if isinstance(group := node.get(key), dict):
            yield from ((s, (key, name)) for name, s in group.items())
    for key in ("allOf", "anyOf", "oneOf", "prefixItems"):
        if isinstance(group := node.get(key), list):
            yield from ((s, (key, i)) for i, s in enumerate(group))
    items = node.get("items")
    if isinstance(items, list):  # draft 4-7 tuples
        yield from ((s, ("items", i)) for i, s in enumerate(items))
    for key in ("additionalProperties", "additionalItems", "contains", "propertyNames", "then", "else"):
        if isinstance(node.get(key), dict | bool):
            yield node[key], (key,)
    if isinstance(items, dict | bool):
        yield items, ("items",)


def _count(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _requirements(node: dict[str, Any], resolve: Any) -> list[Requirement]:
    """What an instance of ``node`` needs, as subschemas that must have instances."""
    needs: list[Requirement] = []
    if isinstance(node.get("$ref"), str) and (target := resolve(node["$ref"])) is not None:
        needs.append([[(target, ("$ref",))]])
    if isinstance(group := node.get("allOf"), list):
        needs += [[[(s, ("allOf", i))]] for i, s in enumerate(group)]
    for key in ("anyOf", "oneOf"):
        if isinstance(group := node.get(key), list) and group:
            needs.append([[(s, (key, i))] for i, s in enumerate(group)])
    if "const" in node or "enum" in node:
        return needs  # an instance is one of the values written down
    kind = node.get("type")
    named = [kind] if isinstance(kind, str) else kind if isinstance(kind, list) else []
    types = [t for t in named if t in _TYPES] or list(_TYPES)
    if any(t in _SCALARS for t in types):
        return needs  # a scalar is always finite (llguidance reports impossible bounds itself)
    alternatives: list[list[tuple[Any, Path]]] = []
    if "object" in types:
        alternatives += _object_needs(node)
    if "array" in types:
        alternatives.append(_array_needs(node))
    needs.append(alternatives)
    return needs


def _object_needs(node: dict[str, Any]) -> list[list[tuple[Any, Path]]]:
    found = node.get("properties")
    properties: dict[str, Any] = found if isinstance(found, dict) else {}
    extra = node.get("additionalProperties", True)
    required = [r for r in node.get("required") or [] if isinstance(r, str)]
    need: list[tuple[Any, Path]] = []
    for name in dict.fromkeys(required):
        if name in properties:
            need.append((properties[name], ("properties", name)))
        elif isinstance(extra, dict | bool):
            need.append((extra, ("additionalProperties",)))
    if _count(node.get("minProperties"), 0) <= len(set(required)):
        return [need]
    # More properties than required: one more optional one, or any number of others.
    more: list[tuple[Any, Path]] = [(s, ("properties", k)) for k, s in properties.items() if k not in required]
    if isinstance(extra, dict | bool):
        more.append((extra, ("additionalProperties",)))
    return [[*need, option] for option in more]


def _array_needs(node: dict[str, Any]) -> list[tuple[Any, Path]]:
    items = node.get("items", True)
    prefix_key = "items" if isinstance(items, list) else "prefixItems"
    found = node.get(prefix_key)
    prefix: list[Any] = found if isinstance(found, list) else []
    rest = node.get("additionalItems", True) if prefix_key == "items" else items
    rest_path: Path = ("additionalItems",) if prefix_key == "items" else ("items",)
    count = _count(node.get("minItems"), 0)
    need: list[tuple[Any, Path]] = [(s, (prefix_key, i)) for i, s in enumerate(prefix[:count])]
    if count > len(prefix) and isinstance(rest, dict | bool):
        need.append((rest, rest_path))
    if isinstance(node.get("contains"), dict | bool) and _count(node.get("minContains"), 1) > 0:
        need.append((node["contains"], ("contains",)))
    return need


class _Schema:
    """A schema document's subschemas, found from its root and its local ``$ref`` targets."""

    def __init__(self, root: Any) -> None:
        self.root = root
        self.where: dict[int, Path] = {}  # id(subschema) -> where it was found first
        self.nodes: list[dict[str, Any]] = []
        self.needs: dict[int, list[Requirement]] = {}
        queue: deque[tuple[Any, Path]] = deque([(root, ())])
        while queue:
            node, path = queue.popleft()
            if not isinstance(node, dict) or id(node) in self.where:
                continue
            self.where[id(node)] = path
            self.nodes.append(node)
            self.needs[id(node)] = _requirements(node, self.resolve)
            queue.extend((s, (*path, *rel)) for s, rel in _subschemas(node))
            if isinstance(node.get("$ref"), str) and (target := self.resolve(node["$ref"])) is not None:
                queue.append((target, self.pointer_path(node["$ref"])))

    @staticmethod
    def pointer_path(ref: str) -> Path:
        tokens = ref[2:].split("/") if ref.startswith("#/") else []
        return tuple(unquote(t).replace("~1", "/").replace("~0", "~") for t in tokens)

    def resolve(self, ref: str) -> Any:
        """A local ``$ref``'s target, or None (remote, anchors, missing: llguidance's to report)."""
        if ref != "#" and not ref.startswith("#/"):
            return None
        node: Any = self.root
        for token in self.pointer_path(ref):
            if isinstance(node, dict) and token in node:
                node = node[token]
            elif isinstance(node, list) and isinstance(token, str) and token.isdigit() and int(token) < len(node):
                node = node[int(token)]
            else:
                return None
        return node if isinstance(node, dict | bool) else None


def _holds(requirement: Requirement, finite: set[int]) -> bool:
    return any(all(_ok(s, finite) for s, _ in option) for option in requirement)


def _ok(schema: Any, finite: set[int]) -> bool:
    return schema is True or (isinstance(schema, dict) and id(schema) in finite)


def finite_instances(schema: Any, param: str) -> None:
    """400 unless every subschema an instance may use has a finite instance (below)."""
    _check_finite(_Schema(schema), param)


def _check_finite(doc: _Schema, param: str) -> None:
    """400 unless every subschema an instance may use has a finite instance.

    A least fixed point: nothing is known finite at first; a subschema is, once what it
    requires is (a ``$ref`` target, every ``allOf`` entry, one ``anyOf`` branch, its required
    properties, its ``minItems`` items...). Recursion with a way out (an optional property,
    ``minItems`` 0, a branch that ends) becomes finite; a cycle with none never does: the
    decoder could only ever go deeper, or finds no token at all. Linear in the schema's size
    (a worklist over who requires whom), which the budget bounds."""
    users: dict[int, list[dict[str, Any]]] = {}
    for node in doc.nodes:
        for requirement in doc.needs[id(node)]:
            for option in requirement:
                for child, _ in option:
                    users.setdefault(id(child), []).append(node)
    finite: set[int] = set()
    work = deque(doc.nodes)
    while work:
        node = work.popleft()
        if id(node) not in finite and all(_holds(r, finite) for r in doc.needs[id(node)]):
            finite.add(id(node))
            work.extend(users.get(id(node), []))
    for node in doc.nodes:  # breadth-first from the root: the shallowest culprit first
        if id(node) not in finite:
            _refuse(doc, node, finite, param)


def _refuse(doc: _Schema, start: dict[str, Any], finite: set[int], param: str) -> None:
    """400 naming the cycle that keeps ``start`` from ending, and the ``$ref`` that closes it."""
    trail: list[tuple[dict[str, Any], Path]] = []  # (subschema, the edge taken out of it)
    seen: dict[int, int] = {}
    node: Any = start
    while isinstance(node, dict) and id(node) not in seen:
        seen[id(node)] = len(trail)
        failing = next(r for r in doc.needs[id(node)] if not _holds(r, finite))
        blocked = [(s, p) for option in failing for s, p in option if isinstance(s, dict) and id(s) not in finite]
        if not blocked:
            return  # only false schemas in the way: llguidance names those itself
        trail.append((node, blocked[0][1]))
        node = blocked[0][0]
    cycle = trail[seen[id(node)] :]
    refs = [(owner, rel) for owner, rel in cycle if rel == ("$ref",)]
    owner, rel = refs[0] if refs else cycle[0]
    targets = {id(doc.resolve(o["$ref"])) for o, _ in refs}
    names = [_pointer(doc.where[id(n)]) for n, _ in cycle if id(n) in targets]
    if len(names) == 1:
        how = f"{names[0]} refers to itself"
    elif len(names) == 2:
        how = f"{names[0]} and {names[1]} refer to each other"
    else:
        how = f"{', '.join(names[:-1])} and {names[-1]} refer to one another"
    keyword = _dotted(param, (*doc.where[id(owner)], *rel))
    raise SchemaError(f"{param}: schema has no finite instance: {how} with no way out", param=keyword)


def _dotted(param: str, path: Path) -> str:
    out = param
    for token in path:
        out += f"[{token}]" if isinstance(token, int) else f".{token}"
    return out


def _pointer(path: Path) -> str:
    return "#" + "".join("/" + str(t).replace("~", "~0").replace("/", "~1") for t in path)


def _check_rows(doc: _Schema, param: str) -> None:
    """400 for an object with more optional properties than llguidance's parser row holds."""
    for node in doc.nodes:
        properties = node.get("properties")
        if not isinstance(properties, dict):
            continue
        required = {r for r in node.get("required") or [] if isinstance(r, str)}
        optional = sum(1 for name in properties if name not in required)
        if optional > MAX_OPTIONAL_PROPERTIES:
            where = _dotted(param, (*doc.where[id(node)], "properties"))
            raise SchemaError(
                f"{where}: {optional} optional properties, more than constrained decoding can offer at once "
                f"({MAX_OPTIONAL_PROPERTIES}); make some of them required",
                param=where,
            )
