"""Intake's checks of a request's tools and schemas (``lmspd.responses.enforce``): the budget,
what llguidance's parser cannot do per step, and schemas with no finite instance, each a 400
naming the field, the keyword or the limit. The same requests through a real server:
tests/api/test_grammar_attacks.py."""

from __future__ import annotations

from typing import Any

import pytest

from lmspd.config import ResponsesConfig
from lmspd.errors import InvalidRequestError
from lmspd.responses.enforce import MAX_OPTIONAL_PROPERTIES, SchemaBudget, SchemaError, check_directives
from lmspd.responses.tools import directives

BUDGET = SchemaBudget.of(ResponsesConfig())

# (schema, the keyword the 400 names, the cycle it describes)
ENDLESS: list[tuple[str, dict[str, Any], str, str]] = [
    ("root-ref", {"$ref": "#"}, "$ref", "# refers to itself"),
    ("def-self", {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, "$defs.a.$ref", "#/$defs/a refers"),
    (
        "defs-mutual",
        {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
        "$defs.a.$ref",
        "#/$defs/a and #/$defs/b refer to each other",
    ),
    (
        "required-self",
        {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]},
        "properties.next.$ref",
        "# refers to itself",
    ),
    ("min-items-self", {"type": "array", "items": {"$ref": "#"}, "minItems": 1}, "items.$ref", "# refers"),
    ("all-of-self", {"allOf": [{"$ref": "#"}]}, "allOf[0].$ref", "# refers to itself"),
    (
        "any-of-all-recurse",
        {
            "$defs": {
                "a": {"type": "object", "properties": {"x": {"$ref": "#/$defs/b"}}, "required": ["x"]},
                "b": {
                    "anyOf": [{"$ref": "#/$defs/a"}, {"type": "array", "items": {"$ref": "#/$defs/b"}, "minItems": 1}]
                },
            },
            "$ref": "#/$defs/a",
        },
        "$defs.a.properties.x.$ref",
        "#/$defs/a and #/$defs/b refer to each other",
    ),
    (
        "min-properties-self",
        {"type": "object", "additionalProperties": {"$ref": "#"}, "minProperties": 1},
        "additionalProperties.$ref",
        "# refers to itself",
    ),
]
FINITE: list[dict[str, Any]] = [
    {"type": "object", "properties": {"next": {"$ref": "#"}}},  # a list that may end
    {"$defs": {"n": {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/n"}}}}}},
    {
        "$defs": {
            "node": {"type": "object", "properties": {"next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}}}
        },
        "$ref": "#/$defs/node",
    },
    {"properties": {"next": {"$ref": "#"}}, "required": ["next"]},  # no type: a scalar ends it
    {"$defs": {"unused": {"$ref": "#/$defs/unused"}}, "type": "string"},  # never reached
]


def check(**fields: Any) -> None:
    check_directives(
        directives(
            **{
                **dict.fromkeys(("tools", "tool_choice", "parallel_tool_calls", "max_tool_calls", "text", "reasoning")),
                **fields,
            }
        ),
        BUDGET,
    )


def fmt(schema: dict[str, Any]) -> dict[str, Any]:
    return {"format": {"type": "json_schema", "name": "out", "schema": schema}}


@pytest.mark.parametrize(("schema", "keyword", "how"), [c[1:] for c in ENDLESS], ids=[c[0] for c in ENDLESS])
def test_a_schema_with_no_finite_instance_names_the_ref_that_closes_its_cycle(
    schema: dict[str, Any], keyword: str, how: str
) -> None:
    with pytest.raises(SchemaError) as info:
        check(text=fmt(schema))
    assert info.value.param == f"text.format.schema.{keyword}"
    assert "schema has no finite instance" in info.value.message and how in info.value.message
    if schema.get("type", "object") == "object":  # what a tool's parameters may be
        tool = {"type": "function", "name": "f", "parameters": schema}
        with pytest.raises(SchemaError) as info:
            check(tools=[tool], tool_choice="required")
        assert info.value.param == f"tools[0].parameters.{keyword}"


@pytest.mark.parametrize("schema", FINITE)
def test_recursion_with_a_way_out_is_accepted(schema: dict[str, Any]) -> None:
    check(text=fmt(schema))


def test_three_definitions_in_a_cycle_are_named_in_order() -> None:
    defs = {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/c"}, "c": {"allOf": [{"$ref": "#/$defs/a"}]}}
    with pytest.raises(SchemaError, match="#/\\$defs/a, #/\\$defs/b and #/\\$defs/c refer to one another"):
        check(text=fmt({"$defs": defs, "type": "object", "properties": {"v": {"$ref": "#/$defs/a"}}}))


def test_an_unforced_tool_schema_is_only_measured() -> None:
    """Under auto, a non-strict tool is rendered, never enforced: only the budget applies."""
    tool = {
        "type": "function",
        "name": "f",
        "strict": False,
        "parameters": {"type": "object", "allOf": [{"$ref": "#"}]},
    }
    check(tools=[tool], tool_choice="auto")


def test_the_budget_names_the_field_and_the_limit() -> None:
    wide = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(BUDGET.max_nodes)}}
    with pytest.raises(SchemaError, match=r"responses\.max_schema_nodes") as info:
        check(text=fmt(wide))
    assert info.value.param == "text.format.schema"
    # Counted over the whole request: the tool that spends the rest is named.
    half = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(BUDGET.max_nodes // 2)}}
    tools = [{"type": "function", "name": f"f{i}", "parameters": half} for i in range(3)]
    with pytest.raises(SchemaError, match=r"responses\.max_schema_nodes") as info:
        check(tools=tools)
    assert info.value.param == "tools[1].parameters"
    deep: dict[str, Any] = {"type": "string"}
    for _ in range(BUDGET.max_depth):
        deep = {"type": "object", "properties": {"a": deep}}
    with pytest.raises(SchemaError, match=r"responses\.max_schema_depth") as info:
        check(text=fmt(deep))
    assert info.value.param == "text.format.schema"
    values = {"enum": [f"v{i}" for i in range(BUDGET.max_nodes)]}  # an enum's values count
    with pytest.raises(SchemaError, match=r"responses\.max_schema_nodes"):
        check(text=fmt(values))
    pattern = {"type": "string", "pattern": "^(" + "|".join(f"w{i}" for i in range(BUDGET.max_chars // 4)) + ")$"}
    with pytest.raises(SchemaError, match=r"responses\.max_schema_chars") as info:
        check(text=fmt(pattern))
    assert info.value.param == "text.format.schema"
    many = [{"type": "function", "name": f"f{i}"} for i in range(BUDGET.max_tools + 1)]
    with pytest.raises(SchemaError, match=r"responses\.max_tools") as info:
        check(tools=many)
    assert info.value.param == "tools"


def test_a_schema_at_the_depth_limit_compiles() -> None:
    """The depth limit sits below what llguidance reads (it fails past 128 JSON levels)."""
    deep: dict[str, Any] = {"type": "string"}
    while True:
        wrapped = {"type": "object", "properties": {"a": deep}}
        if _depth(wrapped) > BUDGET.max_depth:
            break
        deep = wrapped
    check(text=fmt(deep))


def _depth(node: Any) -> int:
    if isinstance(node, dict):
        return 1 + max((_depth(v) for v in node.values()), default=0)
    if isinstance(node, list):
        return 1 + max((_depth(v) for v in node), default=0)
    return 0


def test_more_optional_properties_than_the_parser_holds_are_refused() -> None:
    """Past the limit llguidance validates the grammar, then fails at the object's first key in
    the middle of a response; at the limit it decodes (tests/engine/test_grammar_budget.py)."""

    def props(n: int) -> dict[str, Any]:
        return {f"p{i}": {"type": "string"} for i in range(n)}

    check(text=fmt({"type": "object", "properties": props(MAX_OPTIONAL_PROPERTIES)}))
    inner = {"type": "object", "properties": props(MAX_OPTIONAL_PROPERTIES + 1)}
    with pytest.raises(SchemaError, match="optional properties") as info:
        check(text=fmt({"type": "object", "properties": {"inner": inner}}))
    assert info.value.param == "text.format.schema.properties.inner.properties"
    # Required ones cost the parser nothing at each key.
    names = list(props(MAX_OPTIONAL_PROPERTIES + 1))
    check(text=fmt({"type": "object", "properties": props(len(names)), "required": names[:10]}))


def test_a_json_schema_format_needs_a_name() -> None:
    """OpenAI requires text.format.name (and Chat's response_format.json_schema.name)."""
    with pytest.raises(InvalidRequestError) as info:
        check(text={"format": {"type": "json_schema", "schema": {"type": "object"}}})
    assert info.value.param == "text.format.name" and "text.format.name" in info.value.message
