"""Grammar and schema attacks through a real ``lmspd serve`` (docs/reliability.md#grammar-and-schema-attacks):
a tool schema built to be expensive must not slow other requests, a schema with no finite
instance is a 400 naming the keyword on every surface, and a huge tool list or schema leaves
the server answering while intake takes it apart. No figure here is absolute: each request
is compared with itself, measured alone in the same test.

The model is the tiny one with a 32k context, so a prompt that renders a thousand-entry tool
schema fits and is not refused for its length alone.
"""

from __future__ import annotations

import itertools
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness.models import make_tiny_model
from harness.server import Server, tiny_server
from lmspd.models.registry import ResolvedModel

# A thousand copies of one small subschema: its prompt is ~14k tokens, its grammar an
# intersection of a thousand schemas.
ALL_OF = {"type": "object", "allOf": [{"properties": {"a": {"type": "string"}}} for _ in range(1000)]}
ENDLESS: list[tuple[str, dict[str, Any], str]] = [
    ("root-ref", {"$ref": "#"}, "$ref"),
    ("def-self", {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, "$defs.a.$ref"),
    (
        "defs-mutual",
        {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
        "$defs.a.$ref",
    ),
    (
        "required-self",
        {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]},
        "properties.next.$ref",
    ),
    ("min-items-self", {"type": "array", "items": {"$ref": "#"}, "minItems": 1}, "items.$ref"),
    ("all-of-self", {"allOf": [{"$ref": "#"}]}, "allOf[0].$ref"),
    ("prefix-items-self", {"type": "array", "prefixItems": [{"$ref": "#"}], "minItems": 1}, "prefixItems[0].$ref"),
    (
        "min-properties-self",
        {"type": "object", "additionalProperties": {"$ref": "#"}, "minProperties": 1},
        "additionalProperties.$ref",
    ),
]
VICTIM = {"model": "tiny", "input": "Tell me a story.", "temperature": 0, "max_output_tokens": 48}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, model_cache: Path, smol_dir: Path) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("grammar-attacks")
    wide = ResolvedModel(name="tiny", path=make_tiny_model(tmp / "tiny32k", smol_dir, context=32768))
    with tiny_server(tmp, model_cache, wide, engine="max_concurrency = 4\n") as srv:
        srv.start()
        yield srv


def victim_seconds(url: str) -> float:
    start = time.perf_counter()
    r = httpx.post(f"{url}/v1/responses", json=VICTIM, timeout=300)
    assert r.status_code == 200 and r.json()["usage"]["output_tokens"] == 48, r.text
    return time.perf_counter() - start


def test_a_thousand_fold_all_of_tool_does_not_slow_other_requests(server: Server) -> None:
    """It used to be accepted and rendered into a 14k-token prompt whose prefill the victim's
    every step then waited on (~30 times slower here); its schema is now past the budget."""
    victim_seconds(server.url)  # warm-up
    alone = statistics.median(victim_seconds(server.url) for _ in range(3))
    tool = {"type": "function", "name": "fill", "parameters": ALL_OF}
    body = {"model": "tiny", "input": "Fill it in.", "tools": [tool], "max_output_tokens": 64, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/responses", json=body, timeout=300) as attack:
        accepted = attack.status_code == 200
        if accepted:
            next(attack.iter_lines())  # it runs while the victim does (leaving cancels it)
        beside = victim_seconds(server.url)
        if not accepted:
            attack.read()
    print(f"victim alone {alone:.3f} s, beside the attack {beside:.3f} s")
    assert beside < 5 * alone, f"the victim took {beside:.2f} s beside the attack, {alone:.2f} s alone"
    assert not accepted and attack.status_code == 400, attack.status_code
    error = attack.json()["error"]
    assert error["param"] == "tools[0].parameters" and "responses.max_schema_nodes" in error["message"], error


def _requests(surface: str, schema: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    fmt = {"type": "json_schema", "name": "out", "schema": schema}
    if surface == "chat":
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        return "/v1/chat/completions", {**chat, "response_format": {"type": "json_schema", "json_schema": fmt}}
    request = {"model": "tiny", "input": "hi", "max_output_tokens": 4, "text": {"format": fmt}}
    if surface == "tasks":
        return "/lmsp/v1/tasks", {"type": "response", "input": request}
    return "/v1/responses", request


@pytest.mark.parametrize(("schema", "keyword"), [c[1:] for c in ENDLESS], ids=[c[0] for c in ENDLESS])
def test_a_schema_with_no_finite_instance_is_a_400_naming_the_keyword(
    server: Server, schema: dict[str, Any], keyword: str
) -> None:
    for surface, param in (
        ("responses", f"text.format.schema.{keyword}"),
        ("chat", f"response_format.json_schema.schema.{keyword}"),  # named as Chat's field
        ("tasks", f"input.text.format.schema.{keyword}"),
    ):
        path, body = _requests(surface, schema)
        r = httpx.post(f"{server.url}{path}", json=body, timeout=60)
        assert r.status_code == 400, (surface, r.text)
        error = r.json().get("error", r.json())
        assert error["param"] == param, (surface, error)
        message = error.get("message", error.get("detail"))
        assert "schema has no finite instance" in message and "with no way out" in message, (surface, error)


class Probe:
    """/healthz asked back to back from a thread; the longest wait between two answers."""

    def __init__(self, url: str) -> None:
        self.url, self.answered, self.running = url, [time.perf_counter()], True
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        with httpx.Client(timeout=60) as client:
            while self.running:
                assert client.get(f"{self.url}/healthz").status_code == 200
                self.answered.append(time.perf_counter())

    def longest_gap_during(self, work: Callable[[], None], at_least: int = 50) -> float:
        """Probes answered while ``work`` runs (and until ``at_least`` are), their longest gap."""
        first = len(self.answered)
        work()
        while len(self.answered) < first + at_least:
            time.sleep(0.005)
        stamps = self.answered[first - 1 :]
        return max(b - a for a, b in itertools.pairwise(stamps))


@pytest.mark.parametrize("what", ["10k-tools", "10k-properties"])
def test_a_huge_tool_list_or_schema_leaves_the_server_answering(server: Server, what: str) -> None:
    """Intake took them apart on the event loop: seconds without a /healthz answer."""
    if what == "10k-tools":
        extra: dict[str, Any] = {"tools": [{"type": "function", "name": f"t{i}"} for i in range(10_000)]}
    else:
        properties = {f"p{i}": {"type": "string"} for i in range(10_000)}
        extra = {
            "text": {
                "format": {"type": "json_schema", "name": "out", "schema": {"type": "object", "properties": properties}}
            }
        }
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 4, **extra}
    probe = Probe(server.url)
    probe.thread.start()
    try:
        idle = probe.longest_gap_during(lambda: None)
        answers: list[httpx.Response] = []
        busy = probe.longest_gap_during(
            lambda: answers.append(httpx.post(f"{server.url}/v1/responses", json=body, timeout=120))
        )
    finally:
        probe.running = False
        probe.thread.join(60)
    print(f"{what}: longest /healthz gap {busy * 1000:.1f} ms during the request, {idle * 1000:.1f} ms idle")
    assert busy < 25 * idle, f"/healthz waited {busy * 1000:.0f} ms during the request, {idle * 1000:.0f} ms idle"
    assert answers[0].status_code == 400, answers[0].text
    assert answers[0].json()["error"]["param"] == ("tools" if what == "10k-tools" else "text.format.schema")


def test_a_json_schema_format_without_a_name_is_a_400(server: Server) -> None:
    """OpenAI requires the name (text.format.name; Chat's response_format.json_schema.name)."""
    for surface, param in (
        ("responses", "text.format.name"),
        ("chat", "response_format.json_schema.name"),
        ("tasks", "input.text.format.name"),
    ):
        path, body = _requests(surface, {"type": "object"})
        request = body["input"] if surface == "tasks" else body
        fmt = body["response_format"]["json_schema"] if surface == "chat" else request["text"]["format"]
        del fmt["name"]
        r = httpx.post(f"{server.url}{path}", json=body, timeout=60)
        assert r.status_code == 400, (surface, r.text)
        error = r.json().get("error", r.json())
        assert error["param"] == param and "name" in error.get("message", error.get("detail")), (surface, error)
