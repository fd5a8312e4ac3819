"""The MLX ring group an engine belongs to: formed on a control channel (every rank meets rank
0 within a deadline, the hosts' versions agreed, rank 0's settings handed out), then MLX's ring;
each loop's commands sent from rank 0 (``Tick``); model files agreed; and a watchdog.

Why the control channel and the watchdog (docs/distributed.md): MLX's ring backend waits
without end for a peer that never connects, holding the GIL; a rank waiting in a collective
spins; and a peer that vanishes without closing its sockets (a network drop) leaves a
collective waiting. A peer that dies with its sockets closed (kill -9) ends the collective at
once with ``RuntimeError("[ring] connection to a peer was lost")``. Either way the rank exits:
the group is formed again from scratch when every host is back.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import logging
import os
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import TextIO

import mlx.core as mx
import msgspec
import numpy as np

from lmspd.config import EngineConfig
from lmspd.errors import EngineGroupError as GroupError
from lmspd.models.footprint import memory_budget

log = logging.getLogger("lmspd.engine")

DEFAULT_PORT = 47100
# While idle, rank 0 shares an empty tick this often, so every rank knows the others live.
HEARTBEAT_SECS = 1.0
# A model's load may keep the others waiting this long at most.
LOAD_TIMEOUT_SECS = 600.0
# Exit status of a rank whose group broke: the server restarts its engine, `join` its rank.
GROUP_LOST = 75


class Tick(msgspec.Struct, array_like=True):
    """One loop of rank 0's: the commands it took, in order, and the grammars compiled by now
    (their requests join the batch this loop on every rank)."""

    seq: int
    commands: list[bytes]
    compiled: list[str]
    ack: bool = False  # answer it (rank 0's idle heartbeat: is every rank still there?)


class Member(msgspec.Struct, array_like=True):
    """What each rank says of itself when the group starts."""

    host: str
    versions: str  # lmspd and mlx
    memory: int  # physical bytes


class Join(msgspec.Struct, array_like=True):
    """A rank's first word to rank 0 on the control channel."""

    rank: int
    member: Member


class Welcome(msgspec.Struct, array_like=True):
    """Rank 0's answer once every rank has joined: the engine settings every rank runs (its
    own, the memory budget the group's, so that every rank decides alike) and the members; or
    why the group does not form."""

    config: EngineConfig
    members: list[Member]
    refusal: str = ""


def _devnull() -> TextIO:
    global _DEVNULL
    if _DEVNULL is None:
        _DEVNULL = open(os.devnull, "w")  # noqa: SIM115  # the process's, for faulthandler
    return _DEVNULL


_DEVNULL: TextIO | None = None


def endpoint(host: str) -> str:
    """``host[:port]`` as the ring backend takes it: an IPv4 address and a port."""
    name, _, port = host.rpartition(":") if ":" in host else (host, "", "")
    if not name:
        name, port = host, ""
    try:
        ip = socket.gethostbyname(name)
    except OSError as exc:
        raise GroupError(f"engine.hosts: cannot resolve {name!r}: {exc}") from exc
    return f"{ip}:{int(port) if port else DEFAULT_PORT}"


def physical_memory() -> int:
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def versions() -> str:
    from importlib.metadata import version

    return f"lmspd {version('lmspd')}, mlx {getattr(mx, '__version__', 'unknown')}"


class Group:
    """This process's rank in the ring, and what passes between the ranks."""

    def __init__(
        self, hosts: list[str], rank: int, timeout: float, on_lost: Callable[[str], None] = lambda _: None
    ) -> None:
        self.hosts = hosts
        self.rank = rank
        self.size = len(hosts)
        self.timeout = timeout
        self._on_lost = on_lost
        self._waiting_since: float | None = None
        self._wait_limit = timeout
        self._what = ""
        self.seq = 0
        self._peers: list[socket.socket] = []  # the control channel: rank 0's to each rank, or ours to it
        self.members: list[Member] = []
        self.link_bytes_per_sec = 0.0

    # --- start ------------------------------------------------------------------------------

    def start(self, deadline: float, config: EngineConfig | None = None) -> EngineConfig:
        """Form the group: every rank meets rank 0 on the control channel within ``deadline``
        seconds (the same versions, or none forms), then the ring starts; the engine settings
        every rank runs, rank 0's (``config``, which it passes) for the group (group_config)."""
        if not 0 <= self.rank < self.size:
            raise GroupError(f"rank {self.rank} is not in a group of {self.size} hosts (engine.hosts)")
        ring = [endpoint(h) for h in self.hosts]
        if self.rank == 0:
            assert config is not None
            welcome = self._welcome(ring[0], deadline, config)
        else:
            welcome = self._join(ring[0], deadline)
        self.members = welcome.members
        self._init_ring(ring)
        threading.Thread(target=self._watch, name="ring-watchdog", daemon=True).start()
        self.link_bytes_per_sec = self._measure_link()
        return welcome.config

    def _me(self) -> Member:
        return Member(self.hosts[self.rank], versions(), physical_memory())

    def _welcome(self, ring0: str, deadline: float, config: EngineConfig) -> Welcome:
        """Rank 0: every other rank's Join, within ``deadline``; their Welcome."""
        ip, port = ring0.rsplit(":", 1)
        members: dict[int, Member] = {0: self._me()}
        joined: dict[int, socket.socket] = {}
        waiting = ", ".join(f"rank {r} ({h})" for r, h in enumerate(self.hosts) if r)
        log.info("forming the engine group: waiting up to %.0fs for %s", deadline, waiting)
        end = time.monotonic() + deadline
        try:
            with socket.create_server((ip, int(port) + 1), reuse_port=False) as server:
                while len(joined) < self.size - 1:
                    left = end - time.monotonic()
                    missing = ", ".join(f"rank {r} ({h})" for r, h in enumerate(self.hosts) if r and r not in joined)
                    if left <= 0:
                        raise GroupError(f"the group did not form within {deadline:.0f}s: waiting for {missing}")
                    server.settimeout(left)
                    try:
                        conn, _ = server.accept()
                    except TimeoutError:
                        continue
                    join = self._hear_join(conn)
                    if join is None or join.rank in joined or not 0 < join.rank < self.size:
                        conn.close()  # not a rank of this group (a stray connection): waited on
                        continue
                    joined[join.rank], members[join.rank] = conn, join.member
        except OSError as exc:
            raise GroupError(f"the control channel cannot listen on {ip}:{int(port) + 1}: {exc}") from exc
        ordered = [members[r] for r in range(self.size)]
        self._peers = [joined[r] for r in range(1, self.size)]
        for r, m in enumerate(ordered):
            if m.versions != ordered[0].versions:
                why = (
                    f"rank {r} ({m.host}) runs {m.versions}; rank 0 ({ordered[0].host}) runs "
                    f"{ordered[0].versions}: every host must run the same lmspd and mlx"
                )
                self.send(msgspec.msgpack.encode(Welcome(config, ordered, refusal=why)))
                raise GroupError(why)
        welcome = Welcome(group_config(config, ordered), ordered)
        self.send(msgspec.msgpack.encode(welcome))
        return welcome

    def _hear_join(self, conn: socket.socket) -> Join | None:
        conn.settimeout(self.timeout)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            n = int.from_bytes(self._read(conn, 4), "little")
            if n > 1 << 16:
                return None
            return msgspec.msgpack.decode(self._read(conn, n), type=Join)
        except (OSError, msgspec.DecodeError):
            return None

    def _join(self, ring0: str, deadline: float) -> Welcome:
        """A rank past 0: meet rank 0 (trying until ``deadline``); its Welcome."""
        ip, port = ring0.rsplit(":", 1)
        where = f"rank 0 ({self.hosts[0]}, control port {int(port) + 1})"
        log.info("joining the engine group of %s: trying for up to %.0fs", where, deadline)
        end = time.monotonic() + deadline
        while True:
            try:
                conn = socket.create_connection((ip, int(port) + 1), timeout=self.timeout)
                break
            except OSError as exc:
                if time.monotonic() + 0.2 > end:
                    raise GroupError(f"the group did not form within {deadline:.0f}s: {where}: {exc}") from exc
                time.sleep(0.2)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._peers = [conn]
        data = msgspec.msgpack.encode(Join(self.rank, self._me()))
        try:
            conn.sendall(len(data).to_bytes(4, "little") + data)
            welcome = msgspec.msgpack.decode(self.receive(self.timeout, quiet=True), type=Welcome)
        except (GroupError, msgspec.DecodeError) as exc:
            raise GroupError(f"{where} did not answer as an lmspd engine: {exc}") from exc
        if welcome.refusal:
            raise GroupError(welcome.refusal)
        return welcome

    def _init_ring(self, ring: list[str]) -> None:
        """MLX's ring, every rank present by now (the control channel said so)."""
        with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="lmspd-ring-", delete=False) as f:
            json.dump([[e] for e in ring], f)
        os.environ["MLX_HOSTFILE"], os.environ["MLX_RANK"] = f.name, str(self.rank)
        # MLX's init holds the GIL while it waits, so no Python thread can time it out:
        # faulthandler's own C thread ends the process if a rank vanished just now.
        self._on_lost(f"the ring did not start within {self.timeout:.0f}s")
        faulthandler.dump_traceback_later(self.timeout, exit=True, file=_devnull())
        try:
            mx.distributed.init(strict=True, backend="ring")
        except RuntimeError as exc:
            raise GroupError(f"the ring backend did not start: {exc}") from exc
        finally:
            faulthandler.cancel_dump_traceback_later()
            os.unlink(f.name)

    def _measure_link(self) -> float:
        """Bytes a second through the ring, one 4 MiB all_sum timed (reported, not used)."""
        x = mx.zeros((1 << 20,), dtype=mx.float32)
        self._collective(lambda: mx.distributed.all_sum(x), "the link measurement")
        start = time.perf_counter()
        self._collective(lambda: mx.distributed.all_sum(x), "the link measurement")
        return x.nbytes / max(time.perf_counter() - start, 1e-9)

    # --- what passes between ranks -------------------------------------------------------------

    def _collective(self, op: Callable[[], mx.array], what: str) -> mx.array:
        """``op``'s result, evaluated under the watchdog."""
        with self.watching(what):
            out = op()
            mx.eval(out)
        return out

    def gather(self, data: bytes, width: int = 256) -> list[bytes]:
        """Every rank's ``data`` (at most ``width`` bytes), in rank order."""
        if len(data) > width - 2:
            raise ValueError(f"{len(data)} bytes do not fit a gather of {width}")
        buf = np.zeros(width, dtype=np.uint8)
        buf[:2] = np.frombuffer(len(data).to_bytes(2, "little"), dtype=np.uint8)
        buf[2 : 2 + len(data)] = np.frombuffer(data, dtype=np.uint8)
        x = mx.array(buf)
        out = np.array(self._collective(lambda: mx.distributed.all_gather(x), "a gather")).reshape(self.size, width)
        return [bytes(row[2 : 2 + int.from_bytes(bytes(row[:2]), "little")]) for row in out]

    # --- the control channel: rank 0's ticks ----------------------------------------------------

    def send(self, data: bytes) -> None:
        """Rank 0: ``data`` to every other rank."""
        frame = len(data).to_bytes(4, "little") + data
        for r, conn in enumerate(self._peers, start=1):
            try:
                conn.sendall(frame)
            except OSError as exc:
                raise self._gone(f"rank {r} ({self.hosts[r]}) closed the control channel: {exc}") from exc

    def receive(self, limit: float, quiet: bool = False) -> bytes:
        """A rank past 0: rank 0's next ``send``, within ``limit`` seconds (``quiet``: a failure
        raised, not reported as the group lost)."""
        conn = self._peers[0]
        conn.settimeout(limit)
        gone = GroupError if quiet else self._gone
        try:
            n = int.from_bytes(self._read(conn, 4), "little")
            return self._read(conn, n)
        except TimeoutError as exc:
            raise gone(f"no word from rank 0 ({self.hosts[0]}) within {limit:.0f}s") from exc
        except OSError as exc:
            raise gone(f"rank 0 ({self.hosts[0]}) closed the control channel: {exc}") from exc

    @staticmethod
    def _read(conn: socket.socket, n: int) -> bytes:
        data = bytearray()
        while len(data) < n:
            chunk = conn.recv(n - len(data))
            if not chunk:
                raise ConnectionResetError("closed")
            data += chunk
        return bytes(data)

    def _gone(self, why: str) -> GroupError:
        self._lost(why)
        return GroupError(why)

    def tick(self, tick: Tick | None, slow: bool = False) -> Tick:
        """Rank 0's loop sent (the others pass None and receive it); each rank checks it is in
        step. A tick that asks (rank 0's idle heartbeat) is answered, so a rank gone silent is
        found while nothing runs too; a busy loop's passes find it (the watchdog)."""
        limit = LOAD_TIMEOUT_SECS if slow else self.timeout
        if tick is not None:
            self.send(msgspec.msgpack.encode(tick))
            shared = tick
            for r, conn in enumerate(self._peers, start=1) if tick.ack else ():
                conn.settimeout(self.timeout)
                try:
                    self._read(conn, 1)
                except TimeoutError as exc:
                    raise self._gone(f"no answer from rank {r} ({self.hosts[r]}) within {self.timeout:.0f}s") from exc
                except OSError as exc:
                    raise self._gone(f"rank {r} ({self.hosts[r]}) closed the control channel: {exc}") from exc
        else:
            # Rank 0 ticks at least every HEARTBEAT_SECS; a step or a load may come between.
            shared = msgspec.msgpack.decode(self.receive(limit + HEARTBEAT_SECS), type=Tick)
            if shared.ack:
                try:
                    self._peers[0].sendall(b"\x01")
                except OSError as exc:
                    raise self._gone(f"rank 0 ({self.hosts[0]}) closed the control channel: {exc}") from exc
        self.seq += 1
        if shared.seq != self.seq:
            raise self._gone(f"out of step: tick {shared.seq} from rank 0, {self.seq} here")
        return shared

    def agree(self, what: str, value: str) -> None:
        """Every rank's ``value`` the same (a model file's digest), or a GroupError on all."""
        values = [v.decode() for v in self.gather(value.encode()[:250])]
        for r, v in enumerate(values):
            if v != values[0]:
                raise GroupError(
                    f"rank {r} ({self.hosts[r]}) holds a different {what} than rank 0 ({self.hosts[0]}): "
                    f"{v[:40]} against {values[0][:40]}"
                )

    @contextlib.contextmanager
    def watching(self, what: str) -> Iterator[None]:
        """Work whose passes wait on the other ranks (a step), under the watchdog."""
        self._what, self._wait_limit = what, self.timeout
        self._waiting_since = time.monotonic()
        try:
            yield
        except RuntimeError as exc:
            if "[ring]" in str(exc):
                self._lost(f"{what}: {exc}")
            raise
        finally:
            self._waiting_since = None

    # --- the watchdog -------------------------------------------------------------------------

    def _watch(self) -> None:
        while True:
            time.sleep(0.2)
            since = self._waiting_since
            if since is not None and time.monotonic() - since > self._wait_limit:
                self._lost(f"no answer within {self._wait_limit:.0f}s in {self._what}")
                os._exit(GROUP_LOST)

    def _lost(self, why: str) -> None:
        others = ", ".join(f"rank {r} ({h})" for r, h in enumerate(self.hosts) if r != self.rank)
        message = f"engine group lost ({others}): {why}"
        log.error(message)
        self._on_lost(message)


def group_config(config: EngineConfig, members: list[Member]) -> EngineConfig:
    """The engine settings a group runs: what a clock or a host's own memory or disk would decide
    differently on each host is fixed (docs/distributed.md, "What a group leaves out"): the
    prompt cache in memory only, prefill steps of one size, one model at a time, one memory
    budget (the hosts' shares summed)."""
    budget = config.max_memory_bytes
    if budget is None:
        budget = sum(memory_budget(None, m.memory) for m in members)
    return msgspec.structs.replace(
        config,
        prompt_cache_disk_max_bytes=0,
        prefill_interleave_ms=0,
        max_loaded_models=1,
        max_memory_bytes=budget,
    )
