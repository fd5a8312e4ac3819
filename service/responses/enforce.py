"""Which JSON schemas constrained decoding can enforce: a schema's grammar (llguidance, in
lmspd's one layout) and the check that answers 400 naming the keyword it cannot enforce.

Intake checks a request's schemas here (:attr:`lmspd.responses.schema.ResponseRequest.directives`);
:mod:`lmspd.prompting.grammar` builds whole grammars on the same layout. llguidance is imported
on first use, so the server starts without it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from lmspd.errors import InvalidRequestError

# One canonical spacing: what json.dumps writes and chat templates show models, and a
# bounded choice at every separator (free whitespace lets a weak model ramble).
_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_UNIMPLEMENTED = re.compile(r'Unimplemented keys: \["([^"]+)"')


def with_layout(schema: Mapping[str, Any]) -> dict[str, Any]:
    return {**schema, "x-guidance": {**_LAYOUT, **schema.get("x-guidance", {})}}


def json_schema_grammar(schema: Mapping[str, Any]) -> str:
    from llguidance import LLMatcher

    return str(LLMatcher.grammar_from_json_schema(with_layout(schema)))


def check(grammar: str, param: str) -> None:
    """400 naming the schema keyword (or the reason) the grammar cannot enforce."""
    from llguidance import LLMatcher

    error = LLMatcher.validate_grammar(grammar)
    if error:
        found = _UNIMPLEMENTED.search(error)
        where = f"{param}.{found.group(1)}" if found else param
        what = f"keyword '{found.group(1)}' cannot be enforced" if found else error.strip().splitlines()[0]
        raise InvalidRequestError(f"{param}: {what} by constrained decoding", param=where)


def check_lark(lark: str, param: str) -> None:
    from llguidance import LLMatcher

    check(str(LLMatcher.grammar_from_lark(lark)), param)
