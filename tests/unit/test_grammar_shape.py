"""How a request's grammar is written: each tool's schema once, however many rules use it."""

from __future__ import annotations

import json

from lmspd.prompting import grammar
from lmspd.responses.tools import tool_options

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]+$"}}}


def test_a_tool_schema_is_written_once_whatever_the_choice() -> None:
    """Under ``auto`` the free-text rule and the later calls share one body rule: a copy
    doubled the grammar llguidance compiles (and every schema in it)."""
    tools = [{"type": "function", "name": f"f{i}", "parameters": SCHEMA} for i in range(3)]
    needle = json.dumps(SCHEMA)[:-1]  # the schema as the grammar embeds it (with its layout after)
    for choice in ("auto", "required", {"type": "function", "name": "f0"}):
        lark = grammar.build(
            text_format=None, tools=tool_options(tools, choice, None, None), tool_format="json_tools", special={}
        )
        assert lark is not None
        callable_tools = 1 if isinstance(choice, dict) else 3
        assert lark.count(needle) == callable_tools, (choice, lark)
