"""An agent's edit, with and without speculation: lmspd against llama-server, each alone.

    python -m bench.speculation [--rounds 3] [--model-dir DIR] [--llama-server PATH [--gguf FILE]]
                                [--tokens 400] [--prose]

The request is what a coding agent sends when it changes a file: the file in the prompt
(``EDITED``, 60 lines of Python) and "repeat it with one name changed"; the answer repeats
most of the prompt, the case prompt-lookup drafts exist for (docs/speculation.md). Streaming,
greedy Chat Completions, the same body to every server; per server and round: decode tok/s
(tokens after the first over the time from the first to the last) and the whole answer's
seconds. lmspd runs as it ships (``speculative_tokens`` 16) and with speculation off
(``LMSPD_SPECULATIVE_TOKENS=0``); llama-server as ``bench.peers`` runs it, and with its own
n-gram speculation (``--spec-type ngram-simple``, this build's prompt-lookup). Rounds alternate
the servers; the table gives medians (ranges) and lmspd's answers with and without drafts are
checked to be the same text. ``--prose`` asks for a story instead: what drafting costs where
the answer does not repeat its prompt.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.peers import GGUF, Server, bundled_gguf, stream
from harness.server import free_port
from lmspd.config import load_config
from lmspd.models.registry import ModelRegistry

EDITED = '''class Inventory:
    """Items on hand, by name, with their unit prices."""

    def __init__(self):
        self.items = {}
        self.prices = {}

    def add(self, name, count, price):
        if count <= 0:
            raise ValueError("count must be positive")
        self.items[name] = self.items.get(name, 0) + count
        self.prices[name] = price

    def remove(self, name, count):
        held = self.items.get(name, 0)
        if count > held:
            raise ValueError(f"only {held} of {name} on hand")
        self.items[name] = held - count
        if self.items[name] == 0:
            del self.items[name]
            del self.prices[name]

    def total(self):
        return sum(self.items[name] * self.prices[name] for name in self.items)

    def names(self):
        return sorted(self.items)

    def report(self):
        lines = []
        for name in self.names():
            count = self.items[name]
            price = self.prices[name]
            lines.append(f"{name}: {count} at {price:.2f} = {count * price:.2f}")
        lines.append(f"total: {self.total():.2f}")
        return "\\n".join(lines)


def restock(inventory, orders):
    for name, count, price in orders:
        inventory.add(name, count, price)
    return inventory.total()


def clear(inventory):
    for name in inventory.names():
        inventory.remove(name, inventory.items[name])
    return inventory.total()


if __name__ == "__main__":
    shop = Inventory()
    restock(shop, [("apple", 10, 0.5), ("pear", 4, 0.75), ("plum", 12, 0.2)])
    print(shop.report())
    clear(shop)
    print(shop.report())
'''
PROMPT = (
    "Here is a Python file:\n\n```python\n"
    + EDITED
    + "```\n\nRename the method `total` to `grand_total` everywhere. Reply with the whole file."
)
# Where drafts rarely hold: what speculation costs an answer that does not repeat its prompt.
PROSE = "Write a short story about a lighthouse keeper who finds a message in a bottle."
SERVERS = ("lmspd", "lmspd, no drafts", "llama-server", "llama-server, ngram-simple")


def edit(port: int, tokens: int, prompt: str = PROMPT) -> tuple[float, float, int, str]:
    """(decode tok/s, the answer's seconds, tokens, text) of one streamed greedy answer."""
    pieces: list[str] = []
    ttft, span, count = stream(port, "bench", prompt, tokens, pieces=pieces, system=None)
    return (count - 1) / span, ttft + span, count, "".join(pieces)


def server(name: str, port: int, data: Path, model_dir: Path, args: Any) -> Server:
    if name.startswith("lmspd"):
        cmd = [sys.executable, "-m", "lmspd.cli", "serve", "--config", str(data / "lmspd.toml")]
        cmd += ["--port", str(port), "--model", "bench", "--data-dir", str(data / f"db-{port}")]
        if name != "lmspd":
            cmd = ["env", "LMSPD_SPECULATIVE_TOKENS=0", *cmd]
        return Server(name, cmd, port, "/readyz", data / f"{port}.log")
    cmd = [str(args.llama_server), "-m", str(args.gguf), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--parallel", "8", "--kv-unified", "-t", str(os.cpu_count() or 1), "--jinja"]
    if name.endswith("ngram-simple"):
        cmd += ["--spec-type", "ngram-simple"]
    return Server(name, cmd, port, "/health", data / f"{port}.log")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.speculation", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--llama-server", type=Path, default=None, help="llama.cpp's llama-server binary")
    parser.add_argument("--gguf", type=Path, default=GGUF, help="the GGUF file llama-server serves")
    parser.add_argument("--tokens", type=int, default=400)
    parser.add_argument("--prose", action="store_true", help="a story instead of the edit (drafts rarely hold)")
    args = parser.parse_args()
    config = load_config()
    model_dir = (args.model_dir or ModelRegistry(config).resolve(config.default_model).path).resolve()
    names = [n for n in SERVERS if args.llama_server or n.startswith("lmspd")]
    if args.llama_server and args.gguf == GGUF:
        bundled_gguf(GGUF)
    figures: dict[str, list[tuple[float, float, int]]] = {n: [] for n in names}
    texts: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="lmspd-spec-") as tmp:
        data = Path(tmp)
        (data / "lmspd.toml").write_text(f'[models.bench]\npath = "{model_dir}"\n[server]\ndata_dir = "{data}"\n')
        for round_no in range(args.rounds):
            shift = round_no % len(names)
            for name in names[shift:] + names[:shift]:
                port = free_port()
                with server(name, port, data, model_dir, args):
                    edit(port, 8)  # the model warm, its first pass paid
                    rate, seconds, count, text = edit(port, args.tokens, PROSE if args.prose else PROMPT)
                figures[name].append((rate, seconds, count))
                texts.setdefault(name, text)
                print(f"round {round_no + 1} {name}: {rate:.1f} tok/s, {seconds:.2f} s, {count} tokens", flush=True)
    same = texts.get("lmspd") == texts.get("lmspd, no drafts")
    print(f"\nmodel {model_dir}, {os.cpu_count()} CPUs, medians (ranges) of {args.rounds} rounds")
    print(f"lmspd's answers with and without drafts: {'the same text' if same else 'DIFFERENT'}\n")
    print("| server | decode tok/s | answer seconds | tokens |")
    print("|---|---:|---:|---:|")
    for name in names:
        rates = [f[0] for f in figures[name]]
        secs = [f[1] for f in figures[name]]
        print(
            f"| {name} | {statistics.median(rates):.1f} ({min(rates):.1f}–{max(rates):.1f}) "
            f"| {statistics.median(secs):.2f} ({min(secs):.2f}–{max(secs):.2f}) | {figures[name][0][2]} |"
        )
    if "llama-server" in figures:
        ours = statistics.median(f[0] for f in figures["lmspd"])
        for peer in ("llama-server", "llama-server, ngram-simple"):
            print(f"lmspd / {peer}, decode: {ours / statistics.median(f[0] for f in figures[peer]):.2f}")
    if not same:
        sys.exit("lmspd's answers differ with and without drafts")


if __name__ == "__main__":
    main()
