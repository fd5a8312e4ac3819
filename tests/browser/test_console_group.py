"""The console's Server page for a server whose engine is an MLX ring group of two ranks on
loopback (docs/distributed.md): the engine's hosts and the link, and the model's part on each."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Page, expect

from harness.browser import Console
from harness.group import Joiner, loopback_hosts, toml_list
from harness.server import Server, submit, tiny_server, wait_final
from lmspd.models.registry import ResolvedModel

SLOW = 30_000  # ms: only the waits' deadline


@pytest.fixture(scope="module")
def hosts() -> list[str]:
    return loopback_hosts()


@pytest.fixture(scope="module")
def server(
    hosts: list[str], tmp_path_factory: pytest.TempPathFactory, model_cache: Path, tiny: ResolvedModel
) -> Iterator[Server]:
    work = tmp_path_factory.mktemp("group")
    with Joiner(work, hosts), tiny_server(work, model_cache, tiny, engine=f"hosts = {toml_list(hosts)}\n") as srv:
        srv.start()
        yield srv


def test_the_server_page_shows_the_group(page: Page, server: Server, hosts: list[str], console: Console) -> None:
    assert wait_final(server.url, submit(server.url, "fail", "Hi", 4)["id"])["status"] == "succeeded"
    page.goto("/#/server")
    engine = page.locator("#server-engine")
    expect(engine).to_contain_text(f"rank 0 {hosts[0]}", timeout=SLOW)
    expect(engine).to_contain_text(f"rank 1 {hosts[1]}")
    expect(engine).to_contain_text("/s")  # the link's speed
    row = page.locator("#server-models tr", has_text="tiny").first
    expect(row).to_contain_text("on rank 0 (layers 1–1)")
    expect(row).to_contain_text("on rank 1 (layers 0–0)")
    console.assert_clean()
