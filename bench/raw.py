"""Raw mlx-lm on the engine's terms: the floor that lmspd's overhead is measured against.

A child process (``python -m bench.raw MODEL_DIR DTYPE``) loads the model as the engine does
(the system BLAS first, then MLX, the same weight dtype) and answers JSON lines on stdin:

    {"op": "ttft", "messages": [...]}              -> {"seconds": s, "prompt_tokens": n}
    {"op": "batch", "prompts": [[...], ...], "tokens": k}  -> {"seconds": s, "tokens": n}

``ttft`` is the time from the messages to the first token of ``stream_generate``, rendering
and tokenizing included (lmspd does both too); ``batch`` inserts every prompt into one
``BatchGenerator`` at once and runs it until each has ``tokens`` tokens, prefill included.
A child keeps its model loaded between requests, so the benchmarks can alternate it with a
server, and its BLAS and MLX never load into the benchmark process.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


class Raw:
    """The benchmark's end of a raw child process."""

    def __init__(self, model_dir: Path, dtype: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.raw", str(model_dir), dtype],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.ask({"op": "ready"})

    def ask(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the raw mlx-lm process exited")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def ttft(self, messages: list[dict[str, str]]) -> tuple[float, int]:
        reply = self.ask({"op": "ttft", "messages": messages})
        return float(reply["seconds"]), int(reply["prompt_tokens"])

    def batch(self, prompts: list[list[dict[str, str]]], tokens: int) -> float:
        """Aggregate tokens per second of one BatchGenerator run."""
        reply = self.ask({"op": "batch", "prompts": prompts, "tokens": tokens})
        return float(reply["tokens"]) / float(reply["seconds"])

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(30)


def serve(model_dir: Path, dtype: str) -> None:
    from lmspd.engine.upstream.blas import load as load_blas

    load_blas("auto")  # before MLX, as the engine does
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator, stream_generate
    from mlx_lm.sample_utils import make_sampler
    from mlx_lm.utils import load_model, load_tokenizer

    from lmspd.engine.weights import apply_weight_dtype

    model, _ = load_model(model_dir)
    apply_weight_dtype(model, dtype)
    mx.eval(model.parameters())
    tokenizer = load_tokenizer(model_dir)
    greedy = make_sampler(0.0)

    def render(messages: list[dict[str, str]]) -> list[int]:
        ids: list[int] = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return ids

    for line in sys.stdin:
        request = json.loads(line)
        reply: dict[str, Any] = {}
        if request["op"] == "ttft":
            start = time.perf_counter()
            ids = render(request["messages"])
            next(iter(stream_generate(model, tokenizer, ids, max_tokens=1, sampler=greedy)))
            reply = {"seconds": time.perf_counter() - start, "prompt_tokens": len(ids)}
        elif request["op"] == "batch":
            start = time.perf_counter()
            n = len(request["prompts"])
            batch = BatchGenerator(model, completion_batch_size=n, prefill_step_size=512)
            batch.insert([render(m) for m in request["prompts"]], max_tokens=[request["tokens"]] * n)
            done = produced = 0
            while done < n:
                for response in batch.next_generated():
                    produced += 1
                    done += response.finish_reason is not None
            batch.close()
            reply = {"seconds": time.perf_counter() - start, "tokens": produced}
        print(json.dumps(reply), flush=True)


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(
        description="A raw mlx-lm child for the benchmarks: answers JSON lines on stdin (see bench/raw.py)."
    )
    parser.add_argument("model_dir", type=Path, help="the converted model directory")
    parser.add_argument("dtype", help="the weight dtype, as engine.weight_dtype takes it")
    args = parser.parse_args()
    serve(args.model_dir, args.dtype)


if __name__ == "__main__":
    main()
