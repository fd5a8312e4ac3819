"""lmspd's own invariants, as schemathesis checks (loaded by ``harness.fuzz`` through SCHEMATHESIS_HOOKS).

``error_shape``: every error body is what its surface promises: Anthropic's envelope on the
Messages API (docs/messages.md), OpenAI's on the rest of /v1 and its aliases, an RFC 9457
problem object (``application/problem+json``) on /lmsp/v1 and the rest; a 401 says ``WWW-Authenticate: Bearer``.

``auth_enforced``: with ``LMSPD_FUZZ_EXPECT=401`` (a server with tokens, fuzzed without one or
with a wrong one), no route but the public ones answers anything but an error.
"""

from __future__ import annotations

import json
import os
from typing import Any

import schemathesis

PUBLIC = frozenset({"/healthz", "/lmsp/v1/healthz", "/readyz", "/openapi.json"})


def _anthropic_path(path: str) -> bool:
    return path.removeprefix("/v1").partition("/")[2].split("/")[0] == "messages"


def _openai_path(path: str) -> bool:
    return path.startswith(("/v1/", "/responses", "/chat/")) and not _anthropic_path(path)


def _body(response: schemathesis.Response) -> Any:
    try:
        return json.loads(response.content)
    except ValueError:
        raise AssertionError(f"error body is not JSON: {response.content[:200]!r}") from None


def _media(response: schemathesis.Response) -> str:
    values = response.headers.get("content-type") or [""]
    return values[0].partition(";")[0].strip()


@schemathesis.check
def error_shape(ctx: schemathesis.CheckContext, response: schemathesis.Response, case: schemathesis.Case[Any]) -> None:
    if response.status_code < 400:
        return
    path = response.request.path_url.partition("?")[0]
    authenticate = response.headers.get("www-authenticate") or []
    check_error(path, response.status_code, _media(response), _body(response), authenticate)


def check_error(path: str, status: int, media: str, body: Any, authenticate: list[str]) -> None:
    """``error_shape`` on an answer's parts (also ``harness.fuzz``'s hand-written attacks')."""
    if _anthropic_path(path):
        assert media == "application/json", f"{status} on {path} is {media}"
        assert isinstance(body, dict) and body.get("type") == "error", f"not Anthropic's envelope: {body!r}"
        error = body.get("error")
        assert isinstance(error, dict) and set(error) == {"type", "message"}, body
        assert isinstance(error["message"], str) and isinstance(error["type"], str), body
    elif _openai_path(path):
        assert media == "application/json", f"{status} on {path} is {media}"
        error = body.get("error") if isinstance(body, dict) else None
        assert isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}, (
            f"{status} on {path} is not OpenAI's error envelope: {body!r}"
        )
        assert isinstance(error["message"], str) and isinstance(error["type"], str), body
        assert error["param"] is None or isinstance(error["param"], str), body
        assert error["code"] is None or isinstance(error["code"], str), body
    else:
        assert media == "application/problem+json", f"{status} on {path} is {media}"
        assert isinstance(body, dict), body
        assert str(body.get("type", "")).startswith("urn:lmsp:problem:"), f"not a problem object: {body!r}"
        assert body.get("status") == status, f"problem status {body.get('status')} on a {status}: {body!r}"
        assert isinstance(body.get("title"), str) and isinstance(body.get("code"), str), body
        assert body["type"] == f"urn:lmsp:problem:{body['code']}", body
    if status == 401:
        assert authenticate == ["Bearer"], f"401 without WWW-Authenticate: {path}"


@schemathesis.check
def auth_enforced(
    ctx: schemathesis.CheckContext, response: schemathesis.Response, case: schemathesis.Case[Any]
) -> None:
    if os.environ.get("LMSPD_FUZZ_EXPECT") != "401":
        return
    path = response.request.path_url.partition("?")[0]
    if path in PUBLIC or path == "/" or path.startswith("/console/"):  # the console's page and assets
        return
    # A 404/405 only from the router (a generated path parameter with a "/" in it matches no
    # route): it answers before any handler, so nothing of anyone's is read.
    if response.status_code in (404, 405):
        body = _body(response)
        openai_like = _openai_path(path) or _anthropic_path(path)
        said = body["error"]["message"] if openai_like else body.get("detail")
        assert said in ("Not Found", "Method Not Allowed"), f"{case.method} {path} without a valid token: {body!r}"
        return
    assert response.status_code == 401, f"{case.method} {path} without a valid token: {response.status_code}"
