"""The console's chat on the bundled model (SmolLM2-135M-Instruct) in headless Chromium: a
greedy answer to a real question streams in, with its time to first token, and reads as the
stored response says. The README's screenshot of the console comes from this test
(docs/console.md, "Tests and screenshots")."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Browser, expect

from harness.browser import LAPTOP, Console, shot
from harness.server import Server, tiny_server
from lmspd.models.registry import ResolvedModel

pytestmark = pytest.mark.real_model
SLOW = 120_000  # ms: the deadline of waits that end on the state they wait for (a first load)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, model_cache: Path, tiny: ResolvedModel) -> Iterator[Server]:
    smol = '[models.smol]\npath = "smollm2-135m-instruct"\n'
    with tiny_server(
        tmp_path_factory.mktemp("console-smol"),
        model_cache,
        tiny,
        engine='preload = ["smol"]\n',  # loaded before ready: the picture shows a warm first token
        models=smol,
        dtype="quantized",
    ) as srv:
        srv.start()
        yield srv


def test_the_bundled_model_answers_in_the_chat(browser: Browser, server: Server, console: Console) -> None:
    context = browser.new_context(viewport=LAPTOP, base_url=server.url)
    page = console.watch(context.new_page())
    page.goto("/")
    expect(page.locator("#chat-model option[value='smol']")).to_be_attached(timeout=SLOW)
    page.get_by_label("Model", exact=True).select_option("smol")
    page.get_by_label("Temperature", exact=True).fill("0")
    page.get_by_label("Max output tokens", exact=True).fill("48")
    page.get_by_label("Message", exact=True).fill("What is the capital of France?")
    page.get_by_role("button", name="Send").click()
    answer = page.locator(".turn.assistant").last
    expect(answer.locator(".meta")).to_contain_text("TTFT", timeout=SLOW)
    expect(answer.locator(".answer-text")).to_contain_text("Paris")
    response_id = page.evaluate("JSON.parse(localStorage.getItem('lmspd.chat')).turns[0].id")
    stored = httpx.get(f"{server.url}/v1/responses/{response_id}", timeout=10).json()
    assert stored["model"] == "smol" and stored["temperature"] == 0
    text = "".join(c["text"] for item in stored["output"] if item["type"] == "message" for c in item["content"])
    expect(answer.locator(".answer-text")).to_have_text(text)
    page.locator("details.settings summary").click()  # fold the settings away for the picture
    shot(page, "console-chat.png")
    console.assert_clean()
    context.close()
