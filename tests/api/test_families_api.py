"""Each tool-call template family on the real engine path: a tiny random-weight model per
family (its real marker tokens, its own chat template) behind one ``lmspd serve``.

Random weights say nothing sensible, so a valid call under ``tool_choice: required`` proves
the grammar for the family's call syntax, and the parse that reads it back."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from harness.families import FAMILY_FORMAT, make_family_tokenizer
from harness.models import make_tiny_model
from harness.openresponses import validate, validate_event
from harness.server import Server, tiny_server
from lmspd.models.registry import ResolvedModel

PARAMS = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
        "metric": {"type": "boolean"},
    },
    "required": ["city", "days", "metric"],
    "additionalProperties": False,
}
TOOLS: Any = [{"type": "function", "name": "forecast", "description": "Weather forecast", "parameters": PARAMS}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, model_cache: Path, smol_dir: Path) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("families")
    models = ""
    for i, family in enumerate(FAMILY_FORMAT):
        tokenizer = make_family_tokenizer(tmp / f"{family}-tok", smol_dir, family)
        path = make_tiny_model(tmp / family, tokenizer, seed=i, context=2048)
        models += f'[models.{family}]\npath = "{path}"\n'
    first = ResolvedModel(name="hermes_think", path=tmp / "hermes_think")
    with tiny_server(
        tmp, model_cache, first, engine="max_loaded_models = 4\nmax_concurrency = 2\n", models=models
    ) as srv:
        srv.start()
        yield srv


@pytest.fixture
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-no-auth", max_retries=0)


@pytest.mark.parametrize("family", list(FAMILY_FORMAT))
def test_required_call_is_valid_and_streams(client: openai.OpenAI, family: str) -> None:
    with client.responses.stream(
        model=family,
        input="Weather in Oslo for three days?",
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=120,
        extra_body=NO_THINKING if family == "hermes_think" else None,
    ) as stream:
        events = [event.model_dump(mode="json", exclude_unset=True) for event in stream]
        final = stream.get_final_response().model_dump(mode="json", exclude_unset=True)
    for event in events:
        validate_event(event)
    validate("ResponseResource", final)
    assert final["status"] == "completed", final
    (call,) = [item for item in final["output"] if item["type"] == "function_call"]
    assert call["name"] == "forecast" and call["status"] == "completed"
    jsonschema.validate(json.loads(call["arguments"]), PARAMS)
    deltas = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    # How many deltas depends on timing: the server groups what arrives while a commit runs
    # (core/supervisor.py); that the arguments stream piece by piece is tests/unit/test_outputs.py's.
    assert deltas and "".join(deltas) == call["arguments"]


def test_native_template_renders_the_call_and_its_output(client: openai.OpenAI) -> None:
    first = client.responses.create(
        model="qwen3_coder", input="Oslo?", tools=TOOLS, tool_choice="required", max_output_tokens=120
    )
    call = next(item for item in first.output if item.type == "function_call")
    second = client.responses.create(
        model="qwen3_coder",
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        tools=TOOLS,
        max_output_tokens=4,
    )
    assert second.status in ("completed", "incomplete")
    assert [item.type for item in second.output][-1] in ("message", "function_call")


def test_reasoning_streams_in_its_own_item_first(client: openai.OpenAI) -> None:
    """The hermes_think template opens ``<think>`` in the prompt: what the model says first
    is reasoning, in a reasoning item (random weights never close it within 12 tokens)."""
    with client.responses.stream(model="hermes_think", input="Think about it.", max_output_tokens=12) as stream:
        events = [event.model_dump(mode="json", exclude_unset=True) for event in stream]
    for event in events:
        validate_event(event)
    kinds = [e["type"] for e in events]
    assert events[kinds.index("response.output_item.added")]["item"]["type"] == "reasoning"
    deltas = [e["delta"] for e in events if e["type"] == "response.reasoning_text.delta"]
    done = next(e for e in events if e["type"] == "response.reasoning_text.done")
    assert deltas and "".join(deltas) == done["text"]
    final = events[-1]["response"]
    assert final["output"][0]["type"] == "reasoning"
    assert final["output"][0]["content"] == [{"type": "reasoning_text", "text": done["text"]}]
    assert "<think>" not in done["text"]


STAMP: Any = {
    "type": "custom",
    "name": "stamp",
    "description": "Stamp a date",
    "format": {"type": "grammar", "syntax": "regex", "definition": r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"},
}


@pytest.mark.parametrize("family", list(FAMILY_FORMAT))
def test_custom_call_where_the_family_can_carry_one(client: openai.OpenAI, family: str) -> None:
    """Hermes/Qwen JSON and Qwen3-Coder carry a custom tool's raw input; Mistral and Llama 3
    have no marker that could end it, and say so naming the tool."""
    request: Any = {
        "model": family,
        "input": "Stamp today.",
        "tools": [STAMP],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_output_tokens": 60,
        "extra_body": NO_THINKING if family == "hermes_think" else None,
    }
    if FAMILY_FORMAT[family] not in ("json_tools", "qwen3_coder"):
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(**request)
        assert info.value.body is not None and info.value.body["param"] == "tools[0].type"  # type: ignore[index]
        return
    with client.responses.stream(**request) as stream:
        events = [event.model_dump(mode="json", exclude_unset=True) for event in stream]
        final = stream.get_final_response().model_dump(mode="json", exclude_unset=True)
    for event in events:
        validate_event(event)
    (call,) = final["output"]
    assert call["type"] == "custom_tool_call" and call["status"] == "completed", call
    assert re.fullmatch(STAMP["format"]["definition"], call["input"])
    deltas = [e["delta"] for e in events if e["type"] == "response.custom_tool_call_input.delta"]
    assert "".join(deltas) == call["input"]


def test_required_after_an_opened_reasoning_block_reasons_then_calls(client: openai.OpenAI) -> None:
    """The hermes_think template opens ``<think>`` and its ``</think>`` is a special token: the
    grammar lets the thought run to it, then only calls (its lazy rule, which llguidance refuses
    around a special token, made this a 400). Random weights seldom close the thought."""
    response = client.responses.create(
        model="hermes_think", input="Weather in Oslo?", tools=TOOLS, tool_choice="required", max_output_tokens=40
    )
    validate("ResponseResource", response.model_dump(mode="json", exclude_unset=True))
    assert response.status in ("completed", "incomplete")
    assert {item.type for item in response.output} <= {"reasoning", "function_call"}
    assert response.output[0].type == "reasoning"
