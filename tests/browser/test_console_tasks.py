"""The console's tasks in headless Chromium against real ``lmspd serve`` processes: a task
submitted from the page is followed live; the server is killed with SIGKILL and started again on
the same data and port; the page says "reconnecting", resumes the stream with Last-Event-ID and
ends showing the completed text, equal to what the API returns. With tokens configured the page
asks for one (kept in sessionStorage, never in a URL) and one token never sees another's tasks."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from playwright.sync_api import Browser, Page, expect

from harness.browser import LAPTOP, Console, shot
from harness.server import Server, task, tiny_server, wait_final
from lmspd.models.registry import ResolvedModel

SLOW = 60_000  # ms: the deadline of waits that end on the state they wait for
TOKENS = {"alice": "console-alice-token", "bob": "console-bob-token"}
# The network errors a kill -9 provokes: the open stream cut mid-chunk, then the page's
# reconnect attempts refused while the server is down.
KILLED = ("net::ERR_INCOMPLETE_CHUNKED_ENCODING", "net::ERR_CONNECTION_REFUSED")


def output_text(found: dict[str, Any]) -> str:
    return "".join(
        c["text"] for item in found["response"]["output"] if item["type"] == "message" for c in item["content"]
    )


def events(url: str, task_id: str, headers: dict[str, str] | None = None) -> list[dict[str, Any]]:
    with httpx.stream("GET", f"{url}/lmsp/v1/tasks/{task_id}/events", headers=headers, timeout=30) as r:
        return [msgspec.json.decode(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]


@pytest.fixture
def restartable(tmp_path: Path, model_cache: Path, tiny_long: ResolvedModel) -> Iterator[Server]:
    with tiny_server(tmp_path, model_cache, tiny_long) as srv:
        srv.start()
        yield srv


def test_a_task_is_followed_across_a_kill_and_a_restart(
    browser: Browser, restartable: Server, console: Console
) -> None:
    server = restartable
    context = browser.new_context(viewport=LAPTOP, base_url=server.url)
    page = console.watch(context.new_page())
    page.goto("/#/tasks")
    expect(page.get_by_label("Model", exact=True)).to_have_value("tiny", timeout=SLOW)
    page.get_by_label("Prompt", exact=True).fill("Tell me a story about a lighthouse.")
    page.get_by_label("On restart", exact=True).select_option("resume")
    page.get_by_label("Max output tokens", exact=True).fill("1500")
    page.get_by_role("button", name="Submit").click()
    expect(page).to_have_url(re.compile(r"#/tasks/task_\w+$"), timeout=SLOW)
    task_id = page.url.rpartition("/")[2]
    text = page.locator("#task-text")
    connection = page.locator("#task-connection")
    expect(connection).to_have_attribute("data-state", "live", timeout=SLOW)
    expect(text).not_to_be_empty(timeout=SLOW)
    assert "token" not in page.url

    server.kill9()  # mid-generation: the task had 1500 tokens to go
    expect(connection).to_have_attribute("data-state", "reconnecting", timeout=SLOW)
    expect(connection).to_have_text("reconnecting…")
    before = text.inner_text()
    server.start()  # the same data dir and port

    expect(connection).to_have_attribute("data-state", "finished", timeout=SLOW)
    expect(page.locator("#task-status")).to_have_text("succeeded")
    final = wait_final(server.url, task_id)
    assert final["status"] == "succeeded" and final["attempt"] == 1
    expect(text).to_have_text(output_text(final))  # every delta once, across the restart
    assert len(output_text(final)) > len(before) and output_text(final).startswith(before)
    kinds = [e["type"] for e in events(server.url, task_id)]
    assert kinds.count("response.in_progress") == 2, "it was resumed after the restart, not run through"
    shot(page, "console-task.png")

    page.goto("/#/tasks")  # the list, newest first, shows it
    first = page.locator("#tasks-rows tr").first
    expect(first).to_contain_text(task_id, timeout=SLOW)
    expect(first).to_contain_text("succeeded")
    page.get_by_label("Status", exact=True).select_option("failed")
    expect(page.locator("#tasks-rows tr")).to_have_count(0, timeout=SLOW)
    page.get_by_label("Status", exact=True).select_option("succeeded")
    expect(page.locator("#tasks-rows tr").first).to_contain_text(task_id, timeout=SLOW)
    shot(page, "console-tasks.png")
    console.assert_clean(*KILLED)
    context.close()


def test_cancel_from_the_task_page(browser: Browser, restartable: Server, console: Console) -> None:
    server = restartable
    body = {"type": "response", "input": {"input": "Go on and on", "max_output_tokens": 3000}}
    task_id = httpx.post(f"{server.url}/lmsp/v1/tasks", json=body, timeout=30).json()["id"]
    context = browser.new_context(viewport=LAPTOP, base_url=server.url)
    page = console.watch(context.new_page())
    page.goto(f"/#/tasks/{task_id}")
    expect(page.locator("#task-text")).not_to_be_empty(timeout=SLOW)
    page.get_by_role("button", name="Cancel").click()
    expect(page.locator("#task-connection")).to_have_attribute("data-state", "finished", timeout=SLOW)
    expect(page.locator("#task-status")).to_have_text("cancelled")
    assert task(server.url, task_id)["status"] == "cancelled"
    expect(page.get_by_role("button", name="Cancel")).to_be_disabled()
    console.assert_clean()
    context.close()


def test_paging_through_the_list(browser: Browser, restartable: Server, console: Console) -> None:
    server = restartable
    body = {"type": "response", "input": {"input": "Hi", "max_output_tokens": 1}}
    ids = [httpx.post(f"{server.url}/lmsp/v1/tasks", json=body, timeout=30).json()["id"] for _ in range(23)]
    context = browser.new_context(viewport=LAPTOP, base_url=server.url)
    page = console.watch(context.new_page())
    page.goto("/#/tasks")
    rows = page.locator("#tasks-rows tr td:first-child")
    expect(rows).to_have_count(20, timeout=SLOW)
    expect(rows.first).to_have_text(ids[-1])  # newest first
    page.get_by_role("button", name="Older tasks").click()
    expect(rows).to_have_count(23, timeout=SLOW)
    assert rows.all_inner_texts() == ids[::-1]
    expect(page.get_by_role("button", name="Older tasks")).to_be_hidden()
    console.assert_clean()
    context.close()


@pytest.fixture(scope="module")
def tokened(tmp_path_factory: pytest.TempPathFactory, model_cache: Path, tiny_long: ResolvedModel) -> Iterator[Server]:
    tokens = "".join(f'{name} = "{token}"\n' for name, token in TOKENS.items())
    with tiny_server(
        tmp_path_factory.mktemp("tokened"), model_cache, tiny_long, models=f"[server.tokens]\n{tokens}"
    ) as srv:
        srv.start()
        yield srv


def sign_in(page: Page, token: str) -> None:
    page.get_by_label("Access token", exact=True).fill(token)
    page.get_by_role("button", name="Sign in").click()


def signed_in(page: Page, token: str) -> None:
    """Sign in, and wait until the token was taken (before navigating on)."""
    sign_in(page, token)
    expect(page.get_by_role("button", name="Sign out")).to_be_visible(timeout=SLOW)


def test_the_page_asks_for_a_token_and_shows_only_its_owners_tasks(
    browser: Browser, tokened: Server, console: Console
) -> None:
    server = tokened
    alices = {"Authorization": f"Bearer {TOKENS['alice']}"}
    body = {"type": "response", "input": {"input": "Alice's secret", "max_output_tokens": 4}}
    r = httpx.post(f"{server.url}/lmsp/v1/tasks", json=body, headers=alices, timeout=30)
    assert r.status_code == 202, r.text
    alice_task = r.json()["id"]

    context = browser.new_context(viewport=LAPTOP, base_url=server.url)
    page = console.watch(context.new_page())
    page.goto("/#/tasks")
    expect(page.get_by_role("heading", name="Sign in")).to_be_visible(timeout=SLOW)
    sign_in(page, "not-a-token")
    expect(page.get_by_role("alert")).to_have_text("That token was refused.", timeout=SLOW)
    sign_in(page, TOKENS["bob"])
    expect(page.locator("#tasks-status-line")).to_have_text("No tasks yet.", timeout=SLOW)  # none of Alice's
    assert page.evaluate("sessionStorage.getItem('lmspd.token')") == TOKENS["bob"]
    assert TOKENS["bob"] not in page.url and not page.evaluate("JSON.stringify(localStorage)").count(TOKENS["bob"])
    page.goto(f"/#/tasks/{alice_task}")  # Alice's task by its id: not found for Bob
    expect(page.locator("#task-error")).to_contain_text("not found", timeout=SLOW)
    page.goto("/#/server")
    expect(page.locator("#server-queue")).to_contain_text("succeeded", timeout=SLOW)
    counts = page.locator("#server-queue dd").all_inner_texts()
    assert counts == ["0"] * 7, counts  # Bob's queue is empty, whatever Alice has

    page.get_by_role("button", name="Sign out").click()
    expect(page.get_by_role("heading", name="Sign in")).to_be_visible()
    assert page.evaluate("sessionStorage.getItem('lmspd.token')") is None
    signed_in(page, TOKENS["alice"])
    page.goto("/#/tasks")
    expect(page.locator("#tasks-rows tr").first).to_contain_text(alice_task, timeout=SLOW)
    expect(page.locator("#tasks-rows tr")).to_have_count(1)

    fresh = console.watch(context.new_page())  # sessionStorage is the tab's: a new tab asks again
    fresh.goto("/#/tasks")
    expect(fresh.get_by_role("heading", name="Sign in")).to_be_visible(timeout=SLOW)
    # The only errors: the 401s that made the page ask (and the refused token's), and the 404
    # Bob got for Alice's task.
    console.assert_clean("status of 401", "status of 404")
    context.close()


def storages(page: Page) -> str:
    """Everything the page keeps in the browser, both storages."""
    return str(page.evaluate("JSON.stringify([localStorage, sessionStorage])"))


def chat_as(page: Page, token: str, system: str, text: str) -> None:
    """Sign in on the chat page and send one message, with ``system`` as the system prompt."""
    page.goto("/#/chat")
    expect(page.get_by_role("heading", name="Sign in")).to_be_visible(timeout=SLOW)
    sign_in(page, token)
    expect(page.get_by_label("Model", exact=True)).to_have_value("tiny", timeout=SLOW)
    page.get_by_label("Max output tokens", exact=True).fill("4")
    page.get_by_label("System prompt", exact=True).fill(system)
    page.get_by_label("Message", exact=True).fill(text)
    page.get_by_label("Message", exact=True).press("Enter")
    expect(page.locator(".turn.assistant .meta").last).to_contain_text("tokens", timeout=SLOW)


def test_the_next_person_on_the_browser_never_gets_the_last_ones_conversation(
    browser: Browser, tokened: Server, console: Console
) -> None:
    """Alice's system prompt and turn ids are hers: gone when she signs out (or closes her tab), so
    Bob, signing in next on the same browser, neither sees them nor sends them (docs/console.md)."""
    server = tokened
    secret = "Alice's system prompt: the vault code is 7741."
    context = browser.new_context(viewport=LAPTOP, base_url=server.url)
    page = console.watch(context.new_page())
    chat_as(page, TOKENS["alice"], secret, "Hello from Alice")
    assert secret in storages(page)  # kept while she is signed in (a reload keeps her conversation)
    page.get_by_role("button", name="Sign out").click()
    expect(page.get_by_role("heading", name="Sign in")).to_be_visible()
    assert secret not in storages(page) and "lmspd.chat" not in storages(page), storages(page)

    sign_in(page, TOKENS["bob"])
    expect(page.get_by_label("Model", exact=True)).to_have_value("tiny", timeout=SLOW)
    expect(page.get_by_label("System prompt", exact=True)).to_have_value("")
    expect(page.locator(".turn")).to_have_count(0)
    page.get_by_label("Max output tokens", exact=True).fill("4")
    page.get_by_label("Message", exact=True).fill("Hello from Bob")
    page.get_by_label("Message", exact=True).press("Enter")
    expect(page.locator(".turn.assistant .meta").last).to_contain_text("tokens", timeout=SLOW)
    (turn,) = msgspec.json.decode(page.evaluate("sessionStorage.getItem('lmspd.chat')"))["turns"]
    bobs = {"Authorization": f"Bearer {TOKENS['bob']}"}
    sent = httpx.get(f"{server.url}/v1/responses/{turn['id']}", headers=bobs, timeout=10).json()
    assert sent["instructions"] is None and sent["previous_response_id"] is None, sent

    # Alice leaves by closing her tab, without signing out: Bob's new tab starts afresh too.
    hers = console.watch(context.new_page())
    chat_as(hers, TOKENS["alice"], secret, "Hello again")
    hers.close()
    his = console.watch(context.new_page())
    his.goto("/#/chat")
    expect(his.get_by_role("heading", name="Sign in")).to_be_visible(timeout=SLOW)
    sign_in(his, TOKENS["bob"])
    expect(his.get_by_label("Model", exact=True)).to_have_value("tiny", timeout=SLOW)
    expect(his.get_by_label("System prompt", exact=True)).to_have_value("")
    expect(his.locator(".turn")).to_have_count(0)
    assert secret not in storages(his)
    console.assert_clean("status of 401")  # the 401s that made each tab ask for a token
    context.close()
