"""The browser tier's helpers (tests/browser): the system Chromium's flags, the viewports, a
page's console watched for errors, screenshots for the docs."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from playwright.sync_api import ConsoleMessage, Page, ViewportSize

CHROMIUM = os.environ.get("LMSPD_CHROMIUM", "/usr/bin/chromium")
# This machine's network is closed and the profile must start empty: nothing reaches out.
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
LAPTOP: ViewportSize = {"width": 1280, "height": 800}
PHONE: ViewportSize = {"width": 390, "height": 844}
# Where the tests' screenshots go: the docs' own pictures when asked (docs/console.md says how).
SHOTS = Path(os.environ["LMSPD_CONSOLE_SHOTS"]) if os.environ.get("LMSPD_CONSOLE_SHOTS") else None


@dataclass
class Console:
    """What a page said on its console, and its uncaught errors."""

    errors: list[str] = field(default_factory=list)

    def watch(self, page: Page) -> Page:
        def said(msg: ConsoleMessage) -> None:
            if msg.type in ("error", "warning"):
                self.errors.append(f"{msg.type}: {msg.text}")

        page.on("console", said)
        page.on("pageerror", lambda exc: self.errors.append(f"uncaught: {exc}"))
        return page

    def assert_clean(self, *expected: str) -> None:
        """No error but those containing one of ``expected`` (network errors a test provokes)."""
        unexpected = [e for e in self.errors if not any(x in e for x in expected)]
        assert not unexpected, unexpected


def shot(page: Page, name: str) -> None:
    """A screenshot of the page, kept under docs/ when LMSPD_CONSOLE_SHOTS names it."""
    if SHOTS is not None:
        SHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SHOTS / name), full_page=False)
