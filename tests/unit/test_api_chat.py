"""A failed chat completion answers the status its error stands for, in OpenAI's envelope."""

from __future__ import annotations

import json

import pytest

from lmspd.api.chat import failed_error
from lmspd.api.problems import openai_response
from lmspd.responses import schema as s


def failed(code: str | None) -> s.Response:
    error = None if code is None else s.ResponseError(code=code, message=f"it failed: {code}")
    return s.Response(id="resp_1", created_at=0, model="m", status="failed", output=[], error=error)


@pytest.mark.parametrize(
    ("code", "status", "kind"),
    [
        ("context_length_exceeded", 400, "invalid_request_error"),
        ("invalid_prompt", 400, "invalid_request_error"),
        ("invalid_request", 400, "invalid_request_error"),
        ("engine_crashed", 500, "server_error"),
        ("server_restarted", 500, "server_error"),
        ("something_new", 500, "server_error"),
        (None, 500, "server_error"),
    ],
)
def test_a_failed_generation_answers_its_errors_status(code: str | None, status: int, kind: str) -> None:
    answer = openai_response(failed_error(failed(code)))
    body = json.loads(bytes(answer.body))
    assert answer.status_code == status
    assert body["error"]["type"] == kind
    assert body["error"]["message"] == (f"it failed: {code}" if code else "the response ended failed")
