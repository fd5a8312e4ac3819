"""A web page in the user's own browser attacking a tokenless lmspd on loopback, as the third
adversarial round did (docs/reliability.md, round 3; docs/operations.md, "Security").

The attacker's page is served by a second HTTP server on another loopback port: another
origin, in the same private address space (so Chromium's own local-network rules stay out of
the way and only lmspd's guard stands between the page and the server). It tries the
state-changing routes with the requests a page may send without asking (a ``no-cors`` fetch of
a Blob, an auto-submitted form); a page on a name rebound to 127.0.0.1 tries to read the tasks.
Playwright sees each answer's real status, which the page itself cannot; the server is then
asked, without any Origin, whether anything changed.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import Browser, Playwright, Response

from harness.browser import CHROMIUM, FLAGS, LAPTOP, Console
from harness.clients import require
from harness.server import Server, free_port, tiny_server, wait_final
from lmspd.models.registry import ResolvedModel

SLOW = 60_000  # ms
SECRET = "the victim's prompt: the vault code is 7741"


@contextlib.contextmanager
def attacker_site(html: str) -> Iterator[str]:
    """A page of another origin (loopback, another port), served at ``/``."""
    body = html.encode()

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    site = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Page)
    thread = threading.Thread(target=site.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{site.server_address[1]}"
    finally:
        site.shutdown()
        site.server_close()


def attack_page(target: str) -> str:
    """The requests a page may send cross-origin without a preflight: ``no-cors`` fetches
    (a Blob body declares no Content-Type) and, on a button, a form that unloads the model."""
    body = json.dumps({"input": "Write a poem.", "max_output_tokens": 4})
    task = json.dumps({"type": "response", "input": {"input": "Write a poem.", "max_output_tokens": 4}})
    return f"""<!doctype html><title>cat pictures</title>
<form id="unload" method="POST" action="{target}/lmsp/v1/models/tiny/unload?force=true"></form>
<script>
async function attack() {{
  const blob = (text) => new Blob([text]);
  await fetch("{target}/v1/responses", {{method: "POST", mode: "no-cors", body: blob({json.dumps(body)})}});
  await fetch("{target}/lmsp/v1/tasks", {{method: "POST", mode: "no-cors", body: blob({json.dumps(task)})}});
  await fetch("{target}/lmsp/v1/engine/recycle", {{method: "POST", mode: "no-cors"}});
  await fetch("{target}/v1/responses", {{method: "POST", mode: "no-cors",
    headers: {{"Content-Type": "text/plain"}}, body: {json.dumps(body)}}});
  return "sent";
}}
</script>"""


def summary(url: str) -> dict[str, Any]:
    return dict(httpx.get(f"{url}/lmsp/v1/summary", timeout=10).json())


@pytest.fixture
def victim(tmp_path: Path, model_cache: Path, tiny: ResolvedModel) -> Iterator[Server]:
    """A tokenless server on loopback (the default setup) with one finished task of the
    victim's, and the model loaded."""
    with tiny_server(tmp_path, model_cache, tiny) as srv:
        srv.start()
        body = {"type": "response", "input": {"input": SECRET, "max_output_tokens": 4, "temperature": 0}}
        created = httpx.post(f"{srv.url}/lmsp/v1/tasks", json=body, timeout=30)
        assert created.status_code == 202, created.text
        wait_final(srv.url, created.json()["id"])
        yield srv


def test_a_page_of_another_origin_cannot_change_anything(browser: Browser, victim: Server, console: Console) -> None:
    before = summary(victim.url)
    assert before["engine"]["state"] == "up" and sum(before["tasks"].values()) == 1
    assert [m["loaded"] for m in before["models"] if m["id"] == "tiny"] == [True]
    with attacker_site(attack_page(victim.url)) as site:
        page = console.watch(browser.new_context(viewport=LAPTOP).new_page())
        answers: list[Response] = []
        page.on("response", lambda r: answers.append(r) if r.url.startswith(victim.url) else None)
        page.goto(site)
        assert page.evaluate("attack()") == "sent"
        with page.expect_navigation(url=f"{victim.url}/**", timeout=SLOW) as landed:
            page.evaluate("document.getElementById('unload').submit()")
        form = landed.value
        assert form is not None
        answers.append(form)

    by_path = {(r.request.method, r.url.removeprefix(victim.url)): r for r in answers}
    assert {path for _, path in by_path} == {
        "/v1/responses",
        "/lmsp/v1/tasks",
        "/lmsp/v1/engine/recycle",
        "/lmsp/v1/models/tiny/unload?force=true",
    }
    for r in answers:  # refused by Origin, before a body or a route is looked at
        assert r.status == 403, (r.url, r.status)
    # The form's answer is a page the browser shows (the fetches' are opaque to Playwright too).
    assert form.header_value("content-type") == "application/problem+json"
    assert json.loads(form.text())["code"] == "forbidden_origin"

    after = summary(victim.url)  # asked without an Origin, as the CLI does
    assert after["tasks"] == before["tasks"]  # no task and no response was created
    assert after["engine"]["pid"] == before["engine"]["pid"]  # the engine was not recycled
    assert [m["loaded"] for m in after["models"] if m["id"] == "tiny"] == [True]  # not unloaded
    console.assert_clean("Failed to load resource")


def test_a_rebound_name_reads_nothing(playwright: Playwright, victim: Server, console: Console) -> None:
    """DNS rebinding: the page's own name now resolves to 127.0.0.1, so to the browser the
    server is same-origin; its requests still carry that name as their Host."""
    exe = require(f"Chromium ({CHROMIUM})", shutil.which(CHROMIUM))
    rebinding = playwright.chromium.launch(
        executable_path=exe, headless=True, args=[*FLAGS, "--host-resolver-rules=MAP rebind.test 127.0.0.1"]
    )
    try:
        page = console.watch(rebinding.new_context(viewport=LAPTOP).new_page())
        landed = page.goto(f"http://rebind.test:{victim.port}/")
        assert landed is not None and landed.status == 421
        read = page.evaluate(
            """async () => {
              const r = await fetch("/lmsp/v1/tasks");
              return {status: r.status, body: await r.text()};
            }"""
        )
        assert read["status"] == 421 and "misdirected_request" in read["body"]
        assert SECRET not in read["body"] and "task_" not in read["body"]
    finally:
        rebinding.close()
    console.assert_clean("Failed to load resource")


def test_the_console_origin_and_an_allowed_app_still_work(
    browser: Browser, tmp_path: Path, model_cache: Path, tiny: ResolvedModel, console: Console
) -> None:
    """The server's own origin (the console, by either loopback name) needs nothing set; a
    browser app of another origin works once ``allowed_origins`` names it, with CORS."""
    with attacker_site("<!doctype html><title>my app</title>") as app_origin:
        allowed = f'allowed_origins = ["{app_origin}"]\n'
        with tiny_server(tmp_path, model_cache, tiny, server=allowed) as srv:
            srv.start()
            context = browser.new_context(viewport=LAPTOP)
            post = """async (url) => {
              const r = await fetch(url, {method: "POST", headers: {"Content-Type": "application/json"},
                body: JSON.stringify({type: "response", input: {input: "Hello.", max_output_tokens: 2}})});
              return {status: r.status, body: await r.json()};
            }"""
            for own in (srv.url, f"http://localhost:{srv.port}"):
                page = console.watch(context.new_page())
                page.goto(f"{own}/")
                made = page.evaluate(post, f"{own}/lmsp/v1/tasks")
                assert made["status"] == 202 and made["body"]["id"].startswith("task_")
            page = console.watch(context.new_page())
            page.goto(app_origin)
            made = page.evaluate(post, f"{srv.url}/lmsp/v1/tasks")  # a preflighted CORS request
            assert made["status"] == 202 and made["body"]["id"].startswith("task_")
            wait_final(srv.url, made["body"]["id"])
    console.assert_clean()
