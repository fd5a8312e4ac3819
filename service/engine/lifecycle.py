"""When the engine unloads an idle model, and what it reports about its memory.

A long-lived engine shares its machine with other programs: a model nobody has used for
``keep_alive_secs`` is unloaded so its memory goes back to them (the next request loads it
again). Keep-alives and pins are remembered by model name, not by loaded copy, so a model
reloaded after an idle unload (or pinned before it is loaded) keeps them.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from lmspd.config import EngineConfig
from lmspd.engine import protocol as p
from lmspd.errors import LmspdError, ModelTooLargeError
from lmspd.models.footprint import Footprint, estimate_or_zero, memory_budget, refuse_oversized


class Lifecycle:
    def __init__(self, keep_alive_secs: float) -> None:
        self.default_keep_alive = keep_alive_secs
        self.keep_alive: dict[str, float] = {}  # per model, where it was said
        self.pinned: set[str] = set()
        self.last_used: dict[str, float] = {}  # monotonic time its last request ended (or it loaded)

    def keep_alive_of(self, name: str) -> float:
        return self.keep_alive.get(name, self.default_keep_alive)

    def touch(self, name: str, now: float | None = None) -> None:
        self.last_used[name] = time.monotonic() if now is None else now

    def due_at(self, name: str) -> float | None:
        """When an idle model is unloaded (monotonic); None: never (pinned, keep-alive 0)."""
        keep = self.keep_alive_of(name)
        if name in self.pinned or keep <= 0:
            return None
        return self.last_used.get(name, time.monotonic()) + keep

    def due(self, idle: Iterable[str], now: float) -> list[str]:
        """The idle models whose keep-alive has passed."""
        return [n for n in idle if (at := self.due_at(n)) is not None and at <= now]

    def wait(self, idle: Iterable[str], now: float) -> float | None:
        """Seconds until the next idle unload (None: none is due ever)."""
        dues = [at for n in idle if (at := self.due_at(n)) is not None]
        return max(0.0, min(dues) - now) if dues else None

    def state(self, name: str, busy: int, now: float) -> tuple[float | None, float | None]:
        """(idle seconds, seconds until its unload) of a loaded model."""
        if busy:
            return None, None
        idle = now - self.last_used.get(name, now)
        at = self.due_at(name)
        return idle, None if at is None else max(0.0, at - now)

    def unloaded(self, name: str) -> p.ModelState:
        return p.ModelState(
            model=name, loaded=False, keep_alive_secs=self.keep_alive_of(name), pinned=name in self.pinned
        )


def resident_bytes(model: Any) -> int:
    """The bytes a loaded model's parameters hold (as converted per weight_dtype)."""
    from mlx.utils import tree_flatten

    return sum(int(v.nbytes) for _, v in tree_flatten(model.parameters()))


def rss_bytes() -> int:
    """This process's resident set size (0 where it cannot be read)."""
    try:
        with open("/proc/self/statm") as f:  # Linux: pages
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    if sys.platform == "darwin":  # no /proc: ps reports the current RSS in KiB
        try:
            out = subprocess.run(
                ["ps", "-o", "rss=", "-p", str(os.getpid())], capture_output=True, text=True, timeout=5
            )
            return int(out.stdout.strip() or 0) * 1024
        except (OSError, ValueError, subprocess.SubprocessError):
            return 0
    return 0


def release_memory() -> None:
    """Give freed model memory back: the objects first, then MLX's buffer cache."""
    import gc

    import mlx.core as mx

    gc.collect()
    mx.clear_cache()
    if sys.platform.startswith("linux"):
        _malloc_trim()


def _malloc_trim() -> None:
    """glibc keeps freed heap pages unless asked: an unloaded model's arrays would stay in
    the RSS (MLX's CPU allocator allocates with malloc)."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class MemoryBudget:
    """What the engine's models and prompt caches may hold together (``max_memory_bytes``).

    A model not yet loaded counts as its estimate (lmspd.models.footprint); a loaded one as
    its weights' real bytes plus its estimated KV. The prompt cache gets what is left, up to
    its own bound: it is trimmed before any model is evicted to make room.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.limit = memory_budget(config.max_memory_bytes)
        self._estimates: dict[str, Footprint] = {}

    def estimate(self, path: str) -> Footprint:
        if path not in self._estimates:
            self._estimates[path] = estimate_or_zero(Path(path), self.config)
        return self._estimates[path]

    def fits_alone(self, path: str) -> bool:
        return self.estimate(path).total <= self.limit

    def refusal(self, name: str, path: str) -> LmspdError | None:
        """The error for a model that cannot fit even alone (None: it can)."""
        try:
            refuse_oversized(name, Path(path), self.config)
        except ModelTooLargeError as exc:
            return exc
        return None

    def held(self, path: str, resident: int) -> int:
        """What a loaded model counts for: its weights as loaded and its KV's estimate."""
        return resident + self.estimate(path).kv

    def cache_room(self, used: int) -> int:
        """The prompt cache's bound when the models count ``used`` bytes."""
        return max(0, min(self.config.prompt_cache_max_bytes, self.limit - used))
