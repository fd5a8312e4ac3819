"""The error tree: every class carries its status, and both envelopes are built from it."""

from __future__ import annotations

import msgspec
import pytest

from lmspd import errors as e
from lmspd.api.problems import openai_body, openai_response, problem_response


def _all(cls: type[e.LmspdError]) -> list[type[e.LmspdError]]:
    return [cls, *(sub for child in cls.__subclasses__() for sub in _all(child))]


@pytest.mark.parametrize("cls", _all(e.LmspdError), ids=lambda c: c.__name__)
def test_every_error_renders_as_a_problem_and_an_openai_error(cls: type[e.LmspdError]) -> None:
    exc = cls("what went wrong", param="field")
    problem = msgspec.json.decode(problem_response(exc).body)
    assert problem == {
        "type": f"urn:lmsp:problem:{cls.code}",
        "title": cls.title,
        "status": cls.status,
        "detail": "what went wrong",
        "code": cls.code,
        "param": "field",
    }
    response = openai_response(exc)
    assert response.status_code == (cls.openai_status or cls.status)
    body = msgspec.json.decode(response.body)["error"]
    assert (body["message"], body["param"], body["code"]) == ("what went wrong", "field", cls.openai_code)
    assert 400 <= cls.status < 600


@pytest.mark.parametrize(
    ("code", "cls", "status"),
    [
        ("model_not_found", e.ModelNotFoundError, 404),
        ("model_load_failed", e.ModelError, 500),  # exists but failed to load: not a 404
        ("context_length_exceeded", e.ContextLengthExceededError, 400),
        ("invalid_request", e.InvalidRequestError, 400),
        ("engine_crashed", e.EngineCrashedError, 500),
        ("rate_limit_exceeded", e.RateLimitError, 429),
        ("no_such_code", e.LmspdError, 500),
    ],
)
def test_codes_map_one_to_one_onto_classes(code: str, cls: type[e.LmspdError], status: int) -> None:
    exc = e.error_for(code, "m", param="p")
    assert type(exc) is cls and exc.status == status and exc.param == "p"


def test_a_full_queue_is_429_on_lmsp_and_503_overloaded_on_v1() -> None:
    exc = e.QueueFullError("full")
    assert problem_response(exc).status_code == 429 and problem_response(exc).headers["retry-after"] == "1"
    assert openai_response(exc).status_code == 503
    assert openai_body(exc).error.type == "overloaded"
    assert openai_response(e.UnauthorizedError("no")).headers["www-authenticate"] == "Bearer"
