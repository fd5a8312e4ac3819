"""Prompt cache benchmark: a long conversation against a real ``lmspd serve``, turn by turn.

    python -m bench.prompt_cache [--system-tokens 1500] [--turns 4] [--tokens 16]

A 4-turn ``previous_response_id`` conversation with a long system prompt (``instructions``,
sent with every turn as clients do), streamed through the ``openai`` SDK. Prints each turn's
time to first token (request sent → first ``response.output_text.delta``) and
``cached_tokens``; turns 2..N against turn 1 (cold) in the same run; then the server is
killed with SIGKILL, restarted on the same data directory, and one more turn is timed
against the same cold turn. Last, the prompt cache's peak size (from the engine's log)
against its bound. Greedy, bundled model unless ``--model``.
"""

from __future__ import annotations

import argparse
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from openai import OpenAI

from harness.server import free_port, kill, spawn
from lmspd.config import load_config
from lmspd.engine.prompt_cache import stored_lengths
from lmspd.models.registry import ModelRegistry
from lmspd.prompting.generation import tokenizer_for

WORDS = (
    "The assistant works for a small bakery in a mountain town. It knows the opening hours, the "
    "daily breads, the cakes that must be ordered two days ahead, the allergens of each recipe, the "
    "delivery area, the prices in euros, and the names of the three bakers. It answers in one short "
    "sentence, politely, and never invents a product that is not on the list. "
)
QUESTIONS = [
    "When do you open on Sunday?",
    "Do you have rye bread today?",
    "Can I order a birthday cake for Friday?",
    "Is the walnut loaf free of milk?",
    "Do you deliver to the next village?",
]


class Server:
    def __init__(self, config: Path, port: int, log: Path) -> None:
        self.config, self.port, self.log = config, port, log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        cmd = [sys.executable, "-m", "lmspd.cli", "serve", "--config", str(self.config), "--port", str(self.port)]
        self.proc = spawn(cmd, f"http://127.0.0.1:{self.port}/readyz", self.log)

    def kill(self) -> None:
        assert self.proc is not None
        kill(self.proc, signal.SIGKILL)  # the server and its engine, as a power cut would


def turn(client: OpenAI, model: str, system: str, question: str, previous: str | None, tokens: int) -> dict[str, float]:
    start = time.perf_counter()
    first = 0.0
    stream = client.responses.create(
        model=model,
        instructions=system,
        input=question,
        previous_response_id=previous,
        max_output_tokens=tokens,
        temperature=0,
        stream=True,
    )
    for event in stream:
        if event.type == "response.output_text.delta" and not first:
            first = time.perf_counter() - start
        if event.type in ("response.completed", "response.incomplete"):
            usage = event.response.usage
            assert usage is not None
            cached = usage.input_tokens_details.cached_tokens if usage.input_tokens_details else 0
            return {
                "id": event.response.id,  # type: ignore[dict-item]
                "ttft": first or (time.perf_counter() - start),
                "input": usage.input_tokens,
                "cached": cached,
            }
    raise RuntimeError("the stream ended without a final event")


def system_prompt(model: str, tokens: int) -> str:
    """WORDS repeated up to ``tokens`` tokens of the model's tokenizer."""
    tok = tokenizer_for(ModelRegistry(load_config()).resolve(model))
    text = ""
    while len(tok.encode(text + WORDS)) <= tokens:
        text += WORDS
    return text.strip()


def peak_cache_bytes(log: Path) -> int:
    found = [int(m.group(1)) for m in re.finditer(r"prompt cache: \d+ entries, (\d+) bytes", log.read_text())]
    return max(found, default=0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--system-tokens", type=int, default=1500)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--cache-bytes", type=int, default=256 * 1024**2)
    args = parser.parse_args()
    base = load_config()
    model = args.model or base.default_model
    with tempfile.TemporaryDirectory(prefix="lmspd-bench-cache-") as tmp:
        data = Path(tmp)
        config = data / "lmspd.toml"
        config.write_text(
            f'cache_dir = "{base.model_cache_dir}"\n'
            f"[engine]\nprompt_cache_max_bytes = {args.cache_bytes}\n"
            f'[server]\ndata_dir = "{data}"\n'
        )
        log = data / "server.log"
        server = Server(config, free_port(), log)
        server.start()
        client = OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="none", timeout=600)
        system = system_prompt(model, args.system_tokens)
        rows: list[dict[str, float]] = []
        previous: str | None = None
        folder = data / "prompt-cache"
        for i in range(args.turns):
            row = turn(client, model, system, QUESTIONS[i % len(QUESTIONS)], previous, args.tokens)
            previous = str(row["id"])
            rows.append(row)
            print(
                f"turn {i + 1}: {row['input']:.0f} input tokens, {row['cached']:.0f} cached, "
                f"time to first token {row['ttft']:.2f} s",
                flush=True,
            )
        deadline = time.monotonic() + 120
        # The last turn's cache is written once the engine is idle: kill only after that.
        while max(stored_lengths(folder), default=0) < rows[-1]["input"] and time.monotonic() < deadline:
            time.sleep(0.1)
        server.kill()
        server.start()
        client = OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="none", timeout=600)
        after = turn(client, model, system, QUESTIONS[args.turns % len(QUESTIONS)], previous, args.tokens)
        server.kill()
        cold = rows[0]["ttft"]
        print(
            f"after kill -9 and restart: {after['input']:.0f} input tokens, {after['cached']:.0f} cached, "
            f"time to first token {after['ttft']:.2f} s"
        )
        print()
        for i, row in enumerate(rows[1:], start=2):
            print(f"turn {i} vs turn 1: {cold / row['ttft']:.1f}x faster to first token")
        print(f"first turn after restart vs turn 1 (cold): {cold / after['ttft']:.1f}x faster to first token")
        peak = peak_cache_bytes(log)
        print(
            f"prompt cache peak {peak / 1024**2:.1f} MiB of its {args.cache_bytes / 1024**2:.0f} MiB bound "
            f"({100 * peak / args.cache_bytes:.0f}%)"
        )


if __name__ == "__main__":
    main()
