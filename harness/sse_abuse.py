"""Event streams under abuse, against a real ``lmspd serve`` on loopback.

    python -m harness.sse_abuse [--drops 1000] [--slow 200] [--rounds 3] [--events 5000]

A finished task with ``--events`` events (seeded through the store before the server starts),
then: ``--drops`` SSE connections to its event stream, each dropped abruptly (RST) after the
first bytes; then ``--slow`` readers that never read (a small receive buffer, so the server's
writes block at once). The server disconnects the slow readers after two keep-alive intervals
(5 s here). Measured from /proc: the server's open file descriptors and RSS before, at the
peak and after each phase, and memory per slow reader. Exits non-zero if descriptors do not
return to the baseline, streams stay open, RSS keeps growing after the first round, or the
server logged a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import socket
import struct
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from harness.history import seed_history
from harness.server import free_port, kill, spawn

KEEPALIVE_SECS = 5.0


class Server:
    def __init__(self, proc_pid: int, port: int) -> None:
        self.pid, self.port = proc_pid, port
        # One kept-alive connection for the scrapes, counted in the baseline (Hypercorn keeps a
        # closed one's socket until its keep-alive timeout).
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def rss_mb(self) -> float:
        with open(f"/proc/{self.pid}/status") as status:
            line = next(line for line in status if line.startswith("VmRSS:"))
        return int(line.split()[1]) / 1024

    def streams(self) -> float:
        text = self.client.get("/metrics").text
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("lmspd_sse_streams_open"))


def wait_for(what: str, ok: Callable[[], bool], timeout: float = 60) -> float:
    started = time.monotonic()
    while not ok():
        if time.monotonic() - started > timeout:
            raise SystemExit(f"sse_abuse: {what} not reached within {timeout:.0f} s")
        time.sleep(0.1)
    return time.monotonic() - started


def request(port: int, task_id: str) -> bytes:
    return f"GET /lmsp/v1/tasks/{task_id}/events HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode()


def drop_abruptly(port: int, task_id: str, n: int) -> None:
    """``n`` streams opened, their first bytes read, then reset (SO_LINGER 0): no FIN, no goodbye."""
    for _ in range(n):
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(request(port, task_id))
            assert sock.recv(4096).startswith(b"HTTP/1.1 200"), "the stream did not start"
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def open_slow(port: int, task_id: str, n: int) -> list[socket.socket]:
    """``n`` readers that never read, with a small receive buffer."""
    readers = []
    for _ in range(n):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", port))
        sock.sendall(request(port, task_id))
        readers.append(sock)
    return readers


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--drops", type=int, default=1000)
    parser.add_argument("--slow", type=int, default=200)
    parser.add_argument("--events", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of slow readers")
    parser.add_argument("--model", required=False, help="model directory (default: a tiny random one)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="lmspd-sse-abuse-"))
    try:
        task_id = asyncio.run(seed_history(work / "lmspd.db", args.events))
        if args.model is None:
            from harness.fuzz import tiny_model

            model = tiny_model(work / "tiny")
        else:
            model = Path(args.model)
        config = work / "lmspd.toml"
        config.write_text(
            'default_model = "tiny"\n[engine]\nweight_dtype = "quantized"\nprompt_cache_disk_max_bytes = 0\n'
            f'[server]\ndata_dir = "{work}"\nkeepalive_secs = {KEEPALIVE_SECS}\n'
            f'[models.tiny]\npath = "{model}"\n'
        )
        port = free_port()
        cmd = [sys.executable, "-m", "lmspd.cli", "serve", "--config", str(config), "--port", str(port)]
        proc = spawn(cmd, f"http://127.0.0.1:{port}/readyz", work / "server.log")
        try:
            failed = measure(Server(proc.pid, port), task_id, args)
            if tracebacks := (work / "server.log").read_text().count("Traceback"):
                print(f"sse_abuse: the server logged {tracebacks} tracebacks")
                return 1
            return failed
        finally:
            kill(proc, signal.SIGTERM)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def measure(server: Server, task_id: str, args: argparse.Namespace) -> int:
    # Warm: the first stream pays for imports and the database's page cache.
    drop_abruptly(server.port, task_id, 20)
    wait_for("warm-up streams closed", lambda: server.streams() == 0)
    base_fds, base_rss = server.fds(), server.rss_mb()
    rows = [("baseline", base_fds, base_rss, "")]
    failures = []

    started = time.monotonic()
    drop_abruptly(server.port, task_id, args.drops)
    took = time.monotonic() - started
    settle = wait_for("dropped streams closed", lambda: server.streams() == 0 and server.fds() <= base_fds)
    note = f"opened in {took:.1f} s, closed {settle:.1f} s later"
    rows.append((f"{args.drops} dropped", server.fds(), server.rss_mb(), note))

    rss = []
    for round_ in range(1, args.rounds + 1):
        readers = open_slow(server.port, task_id, args.slow)
        # Until the server has dropped them all: the most open at once, and the RSS then.
        started, peak_streams, peak_rss, held = time.monotonic(), 0.0, 0.0, 0
        while (streams := server.streams()) or not peak_streams:
            if streams >= peak_streams:
                peak_streams, peak_rss, held = streams, server.rss_mb(), server.fds()
            if time.monotonic() - started > 120:
                raise SystemExit("sse_abuse: slow readers still served after 120 s")
            time.sleep(0.05)
        gone = time.monotonic() - started
        freed = wait_for("slow readers' sockets freed", lambda: server.fds() <= base_fds)
        after = server.rss_mb()
        rss.append(after)
        per = (peak_rss - base_rss) * 1024 / peak_streams
        note = f"{peak_streams:.0f} at once, {per:.0f} KiB each"
        rows.append((f"{args.slow} slow, round {round_}: peak", held, peak_rss, note))
        note = f"all dropped {gone:.1f} s after opening, sockets freed +{freed:.1f} s"
        rows.append((f"{args.slow} slow, round {round_}: after", server.fds(), after, note))
        for sock in readers:
            sock.close()

    final_fds = server.fds()
    if final_fds > base_fds:
        failures.append(f"{final_fds - base_fds} descriptors more than at the start")
    # The first round raises the allocator's high-water mark; later ones must not keep raising it
    # (fragmentation moves it a few MB; a leak of 40 KiB per reader would add 8 MB a round).
    if len(rss) > 1 and rss[-1] - rss[0] > 8 * (len(rss) - 1):
        failures.append(f"RSS grew {rss[-1] - rss[0]:.0f} MB in {len(rss) - 1} rounds after the first")
    print(f"sse_abuse: {args.events}-event stream, keep-alive {KEEPALIVE_SECS} s (slow readers go after 2 of them)")
    print(f"{'phase':<28} {'fds':>5} {'RSS MB':>8}  note")
    for name, fds, mem, note in rows:
        print(f"{name:<28} {fds:>5} {mem:>8.1f}  {note}")
    print(f"fds back to baseline: {'yes' if final_fds <= base_fds else 'NO'}; " + "; ".join(failures or ["ok"]))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
