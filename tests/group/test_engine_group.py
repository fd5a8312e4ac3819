"""One model over two hosts (SPEC §17, docs/distributed.md), at the engine: a real engine
process as rank 0 and a real ``lmspd engine join`` as rank 1, an MLX ring group over loopback.
Not in the default run (pyproject testpaths): ``.ci/run`` runs this folder in a bounded step of
its own.

Greedy output on two ranks equals one process's, token for token; each rank holds its share
of the layers; a rank killed -9 or silent mid-generation ends the engine within a bound, and
the group formed again resumes the answer exactly; a missing host, another version and a
different model file are each a clear error naming the host.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import jsonschema
import msgspec
import pytest

from harness.generation import GREEDY, PROMPTS, SCHEMA, collect, request, schema_grammar
from harness.group import Joiner, loopback_hosts
from harness.models import LAYERED, make_tiny_model
from harness.wait import wait_until_async
from lmspd.config import EngineConfig
from lmspd.engine import protocol as p
from lmspd.engine.process import EngineClient
from lmspd.errors import EngineCrashedError, LmspdError
from lmspd.models.registry import ResolvedModel
from lmspd.prompting.generation import build_generate

TIMEOUT = 5.0  # group_timeout_secs: a silent rank is lost after this


def _group(hosts: list[str]) -> EngineClient:
    return EngineClient(EngineConfig(hosts=hosts, group_timeout_secs=TIMEOUT))


async def _answers(engine: EngineClient, model: ResolvedModel, max_tokens: int = 32) -> list[list[int]]:
    alone = [(await collect(engine, request(model, q, max_tokens=max_tokens)))[0] for q in PROMPTS]
    together = await asyncio.gather(*(collect(engine, request(model, q, max_tokens=max_tokens)) for q in PROMPTS))
    assert [t[0] for t in together] == alone  # batched as one process batches: the same tokens
    return alone


@pytest.fixture(scope="module")
def hosts() -> list[str]:
    return loopback_hosts()


@pytest.fixture(scope="module")
def joiner(hosts: list[str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Joiner]:
    with Joiner(tmp_path_factory.mktemp("join"), hosts, timeout_secs=TIMEOUT) as j:
        yield j


@pytest.fixture(scope="module")
async def group(hosts: list[str], joiner: Joiner) -> AsyncIterator[EngineClient]:
    engine = _group(hosts)
    await engine.start()
    yield engine
    await engine.close()


@pytest.fixture(scope="module")
async def solo() -> AsyncIterator[EngineClient]:
    engine = EngineClient(EngineConfig())
    await engine.start()
    yield engine
    await engine.close()


@pytest.mark.parametrize("which", ["smol", "tiny"])
async def test_two_ranks_answer_token_for_token_as_one_process(
    group: EngineClient, solo: EngineClient, which: str, request: pytest.FixtureRequest
) -> None:
    model: ResolvedModel = request.getfixturevalue(which)
    split = await group.load(model.name, str(model.path))
    whole = await solo.load(model.name, str(model.path))
    assert await _answers(group, model) == await _answers(solo, model)
    assert group.info is not None and [h.rank for h in group.info.hosts] == [0, 1]
    # Rank 1 holds the first layers, rank 0 the rest; each only its own.
    ranks = {h.rank: h for h in split.hosts}
    assert ranks[1].layers[0] == 0 and ranks[1].layers[1] == ranks[0].layers[0] < ranks[0].layers[1]
    for h in split.hosts:
        assert 0 < h.resident_bytes < whole.resident_bytes
    assert split.resident_bytes == ranks[0].resident_bytes


async def test_grammars_compile_and_constrain_alike_on_every_rank(
    group: EngineClient, solo: EngineClient, tiny: ResolvedModel
) -> None:
    """Each rank compiles a new grammar on its own thread; the request joins the batch on every
    rank in the loop where rank 0's has compiled (the tick says which), beside a free request."""
    await group.load(tiny.name, str(tiny.path))
    await solo.load(tiny.name, str(tiny.path))
    lark = schema_grammar(SCHEMA)
    answers = []
    for engine in (group, solo):
        free = request(tiny, PROMPTS[0], max_tokens=16)
        constrained = [msgspec.structs.replace(request(tiny, q, max_tokens=64), grammar=lark) for q in PROMPTS[:3]]
        results = await asyncio.gather(collect(engine, free), *(collect(engine, c) for c in constrained))
        answers.append([r[0] for r in results])
        for _, text, fin in results[1:]:
            assert fin.reason == "stop", text
            jsonschema.validate(json.loads(text), SCHEMA)
    assert answers[0] == answers[1]


@pytest.fixture(scope="module")
def layered(tmp_path_factory: pytest.TempPathFactory, smol_dir: Path) -> ResolvedModel:
    """A random Llama whose 24 layers outweigh its embeddings (harness.models.LAYERED)."""
    path = make_tiny_model(tmp_path_factory.mktemp("layered") / "layered", smol_dir, shape=LAYERED, context=512)
    return ResolvedModel(name="layered", path=path)


def _rss(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(x for x in status.splitlines() if x.startswith("VmRSS:")).split()[1]) * 1024


async def test_each_rank_holds_about_half_of_a_model_whose_layers_outweigh_its_embeddings(
    group: EngineClient, solo: EngineClient, joiner: Joiner, layered: ResolvedModel
) -> None:
    split = await group.load(layered.name, str(layered.path))
    whole = await solo.load(layered.name, str(layered.path))
    try:
        assert [h.layers for h in split.hosts] == [[12, 24], [0, 12]]  # alike memory: alike shares
        for h in split.hosts:  # each rank's 12 layers and the embeddings (18% of the model)
            assert h.resident_bytes < 0.6 * whole.resident_bytes, (h, whole.resident_bytes)
        # The processes too: each rank's resident set holds what one process does, less about
        # half the model (the interpreter, MLX and the tokenizer are in each).
        assert group.process is not None and group.process.pid is not None
        assert solo.process is not None and solo.process.pid is not None
        saved = _rss(solo.process.pid) - max(_rss(group.process.pid), _rss(joiner.rank_pid()))
        assert saved > 0.4 * whole.resident_bytes, saved
        cmd = request(layered, PROMPTS[0], max_tokens=16)
        assert (await collect(group, cmd))[0] == (await collect(solo, cmd))[0]
    finally:
        await group.unload(layered.name)
        await solo.unload(layered.name)


async def test_the_prompt_cache_hits_and_evicts_alike_on_every_rank(
    tmp_path: Path, solo: EngineClient, tiny_long: ResolvedModel
) -> None:
    """Four conversations of three turns each, twice over, with a cache bound that keeps about
    two of them (an entry's KV is 512 bytes a token in 256-token blocks, 128 KiB and up): each
    rank's hits and evictions must be the same, or the ranks' batches would part (a hang, then
    the watchdog). The answers equal one process's; a conversation's later turns hit, and its
    first turn the second time round misses (evicted meanwhile)."""
    hosts = loopback_hosts()
    with Joiner(tmp_path, hosts, timeout_secs=TIMEOUT):
        budget = 400 << 10
        engine = EngineClient(EngineConfig(hosts=hosts, group_timeout_secs=TIMEOUT, prompt_cache_max_bytes=budget))
        await engine.start()
        try:
            await engine.load(tiny_long.name, str(tiny_long.path))
            await solo.load(tiny_long.name, str(tiny_long.path))
            topics = ["the sea", "a mountain", "the city at night", "an old library"]
            history: dict[str, list[dict[str, str]]] = {t: [] for t in topics}
            cached: list[int] = []
            for _round in range(2):
                for topic, turn in [(t, n) for t in topics for n in range(3)]:
                    messages = [*history[topic], {"role": "user", "content": f"Turn {turn}: tell me of {topic}."}]
                    cmd = build_generate(
                        tiny_long, messages, request_id=uuid.uuid4().hex, max_tokens=24, sampling=GREEDY
                    )
                    ids, text, fin = await collect(engine, cmd)
                    assert (
                        ids
                        == (await collect(solo, msgspec.structs.replace(cmd, request_id="solo-" + cmd.request_id)))[0]
                    )
                    cached.append(fin.cached_tokens)
                    history[topic] = [*messages, {"role": "assistant", "content": text}]
            # Each conversation's 2nd and 3rd turns find its earlier turns; the first turn of
            # its second round finds only what all share (the chat template's system turn, 31
            # or 32 tokens): its own entry was evicted meanwhile.
            shared = 40
            assert all(cached[i] > shared for i in range(24) if i % 3), cached
            assert all(n < shared for n in cached[12::3]), cached
            status = await engine.status()
            assert 0 < status.prompt_cache_bytes <= budget
        finally:
            await engine.close()


async def test_a_rank_killed_mid_generation_ends_the_engine_and_the_answer_resumes_exactly(
    hosts: list[str], joiner: Joiner, group: EngineClient, tiny_long: ResolvedModel
) -> None:
    await group.load(tiny_long.name, str(tiny_long.path))
    full, _, _ = await collect(group, request(tiny_long, PROMPTS[2], max_tokens=200))
    seen: list[int] = []
    killed: list[int] = []
    with pytest.raises(EngineCrashedError) as crashed:
        async for ev in group.generate(request(tiny_long, PROMPTS[2], max_tokens=200)):
            if isinstance(ev, p.Delta):
                seen += ev.token_ids
                if len(seen) >= 20 and not killed:
                    killed.append(await asyncio.to_thread(joiner.kill_rank))
    assert "engine group lost" in crashed.value.message and hosts[1] in crashed.value.message
    assert 20 <= len(seen) < 200 and seen == full[: len(seen)]
    # The join starts a fresh rank; the engine started again forms the group with it.
    await group.start()
    await group.load(tiny_long.name, str(tiny_long.path))
    rest, _, fin = await collect(group, request(tiny_long, PROMPTS[2], max_tokens=200, generated=seen))
    assert seen + rest == full and fin.completion_tokens == 200


async def test_a_silent_rank_is_lost_within_the_timeout(
    hosts: list[str], joiner: Joiner, group: EngineClient, tiny_long: ResolvedModel
) -> None:
    """SIGSTOP: the rank's sockets stay open and say nothing, as over a dropped network."""
    if not group.alive:
        await group.start()
    await group.load(tiny_long.name, str(tiny_long.path))
    stopped: list[int] = []
    with pytest.raises(EngineCrashedError) as crashed:
        async for ev in group.generate(request(tiny_long, PROMPTS[0], max_tokens=200)):
            if isinstance(ev, p.Delta) and not stopped:
                stopped.append(joiner.rank_pid())
                os.kill(stopped[0], signal.SIGSTOP)
    os.kill(stopped[0], signal.SIGCONT)  # it finds its peer gone, and the join starts another
    assert f"no answer within {TIMEOUT:.0f}s" in crashed.value.message
    await group.start()
    await group.load(tiny_long.name, str(tiny_long.path))
    assert (await collect(group, request(tiny_long, PROMPTS[1], max_tokens=8)))[2].completion_tokens == 8


async def test_a_missing_host_is_named_once_the_timeout_passes() -> None:
    hosts = loopback_hosts()
    engine = EngineClient(EngineConfig(hosts=hosts, group_timeout_secs=2.0))
    with pytest.raises(EngineCrashedError) as crashed:
        await engine.start()
    assert f"waiting for rank 1 ({hosts[1]})" in crashed.value.message
    assert engine.last_error == crashed.value.message.split(": ", 1)[1]
    await engine.close()


async def test_with_continue_alone_a_missing_host_leaves_rank_0_serving_alone(
    solo: EngineClient, tiny: ResolvedModel
) -> None:
    hosts = loopback_hosts()
    engine = EngineClient(EngineConfig(hosts=hosts, group_timeout_secs=2.0, group_continue_alone=True))
    info = await engine.start()
    try:
        assert info.hosts == [] and f"waiting for rank 1 ({hosts[1]})" in info.alone
        await engine.load(tiny.name, str(tiny.path))
        await solo.load(tiny.name, str(tiny.path))
        cmd = request(tiny, PROMPTS[0], max_tokens=16)
        assert (await collect(engine, cmd))[0] == (await collect(solo, cmd))[0]
    finally:
        await engine.close()


async def test_a_host_running_another_lmspd_is_refused_by_both(tmp_path: Path) -> None:
    """The other host's lmspd says another version (a sitecustomize there, as another install
    would): the group does not form, and both ends say who runs what."""
    (tmp_path / "sitecustomize.py").write_text(
        "import importlib.metadata as m\n"
        "_version = m.version\n"
        "m.version = lambda name: '0.0.1.other' if name == 'lmspd' else _version(name)\n"
    )
    hosts = loopback_hosts()
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    with Joiner(tmp_path, hosts, timeout_secs=TIMEOUT, env={"PYTHONPATH": path}) as other:
        engine = _group(hosts)
        with pytest.raises(EngineCrashedError) as crashed:
            await engine.start()
        await engine.close()
        assert f"rank 1 ({hosts[1]}) runs lmspd 0.0.1.other" in crashed.value.message
        await wait_until_async(lambda: "runs lmspd 0.0.1.other" in other.log, "the joined host said so too")


async def test_a_different_model_file_on_a_host_fails_the_load_on_every_rank(
    tmp_path: Path, tiny: ResolvedModel
) -> None:
    """The other host keeps its models in a directory of its own (cache_dir), where this
    model's weights differ by one byte: the load fails, naming the host, and the group goes on."""
    theirs = tmp_path / "models" / tiny.path.name
    shutil.copytree(tiny.path, theirs)
    weights = next(theirs.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    hosts = loopback_hosts()
    with Joiner(tmp_path, hosts, timeout_secs=TIMEOUT, cache_dir=tmp_path / "models"):
        engine = _group(hosts)
        await engine.start()
        try:
            with pytest.raises(LmspdError) as failed:
                await engine.load(tiny.name, str(tiny.path))
            assert f"rank 1 ({hosts[1]}) holds a different model file" in failed.value.message
            # Every rank failed it alike: the group is still in step and serves what matches.
            (theirs.parent / "tiny_ok").symlink_to(tiny.path)
            same = ResolvedModel(name="tiny_ok", path=tiny.path.parent / "tiny_ok")
            same.path.symlink_to(tiny.path)
            await engine.load(same.name, str(same.path))
            assert (await collect(engine, request(same, PROMPTS[1], max_tokens=4)))[2].completion_tokens == 4
        finally:
            await engine.close()
            (tiny.path.parent / "tiny_ok").unlink(missing_ok=True)


def test_join_refuses_rank_0_and_a_group_of_one(tmp_path: Path) -> None:
    cfg = tmp_path / "one.toml"
    cfg.write_text('[engine]\nhosts = ["127.0.0.1:1", "127.0.0.1:2"]\n')
    run = [sys.executable, "-m", "lmspd.cli", "engine", "join", "--config", str(cfg)]
    done = subprocess.run([*run, "--rank", "0"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--rank 0: ranks 1..1 join" in done.stderr
    cfg.write_text('[engine]\nhosts = ["127.0.0.1:1"]\n')
    done = subprocess.run(run, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "engine.hosts names one host" in done.stderr


async def test_a_join_to_something_that_is_not_rank_0_says_so(tmp_path: Path) -> None:
    """Rank 0's address answers, but not as an engine (a plain TCP server): the rank says it
    could not form the group, and tries again; it never hangs."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        held = []
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except TimeoutError:
                continue
        for c in held:
            c.close()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    hosts = [f"127.0.0.1:{port - 1}", loopback_hosts(1)[0]]  # its control port is the server's
    try:
        with Joiner(tmp_path, hosts, timeout_secs=1.0) as j:
            # It connects, and then hears nothing an engine would say.
            await wait_until_async(
                lambda: (
                    f"rank 0 ({hosts[0]}, control port {port}) did not answer as an lmspd engine" in j.log
                    and "joining again" in j.log
                ),
                lambda: f"the join said it could not form the group: {j.log}",
                timeout=60,
            )
    finally:
        stop.set()
        thread.join()
        server.close()
