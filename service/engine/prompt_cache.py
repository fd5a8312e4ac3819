"""The prompt (prefix) cache: KV caches of earlier sequences, reused by requests that start
with the same tokens, so the next turn of a conversation prefills only its new part.

The cache itself is mlx-lm's ``LRUPromptCache`` (a token trie, LRU, bounded by bytes;
a longer entry is trimmed to the common prefix when that is the best match). This module
adds what a long-lived service needs around it: one namespace per model and client (a
shared prefix answers faster, which is a timing side channel between clients), at least one
token left to prefill (the model must produce the next logits) unless those logits are kept
(``prompt_ends``: an exact repeat runs no pass for its first token), and a disk copy of the
hottest entries that survives restarts and engine crashes. Disk files are written atomically
and named by their SHA-256, so a torn, corrupt or foreign file is detected and ignored.

The disk copy shares its disk with the database, so it gives way: a file is written only where
it leaves ``min_free_bytes`` free. A disk without that room, or a write that fails (a full
disk, a read-only one), turns the disk tier off, said once in the log; its temporary file is
removed, the engine goes on from memory, and the tier writes again once there is room. A
temporary file a killed process left behind is removed when the next engine starts.

Only the engine process imports this module (it imports MLX).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlx_lm.models.cache import (
    LRUPromptCache,
    can_trim_prompt_cache,
    load_prompt_cache,
    save_prompt_cache,
    trim_prompt_cache,
)

from lmspd.engine.prompt_ends import DEFAULT_MAX_BYTES as DEFAULT_ENDS_BYTES
from lmspd.engine.prompt_ends import PromptEnds
from lmspd.engine.upstream.cache import exact_entry, fetch_whole, namespaces, reach
from lmspd.store.files import PRIVATE_FILE, private_dir

log = logging.getLogger("lmspd.engine.cache")

FORMAT = "lmspd-prompt-cache-1"
SUFFIX = ".safetensors"
# Entries, at most, whatever their size: the trie and the LRU bookkeeping stay small.
MAX_ENTRIES = 1024
# Written while the engine is busy only when this long has passed since the last write.
BUSY_FLUSH_SECS = 10.0
# After a write failed, the disk tier tries again no sooner than this (a read-only disk
# must not cost a failed write per request); an entry too big for the room left waits only
# for the room.
RETRY_SECS = 30.0
# A disk tier that turns off again this soon after it last said so is not said again.
SAY_AGAIN_SECS = 300.0
DEFAULT_MIN_FREE_BYTES = 512 * 1024**2
TMP_PREFIX = ".tmp-"

Namespace = tuple[str, str]  # (model fingerprint, client cache key)
Key = tuple[Namespace, tuple[int, ...]]


@dataclass
class Hit:
    cache: list[Any] | None  # the KV cache to continue from; None: start from scratch
    cached: int  # leading tokens whose KV comes from the cache
    # Every token cached, and the logprobs after the last of them kept (prompt_ends.py): the
    # first token needs no pass. None: at least one token is left to run.
    logprobs: Any | None = None

    def step_back(self) -> Hit:
        """The same hit, its last token left to run after all (its KV dropped)."""
        if self.logprobs is None or self.cache is None:
            return self
        trim_prompt_cache(self.cache, 1)
        return Hit(self.cache, self.cached - 1)


def model_fingerprint(model_dir: Path) -> str:
    """Identifies a model's weights: cached KV is only valid for exactly these."""
    h = hashlib.sha256(str(model_dir.resolve()).encode())
    with contextlib.suppress(OSError):
        h.update((model_dir / "config.json").read_bytes())
    for f in sorted(model_dir.glob("*.safetensors")):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:32]


class PromptCache:
    def __init__(
        self,
        max_bytes: int,
        directory: Path | None = None,
        disk_max_bytes: int = 0,
        disk_min_free_bytes: int = DEFAULT_MIN_FREE_BYTES,
    ) -> None:
        self.enabled = max_bytes > 0
        self.lru = LRUPromptCache(max_size=MAX_ENTRIES, max_bytes=max_bytes)
        self.disk = (
            DiskCache(directory, disk_max_bytes, disk_min_free_bytes)
            if directory is not None and disk_max_bytes > 0
            else None
        )
        self.dirty: OrderedDict[Key, None] = OrderedDict()
        self.ends = PromptEnds()
        # In a group of hosts (engine/group): this rank's layers and the model's, whose KV the
        # budget counts in whole layers (below).
        self.share: tuple[int, int] | None = None
        self.fit(max_bytes)
        self.flushed_at = time.monotonic()
        # Files are written on a thread of their own: hashing and fsyncing a large cache takes
        # seconds on a slow disk, and the engine loop must not stall its streams meanwhile.
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="prompt-cache-disk") if self.disk else None
        self._writing: Future[None] | None = None

    @property
    def nbytes(self) -> int:
        return int(self.lru.nbytes) + self.ends.nbytes

    def fit(self, room: int) -> None:
        """Hold at most ``room`` bytes from now on: a sixteenth of it (16 MiB at most) for the
        prompt ends, the rest for the KV; the least recently used go first.

        A rank of a group holds ``share`` = (its layers, all layers) of each entry's KV: its
        bound is that many whole layers' worth of ``room``, so that every rank, comparing its
        own bytes with its own bound, evicts the same entries at the same moment (every layer
        of a splittable model holds the same KV: engine/group/pipeline.py)."""
        self.ends.resize(min(DEFAULT_ENDS_BYTES, room // 16))
        kv = room - self.ends.max_bytes
        if self.share is not None:
            held, layers = self.share
            kv = held * (kv // layers)
        self.lru.max_bytes = kv
        self.lru.trim_to(n_bytes=self.lru.max_bytes)

    def fetch(self, namespace: Namespace, tokens: list[int]) -> Hit:
        """The longest cached prefix of ``tokens`` (a copy): from ``namespace`` first, else from
        the client's other namespaces (``nearest``). It leaves at least one token to run unless
        the logprobs after all of them are kept (``ends``)."""
        if not self.enabled or len(tokens) < 2:
            return Hit(None, 0)
        nearest = self.nearest(namespace, tokens)
        logprobs = self.ends.get(namespace, tokens)
        if logprobs is not None and (whole := fetch_whole(self.lru, nearest, tokens)) is not None:
            return Hit(whole, len(tokens), logprobs)
        cache, rest = self.lru.fetch_nearest_cache(nearest, tokens)
        if cache is None:
            return Hit(None, 0)
        if not rest:  # the whole sequence is cached, but its last token must still give logits
            if not can_trim_prompt_cache(cache):
                return Hit(None, 0)
            trim_prompt_cache(cache, 1)
            rest = tokens[-1:]
        return Hit(cache, len(tokens) - len(rest))

    def nearest(self, namespace: Namespace, tokens: list[int]) -> Namespace:
        """The namespace to read ``tokens``' prefix from. A client's ``prompt_cache_key`` picks
        the namespace tried first; where another of the same client's (same model) holds a
        longer prefix, that one: a new agent session starts with the system prompt and tools
        of the last one (docs/responses.md, "The prompt cache"). Never another client's: a namespace's
        key is ``[client, prompt_cache_key]`` as JSON (lmspd.prompting.generation.cache_key)."""
        best, most = namespace, reach(self.lru, namespace, tokens)
        if most >= len(tokens) - 1:
            return best
        client = _client(namespace[1])
        if client is None:
            return best
        for other in namespaces(self.lru):
            if (
                isinstance(other, tuple)
                and other != namespace
                and other[0] == namespace[0]
                and _client(other[1]) == client
                and (n := reach(self.lru, other, tokens)) > most
            ):
                best, most = other, n
        return best

    def store(self, namespace: Namespace, tokens: list[int], cache: list[Any]) -> None:
        """Keep the KV of ``tokens`` (every token the model has seen, in order)."""
        if not self.enabled or not tokens or not cache:
            return
        self.lru.insert_cache(namespace, list(tokens), cache)
        key = (namespace, tuple(tokens))
        self.dirty[key] = None
        self.dirty.move_to_end(key)
        log.info("prompt cache: %d entries, %d bytes of %d", len(self.lru), self.nbytes, self.lru.max_bytes)

    def _entry(self, key: Key) -> Any | None:
        return exact_entry(self.lru, key[0], key[1])

    # --- disk -----------------------------------------------------------------------------------

    def load(self, fingerprint: str) -> int:
        """Bring a model's disk entries into memory (oldest first, so the newest stay hottest)."""
        if self.disk is None or not self.enabled:
            return 0
        self.wait()  # the writer's files are complete, and ``disk.files`` is ours again
        loaded = 0
        for key, cache in self.disk.load(fingerprint):
            self.lru.insert_cache(key[0], list(key[1]), cache)
            loaded += 1
        return loaded

    def flush(self, idle: bool) -> None:
        """Hand new entries to the disk writer: whenever the engine is idle, and while it is
        busy at most every BUSY_FLUSH_SECS. One write runs at a time; what is added meanwhile
        waits for the next. The entries' arrays are never changed in place (a fetch copies),
        so the writer reads them safely while the engine goes on."""
        if self.disk is None or self._writer is None or not self.dirty or self.writing:
            return
        if not idle and time.monotonic() - self.flushed_at < BUSY_FLUSH_SECS:
            return
        self.flushed_at = time.monotonic()
        dirty, self.dirty = self.dirty, OrderedDict()
        # Evicted or superseded by a longer entry since: skipped; and only what the disk has
        # room for (with the tier off, none: those entries stay in memory only). Serialized
        # here, on the engine's thread (MLX may evaluate the cache's state to save it); the
        # writer thread then hashes, fsyncs and renames, the slow part. With no write
        # running, ``disk``'s bookkeeping is this thread's to touch.
        entries = [(key, entry.prompt_cache) for key in dirty if (entry := self._entry(key)) is not None]
        admitted = self.disk.admit(entries)
        staged = [(key, tmp) for n, (key, cache) in enumerate(admitted) if (tmp := self.disk.stage(key, cache, n))]
        keep = {key for key, _ in staged} | {key for key in self.disk.files if self._entry(key) is not None}
        self._writing = self._writer.submit(self._write, self.disk, staged, keep)

    @property
    def unflushed(self) -> bool:
        """Entries wait for the disk writer."""
        return self.disk is not None and bool(self.dirty)

    @property
    def writing(self) -> bool:
        return self._writing is not None and not self._writing.done()

    @staticmethod
    def _write(disk: DiskCache, staged: list[tuple[Key, Path]], keep: set[Key]) -> None:
        try:
            for key, tmp in staged:
                disk.commit(key, tmp)
            disk.prune(keep=keep.__contains__)
        except Exception:  # a cache that is not written is only slower later
            log.exception("prompt cache not written")
        finally:
            for _, tmp in staged:  # committed ones were renamed: only a failed one is left
                tmp.unlink(missing_ok=True)

    def wait(self) -> None:
        """Until the write in progress (if any) is on disk."""
        if self._writing is not None:
            self._writing.result()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.shutdown(wait=True)


class DiskCache:
    """``<dir>/<model fingerprint>/<sha256 of the file>.safetensors``, newest kept within bytes,
    never leaving less than ``min_free`` bytes free on the disk."""

    def __init__(self, directory: Path, max_bytes: int, min_free: int = DEFAULT_MIN_FREE_BYTES) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        self.min_free = min_free
        self.files: dict[Key, Path] = {}
        self.off: str | None = None  # why the tier writes nothing now; None: it writes
        self._retry_at = 0.0  # after a failed write: not before this (monotonic)
        self._said_at: float | None = None
        self.sweep()

    def sweep(self) -> None:
        """Remove what writes that never finished left behind (a process killed mid-write):
        temporary files of processes that are gone, or of an earlier process with our pid."""
        with contextlib.suppress(OSError):
            for tmp in self.directory.glob(f"*/{TMP_PREFIX}*"):
                pid = _writer_pid(tmp.name)
                if pid is None or pid == os.getpid() or not _running(pid):
                    tmp.unlink(missing_ok=True)

    def room(self) -> int:
        """Bytes a new file may take: the disk's free space but ``min_free``."""
        try:
            return free_bytes(self.directory) - self.min_free
        except OSError:
            return 0

    def admit(self, entries: list[tuple[Key, list[Any]]]) -> list[tuple[Key, list[Any]]]:
        """Of ``entries`` (oldest first), those the disk has room for, newest first in line;
        none while the tier is off after a failed write. Not even one fitting turns the
        tier off; one fitting again turns it back on."""
        if not entries or (self.off is not None and time.monotonic() < self._retry_at):
            return []
        room = self.room()
        fits: list[tuple[Key, list[Any]]] = []
        for key, cache in reversed(entries):
            if (size := file_bytes(key, cache)) <= room:
                fits.append((key, cache))
                room -= size
        if not fits:
            self.turn_off(
                f"disk full: {_mb(max(0, self.room() + self.min_free))} free, and it keeps "
                f"{_mb(self.min_free)} free for the database ([engine] prompt_cache_disk_min_free_bytes)"
            )
        elif self.off is not None:
            self.off = None
            log.warning("prompt cache: the disk has room again: writing to %s again", self.directory)
        return fits[::-1]

    def turn_off(self, why: str, retry_in: float = 0.0) -> None:
        """Write nothing until there is room (and ``retry_in`` seconds have passed); said once."""
        self._retry_at = time.monotonic() + retry_in
        if self.off is not None:
            return
        self.off = why
        now = time.monotonic()
        if self._said_at is None or now - self._said_at > SAY_AGAIN_SECS:
            self._said_at = now
            log.warning(
                "prompt cache: %s; not writing to %s until there is room (the cache stays in memory)",
                why,
                self.directory,
            )

    def failed(self, tmp: Path, exc: BaseException) -> None:
        """A write failed: its temporary file is removed and the tier turned off."""
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        full = (
            (isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT))
            or "Unable to write" in str(exc)  # MLX's words for a short write
            or self.room() <= 0
        )
        why = f"disk full: a write failed ({exc})" if full else f"a write failed ({exc})"
        self.turn_off(why, retry_in=RETRY_SECS)

    def stage(self, key: Key, cache: list[Any], n: int) -> Path | None:
        """Serialize an entry to a temporary file (not yet durable, not yet found by a load)."""
        namespace, tokens = key
        folder = self.directory / namespace[0]
        tmp = folder / f"{TMP_PREFIX}{os.getpid()}-{n}{SUFFIX}"
        try:
            private_dir(folder)  # a client's prompts, as KV: the owner's alone (docs/operations.md)
            metadata = {"format": FORMAT, "model": namespace[0], "namespace": namespace[1]}
            metadata["tokens"] = json.dumps(tokens)
            save_prompt_cache(str(tmp), cache, metadata)
            os.chmod(tmp, PRIVATE_FILE)  # MLX writes it as the umask says
        except Exception as exc:  # MLX reports a full disk as a RuntimeError ("[write] Unable to write")
            self.failed(tmp, exc)
            return None
        return tmp

    def commit(self, key: Key, tmp: Path) -> None:
        """Make a staged file durable under the name of its SHA-256."""
        try:
            digest = _sha256(tmp)
            with tmp.open("rb") as f:
                os.fsync(f.fileno())
            final = tmp.parent / f"{digest}{SUFFIX}"
            os.replace(tmp, final)  # atomic: a reader sees the whole file or none
            old = self.files.pop(key, None)
            if old is not None and old != final:
                old.unlink(missing_ok=True)
            self.files[key] = final
        except OSError as exc:
            self.failed(tmp, exc)

    def write(self, key: Key, cache: list[Any]) -> None:
        if (tmp := self.stage(key, cache, 0)) is not None:
            self.commit(key, tmp)

    def prune(self, keep: Any) -> None:
        """Drop files whose entries left memory, then the oldest beyond the byte budget."""
        for key, path in list(self.files.items()):
            if not keep(key):
                path.unlink(missing_ok=True)
                del self.files[key]
        sized = []
        for key, path in self.files.items():
            with contextlib.suppress(OSError):
                st = path.stat()
                sized.append((st.st_mtime_ns, st.st_size, key, path))
        total = 0
        for _, size, key, path in sorted(sized, reverse=True):  # newest first
            total += size
            if total > self.max_bytes:
                path.unlink(missing_ok=True)
                del self.files[key]

    def load(self, fingerprint: str) -> list[tuple[Key, list[Any]]]:
        folder = self.directory / fingerprint
        if not folder.is_dir():
            return []
        found = []
        paths = sorted(folder.glob(f"*{SUFFIX}"), key=lambda f: f.stat().st_mtime_ns)
        for path in paths:
            if path.name.startswith(TMP_PREFIX):  # a write that never finished
                path.unlink(missing_ok=True)
                continue
            key = self._read(path, fingerprint)
            if key is not None:
                found.append(key)
        if found:
            log.info("prompt cache: %d entries loaded from %s", len(found), folder)
        return found

    def _read(self, path: Path, fingerprint: str) -> tuple[Key, list[Any]] | None:
        try:
            if _sha256(path) != path.name.removesuffix(SUFFIX):
                raise ValueError("its checksum does not match its contents")
            cache, metadata = load_prompt_cache(str(path), return_metadata=True)
            if metadata.get("format") != FORMAT or metadata.get("model") != fingerprint:
                raise ValueError("it was not written by lmspd for this model")
            tokens = json.loads(metadata["tokens"])
            if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
                raise ValueError("its token list is malformed")
            key: Key = ((fingerprint, str(metadata.get("namespace", ""))), tuple(tokens))
        except Exception as exc:  # never trusted: any failure means the file is not used
            log.warning("prompt cache file %s ignored and removed: %s", path, exc)
            path.unlink(missing_ok=True)
            return None
        self.files[key] = path
        return key, cache


def stored_lengths(directory: Path, skip: frozenset[Path] = frozenset()) -> list[int]:
    """How many tokens each complete cache file under ``directory`` (but those in ``skip``)
    holds, read from its safetensors header alone: what a benchmark or test waits for before
    killing a server."""
    lengths = []
    for path in directory.rglob(f"*{SUFFIX}"):
        if path.name.startswith(TMP_PREFIX) or path in skip:  # still being written, or known
            continue
        with contextlib.suppress(OSError, ValueError, KeyError, StopIteration), path.open("rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
            # save_prompt_cache flattens our metadata under a list index ("0.tokens").
            tokens = next(v for k, v in header["__metadata__"].items() if k.rsplit(".", 1)[-1] == "tokens")
            lengths.append(len(json.loads(tokens)))
    return lengths


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def free_bytes(directory: Path) -> int:
    """The bytes a writer may still use on the file system of ``directory`` (or of its
    nearest existing parent, before it is made)."""
    path = directory
    while not path.exists() and path.parent != path:
        path = path.parent
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def file_bytes(key: Key, cache: list[Any]) -> int:
    """An upper bound on the size of an entry's file: its arrays (as allocated, at least as
    long as what is saved), its token list and the headers."""
    return sum(int(c.nbytes) for c in cache) + 12 * len(key[1]) + 1024 * len(cache) + 4096


def _client(key: str) -> str | None:
    """The client a namespace's key belongs to; None for a key of another shape."""
    try:
        decoded = json.loads(key)
    except ValueError:
        return None
    return decoded[0] if isinstance(decoded, list) and decoded and isinstance(decoded[0], str) else None


def _mb(n: int) -> str:
    return f"{n / 1024**2:.1f} MB"


def _writer_pid(name: str) -> int | None:
    """The pid in a temporary file's name (``.tmp-<pid>-<n>.safetensors``)."""
    head = name.removeprefix(TMP_PREFIX).removesuffix(SUFFIX).split("-")[0]
    return int(head) if head.isdigit() else None


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
