"""One model over two hosts, through a real ``lmspd serve`` (docs/distributed.md): its engine is
rank 0, a real ``lmspd engine join`` rank 1, over loopback. A rank killed -9 mid-generation is an
engine crash to the tasks: ``resume`` finishes with the uninterrupted text once the group has
formed again, ``fail`` fails naming the host; nothing acknowledged is lost. While a host is
missing, ``/readyz`` names it; the models and the summary show the group.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness.group import Joiner, loopback_hosts, toml_list
from harness.server import Server, read_sse, submit, tiny_server, wait_final
from harness.wait import wait_until
from lmspd.models.registry import ResolvedModel

TEXT = "Tell me everything about the sea."
TOKENS = 120


@pytest.fixture(scope="module")
def hosts() -> list[str]:
    return loopback_hosts()


@pytest.fixture(scope="module")
def joiner(hosts: list[str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Joiner]:
    with Joiner(tmp_path_factory.mktemp("join"), hosts, timeout_secs=10) as j:
        yield j


@pytest.fixture(scope="module")
def server(
    hosts: list[str], joiner: Joiner, tmp_path_factory: pytest.TempPathFactory, model_cache: Path, tiny: ResolvedModel
) -> Iterator[Server]:
    engine = f"hosts = {toml_list(hosts)}\ngroup_timeout_secs = 10\n"
    with tiny_server(tmp_path_factory.mktemp("server"), model_cache, tiny, engine=engine) as srv:
        srv.start()
        yield srv


def _text(final: dict[str, Any]) -> str:
    return str(final["response"]["output"][0]["content"][0]["text"])


def test_the_models_and_the_summary_show_the_group(server: Server, hosts: list[str]) -> None:
    wait_final(server.url, submit(server.url, "fail", "Hi", 4)["id"])
    models = httpx.get(f"{server.url}/lmsp/v1/models", timeout=10).json()["data"]
    tiny = next(m for m in models if m["id"] == "tiny")
    assert tiny["loaded"] and [h["host"] for h in tiny["hosts"]] == hosts
    assert [h["layers"] for h in tiny["hosts"]] == [[1, 2], [0, 1]]
    assert all(h["resident_bytes"] > 0 and h["link_bytes_per_sec"] > 0 for h in tiny["hosts"])
    engine = httpx.get(f"{server.url}/lmsp/v1/summary", timeout=10).json()["engine"]
    assert [h["host"] for h in engine["hosts"]] == hosts
    scrape = httpx.get(f"{server.url}/metrics", timeout=10).text
    for rank, host in enumerate(hosts):
        assert f'lmspd_model_host_layers{{host="{host}",model="tiny",rank="{rank}"}} 1.0' in scrape, scrape


def test_a_rank_killed_mid_generation_loses_no_task(server: Server, joiner: Joiner, hosts: list[str]) -> None:
    reference = wait_final(server.url, submit(server.url, "resume", TEXT, TOKENS)["id"])
    assert reference["status"] == "succeeded"
    resume = submit(server.url, "resume", TEXT, TOKENS)
    fail = submit(server.url, "fail", TEXT, TOKENS)
    events: list[dict[str, Any]] = []
    reader = threading.Thread(target=read_sse, args=(server.url, fail["id"], events), kwargs={"stop_after": 12})
    reader.start()
    reader.join(120)  # a dozen of the fail task's events: both are generating
    assert len(events) >= 12
    joiner.kill_rank()
    resumed, failed = wait_final(server.url, resume["id"]), wait_final(server.url, fail["id"])
    assert resumed["status"] == "succeeded" and _text(resumed) == _text(reference) != ""
    assert resumed["attempt"] == 1  # resumed on its first attempt, not started over
    assert failed["status"] == "failed" and failed["error"]["code"] == "engine_crashed"
    assert "engine group lost" in failed["error"]["detail"] and hosts[1] in failed["error"]["detail"]


def test_readyz_names_the_missing_host_until_it_joins(
    server: Server, joiner: Joiner, hosts: list[str], tmp_path: Path
) -> None:
    joiner.__exit__(None, None, None)  # the other host gone: its join stopped, its rank with it

    def not_ready() -> str | None:
        r = httpx.get(f"{server.url}/readyz", timeout=5)
        return r.text if r.status_code == 503 and f"waiting for rank 1 ({hosts[1]})" in r.text else None

    # The engine notices at its next tick (a heartbeat at most) and starts again, waiting.
    wait_until(not_ready, "readyz names the missing host", timeout=60, interval=0.2)
    doctor = subprocess.run(
        [sys.executable, "-m", "lmspd.cli", "doctor", "--config", str(server.config)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "LMSPD_PORT": str(server.port)},
    )
    line = next(x for x in doctor.stdout.splitlines() if x.split()[1:2] == ["group"])
    assert line.startswith("FAIL") and f"waiting for rank 1 ({hosts[1]})" in line, doctor.stdout
    with Joiner(tmp_path, hosts, timeout_secs=10) as back:
        wait_until(server.ready, "ready once the host is back", timeout=90, interval=0.2)
        final = wait_final(server.url, submit(server.url, "fail", "Hi", 4)["id"])
        assert final["status"] == "succeeded"
        assert "joined the engine group" in back.log


def test_with_continue_alone_a_server_missing_its_host_serves_alone_and_says_so(
    tmp_path: Path, model_cache: Path, tiny: ResolvedModel
) -> None:
    hosts = loopback_hosts()
    engine = f"hosts = {toml_list(hosts)}\ngroup_timeout_secs = 2\ngroup_continue_alone = true\n"
    with tiny_server(tmp_path, model_cache, tiny, engine=engine) as srv:
        srv.start()
        ready = httpx.get(f"{srv.url}/readyz", timeout=5).json()
        assert ready["status"] == "ready" and "serving alone (engine.group_continue_alone)" in ready["reason"]
        assert f"waiting for rank 1 ({hosts[1]})" in ready["reason"]
        assert wait_final(srv.url, submit(srv.url, "fail", "Hi", 4)["id"])["status"] == "succeeded"
