"""responses/checks.py: ``accept`` is pure, and what it accepts carries its parsed directives
to intake, so a request is parsed once (the wire struct holds data only)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from lmspd.responses import schema as s
from lmspd.responses.checks import accept

TOOL: dict[str, Any] = {"type": "function", "name": "weather", "parameters": {"type": "object"}}
HOSTED: dict[str, Any] = {"type": "web_search"}


def decoded(**fields: Any) -> s.ResponseRequest:
    return msgspec.json.decode(msgspec.json.encode({"input": "hi", **fields}), type=s.ResponseRequest)


def test_accept_parses_the_directives_the_request_has() -> None:
    request = decoded(tools=[TOOL], tool_choice="required", text={"format": {"type": "json_object"}})
    accepted = accept(request)
    assert accepted.request is request
    assert accepted.directives == s.directives_of(request)
    assert [t.name for t in accepted.directives.tools.callable] == ["weather"]
    assert accepted.directives.tools.choice == "required"


def test_accept_leaves_the_decoded_request_as_it_was() -> None:
    request = decoded(tools=[TOOL, HOSTED])
    accepted = accept(request, hosted_tools="omit")
    assert request.tools == [TOOL, HOSTED]
    assert accepted.request.tools == [TOOL]
    assert accepted.omitted_tools == ("web_search",)
    assert accepted.directives == s.directives_of(accepted.request)


def test_a_copy_carries_the_directives_without_parsing_them_again() -> None:
    accepted = accept(decoded(tools=[TOOL]))
    copy = accepted.replace(input="other", include=[s.LOGPROBS], top_logprobs=2)
    assert copy.directives is accepted.directives
    assert (copy.request.input, copy.request.top_logprobs) == ("other", 2)
    task = copy.task(stop=["###"], seed=7)
    assert isinstance(task.request, s.TaskRequest)
    assert task.directives is accepted.directives
    assert (task.request.stop, task.request.seed, task.request.input) == (["###"], 7, "other")


@pytest.mark.parametrize("field", sorted(s.DIRECTIVE_FIELDS))
def test_a_copy_may_not_change_what_the_directives_are_parsed_from(field: str) -> None:
    accepted = accept(decoded())
    with pytest.raises(ValueError, match=field):
        accepted.replace(**{field: None})
    with pytest.raises(ValueError, match=field):
        accepted.task(**{field: None})


def test_the_wire_struct_holds_data_only() -> None:
    request = decoded(tools=[TOOL])
    assert not hasattr(request, "__dict__")
    assert msgspec.json.decode(msgspec.json.encode(request)) == {"input": "hi", "tools": [TOOL]}
