"""The OpenAI Agents SDK (``openai-agents``) against a real ``lmspd serve`` on the bundled
model: a function-tool loop under ``tool_choice="required"`` (``ModelSettings``), streamed
(``Runner.run_streamed``), through both of its model classes, ``OpenAIResponsesModel``
(``/v1/responses``, the whole history resent each turn) and ``OpenAIChatCompletionsModel``
(``/v1/chat/completions``).

The SDK resets ``tool_choice`` to ``auto`` once a tool has run (``reset_tool_choice``), so the
loop is: a required call, the tool's output sent back, and the model's answer, greedy.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.clients import require_module
from harness.server import Server, tiny_server
from lmspd.models.registry import ResolvedModel

require_module("agents")

from agents import (  # noqa: E402  (after the skip: the SDK is installed by .ci/run)
    Agent,
    FunctionTool,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI  # noqa: E402

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, model_cache: Path, tiny: ResolvedModel) -> Iterator[Server]:
    smol = '[models.smol]\npath = "smollm2-135m-instruct"\n'
    with tiny_server(
        tmp_path_factory.mktemp("agents"), model_cache, tiny, models=smol, dtype="quantized_float32"
    ) as srv:
        srv.start()
        yield srv


def weather_tool(calls: list[str]) -> FunctionTool:
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return f"Sunny and 18 C in {city}."

    return function_tool(get_weather)


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
async def test_a_required_tool_loop_streams_to_the_answer(server: Server, api: str) -> None:
    set_tracing_disabled(True)  # nothing leaves the machine
    client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="sk-no-auth", max_retries=0)
    model = (
        OpenAIResponsesModel(model="smol", openai_client=client)
        if api == "responses"
        else OpenAIChatCompletionsModel(model="smol", openai_client=client)
    )
    calls: list[str] = []
    agent = Agent(
        name="weather",
        instructions="You answer questions about the weather. Use the tool.",
        tools=[weather_tool(calls)],
        model=model,
        model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=64),
    )
    result = Runner.run_streamed(agent, "What is the weather in Paris?", max_turns=4)
    items: list[str] = []
    deltas: list[str] = []
    async for event in result.stream_events():
        if event.type == "run_item_stream_event":
            items.append(event.item.type)
        elif event.type == "raw_response_event" and getattr(event.data, "type", "") == "response.output_text.delta":
            deltas.append(str(getattr(event.data, "delta", "")))
    assert items[:2] == ["tool_call_item", "tool_call_output_item"], items
    assert items[-1] == "message_output_item", items
    assert calls == ["Paris"]
    assert isinstance(result.final_output, str) and result.final_output
    assert deltas, "the answer streamed"
    await client.close()
