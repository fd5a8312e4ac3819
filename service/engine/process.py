"""The server's side of the engine: spawns the process and speaks to it.

A reader thread turns pipe messages into calls on the event loop; a single
writer thread sends commands in order without ever blocking the loop. When the
process dies (segfault, OOM kill), the pipe reaches EOF: every in-flight
request ends with :class:`EngineCrashedError` and :meth:`start` may be called
again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import threading
from collections import OrderedDict
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as mp_wait
from pathlib import Path
from typing import Any

from lmspd.config import EngineConfig
from lmspd.engine import protocol as p
from lmspd.engine.worker import main as worker_main
from lmspd.errors import EngineCrashedError, InvalidRequestError, LmspdError, error_for
from lmspd.logs import current_format

log = logging.getLogger("lmspd.engine")


Event = p.Delta | p.Finished

# Early cancels remembered at most: an id that never generates is forgotten eventually,
# so a caller that cancels and then gives up cannot grow the client without bound.
EARLY_CANCELS_KEPT = 4096


def error_from(reply: p.Failed) -> LmspdError:
    """The engine's codes are the error tree's codes: one class per code, nothing remapped."""
    return error_for(reply.code, reply.message, param=reply.param)


class EngineClient:
    """One engine process. It belongs to the event loop that started it: its reader thread
    hands every reply to that loop, so share a client only among users of that loop."""

    def __init__(self, config: EngineConfig, cache_dir: Path | None = None) -> None:
        self.config = config
        self.cache_dir = cache_dir  # where the prompt cache persists; None: memory only
        self.process: mp.process.BaseProcess | None = None
        self.info: p.Ready | None = None
        self._conn: Connection | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-writer")
        self._streams: dict[str, asyncio.Queue[Event | LmspdError]] = {}
        # Cancels for ids with no stream yet (oldest first): Generate may still be on its way.
        self._early_cancels: OrderedDict[str, None] = OrderedDict()
        self._loads: dict[str, list[asyncio.Future[p.ModelLoaded]]] = {}
        self._ready: asyncio.Future[p.Ready] | None = None
        self.loaded: dict[str, p.ModelLoaded] = {}
        self._closing = False
        # Status queries in flight, by number (answered in the order they were sent).
        self._queries: dict[int, asyncio.Future[p.EngineStatus]] = {}
        self._next_query = 0
        # Told of every load and unload (the supervisor counts them): (event, model, reason).
        self.listeners: list[Callable[[str, str, str], None]] = []
        self._drained = asyncio.Event()  # set whenever no generation is streaming
        # Keep-alives of models configured with their own (by name), sent with each load.
        self.keep_alive: dict[str, float] = {}
        # Why the engine last exited, in its own words ("" if it said nothing): /readyz's.
        self.last_error = ""

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.is_alive() and self.info is not None

    async def start(self, timeout: float = 120.0) -> p.Ready:
        """Spawn the engine process and wait until it has imported MLX."""
        if self.alive and self.info is not None:
            return self.info
        self._loop = asyncio.get_running_loop()
        parent, child = mp.get_context("spawn").Pipe(duplex=True)
        c = self.config
        self.process = mp.get_context("spawn").Process(
            target=worker_main,
            args=(
                child,
                c,
                str(self.cache_dir) if self.cache_dir is not None else None,
                logging.getLogger("lmspd").getEffectiveLevel(),
                current_format(),
            ),
            name="lmspd-engine",
            daemon=True,
        )
        self._ready = self._loop.create_future()
        self._closing = False
        self.process.start()
        child.close()  # only the child holds its end now, so its death means EOF for us
        self._conn = parent
        threading.Thread(target=self._read, args=(parent, self.process), name="engine-reader", daemon=True).start()
        self.info = await asyncio.wait_for(self._ready, timeout)
        return self.info

    def _read(self, conn: Connection, process: mp.process.BaseProcess) -> None:
        assert self._loop is not None
        loop = self._loop
        try:
            # Watch the pipe and the process sentinel together: the process can die while
            # something else still holds its end of the pipe open.
            while conn in mp_wait([conn, process.sentinel]) or conn.poll():
                reply = p.reply_decoder.decode(conn.recv_bytes())
                loop.call_soon_threadsafe(self._dispatch, reply)
        except (EOFError, OSError):
            pass
        # Wait for the process to be gone without reaping it here: close() may be joining it.
        mp_wait([process.sentinel], timeout=5)
        with contextlib.suppress(RuntimeError):  # the loop closed first: nobody is left to tell
            loop.call_soon_threadsafe(self._on_exit, process)

    def _dispatch(self, reply: p.Reply) -> None:
        if isinstance(reply, p.Deltas):
            for d in reply.items:
                if q := self._streams.get(d.request_id):
                    q.put_nowait(d)
        elif isinstance(reply, p.Finished):
            if q := self._streams.get(reply.request_id):
                q.put_nowait(reply)
        elif isinstance(reply, p.Failed):
            if reply.request_id is not None:
                if q := self._streams.get(reply.request_id):
                    q.put_nowait(error_from(reply))
            elif reply.model is not None:
                for fut in self._loads.pop(reply.model, []):
                    if not fut.done():
                        fut.set_exception(error_from(reply))
            else:  # the engine's last word before it exits (its group cannot form or went)
                self.last_error = reply.message
        elif isinstance(reply, p.ModelLoaded):
            if reply.model not in self.loaded:
                self._tell("loaded", reply.model, "")
            self.loaded[reply.model] = reply
            for fut in self._loads.pop(reply.model, []):
                if not fut.done():
                    fut.set_result(reply)
        elif isinstance(reply, p.ModelEvicted):
            log.info("engine unloaded model %s (%s)", reply.model, reply.reason)
            if self.loaded.pop(reply.model, None) is not None:
                self._tell("unloaded", reply.model, reply.reason)
        elif isinstance(reply, p.EngineStatus):
            if (query := self._queries.pop(reply.query, None)) is not None and not query.done():
                query.set_result(reply)
        elif isinstance(reply, p.ModelLoading):
            log.info("engine loading model %s", reply.model)
        elif isinstance(reply, p.Ready) and self._ready and not self._ready.done():
            r = reply
            log.info("engine ready: pid %d, %s backend, mlx %s, BLAS %s", r.pid, r.backend, r.mlx_version, r.blas)
            self.last_error = ""
            self._ready.set_result(reply)

    def _on_exit(self, process: mp.process.BaseProcess) -> None:
        if process is not self.process:
            return
        code = process.exitcode
        if not self._closing:
            log.error("engine process %s exited unexpectedly (exit code %s)", process.pid, code)
        why = f": {self.last_error}" if self.last_error else ""
        err = EngineCrashedError(f"the engine process exited (code {code}){why}")
        for q in self._streams.values():
            q.put_nowait(err)
        for futs in self._loads.values():
            for fut in futs:
                if not fut.done():
                    fut.set_exception(err)
        self._loads.clear()
        for query in self._queries.values():
            if not query.done():
                query.set_exception(err)
        self._queries.clear()
        if self._ready and not self._ready.done():
            self._ready.set_exception(err)
        self.info = None
        self.loaded.clear()

    async def _send(self, cmd: p.Command) -> None:
        if self._conn is None or not self.alive:
            raise EngineCrashedError("the engine process is not running")
        data = p.command_encoder.encode(cmd)
        conn = self._conn
        try:
            await asyncio.get_running_loop().run_in_executor(self._writer, conn.send_bytes, data)
        except (OSError, ValueError) as exc:
            raise EngineCrashedError(f"the engine process is gone: {exc}") from exc

    def resident(self, model: str) -> bool:
        """The model is in the engine's memory, as far as its replies have said."""
        return self.alive and model in self.loaded

    def _tell(self, event: str, model: str, reason: str) -> None:
        for listener in list(self.listeners):
            try:
                listener(event, model, reason)
            except Exception:  # a listener's bug must not stop the replies
                log.exception("engine listener failed")

    async def load(self, model: str, path: str, keep_alive_secs: float | None = None) -> p.ModelLoaded:
        fut: asyncio.Future[p.ModelLoaded] = asyncio.get_running_loop().create_future()
        self._loads.setdefault(model, []).append(fut)
        if keep_alive_secs is None:
            keep_alive_secs = self.keep_alive.get(model)
        await self._send(p.LoadModel(model, path, keep_alive_secs))
        return await fut

    async def status(self) -> p.EngineStatus:
        """What the engine holds now (after every command sent before this one)."""
        self._next_query += 1
        query = self._next_query
        fut: asyncio.Future[p.EngineStatus] = asyncio.get_running_loop().create_future()
        self._queries[query] = fut
        try:
            await self._send(p.Status(query))
            return await fut
        finally:
            self._queries.pop(query, None)

    async def unload(self, model: str, *, force: bool = False) -> p.EngineStatus:
        """Unload ``model`` now (``force``: cancelling its running requests); the status after."""
        await self._send(p.UnloadModel(model=model, force=force))
        return await self.status()

    async def pin(self, model: str, pinned: bool) -> None:
        await self._send(p.PinModel(model=model, pinned=pinned))

    async def generate(self, cmd: p.Generate) -> AsyncGenerator[Event, None]:
        """Yield the request's deltas, then its Finished; raise on failure.

        Leaving the iterator early (``break``, task cancellation) cancels the
        request in the engine.
        """
        if cmd.request_id in self._streams:
            raise InvalidRequestError(f"request id {cmd.request_id} is already running")
        if self._take_early_cancel(cmd.request_id):
            yield p.Finished(
                request_id=cmd.request_id,
                reason="cancelled",
                prompt_tokens=len(cmd.prompt),
                completion_tokens=len(cmd.generated),
            )
            return
        queue: asyncio.Queue[Event | LmspdError] = asyncio.Queue()
        self._streams[cmd.request_id] = queue
        finished = False
        try:
            await self._send(cmd)
            while True:
                item = await queue.get()
                if isinstance(item, LmspdError):
                    finished = True
                    raise item
                yield item
                if isinstance(item, p.Finished):
                    finished = True
                    return
        finally:
            self._streams.pop(cmd.request_id, None)
            if not self._streams:
                self._drained.set()
            if not finished and self.alive:
                await asyncio.shield(self._send_quietly(p.Cancel(cmd.request_id)))

    async def _send_quietly(self, cmd: p.Command) -> None:
        with contextlib.suppress(EngineCrashedError):
            await self._send(cmd)

    async def cancel(self, request_id: str) -> None:
        """Ask the engine to stop a request; its stream ends with ``reason="cancelled"``.

        A request with no stream yet is remembered instead: the engine would drop a
        Cancel for an id it does not know, and the Generate that follows would run to
        the end. Once a stream exists, the single writer thread delivers this Cancel
        after its Generate, so the engine always knows the id by then.
        """
        if request_id in self._streams:
            await self._send_quietly(p.Cancel(request_id))
            return
        self._early_cancels[request_id] = None
        self._early_cancels.move_to_end(request_id)
        while len(self._early_cancels) > EARLY_CANCELS_KEPT:
            self._early_cancels.popitem(last=False)

    def running(self, request_id: str) -> bool:
        """A generation of this id is streaming from this engine."""
        return request_id in self._streams

    async def drained(self) -> None:
        """Return once no generation is streaming (an engine being replaced)."""
        while self._streams:
            self._drained.clear()
            await self._drained.wait()

    def interrupt(self, err: LmspdError) -> None:
        """End every streaming generation with ``err`` (each cancels itself in the engine)."""
        for q in self._streams.values():
            q.put_nowait(err)

    def forget(self, request_id: str) -> None:
        """Drop a remembered cancel (for a request that ended without generating)."""
        self._early_cancels.pop(request_id, None)

    def _take_early_cancel(self, request_id: str) -> bool:
        """Whether the request was cancelled before it started (each cancel applies once)."""
        if request_id not in self._early_cancels:
            return False
        del self._early_cancels[request_id]
        return True

    async def close(self, timeout: float = 10.0) -> None:
        process = self.process
        if process is None:
            return
        self._closing = True
        if self.alive:
            await self._send_quietly(p.Shutdown())
        await asyncio.get_running_loop().run_in_executor(None, process.join, timeout)
        if process.is_alive():
            process.kill()
            await asyncio.get_running_loop().run_in_executor(None, process.join, 5)
        if self._conn is not None:
            self._conn.close()
        self.process = None
        self.info = None

    def stats(self) -> dict[str, Any]:
        return {
            "pid": self.process.pid if self.process else None,
            "alive": self.alive,
            "loaded": sorted(self.loaded),
            "in_flight": len(self._streams),
        }
