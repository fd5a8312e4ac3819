"""The engine's prompt cache: the next turn reuses the KV of the last, gives the same tokens as
a cold run, and the hottest entries survive the engine process (but never a corrupt file)."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import msgspec
import pytest
from mlx_lm.models.cache import KVCache

from harness.disk import fill, free, small_disk
from harness.generation import deltas_of
from harness.wait import wait_until_async
from lmspd.config import EngineConfig
from lmspd.engine import prompt_cache
from lmspd.engine import protocol as p
from lmspd.engine.loaded import KEEP_PREFILL_TOKENS, KEEP_SOON_TOKENS, Request, keeps_early
from lmspd.engine.process import EngineClient
from lmspd.engine.prompt_cache import SUFFIX, DiskCache, PromptCache, stored_lengths
from lmspd.models.registry import ResolvedModel
from lmspd.prompting.generation import build_generate, cache_key

GREEDY = p.SamplingParams(temperature=0.0)
CONFIG = EngineConfig(weight_dtype="quantized", max_concurrency=4)


def kv(tokens: int, seed: int = 0) -> list[KVCache]:
    """A two-layer KV cache holding ``tokens`` positions of random keys and values."""
    mx.random.seed(seed)
    layers = []
    for _ in range(2):
        c = KVCache()
        c.update_and_fetch(mx.random.normal((1, 2, tokens, 4)), mx.random.normal((1, 2, tokens, 4)))
        layers.append(c)
    return layers


def command(model: ResolvedModel, prompt: list[int], max_tokens: int = 12, key: str = "") -> p.Generate:
    base = build_generate(model, [{"role": "user", "content": "x"}], request_id="probe", max_tokens=1, sampling=GREEDY)
    return p.Generate(
        request_id=uuid.uuid4().hex,
        model=model.name,
        path=str(model.path),
        prompt=prompt,
        max_tokens=max_tokens,
        sampling=GREEDY,
        stop_token_ids=base.stop_token_ids,
        cache_key=key,
    )


def first_prompt(model: ResolvedModel) -> list[int]:
    return build_generate(
        model,
        [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Name three rivers."}],
        request_id="p",
        max_tokens=1,
        sampling=GREEDY,
    ).prompt


async def run(engine: EngineClient, cmd: p.Generate) -> tuple[list[int], p.Finished]:
    ids: list[int] = []
    async for ev in engine.generate(cmd):
        if isinstance(ev, p.Delta):
            ids += ev.token_ids
        else:
            return ids, ev
    raise AssertionError("no Finished")


@pytest.fixture(scope="module")
async def cold() -> AsyncIterator[EngineClient]:
    """An engine with the prompt cache off: what every answer must equal."""
    client = EngineClient(EngineConfig(weight_dtype="quantized", max_concurrency=4, prompt_cache_max_bytes=0))
    await client.start()
    yield client
    await client.close()


@pytest.fixture
def warm(engine: EngineClient) -> EngineClient:
    """The session's shared engine, whose config is CONFIG: the cache on (in memory); each
    test keeps to its own cache key."""
    assert engine.config == CONFIG
    return engine


@pytest.fixture
def key() -> str:
    return uuid.uuid4().hex


async def two_turns(engine: EngineClient, model: ResolvedModel, key: str) -> tuple[list[int], list[int]]:
    """Turn 1, then turn 2 = turn 1's prompt, its answer and a new user turn."""
    one = first_prompt(model)
    answer, fin = await run(engine, command(model, one, key=key))
    assert fin.cached_tokens == 0
    return one, [*one, *answer, *first_prompt(model)[-8:]]


async def test_the_next_turn_prefills_only_its_new_part_and_gives_the_same_tokens(
    warm: EngineClient, cold: EngineClient, tiny: ResolvedModel, key: str
) -> None:
    one, two = await two_turns(warm, tiny, key)
    answer, fin = await run(warm, command(tiny, two, key=key))
    # Turn 1 is reused: its prompt and its answer but the last token, which was handed out as
    # soon as its pass computed it, so no pass fed it back (engine/upstream/stepping.py).
    assert fin.cached_tokens == len(one) + 11
    assert fin.prompt_tokens == len(two)
    expected, cold_fin = await run(cold, command(tiny, two))
    assert cold_fin.cached_tokens == 0
    assert answer == expected


async def test_cached_and_fresh_requests_share_one_batch(
    warm: EngineClient, cold: EngineClient, tiny: ResolvedModel, key: str
) -> None:
    _, two = await two_turns(warm, tiny, key)
    fresh = [*first_prompt(tiny)[:-3], 42, 43, 44]
    (hit, hit_fin), (new, new_fin) = await asyncio.gather(
        run(warm, command(tiny, two, key=key)), run(warm, command(tiny, fresh, key=key + "-fresh"))
    )
    assert hit_fin.cached_tokens > 0 and new_fin.cached_tokens == 0
    assert hit == (await run(cold, command(tiny, two)))[0]
    assert new == (await run(cold, command(tiny, fresh)))[0]


async def test_a_long_prompt_is_cached_once_prefilled_not_only_when_its_answer_ends(
    warm: EngineClient, tiny_long: ResolvedModel, key: str
) -> None:
    prompt = [*first_prompt(tiny_long), *range(1000, 1000 + KEEP_PREFILL_TOKENS)]
    long = command(tiny_long, prompt, max_tokens=3000, key=key)
    stream = warm.generate(long)
    first = await anext(stream)  # a token: the prompt has been prefilled
    assert isinstance(first, p.Delta)
    _, fin = await run(warm, command(tiny_long, prompt, max_tokens=2, key=key))
    assert fin.cached_tokens == len(prompt) - 1
    await warm.cancel(long.request_id)
    async for ev in stream:
        if isinstance(ev, p.Finished):
            assert ev.reason == "cancelled"


@pytest.mark.parametrize(
    ("prompt", "cached", "max_tokens", "kept"),
    [
        (KEEP_PREFILL_TOKENS, 0, 3000, True),
        (KEEP_PREFILL_TOKENS - 1, 0, 3000, False),  # short: cached with its answer
        (KEEP_PREFILL_TOKENS + 10, 20, 3000, False),  # the cache gave part of it: too little computed
        (KEEP_PREFILL_TOKENS, 0, KEEP_SOON_TOKENS, False),  # its answer ends soon: cached then
        (KEEP_PREFILL_TOKENS, 0, KEEP_SOON_TOKENS + 1, True),
    ],
)
def test_which_prompts_are_cached_once_prefilled(
    tiny: ResolvedModel, prompt: int, cached: int, max_tokens: int, kept: bool
) -> None:
    req = Request(command(tiny, list(range(prompt)), max_tokens=max_tokens), 0, cast(Any, None), 0, cached)
    assert keeps_early(req) == kept


async def test_an_exact_repeat_takes_its_first_token_from_the_kept_prompt_end(
    warm: EngineClient, cold: EngineClient, tiny: ResolvedModel, key: str
) -> None:
    prompt = first_prompt(tiny)
    first, fin = await run(warm, command(tiny, prompt, key=key))
    assert fin.cached_tokens == 0
    again, fin = await run(warm, command(tiny, prompt, key=key))
    # Every prompt token's KV came from the cache: no pass ran over the last one.
    assert fin.cached_tokens == len(prompt)
    assert again == first == (await run(cold, command(tiny, prompt)))[0]


async def test_a_prompt_end_gives_the_same_logprobs_and_seeded_samples(
    warm: EngineClient, cold: EngineClient, tiny: ResolvedModel, key: str
) -> None:
    prompt = first_prompt(tiny)
    asked = msgspec.structs.replace(command(tiny, prompt, key=key), logprobs=3)
    deltas, _ = await deltas_of(warm, asked)
    repeat, fin = await deltas_of(warm, msgspec.structs.replace(asked, request_id=uuid.uuid4().hex))
    assert fin.cached_tokens == len(prompt)
    assert [d.logprobs for d in repeat] == [d.logprobs for d in deltas]
    seeded = p.SamplingParams(temperature=1.0, seed=5)
    sampled = msgspec.structs.replace(command(tiny, prompt, key=key), sampling=seeded)
    got, fin = await run(warm, sampled)
    assert fin.cached_tokens == len(prompt)
    assert got == (await run(cold, msgspec.structs.replace(sampled, request_id=uuid.uuid4().hex)))[0]


async def test_a_first_token_that_ends_the_answer_never_joins_the_batch(
    warm: EngineClient, tiny: ResolvedModel, key: str
) -> None:
    prompt = first_prompt(tiny)
    answer, _ = await run(warm, command(tiny, prompt, key=key))
    # The only token it may have: answered from the prompt end, finished by length.
    one, fin = await run(warm, command(tiny, prompt, max_tokens=1, key=key))
    assert (one, fin.reason, fin.completion_tokens, fin.cached_tokens) == (answer[:1], "length", 1, len(prompt))
    # Its first token a stop token: the answer is empty, and ends with "stop".
    stopping = msgspec.structs.replace(command(tiny, prompt, key=key), stop_token_ids=[answer[0]])
    none, fin = await run(warm, stopping)
    assert (none, fin.reason, fin.completion_tokens, fin.cached_tokens) == ([], "stop", 0, len(prompt))
    # The engine goes on serving: the repeat after them is whole and the same.
    assert (await run(warm, command(tiny, prompt, key=key)))[0] == answer


async def test_a_constrained_repeat_runs_its_last_token(warm: EngineClient, tiny: ResolvedModel, key: str) -> None:
    prompt = first_prompt(tiny)
    await run(warm, command(tiny, prompt, key=key))
    lark = "start: /[a-z ]{1,8}/"
    _, fin = await run(warm, msgspec.structs.replace(command(tiny, prompt, key=key), grammar=lark))
    assert fin.cached_tokens == len(prompt) - 1  # a grammar masks a pass's logits: the pass runs


async def test_clients_never_share_cached_prefixes(warm: EngineClient, tiny: ResolvedModel, key: str) -> None:
    _, two = await two_turns(warm, tiny, key)
    _, fin = await run(warm, command(tiny, two, key=key + "-someone-else"))
    assert fin.cached_tokens == 0
    _, fin = await run(warm, command(tiny, two, key=key))
    assert fin.cached_tokens > 0


async def test_a_resumed_request_counts_cached_tokens_of_its_prompt_only(
    warm: EngineClient, tiny: ResolvedModel, key: str
) -> None:
    prompt = first_prompt(tiny)
    answer, _ = await run(warm, command(tiny, prompt, max_tokens=12, key=key))
    resumed = command(tiny, prompt, max_tokens=12, key=key)
    resumed = p.Generate(**{**{f: getattr(resumed, f) for f in resumed.__struct_fields__}, "generated": answer[:6]})
    rest, fin = await run(warm, resumed)
    assert rest == answer[6:]
    assert fin.cached_tokens == len(prompt)


async def wait_for_files(folder: Path, count: int) -> list[Path]:
    def found() -> list[Path] | None:
        files = sorted(f for f in folder.rglob(f"*{SUFFIX}") if not f.name.startswith("."))  # not mid-write
        return files if len(files) >= count else None

    return await wait_until_async(found, f"{count} prompt cache files in {folder}", interval=0.05)


async def test_the_cache_survives_kill_9_and_a_corrupt_file_is_ignored(
    tmp_path: Path, cold: EngineClient, tiny: ResolvedModel
) -> None:
    folder = tmp_path / "prompt-cache"
    engine = EngineClient(CONFIG, folder)
    await engine.start()
    try:
        one, two = await two_turns(engine, tiny, "")
        (written,) = await wait_for_files(folder, 1)
        assert engine.process is not None and engine.process.pid is not None
        os.kill(engine.process.pid, signal.SIGKILL)
    finally:
        await engine.close()
    # A torn write, a file whose bytes do not match its name, and bytes that are no cache.
    (written.parent / f".tmp-123{SUFFIX}").write_bytes(b"half")
    corrupt = written.parent / f"{'0' * 64}{SUFFIX}"
    corrupt.write_bytes(written.read_bytes())
    garbage = b"not a safetensors file"
    (written.parent / f"{hashlib.sha256(garbage).hexdigest()}{SUFFIX}").write_bytes(garbage)

    engine = EngineClient(CONFIG, folder)
    await engine.start()
    try:
        answer, fin = await run(engine, command(tiny, two))
    finally:
        await engine.close()
    assert fin.cached_tokens == len(one) + 11  # turn 1 but its answer's last token, as above
    assert answer == (await run(cold, command(tiny, two)))[0]
    # The bad files are gone; what is left is the cache of turn 2, which superseded turn 1's.
    (left,) = written.parent.iterdir()
    assert left.name == f"{hashlib.sha256(left.read_bytes()).hexdigest()}{SUFFIX}" != written.name


# --- the cache without an engine -----------------------------------------------------------


def test_disk_entries_round_trip_and_are_bounded(tmp_path: Path) -> None:
    disk = DiskCache(tmp_path, max_bytes=1 << 30)
    key_a = (("m", ""), (1, 2, 3))
    key_b = (("m", "k"), (4, 5))
    disk.write(key_a, kv(3))
    disk.write(key_b, kv(2, seed=1))
    loaded = dict(DiskCache(tmp_path, max_bytes=1 << 30).load("m"))
    assert set(loaded) == {key_a, key_b}
    assert sorted(stored_lengths(tmp_path)) == [2, 3]
    for a, b in zip(loaded[key_a], kv(3), strict=True):
        assert mx.array_equal(a.keys[..., : a.offset, :], b.keys[..., : b.offset, :])
    assert DiskCache(tmp_path, 1 << 30).load("other-model") == []
    size = next(tmp_path.rglob(f"*{SUFFIX}")).stat().st_size
    disk.max_bytes = size + 1  # room for one: the newest stays
    disk.prune(keep=lambda key: True)
    assert list(disk.files) == [key_b]


def test_disk_files_are_the_owners_alone(tmp_path: Path) -> None:
    """A client's prompts, as KV: 0600 files in 0700 directories whatever the umask (022 here, a
    login shell's; docs/operations.md, "Files and permissions")."""
    old = os.umask(0o022)
    try:
        DiskCache(tmp_path / "data" / "prompt-cache", max_bytes=1 << 30).write((("m", ""), (1, 2, 3)), kv(3))
    finally:
        os.umask(old)
    (path,) = (tmp_path / "data").rglob(f"*{SUFFIX}")
    made = [tmp_path / "data", tmp_path / "data" / "prompt-cache", path.parent]
    assert {d.name: oct(d.stat().st_mode & 0o777) for d in made} == {d.name: "0o700" for d in made}
    assert oct(path.stat().st_mode & 0o777) == "0o600"


def test_a_file_of_another_model_is_not_trusted(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    disk = DiskCache(tmp_path, max_bytes=1 << 30)
    disk.write((("m", ""), (1, 2, 3)), kv(3))
    (path,) = tmp_path.rglob(f"*{SUFFIX}")
    (tmp_path / "n").mkdir()
    moved = tmp_path / "n" / path.name
    path.rename(moved)
    with caplog.at_level(logging.WARNING, logger="lmspd.engine.cache"):
        assert DiskCache(tmp_path, 1 << 30).load("n") == []
    assert "not written by lmspd for this model" in caplog.text
    assert not moved.exists()


def test_the_memory_bound_holds_and_the_newest_entry_stays() -> None:
    one = sum(c.nbytes for c in kv(300))
    cache = PromptCache(max_bytes=2 * one + one // 2)
    for i in range(5):
        cache.store(("m", ""), list(range(i * 1000, i * 1000 + 300)), kv(300, seed=i))
        assert cache.nbytes <= 2 * one + one // 2
    assert cache.fetch(("m", ""), [*range(4000, 4300), 7]).cached == 300
    assert cache.fetch(("m", ""), [*range(0, 300), 7]).cached == 0


def test_prompt_ends_share_the_bound_and_go_least_recently_used_first() -> None:
    row = mx.arange(1000, dtype=mx.float32)  # 4,000 bytes
    cache = PromptCache(max_bytes=16 * 10_000)  # a sixteenth for the ends: two rows and a half
    assert cache.ends.max_bytes == 10_000 and cache.lru.max_bytes == 15 * 10_000
    for i in range(3):
        cache.ends.keep(("m", ""), [i, i + 1], row + i)
        cache.ends.get(("m", ""), [0, 1])  # the first stays the most recently used
    assert cache.ends.get(("m", ""), [1, 2]) is None  # the least recently used went
    kept = cache.ends.get(("m", ""), [0, 1])
    assert kept is not None and mx.array_equal(kept, row).item()
    assert cache.ends.get(("m", "other client"), [0, 1]) is None
    assert cache.nbytes == cache.ends.nbytes == 8_000
    cache.fit(16 * 4_000)  # the engine's memory budget shrank
    assert len(cache.ends) == 1 and cache.nbytes == 4_000 and cache.lru.max_bytes == 15 * 4_000
    # A kept row is a copy: a view would hold its whole step's batch.
    cache.fit(1 << 30)
    batch = list(mx.ones((8, 1 << 20)))  # as a step's logprobs reach the engine (mlx-lm's _step)
    mx.eval(batch)
    with_batch = mx.get_active_memory()
    cache.ends.keep(("m", ""), [5, 6], batch[3])
    del batch
    # The other seven rows are freed (a view would keep all eight); a row's worth of slack for
    # what else the process allocates meanwhile (a few KB seen under pytest-xdist).
    assert mx.get_active_memory() <= with_batch - 6 * (4 << 20)


def test_a_disabled_cache_keeps_nothing() -> None:
    cache = PromptCache(max_bytes=0)
    cache.store(("m", ""), [1, 2, 3], kv(3))
    assert cache.nbytes == 0
    assert cache.fetch(("m", ""), [1, 2, 3, 4]).cache is None


# --- the disk it shares with the database ----------------------------------------------------


def said(caplog: pytest.LogCaptureFixture, words: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "lmspd.engine.cache" and words in r.getMessage()]


def leftovers(folder: Path) -> list[Path]:
    return [f for f in folder.rglob("*") if f.name.startswith(".tmp-")]


def test_a_write_the_disk_cannot_take_is_removed_said_once_and_never_raises(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real ENOSPC mid-write (the room check fooled, as a disk filled by another writer
    meanwhile would fool it): MLX raises a RuntimeError, which used to end the engine and
    leave the half-written file filling the disk."""
    with small_disk(tmp_path / "disk", 1 << 20) as disk:
        folder = disk / "prompt-cache"
        cache = PromptCache(1 << 30, folder, 1 << 30)
        assert cache.disk is not None
        cache.disk.min_free = 0
        monkeypatch.setattr(prompt_cache, "free_bytes", lambda directory: 1 << 40, raising=False)
        caplog.set_level(logging.WARNING, logger="lmspd.engine.cache")
        big = list(range(12_000))  # ~1.5 MB of KV: more than the disk holds
        cache.store(("m", ""), big, kv(len(big)))
        cache.flush(idle=True)
        cache.wait()
        assert not leftovers(folder) and not list(folder.rglob(f"*{SUFFIX}"))
        assert cache.disk.off is not None and free(disk) > (1 << 20) - (64 << 10)
        cache.store(("m", ""), [*big, 1], kv(len(big) + 1, seed=1))
        cache.flush(idle=True)  # off after a failed write: not tried again at once
        cache.wait()
        [line] = said(caplog, "disk full")
        assert "not writing to" in line and "until there is room" in line
        assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"
        # Room again (and the retry time past): the next entry that fits is written.
        monkeypatch.undo()
        monkeypatch.setattr(prompt_cache, "RETRY_SECS", 0.0)
        cache.disk.turn_off("a test", retry_in=0.0)  # already off: only the retry time changes
        cache.store(("m", ""), [7, 8, 9], kv(3))
        cache.flush(idle=True)
        cache.wait()
        assert [len(t) for t in [k[1] for k in cache.disk.files]] == [3]
        assert cache.disk.off is None and said(caplog, "has room again")
        cache.close()


def test_the_disk_copy_leaves_min_free_bytes_and_waits_for_room(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="lmspd.engine.cache")
    with small_disk(tmp_path / "disk", 6 << 20) as disk:
        filler = fill(disk, leave=3 << 20)
        min_free = 1 << 20
        cache = PromptCache(1 << 30, disk / "prompt-cache", 1 << 30, disk_min_free_bytes=min_free)
        assert cache.disk is not None
        tokens = list(range(20_000))  # ~2.5 MB: it would fit the disk, but not above min_free
        cache.store(("m", ""), tokens, kv(len(tokens)))
        cache.flush(idle=True)
        cache.wait()
        assert not cache.disk.files and cache.disk.off is not None
        [line] = said(caplog, "disk full")
        assert "prompt_cache_disk_min_free_bytes" in line
        small = list(range(3000))  # ~400 KB: room for it above min_free
        cache.store(("m", "k"), small, kv(len(small), seed=2))
        cache.flush(idle=True)
        cache.wait()
        assert [k[1] for k in cache.disk.files] == [tuple(small)] and free(disk) >= min_free
        assert said(caplog, "has room again")
        filler.unlink()  # room for the big one now
        cache.store(("m", ""), [*tokens, 5], kv(len(tokens) + 1, seed=3))
        cache.flush(idle=True)
        cache.wait()
        assert len(cache.disk.files) == 2 and free(disk) >= min_free
        assert len(said(caplog, "disk full")) == 1 and not leftovers(disk)
        cache.close()


def test_temporary_files_of_writers_that_are_gone_are_removed_at_start(tmp_path: Path) -> None:
    folder = tmp_path / "prompt-cache" / "model"
    folder.mkdir(parents=True)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = folder / f".tmp-{gone.pid}-0{SUFFIX}"
    mine = folder / f".tmp-{os.getpid()}-3{SUFFIX}"  # an earlier process with this pid
    alive = folder / f".tmp-{os.getppid()}-0{SUFFIX}"  # a live process may be writing it
    for path in (dead, mine, alive):
        path.write_bytes(b"half")
    PromptCache(1 << 20, tmp_path / "prompt-cache", 1 << 20)
    assert [p.name for p in folder.iterdir()] == [alive.name]


def test_prompt_cache_key_is_tried_first_then_the_clients_other_keys() -> None:
    """A new agent session (a new prompt_cache_key) starts from the last session's prefix of the
    same client; never from another client's, and its own key's entry wins when it holds more."""
    cache = PromptCache(max_bytes=1 << 30)
    session = list(range(100, 400))  # an agent's system prompt and tools
    cache.store(("m", cache_key("alice", "s1")), [*session, 1, 2], kv(302))
    assert cache.fetch(("m", cache_key("alice", "s2")), [*session, 9, 9]).cached == 300
    assert cache.fetch(("m", cache_key("alice", None)), [*session, 9, 9]).cached == 300
    assert cache.fetch(("m", cache_key("bob", "s1")), [*session, 9, 9]).cached == 0
    assert cache.fetch(("other-model", cache_key("alice", "s1")), [*session, 9, 9]).cached == 0
    cache.store(("m", cache_key("alice", "s2")), session[:50], kv(50, seed=1))
    assert cache.fetch(("m", cache_key("alice", "s2")), [*session, 9, 9]).cached == 300  # the longer one
    cache.store(("m", cache_key("alice", "s2")), [*session, 9], kv(301, seed=2))
    assert cache.nearest(("m", cache_key("alice", "s2")), [*session, 9, 9]) == ("m", cache_key("alice", "s2"))
