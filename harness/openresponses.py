"""Validate objects against the Open Responses OpenAPI schema (a copy in harness/data, so
tests need nothing outside the project), and the official SDKs' models parsed from ours
(``assert_no_extras``)."""

from __future__ import annotations

import json
from functools import cache
from typing import Any

import jsonschema
import pydantic

from harness import DATA

SCHEMA = DATA / "openresponses-openapi.json"
EVENT_SCHEMAS = {
    "response.created": "ResponseCreatedStreamingEvent",
    "response.queued": "ResponseQueuedStreamingEvent",
    "response.in_progress": "ResponseInProgressStreamingEvent",
    "response.completed": "ResponseCompletedStreamingEvent",
    "response.failed": "ResponseFailedStreamingEvent",
    "response.incomplete": "ResponseIncompleteStreamingEvent",
    "response.output_item.added": "ResponseOutputItemAddedStreamingEvent",
    "response.output_item.done": "ResponseOutputItemDoneStreamingEvent",
    "response.content_part.added": "ResponseContentPartAddedStreamingEvent",
    "response.content_part.done": "ResponseContentPartDoneStreamingEvent",
    "response.output_text.delta": "ResponseOutputTextDeltaStreamingEvent",
    "response.output_text.done": "ResponseOutputTextDoneStreamingEvent",
    "response.function_call_arguments.delta": "ResponseFunctionCallArgumentsDeltaStreamingEvent",
    "response.function_call_arguments.done": "ResponseFunctionCallArgumentsDoneStreamingEvent",
    "response.custom_tool_call_input.delta": "ResponseCustomToolCallInputDeltaStreamingEvent",
    "response.custom_tool_call_input.done": "ResponseCustomToolCallInputDoneStreamingEvent",
}
# docs/responses.md ("Streaming") names reasoning events as OpenAI does (``response.reasoning_text.*``); Open Responses
# calls the same shape ``response.reasoning.*``.
RENAMED_EVENTS = {
    "response.reasoning_text.delta": ("response.reasoning.delta", "ResponseReasoningDeltaStreamingEvent"),
    "response.reasoning_text.done": ("response.reasoning.done", "ResponseReasoningDoneStreamingEvent"),
}

# Vendor events (seed "압축"), not in the Open Responses schema: their integer fields.
VENDOR_EVENTS = {
    "mlx.compaction.started": ("input_tokens",),
    "mlx.compaction.completed": ("input_tokens_before", "input_tokens_after"),
}


# OpenAI's shapes that Open Responses lacks, which agent clients send and lmspd echoes
# (docs/responses.md, "Coding agents"): added to the document, each where OpenAI puts it.
# Custom (freeform) tools: the tool, tool_choice {"type": "custom"}, the custom_tool_call item
# and its two input events (docs/responses.md, "Custom tools"), so every object and event is
# still checked.
_TOOL_FIELDS = {"name": {"type": "string"}, "description": {"anyOf": [{"type": "string"}, {"type": "null"}]}}
_STATUS = {"type": "string", "enum": ["in_progress", "completed", "incomplete"]}


def _event(kind: str, field: str) -> dict[str, Any]:
    fields = {"item_id": {"type": "string"}, "output_index": {"type": "integer"}, field: {"type": "string"}}
    return {
        "type": "object",
        "required": ["type", "sequence_number", *fields],
        "properties": {"type": {"enum": [kind]}, "sequence_number": {"type": "integer"}, **fields},
        "additionalProperties": False,
    }


OPENAI_SCHEMAS: dict[str, Any] = {
    "NamespaceTool": {
        "type": "object",
        "required": ["type", "name", "description", "tools"],
        "properties": {
            "type": {"enum": ["namespace"]},
            "name": {"type": "string"},
            "description": {"type": "string"},
            "tools": {"type": "array", "items": {"$ref": "#/components/schemas/FunctionTool"}},
        },
    },
    "CustomTool": {
        "type": "object",
        "required": ["type", "name", "format"],
        "properties": {
            "type": {"enum": ["custom"]},
            **_TOOL_FIELDS,
            "format": {
                "oneOf": [
                    {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text"]}}},
                    {
                        "type": "object",
                        "required": ["type", "syntax", "definition"],
                        "properties": {
                            "type": {"enum": ["grammar"]},
                            "syntax": {"enum": ["lark", "regex"]},
                            "definition": {"type": "string"},
                        },
                        "additionalProperties": False,
                    },
                ]
            },
        },
        "additionalProperties": False,
    },
    "CustomToolChoice": {
        "type": "object",
        "required": ["type", "name"],
        "properties": {"type": {"enum": ["custom"]}, "name": {"type": "string"}},
        "additionalProperties": False,
    },
    "CustomToolCall": {
        "type": "object",
        "required": ["type", "id", "call_id", "name", "input", "status"],
        "properties": {
            "type": {"enum": ["custom_tool_call"]},
            "id": {"type": "string", "pattern": "^ctc_"},
            "call_id": {"type": "string", "pattern": "^call_"},
            "name": {"type": "string"},
            "input": {"type": "string"},
            "status": _STATUS,
            "namespace": {"type": "string"},
        },
        "additionalProperties": False,
    },
    "ResponseCustomToolCallInputDeltaStreamingEvent": _event("response.custom_tool_call_input.delta", "delta"),
    "ResponseCustomToolCallInputDoneStreamingEvent": _event("response.custom_tool_call_input.done", "input"),
}


def document() -> dict[str, Any]:
    """The Open Responses document with :data:`OPENAI_SCHEMAS` added: a tool is a function,
    namespace or custom tool; an item may be a custom tool call; tool_choice may name a custom tool."""
    doc: dict[str, Any] = json.loads(SCHEMA.read_text())
    schemas = doc["components"]["schemas"]
    schemas.update(OPENAI_SCHEMAS)
    tool = schemas["Tool"]
    schemas["Tool"] = {
        "description": tool["description"],
        "oneOf": [{"$ref": "#/components/schemas/FunctionTool"}]
        + [{"$ref": f"#/components/schemas/{name}"} for name in ("NamespaceTool", "CustomTool")],
    }
    namespace_tools = schemas["NamespaceTool"]["properties"]["tools"]
    namespace_tools["items"] = {
        "oneOf": [{"$ref": "#/components/schemas/FunctionTool"}, {"$ref": "#/components/schemas/CustomTool"}]
    }
    schemas["ItemField"]["oneOf"].append({"$ref": "#/components/schemas/CustomToolCall"})
    schemas["ResponseResource"]["properties"]["tool_choice"]["oneOf"].append(
        {"$ref": "#/components/schemas/CustomToolChoice"}
    )
    return doc


@cache
def _validator(name: str) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator({**document(), "$ref": f"#/components/schemas/{name}"})


def validate(name: str, obj: Any) -> None:
    _validator(name).validate(obj)


def validate_event(event: dict[str, Any]) -> None:
    """Open Responses events by their schema; LMSP's own events by their documented shape."""
    etype = event["type"]
    if etype in EVENT_SCHEMAS:
        validate(EVENT_SCHEMAS[etype], event)
    elif etype in RENAMED_EVENTS:
        their_name, schema = RENAMED_EVENTS[etype]
        validate(schema, {**event, "type": their_name})
    elif etype == "response.cancelled":  # docs/lmsp.md §6.3: {type, sequence_number, response}
        assert set(event) == {"type", "sequence_number", "response"}
        validate("ResponseResource", event["response"])
    elif etype == "lmsp.attempt.restarted":
        assert set(event) == {"type", "sequence_number", "attempt", "reason"}
    elif etype in VENDOR_EVENTS:  # the seed's compaction events: not in Open Responses
        assert set(event) == {"type", "sequence_number", "response_id", *VENDOR_EVENTS[etype]}
        assert all(isinstance(event[k], int) and event[k] >= 0 for k in VENDOR_EVENTS[etype])
    else:
        raise AssertionError(f"unexpected event type {etype}")


def assert_no_extras(model: Any) -> None:
    """The SDKs' models accept unknown keys silently; a key they do not know is a shape bug."""
    if isinstance(model, list):
        for value in model:
            assert_no_extras(value)
    elif isinstance(model, pydantic.BaseModel):
        assert not model.model_extra, f"{type(model).__name__} has unknown keys {model.model_extra}"
        for name in type(model).model_fields:
            assert_no_extras(getattr(model, name))
