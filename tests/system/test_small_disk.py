"""A real ``lmspd serve`` whose data directory is a 12 MB file system of its own (a tmpfs,
harness.disk), with the default configuration: the prompt cache's disk copy, bounded at
2 GiB, shares that disk with the database.

It used to fill it: long prompts' cache files ran into ENOSPC, MLX's RuntimeError ended the
engine, and the half-written ``.tmp-`` file it left kept the disk full (intake answering
503). Now the disk copy leaves ``prompt_cache_disk_min_free_bytes`` free (512 MB by
default: more than this whole disk), says "disk full" once, and every request is served
from memory. The failed-write and room-again paths are tests/engine/test_prompt_cache.py's."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from harness.disk import free, small_disk
from harness.server import Server, tiny_server
from lmspd.models.registry import ResolvedModel

DISK_BYTES = 12 << 20
# ~3,000 tokens of the tiny model's 4,096-token context: ~1.5 MB of KV per prompt cache
# entry, so a handful of distinct prompts is more than the disk holds.
PROMPT_WORDS = 600


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, model_cache: Path, tiny_long: ResolvedModel) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("small-disk")
    with small_disk(tmp / "data", DISK_BYTES), tiny_server(tmp, model_cache, tiny_long) as srv:
        srv.start()
        yield srv


def log_lines(server: Server, words: str) -> list[str]:
    return [line for line in server.log.read_text().splitlines() if words in line]


def test_the_prompt_cache_never_fills_the_disk_it_shares_with_the_database(server: Server) -> None:
    data = server.config.parent / "data"
    before = free(data)
    for i in range(8):  # ~12 MB of cache entries, were they all written
        body = {"input": f"{i} " + "lorem ipsum " * PROMPT_WORDS, "temperature": 0, "max_output_tokens": 8}
        r = httpx.post(f"{server.url}/v1/responses", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["status"] in ("completed", "incomplete"), r.text
        assert r.json()["usage"]["input_tokens"] > 2500
    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert re.search(r"^lmspd_engine_restarts_total 0\.0$", metrics, re.M), "the engine died"
    assert not log_lines(server, "Traceback") and not log_lines(server, "restarting the engine")
    # Nothing half-written left behind, no cache file where it would eat the database's
    # room, and the disk as free as the database's own writes left it.
    assert not [f for f in data.rglob("*") if f.name.startswith(".tmp-")]
    assert not list((data / "prompt-cache").rglob("*.safetensors"))
    database = sum(f.stat().st_size for f in data.glob("lmspd.db*"))
    assert free(data) + database >= before
    [said] = log_lines(server, "prompt cache: disk full")
    assert "prompt_cache_disk_min_free_bytes" in said and "until there is room" in said
