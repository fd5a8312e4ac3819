"""Codex CLI's own requests, replayed byte for byte against a real ``lmspd serve``.

The bodies are what ``codex exec`` 0.171.0 sent (``harness/data/codex/``, README there): its
~6,500-token prompt with 8 function tools, the ``multi_agent_v1`` namespace, ``web_search``
(or not), ``client_metadata``, ``include: ["reasoning.encrypted_content"]``,
``prompt_cache_key``, ``reasoning.summary``, ``store: false``; and turn 2, which replays the
whole history with the server's reasoning item, its ``function_call`` and Codex's
``function_call_output``. Sent with Codex's own headers (``session-id``, ``x-codex-*``, …).

The tiny random model with a 16k context stands in for the model (Codex's default request
is ~9,200 tokens once its namespace's functions are offered; it prefills in about a second):
what is checked is the request surface (docs/responses.md, "Coding agents"), not what the model says. ``thinker`` is
the tiny ``hermes_think`` family model, which opens a reasoning block, so its answers carry
reasoning items with ``encrypted_content``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.codex import Streamed, body, headers, post_stream, without_reasoning_tokens
from harness.families import make_family_tokenizer
from harness.models import make_tiny_model
from harness.openresponses import validate, validate_event
from harness.server import Server, tiny_server
from lmspd.models.registry import ResolvedModel

FINISHED = ("response.completed", "response.incomplete")
HOSTED = {"default-turn1": "web_search", "default-turn2": "web_search", "gpt-5.5-turn1": "tool_search"}


def models(tiny_16k: ResolvedModel, thinker: Path | None = None) -> str:
    """Codex names the model it was configured with: "smollm2" and "gpt-5.5" in the captures."""
    lines = f'[models.smollm2]\npath = "{tiny_16k.path}"\n[models."gpt-5.5"]\npath = "{tiny_16k.path}"\n'
    return lines + (f'[models.thinker]\npath = "{thinker}"\n' if thinker else "")


ENGINE = "max_loaded_models = 3\n"
SERVER = "default_max_output_tokens = 8\n"


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, model_cache: Path, smol_dir: Path, tiny_16k: ResolvedModel
) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("codex-replay")
    tokenizer = make_family_tokenizer(tmp / "thinker-tok", smol_dir, "hermes_think")
    thinker = make_tiny_model(tmp / "thinker", tokenizer, seed=0, context=16384)
    with tiny_server(tmp, model_cache, tiny_16k, engine=ENGINE, server=SERVER, models=models(tiny_16k, thinker)) as srv:
        srv.start()
        yield srv


@pytest.fixture(scope="module")
def omit_server(
    tmp_path_factory: pytest.TempPathFactory, model_cache: Path, tiny_16k: ResolvedModel
) -> Iterator[Server]:
    """``[responses] hosted_tools = "omit"``: hosted tools are left out of the prompt."""
    tmp = tmp_path_factory.mktemp("codex-replay-omit")
    responses = 'hosted_tools = "omit"\n'
    with tiny_server(
        tmp, model_cache, tiny_16k, engine=ENGINE, server=SERVER, models=models(tiny_16k), responses=responses
    ) as srv:
        srv.start()
        yield srv


def open_responses(event: dict[str, Any]) -> dict[str, Any]:
    """``event`` with its response's ``tools`` cut to the function tools: the response echoes
    the tools as declared, and Open Responses knows no ``namespace`` or ``custom`` tool (its
    ``Tool`` is ``FunctionTool`` alone), so the echo of Codex's cannot validate there."""
    response = event.get("response")
    if not isinstance(response, dict) or not response.get("tools"):
        return event
    tools = [tool for tool in response["tools"] if tool.get("type") == "function"]
    return {**event, "response": {**response, "tools": tools}}


def finished(answer: Streamed) -> dict[str, Any]:
    """The checks every accepted Codex request gets: 200, a stream Codex parses (each event
    valid against Open Responses, numbered in order, ending in completed or incomplete, then
    ``[DONE]``), and the final response valid."""
    assert answer.status == 200, answer.error
    for event in answer.events:
        validate_event(open_responses(event))
    assert [e["sequence_number"] for e in answer.events] == list(range(len(answer.events)))
    assert answer.events[0]["type"] == "response.created"
    assert answer.events[-1]["type"] in FINISHED, answer.events[-1]
    assert answer.done
    final = answer.final
    validate("ResponseResource", open_responses({"response": final})["response"])
    assert final["store"] is False
    return final


def turn2(name: str) -> dict[str, Any]:
    """Captured turn 2 with its reasoning token nulled: the capture stand-in's token is not
    lmspd's (that one is refused: below)."""
    payload = body(name)
    payload["input"] = without_reasoning_tokens(payload["input"])
    return payload


@pytest.mark.parametrize("name", ["no-web-search-turn1", "multi-agent-off-turn1", "gpt-5.5-turn1"])
def test_codex_turn1_is_accepted_and_streams(server: Server, name: str) -> None:
    """Every field Codex sends is accepted: client_metadata, the namespace tool,
    include reasoning.encrypted_content, prompt_cache_key, reasoning.summary, store false
    (and for gpt-5.5 the custom apply_patch tool with its Lark grammar, reasoning.effort,
    text.verbosity)."""
    payload = body(name)  # gpt-5.5 also sends tool_search, a hosted type: refused below, dropped here
    payload["tools"] = [t for t in payload["tools"] if t["type"] != "tool_search"]
    final = finished(post_stream(server.url, payload, headers()))
    assert final["usage"]["input_tokens"] > 6000  # the whole prompt, tools included
    # client_metadata is never rendered, and Codex's headers change nothing: the same prompt without them.
    bare = {k: v for k, v in payload.items() if k != "client_metadata"}
    assert finished(post_stream(server.url, bare))["usage"]["input_tokens"] == final["usage"]["input_tokens"]


@pytest.mark.parametrize(
    "name", ["no-web-search-turn2", "multi-agent-off-turn2", "gpt-5.5-turn2", "namespace-call-turn2"]
)
def test_codex_turn2_replay_is_accepted(server: Server, name: str) -> None:
    """Turn 2 replays the history with store false: a reasoning item (encrypted_content
    null), the function_call (in namespace-call-turn2, a namespaced one: ``name`` and
    ``namespace``) and Codex's function_call_output (with its own ``id``)."""
    payload = turn2(name)
    if name == "gpt-5.5-turn2":
        payload["tools"] = [t for t in payload["tools"] if t["type"] != "tool_search"]
    kinds = [item["type"] for item in payload["input"]]
    assert kinds[-3:] == ["reasoning", "function_call", "function_call_output"]
    finished(post_stream(server.url, payload, headers()))


def test_a_reasoning_token_lmspd_did_not_seal_is_refused_naming_the_item(server: Server) -> None:
    """As captured, turn 2's reasoning item carries the capture stand-in's token: it does
    not verify, so the request is a 400 naming the item (docs/responses.md, "Coding agents")."""
    payload = body("no-web-search-turn2")
    index = next(i for i, item in enumerate(payload["input"]) if item["type"] == "reasoning")
    answer = post_stream(server.url, payload, headers())
    assert answer.status == 400, answer.events[-1:] or answer.error
    assert answer.error is not None
    error = answer.error["error"]
    named = f"{error.get('param')} {error.get('message')}"
    assert f"input[{index}]" in named or payload["input"][index]["id"] in named, error


@pytest.mark.parametrize("name", sorted(HOSTED))
def test_hosted_tools_are_refused_by_default_saying_how_to_turn_them_off(server: Server, name: str) -> None:
    payload = turn2(name) if name.endswith("turn2") else body(name)
    answer = post_stream(server.url, payload, headers())
    assert answer.status == 400, answer.events[-1:]
    assert answer.error is not None
    message = answer.error["error"]["message"]
    assert HOSTED[name] in message
    if HOSTED[name] == "web_search":
        assert 'web_search = "disabled"' in message  # what to put in Codex's config


@pytest.mark.parametrize("name", sorted(HOSTED))
def test_hosted_tools_omit_leaves_them_out_and_says_so(omit_server: Server, name: str) -> None:
    payload = turn2(name) if name.endswith("turn2") else body(name)
    answer = post_stream(omit_server.url, payload, headers())
    final = finished(answer)
    assert HOSTED[name] in answer.headers.get("lmspd-omitted-tools", ""), dict(answer.headers)
    assert HOSTED[name] not in {tool["type"] for tool in final["tools"]}
    assert HOSTED[name] in omit_server.log.read_text()  # and the log says so


def test_a_codex_session_replayed_with_the_servers_reasoning_hits_the_prompt_cache(server: Server) -> None:
    """Codex's loop by hand, as it runs with ``store: false``: turn 1, then turn 2 = turn 1's
    input + the server's reasoning item (with the server's own ``encrypted_content``) + the
    call that followed it + the call's output, as captured. (Random weights never close a
    reasoning block, so the answer is reasoning alone and the call is Codex's captured one.)
    The sealed reasoning is opened and rendered, and turn 2 is served from the prompt cache
    for all of turn 1's prompt.

    Not asserted: that the cache also holds the reasoning's own tokens. The seal holds the
    reasoning's text, and random weights often say a token sequence that is not the
    tokenizer's own encoding of its text, so the rendered text re-tokenizes differently
    (0 to 8 of 8 such tokens reused, by the run)."""
    one = body("no-web-search-turn1")
    one["model"] = "thinker"
    first = finished(post_stream(server.url, one, headers()))
    reasoning = [item for item in first["output"] if item["type"] == "reasoning"]
    assert reasoning, first["output"]  # hermes_think opens a reasoning block
    assert all(isinstance(item.get("encrypted_content"), str) and item["encrypted_content"] for item in reasoning)
    captured = body("no-web-search-turn2")["input"]
    call = [item for item in captured if item["type"] in ("function_call", "function_call_output")]
    two = dict(one, input=[*one["input"], *first["output"], *call])
    second = finished(post_stream(server.url, two, headers()))
    # The same turn 2 with the reasoning left out: the sealed one renders as more prompt.
    bare = dict(one, input=[*one["input"], *call])
    without = finished(post_stream(server.url, bare, headers()))
    assert second["usage"]["input_tokens"] > without["usage"]["input_tokens"]
    cached = second["usage"]["input_tokens_details"]["cached_tokens"]
    assert cached >= first["usage"]["input_tokens"], (first["usage"], second["usage"])
