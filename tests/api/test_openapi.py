"""The OpenAPI document: valid OpenAPI 3.1, every route of the app and nothing else, errors
per path family, served at /openapi.json and printed by ``lmspd openapi``.

``harness/data/openapi-3.1-schema.json`` is the OpenAPI Initiative's published schema for 3.1 documents
(https://spec.openapis.org/oas/3.1/schema/2022-10-07, Apache-2.0), vendored verbatim so the test
runs offline. Its ``$dynamicRef: "#meta"`` (a hook for schemas that extend it) resolves to its own
``$defs/schema`` here, so it is read with that as a plain ``$ref``: the same check, five times
faster with ``jsonschema``. It leaves Schema Objects to their dialect: each component is checked
against the Draft 7 meta-schema, whose keyword shapes are those of 2020-12 for every keyword
msgspec writes (the 2020-12 meta-schema's own dynamic references cost seconds).
"""

from __future__ import annotations

import copy
import json
from typing import Any

import httpx
import jsonschema
import msgspec
import pytest
from starlette.applications import Starlette
from starlette.routing import Route

from harness import DATA
from lmspd.api.app import create_app
from lmspd.api.openapi import document
from lmspd.api.problems import openai_body
from lmspd.cli.main import main
from lmspd.config import Config
from lmspd.errors import QueueFullError, TaskNotFoundError
from lmspd.messages.view import error_body

META = json.loads(
    (DATA / "openapi-3.1-schema.json").read_text().replace('"$dynamicRef": "#meta"', '"$ref": "#/$defs/schema"')
)
Doc = dict[str, Any]


@pytest.fixture(scope="module")
def app() -> Starlette:
    return create_app(Config())  # its lifespan (database, engine) never runs here


@pytest.fixture(scope="module")
def doc(app: Starlette) -> Doc:
    decoded: Doc = json.loads(msgspec.json.encode(document(app.routes)))
    return decoded


def _operations(doc: Doc) -> list[tuple[str, str, Doc]]:
    return [(path, method, op) for path, ops in doc["paths"].items() for method, op in ops.items()]


def _conforms(doc: Doc, schema: Doc, instance: object) -> None:
    """``instance`` is valid against ``schema``, whose refs point into the document's components."""
    jsonschema.Draft202012Validator({**schema, "components": doc["components"]}).validate(instance)


def _refs(node: object) -> list[str]:
    if isinstance(node, dict):
        return [v for k, v in node.items() if k == "$ref" and isinstance(v, str)] + [
            r for v in node.values() for r in _refs(v)
        ]
    return [r for v in node for r in _refs(v)] if isinstance(node, list) else []


def test_openapi_document_is_valid_openapi_3_1(doc: Doc) -> None:
    jsonschema.Draft202012Validator(META).validate(doc)
    assert doc["openapi"].startswith("3.1.")
    for schema in doc["components"]["schemas"].values():
        jsonschema.Draft7Validator.check_schema(schema)
    for ref in _refs(doc):  # every reference resolves, within the document
        assert ref.startswith("#/components/schemas/"), ref
        assert ref.removeprefix("#/components/schemas/") in doc["components"]["schemas"], ref
    ids = [op["operationId"] for _, _, op in _operations(doc)]
    assert len(ids) == len(set(ids))
    broken = copy.deepcopy(doc)  # the meta-schema does reject what is not OpenAPI
    broken["paths"]["/healthz"]["get"]["responses"] = ["200"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft202012Validator(META).validate(broken)


def test_openapi_documents_every_route_and_nothing_else(app: Starlette, doc: Doc) -> None:
    served = set()
    for route in app.routes:
        assert isinstance(route, Route) and route.methods
        served |= {(route.path_format, m.lower()) for m in route.methods if m != "HEAD"}  # HEAD: Starlette's, of GET
    assert {(path, method) for path, method, _ in _operations(doc)} == served
    assert {"/v1/responses", "/responses", "/lmsp/v1/tasks/{task_id}/events", "/healthz", "/openapi.json"} <= {
        path for path, _ in served
    }


def test_openapi_errors_streams_and_bodies_per_path(doc: Doc) -> None:
    for path, method, op in _operations(doc):
        anthropic = path.removeprefix("/v1").startswith("/messages")
        openai = path.startswith(("/v1/", "/responses", "/chat/")) and not anthropic
        media, body = ("application/json", "OpenAIError") if openai else ("application/problem+json", "Problem")
        if anthropic:
            media, body = "application/json", "AnthropicError"
            assert "503" not in op["responses"], (method, path)  # Anthropic's overloaded is its 529
            if path.endswith("/messages"):
                assert "overloaded_error" in op["responses"]["529"]["description"]
        errors = {status: r for status, r in op["responses"].items() if status == "default" or status >= "400"}
        if path == "/readyz":
            assert errors.pop("503")["content"]["application/json"]["schema"]["$ref"].endswith("/Health")
        assert "default" in errors, (method, path)
        for response in errors.values():
            assert response["content"] == {media: {"schema": {"$ref": f"#/components/schemas/{body}"}}}, (method, path)
        if op["security"]:  # a token may be required: a 401 is documented
            assert "401" in errors, (method, path)
    sse = {
        (p, m)
        for p, m, op in _operations(doc)
        for r in op["responses"].values()
        if "text/event-stream" in r.get("content", {})
    }
    assert sse == {
        *((f"{prefix}/responses", "post") for prefix in ("/v1", "", "/lmsp/v1")),
        *((f"{prefix}/responses/{{response_id}}", "get") for prefix in ("/v1", "")),
        *((f"{prefix}/chat/completions", "post") for prefix in ("/v1", "")),
        *((f"{prefix}/messages", "post") for prefix in ("/v1", "")),
        ("/lmsp/v1/tasks/{task_id}/events", "get"),
    }
    # Messages streams end with their last event: no [DONE]
    messages = doc["paths"]["/v1/messages"]["post"]["responses"]["200"]["content"]["text/event-stream"]["schema"]
    assert "[DONE]" not in json.dumps(messages["properties"]["data"])
    create = doc["paths"]["/lmsp/v1/tasks"]["post"]
    assert create["requestBody"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/TaskCreate"}
    assert create["responses"]["202"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/TaskObject"
    }
    assert create["responses"]["429"]["description"].startswith("Too many queued tasks")
    assert doc["paths"]["/v1/responses"]["post"]["responses"]["503"]["description"].startswith("Too many queued tasks")
    # the error bodies the app renders are what the document says
    problem = TaskNotFoundError("no such task", param="task_id").problem()
    _conforms(doc, {"$ref": "#/components/schemas/Problem"}, json.loads(msgspec.json.encode(problem)))
    envelope = openai_body(QueueFullError("too many queued tasks"))
    _conforms(doc, {"$ref": "#/components/schemas/OpenAIError"}, json.loads(msgspec.json.encode(envelope)))
    overloaded = error_body(QueueFullError("too many queued tasks"))
    _conforms(doc, {"$ref": "#/components/schemas/AnthropicError"}, json.loads(msgspec.json.encode(overloaded)))


async def test_openapi_served_and_printed(app: Starlette, doc: Doc, capsys: pytest.CaptureFixture[str]) -> None:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as client:
        served = await client.get("/openapi.json")
        health = await client.get("/healthz")
    assert served.status_code == 200 and served.headers["content-type"] == "application/json"
    assert served.json() == doc
    schema = doc["paths"]["/healthz"]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
    _conforms(doc, schema, health.json())
    assert main(["openapi"]) == 0
    assert json.loads(capsys.readouterr().out) == doc
