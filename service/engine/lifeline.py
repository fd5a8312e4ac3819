"""The engine process dies with its server, whatever the engine is doing at that moment.

A server killed with SIGKILL closes its end of the pipe, and the engine exits on EOF, but
only between steps: a long prefill holds the main thread for seconds, and meanwhile the
engine keeps its memory and its accelerator. So the engine also asks the kernel for
SIGKILL when its parent dies (Linux, ``PR_SET_PDEATHSIG``), and everywhere a daemon
thread watches the parent pid, which changes when the parent dies (the orphan is
re-parented), and ends the process from there, since a thread runs during MLX calls.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1
WATCH_INTERVAL_SECS = 0.1


def bind_to_parent(parent: int, interval: float = WATCH_INTERVAL_SECS) -> None:
    """Die within ``interval`` of ``parent`` (this process's parent at its start)."""
    if sys.platform.startswith("linux"):
        # Sent when the thread that spawned this process ends: the server's event loop
        # thread, which lives as long as the server does.
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # it died before the signal was asked for
        os._exit(1)
    threading.Thread(target=_watch, args=(parent, interval), name="engine-lifeline", daemon=True).start()


def _watch(parent: int, interval: float) -> None:
    while os.getppid() == parent:
        time.sleep(interval)
    os._exit(1)  # no cleanup to wait for: the server that needed this engine is gone
