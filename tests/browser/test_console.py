"""The console (docs/console.md) in headless Chromium against a real ``lmspd serve`` on the tiny
model: a chat answer streams in with its time to first token, the next turn chains to it and a
reload reads both back from the server; Stop cancels; the server page shows the summary; every
control is labelled and reachable by keyboard at laptop and phone widths; the page's policy
header is there and nothing on the console complains."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import Browser, Page, ViewportSize, expect

from harness.browser import LAPTOP, PHONE, Console, shot
from harness.server import Server, tiny_server
from lmspd.api.console import CSP
from lmspd.models.registry import ResolvedModel

SLOW = 30_000  # ms: Playwright's waits end on the awaited state; this is only their deadline


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, model_cache: Path, tiny_long: ResolvedModel) -> Iterator[Server]:
    with tiny_server(tmp_path_factory.mktemp("console"), model_cache, tiny_long) as srv:
        srv.start()
        yield srv


def output_text(response: dict[str, Any]) -> str:
    return "".join(c["text"] for item in response["output"] if item["type"] == "message" for c in item["content"])


def stored(server: Server, response_id: str) -> dict[str, Any]:
    r = httpx.get(f"{server.url}/v1/responses/{response_id}", timeout=10)
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def turns(page: Page) -> list[dict[str, Any]]:
    saved: list[dict[str, Any]] = json.loads(page.evaluate("localStorage.getItem('lmspd.chat')"))["turns"]
    return saved


def ask(page: Page, text: str) -> None:
    page.get_by_label("Message", exact=True).fill(text)
    page.get_by_label("Message", exact=True).press("Enter")


def test_the_page_is_served_with_its_policy(page: Page, console: Console) -> None:
    response = page.goto("/")
    assert response is not None and response.status == 200
    assert response.headers["content-security-policy"] == CSP
    assert response.headers["x-content-type-options"] == "nosniff"
    expect(page.get_by_role("navigation", name="Pages")).to_be_visible()
    expect(page.get_by_label("Model", exact=True)).to_have_value("tiny", timeout=SLOW)
    console.assert_clean()


def test_a_chat_answer_streams_chains_and_survives_a_reload(page: Page, server: Server, console: Console) -> None:
    page.goto("/")
    expect(page.get_by_label("Model", exact=True)).to_have_value("tiny", timeout=SLOW)
    page.get_by_label("Max output tokens", exact=True).fill("24")
    page.get_by_label("System prompt", exact=True).fill("You are terse.")
    ask(page, "Hello there")
    answers = page.locator(".turn.assistant")
    expect(answers.first.locator(".meta")).to_contain_text("TTFT", timeout=SLOW)
    expect(answers.first.locator(".meta")).to_contain_text("tok/s")
    (first,) = turns(page)
    one = stored(server, first["id"])
    assert one["status"] in ("completed", "incomplete") and one["instructions"] == "You are terse."
    expect(answers.first.locator(".answer-text")).to_have_text(output_text(one))
    assert output_text(one), "the tiny model said something"
    assert first["ttft_ms"] > 0

    ask(page, "And again")
    expect(answers.nth(1).locator(".meta")).to_contain_text("TTFT", timeout=SLOW)
    second = turns(page)[1]
    two = stored(server, second["id"])
    assert two["previous_response_id"] == first["id"]  # the turns are chained
    expect(answers.nth(1).locator(".answer-text")).to_have_text(output_text(two))

    page.reload()  # the conversation comes back from the server, by its response ids
    expect(page.locator(".turn.user .user-text")).to_have_text(["Hello there", "And again"], timeout=SLOW)
    expect(answers.locator(".answer-text")).to_have_text([output_text(one), output_text(two)])
    # chat.js shows Math.round(ttft_ms), which rounds halves up; Python's round() halves to even
    # (252.5 is 253 there, 252 here), and Chromium's clock makes halves common.
    expect(answers.first.locator(".meta")).to_contain_text(f"TTFT {math.floor(first['ttft_ms'] + 0.5)} ms")
    page.get_by_role("button", name="New chat").click()
    expect(answers).to_have_count(0)
    console.assert_clean()


def test_stop_cancels_the_response(page: Page, server: Server, console: Console) -> None:
    page.goto("/")
    expect(page.get_by_label("Model", exact=True)).to_have_value("tiny", timeout=SLOW)
    page.get_by_role("button", name="New chat").click()
    page.get_by_label("Max output tokens", exact=True).fill("3000")  # it would end incomplete after 3000 tokens
    ask(page, "Tell me a long story")
    answer = page.locator(".turn.assistant").last
    expect(answer.locator(".answer-text")).not_to_be_empty(timeout=SLOW)
    page.get_by_role("button", name="Stop").click()
    expect(answer).to_have_attribute("data-status", "cancelled", timeout=SLOW)
    expect(answer.locator(".meta")).to_contain_text("stopped")
    (turn,) = turns(page)
    cancelled = stored(server, turn["id"])
    assert cancelled["status"] == "cancelled"
    expect(answer.locator(".answer-text")).to_have_text(output_text(cancelled))  # the partial answer, as stored
    expect(page.get_by_role("button", name="Stop")).to_be_disabled()
    console.assert_clean()


def test_the_server_page_shows_the_summary(page: Page, server: Server, console: Console) -> None:
    page.goto("/#/server")
    summary = httpx.get(f"{server.url}/lmsp/v1/summary", timeout=10).json()
    expect(page.locator("#server-overview")).to_contain_text(summary["version"], timeout=SLOW)
    expect(page.locator("#server-overview")).to_contain_text("ready")
    expect(page.locator("#server-engine")).to_contain_text("up")
    row = page.locator("#server-models tr", has_text="tiny").first
    expect(row).to_contain_text("loaded")
    (tiny,) = [m for m in summary["models"] if m["id"] == "tiny"]
    left = tiny["unload_at"] - summary["now"]  # the idle unload (keep_alive_secs, 30 min by default)
    assert 0 < left <= tiny["keep_alive_secs"]
    countdown = row.locator(".countdown")
    expect(countdown).to_have_text(re.compile(rf"in ({int(left // 60) - 1}|{int(left // 60)}) min \d\d s"))
    expect(countdown).not_to_have_text(countdown.inner_text(), timeout=SLOW)  # it counts down
    # A generation the speed then describes (whatever the tests before did).
    r = httpx.post(f"{server.url}/v1/responses", json={"input": "Hi", "max_output_tokens": 8}, timeout=30)
    assert r.status_code == 200, r.text
    expect(page.locator("#server-speed dd").first).to_have_text(re.compile(r"^\d+(\.\d)? ms$"), timeout=SLOW)
    expect(page.locator("#server-speed dd").nth(1)).to_have_text(re.compile(r"^\d+(\.\d)?$"))
    expect(page.locator("#server-queue")).to_contain_text("succeeded")
    shot(page, "console-server.png")
    console.assert_clean()


CONTROLS = "a[href], button, input, select, textarea, summary, [tabindex]:not([tabindex='-1'])"
# In the page: the visible controls without a name (a label, aria-label(ledby), or a link's or
# button's text), and those Tab never reached (each focused element marks itself).
UNLABELLED = """(sel) => [...document.querySelectorAll(sel)].filter((el) => el.getClientRects().length).filter((el) =>
  !(el.getAttribute("aria-label") || el.getAttribute("aria-labelledby") || el.closest("label")
    || (el.id && document.querySelector(`label[for="${CSS.escape(el.id)}"]`))
    || (["A", "BUTTON", "SUMMARY"].includes(el.tagName) && el.textContent.trim())))
  .map((el) => el.outerHTML.slice(0, 120))"""
REACHABLE = """(sel) => [...document.querySelectorAll(sel)]
  .filter((el) => el.getClientRects().length && !el.disabled && getComputedStyle(el).visibility !== "hidden")"""
MARK = "() => { const el = document.activeElement; if (el && el !== document.body) el.dataset.kbd = '1'; }"
MISSED = f"(sel) => ({REACHABLE})(sel).filter((el) => !el.dataset.kbd).map((el) => el.outerHTML.slice(0, 120))"


def keyboard_check(page: Page) -> None:
    """Every visible control has a name (its label, aria-label or text) and Tab reaches it."""
    unlabelled = page.evaluate(UNLABELLED, CONTROLS)
    assert unlabelled == [], unlabelled
    count = page.evaluate(f"(sel) => ({REACHABLE})(sel).length", CONTROLS)
    page.locator("body").focus()
    for _ in range(count + 5):
        page.keyboard.press("Tab")
        page.evaluate(MARK)
    missing = page.evaluate(MISSED, CONTROLS)
    assert missing == [], missing


@pytest.mark.parametrize("viewport", [LAPTOP, PHONE], ids=["laptop", "phone"])
@pytest.mark.parametrize("where", ["/#/chat", "/#/tasks", "/#/server"])
def test_every_control_is_labelled_reachable_and_fits(
    browser: Browser, server: Server, console: Console, viewport: ViewportSize, where: str
) -> None:
    context = browser.new_context(viewport=viewport, base_url=server.url)
    page = console.watch(context.new_page())
    page.goto(where)
    expect(page.locator("main h1, main h2").first).to_be_attached(timeout=SLOW)
    expect(page.locator("#chat-model option, #task-model option, #server-models tr").first).to_be_attached(timeout=SLOW)
    keyboard_check(page)
    overflow = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
    assert overflow <= 0, f"{where} is {overflow}px wider than a {viewport['width']}px screen"
    console.assert_clean()
    context.close()


def test_the_accessibility_check_catches_an_unlabelled_control(page: Page) -> None:
    page.goto("/#/server")
    expect(page.locator("#server-overview dd").first).to_be_attached(timeout=SLOW)
    page.evaluate("document.getElementById('main').append(Object.assign(document.createElement('input'), {id: 'x'}))")
    with pytest.raises(AssertionError, match='id="x"'):
        keyboard_check(page)
