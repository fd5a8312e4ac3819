"""The console in a real browser: Debian's headless Chromium driven by Playwright for Python
(launched on the system's binary, no browser download), against real ``lmspd serve`` processes
on the tiny model. Not in the default run: ``.ci/run`` installs ``chromium`` and the driver and
runs this folder in a step of its own (docs/testing.md). Without Chromium or Playwright the tests
skip on a developer's machine and fail under CI (``CI=true``).

Every page is watched: a console error, an uncaught exception or a CSP violation fails the test
(``Console.assert_clean``), save the network errors a test provokes and names.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest

from harness.clients import require, require_module

require_module("playwright")

from playwright.sync_api import Browser, Page, Playwright, sync_playwright  # noqa: E402

from harness.browser import CHROMIUM, FLAGS, LAPTOP, Console  # noqa: E402
from harness.server import Server  # noqa: E402


@pytest.fixture(scope="session")
def playwright() -> Iterator[Playwright]:
    with sync_playwright() as pw:
        yield pw


@pytest.fixture(scope="session")
def browser(playwright: Playwright) -> Iterator[Browser]:
    exe = require(f"Chromium ({CHROMIUM})", shutil.which(CHROMIUM))
    # launch() gives the browser a fresh, temporary user-data-dir of its own.
    found = playwright.chromium.launch(executable_path=exe, headless=True, args=FLAGS)
    yield found
    found.close()


@pytest.fixture
def console() -> Console:
    return Console()


@pytest.fixture
def page(browser: Browser, server: Server, console: Console) -> Iterator[Page]:
    """A laptop-sized page on the module's ``server`` (each module says which), watched."""
    context = browser.new_context(viewport=LAPTOP, base_url=server.url)
    yield console.watch(context.new_page())
    context.close()
