"""How far each numerics path is from the exact one: the measurement every faster path is
judged by (docs/benchmarks.md, "Accuracy", says the budget and today's figures).

    python -m bench.quality [--model-dir DIR] [--paths quantized_float32,fast,quantized,float32]
                            [--llama-server PATH [--gguf FILE]] [--prompts N] [--tokens 64]
                            [--text-tokens 10240] [--window 512] [--rows 32] [--resume-cuts 5,20,40]
                            [--json OUT]

A path is an ``[engine] weight_dtype`` the engine can run the model in, loaded as the engine
loads it (``lmspd.engine.weights``): ``quantized_float32`` is lmspd's packed kernels, the exact
path every other is measured against (MLX's quantized products' bits in float32); ``fast`` is
those kernels with ``[engine] numerics = "fast"`` (8-bit activations, docs/numerics.md);
``quantized`` is MLX's own quantized model as mlx-lm runs it on this CPU (the file's 16-bit
activations); ``float32`` / ``float16`` / ``bfloat16`` the weights dequantized.

**Agreement** (against llama.cpp): the shipped prompts (``harness/data/quality/prompts.json``),
each rendered by the model's chat template as the engine renders it, greedy, ``--tokens`` each;
per prompt, how many tokens equal the exact path's before the first difference (an end of
text ends a sequence; it is not counted), and whether the whole answer is identical. With
``--llama-server``, llama.cpp's server on the GGUF file the model was converted from answers
the same token ids (``/completion``, greedy) in the same run.

**Divergence**: teacher-forced over the shipped public-domain text
(``harness/data/quality/genesis-1-18.txt``, the King James Genesis 1-18, 13,647 tokens), in
windows of ``--window`` tokens on a fresh cache each, ``--rows`` tokens a forward pass (32 or
fewer: the decode kernels, whose rows are computed as one decoding token's; ``--window 1``:
the whole text one token a step): at every position, the KL divergence of the path's
next-token distribution from the exact path's, whether its most likely token is the exact
path's, and the perplexity of the text under each path.

**Resume** (``--resume-cuts``): each of lmspd's paths' own answers cut after those many tokens
and resumed, as a task resumed after a restart is (``resumes``), against the uninterrupted
answer: how many differ (SPEC §16: on any path a greedy ``resume`` equals the uninterrupted run).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.peers import GGUF, bundled_gguf
from bench.step_profile import default_model_dir
from harness import DATA
from harness.server import free_port, kill, spawn

EXACT = "quantized_float32"
FAST = "fast"
QUALITY = DATA / "quality"
PROMPTS = QUALITY / "prompts.json"
TEXT = QUALITY / "genesis-1-18.txt"


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many tokens ``a`` and ``b`` share before their first difference."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@dataclass
class Agreement:
    """One path's answers against the exact path's, over the prompts."""

    prefixes: list[int] = field(default_factory=list)  # tokens equal before the first difference
    identical: int = 0

    def add(self, exact: list[int], answer: list[int]) -> None:
        self.prefixes.append(common_prefix(exact, answer))
        self.identical += exact == answer

    @property
    def mean(self) -> float:
        return sum(self.prefixes) / len(self.prefixes) if self.prefixes else 0.0


@dataclass
class Divergence:
    """One path's next-token distributions against the exact path's, over the text."""

    positions: int = 0
    kl_sum: float = 0.0  # nats
    kl_max: float = 0.0
    top1_same: int = 0
    nll_sum: float = 0.0  # of the text's own next tokens, under this path

    @property
    def kl_mean(self) -> float:
        return self.kl_sum / self.positions if self.positions else 0.0

    @property
    def top1(self) -> float:
        return self.top1_same / self.positions if self.positions else 0.0

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll_sum / self.positions) if self.positions else 0.0


class Numerics:
    """A model loaded in one ``weight_dtype`` (``fast``: lmspd's kernels with fast numerics),
    decoding one sequence at a time."""

    def __init__(self, model_dir: Path, name: str) -> None:
        import mlx.core as mx
        from mlx_lm.utils import load_model

        from lmspd.engine import kernels
        from lmspd.engine.weights import apply_weight_dtype

        self.name = name
        self.model, _ = load_model(model_dir)
        self.runs = apply_weight_dtype(self.model, EXACT if name == FAST else name)
        # The kernels' numerics are the process's: each path sets its own before it computes.
        self.numerics = "fast" if name == FAST else "exact"
        self.ext = kernels.load() if self.runs == EXACT else None
        mx.eval(self.model.parameters())
        self.cache: list[Any] = []

    def start(self) -> None:
        from mlx_lm.models.cache import make_prompt_cache

        self.cache = make_prompt_cache(self.model)

    def logprobs_rows(self, tokens: list[int]) -> Any:
        """Each position's next-token log-probabilities over ``tokens`` (appended to the cache)."""
        import mlx.core as mx

        if self.ext is not None:
            self.ext.set_numerics(self.numerics)
        logits = self.model(mx.array([tokens]), cache=self.cache)[0].astype(mx.float32)
        out = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        mx.eval(out)  # computed under this path's numerics
        return out

    def logprobs(self, tokens: list[int]) -> Any:
        """The next token's log-probabilities after ``tokens`` (appended to the cache)."""
        return self.logprobs_rows(tokens)[-1]

    def greedy(self, prompt: list[int], tokens: int, ends: set[int]) -> list[int]:
        """As the engine answers: the prompt but its last token prefilled, then decoding from
        that token on, one row a step."""
        import mlx.core as mx
        import numpy as np

        self.start()
        if len(prompt) > 1:
            self.logprobs_rows(prompt[:-1])
        out: list[int] = []
        step = prompt[-1:]
        while len(out) < tokens:
            token = int(np.asarray(mx.argmax(self.logprobs(step))))
            if token in ends:
                break
            out.append(token)
            step = [token]
        return out


@dataclass
class Resumes:
    """A path's greedy answers resumed after a cut against its own uninterrupted ones."""

    cuts: list[int]
    checked: int = 0
    differ: list[tuple[int, int, str]] = field(default_factory=list)  # (prompt, cut, how)


def resumes(
    path: Numerics, prompts: list[list[int]], answers: list[list[int]], cuts: list[int], ends: set[int]
) -> Resumes:
    """Each answer cut after ``cuts`` tokens and resumed, greedy to the same length: as the
    engine resumes it ("pieces": the prompt but its last token prefilled as before, then that
    token and the tokens generated so far in passes of up to 32 rows, engine/admission.py's
    ``resumed_segments``), and, for comparison, the prompt and those tokens prefilled in one
    pass ("one pass", the prefill's products for all of them)."""
    import mlx.core as mx
    import numpy as np

    found = Resumes(cuts)
    for i, (prompt, answer) in enumerate(zip(prompts, answers, strict=True)):
        for cut in cuts:
            if cut >= len(answer):
                continue
            for how in ("pieces", "one pass"):
                path.start()
                if how == "pieces":
                    if len(prompt) > 1:
                        path.logprobs_rows(prompt[:-1])
                    rest = [prompt[-1], *answer[:cut]]
                    for at in range(0, len(rest), 32):
                        logprobs = path.logprobs(rest[at : at + 32])
                else:
                    logprobs = path.logprobs(prompt + answer[:cut])
                out = answer[:cut]
                while len(out) < len(answer):
                    token = int(np.asarray(mx.argmax(logprobs)))
                    if token in ends:
                        break
                    out.append(token)
                    logprobs = path.logprobs([token])
                found.checked += 1
                if out != answer:
                    found.differ.append((i, cut, how))
    return found


def rendered_prompts(model_dir: Path, count: int) -> tuple[list[list[int]], set[int]]:
    """The shipped prompts as the engine renders them (their token ids), and the end tokens."""
    from lmspd.engine.protocol import SamplingParams
    from lmspd.models.registry import ResolvedModel
    from lmspd.prompting.generation import build_generate

    texts = json.loads(PROMPTS.read_text())[:count]
    model = ResolvedModel(name="quality", path=model_dir)
    cmds = [
        build_generate(
            model,
            [{"role": "user", "content": text}],
            request_id=uuid.uuid4().hex,
            max_tokens=1,
            sampling=SamplingParams(temperature=0.0),
        )
        for text in texts
    ]
    return [list(cmd.prompt) for cmd in cmds], set(cmds[0].stop_token_ids)


def llama_answers(binary: Path, gguf: Path, prompts: list[list[int]], tokens: int, ends: set[int]) -> list[list[int]]:
    """llama-server's greedy answers to the same token ids (one slot, two threads)."""
    port = free_port()
    cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(os.cpu_count() or 1)]
    cmd += ["--parallel", "1", "-c", "4096"]
    with tempfile.TemporaryDirectory(prefix="lmspd-quality-") as tmp:
        proc = spawn(cmd, f"http://127.0.0.1:{port}/health", Path(tmp) / "llama-server.log")
        try:
            answers = []
            for prompt in prompts:
                body = {
                    "prompt": prompt,
                    "n_predict": tokens,
                    "temperature": 0.0,
                    "top_k": 1,
                    "cache_prompt": False,
                    "return_tokens": True,
                }
                got = httpx.post(f"http://127.0.0.1:{port}/completion", json=body, timeout=600).json()
                answers.append([t for t in got["tokens"] if t not in ends])
            return answers
        finally:
            kill(proc)


def agreed(exact: list[list[int]], answers: list[list[int]]) -> Agreement:
    row = Agreement()
    for reference, answer in zip(exact, answers, strict=True):
        row.add(reference, answer)
    return row


def divergence(paths: list[Numerics], text: list[int], window: int, rows: int = 0) -> dict[str, Divergence]:
    """Every path fed the text in windows of ``window`` tokens (each on a fresh cache; 1: the
    whole text one token a step, as decoding runs), ``rows`` a forward pass (0: the window),
    each window's positions after its first scored:
    KL(exact || path) of the next-token distributions, top-1, and the text's own next token."""
    import mlx.core as mx
    import numpy as np

    found = {path.name: Divergence() for path in paths}
    chunks = [text[i : i + window + 1] for i in range(0, len(text) - 1, window)] if window > 1 else [text]
    for chunk in chunks:
        if len(chunk) < 2:
            continue
        for path in paths:
            path.start()
        fed = chunk[:-1]
        step_rows = (rows or len(fed)) if window > 1 else 1
        steps = [fed[i : i + step_rows] for i in range(0, len(fed), step_rows)]
        nexts = chunk[1:]
        at = 0
        for step in steps:
            logprobs = [path.logprobs_rows(step) for path in paths]  # (rows, vocab) each
            ref = logprobs[0]
            p_ref, top_ref = mx.exp(ref), mx.argmax(ref, axis=-1)
            target = mx.array(nexts[at : at + len(step)])[:, None]
            stats = [
                mx.stack(
                    [
                        mx.sum(p_ref * (ref - lp), axis=-1),
                        (mx.argmax(lp, axis=-1) == top_ref).astype(mx.float32),
                        -mx.take_along_axis(lp, target, axis=-1)[:, 0],
                    ]
                )
                for lp in logprobs
            ]
            values = np.asarray(mx.stack(stats), dtype=np.float64)  # (paths, 3, rows)
            for path, (kl, same, nll) in zip(paths, values, strict=True):
                row = found[path.name]
                row.positions += len(kl)
                row.kl_sum += float(kl.sum())
                row.kl_max = max(row.kl_max, float(kl.max()))
                row.top1_same += int(same.sum())
                row.nll_sum += float(nll.sum())
            at += len(step)
    return found


def report(agreement: dict[str, Agreement], diverged: dict[str, Divergence], tokens: int, prompts: int) -> None:
    print(f"\nagreement with {EXACT}, greedy, {tokens} tokens, {prompts} prompts")
    print("| path | mean tokens before the first difference | identical answers |")
    print("|---|---:|---:|")
    for name, row in agreement.items():
        print(f"| {name} | {row.mean:.1f} | {row.identical}/{len(row.prefixes)} |")
    if diverged:
        positions = next(iter(diverged.values())).positions
        print(f"\ndivergence from {EXACT}, teacher-forced, {positions} positions")
        print("| path | mean KL (nats) | max KL | top-1 agreement | perplexity |")
        print("|---|---:|---:|---:|---:|")
        for name, d in diverged.items():
            print(f"| {name} | {d.kl_mean:.3g} | {d.kl_max:.3g} | {100 * d.top1:.2f}% | {d.perplexity:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.quality", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--paths", default=f"{EXACT},{FAST},float32", help="weight dtypes or fast, the exact first")
    parser.add_argument("--llama-server", type=Path, default=None, help="llama.cpp's llama-server binary")
    parser.add_argument("--gguf", type=Path, default=GGUF, help="the GGUF file llama-server serves")
    parser.add_argument("--prompts", type=int, default=30)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--text-tokens", type=int, default=10240, help="0: no divergence table")
    parser.add_argument(
        "--window", type=int, default=512, help="tokens a fresh cache takes (1: the whole text, one token a step)"
    )
    parser.add_argument("--rows", type=int, default=0, help="tokens a forward pass (0: the window; 32: decode's)")
    parser.add_argument("--resume-cuts", default="", help="e.g. 5,20,40: resume checks after these tokens")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here too")
    args = parser.parse_args()
    from lmspd.engine.upstream.blas import load as load_blas

    load_blas("auto")  # before MLX, as the engine does
    from transformers import AutoTokenizer
    from transformers.utils import logging as transformers_logging

    # The text is longer than a context (it is windowed): no warning saying so.
    transformers_logging.set_verbosity_error()  # type: ignore[no-untyped-call]

    model_dir = (args.model_dir or default_model_dir()).resolve()
    names = args.paths.split(",")
    if names[0] != EXACT:
        parser.error(f"--paths must start with {EXACT}, the path the others are measured against")
    began = time.monotonic()
    paths = [Numerics(model_dir, name) for name in names]
    print(f"model {model_dir}: paths {', '.join(f'{p.name} (runs {p.runs})' for p in paths)}", flush=True)
    prompts, ends = rendered_prompts(model_dir, args.prompts)
    exact = [paths[0].greedy(prompt, args.tokens, ends) for prompt in prompts]
    answers = {paths[0].name: exact} | {p.name: [p.greedy(q, args.tokens, ends) for q in prompts] for p in paths[1:]}
    agreement = {p.name: agreed(exact, answers[p.name]) for p in paths[1:]}
    if args.llama_server is not None:
        gguf = bundled_gguf(args.gguf) if args.gguf == GGUF else args.gguf
        agreement["llama-server"] = agreed(exact, llama_answers(args.llama_server, gguf, prompts, args.tokens, ends))
    print(f"agreement measured in {time.monotonic() - began:.0f}s", flush=True)
    resumed: dict[str, Resumes] = {}
    if args.resume_cuts:
        cuts = [int(c) for c in args.resume_cuts.split(",")]
        # Against the path's own uninterrupted answer: SPEC §16's determinism, per path.
        resumed = {p.name: resumes(p, prompts, answers[p.name], cuts, ends) for p in paths if p.runs == EXACT}
        for name, r in resumed.items():
            print(f"resume on {name}: {len(r.differ)} of {r.checked} differ {r.differ}", flush=True)
    diverged: dict[str, Divergence] = {}
    if args.text_tokens:
        text = AutoTokenizer.from_pretrained(model_dir).encode(TEXT.read_text())[: args.text_tokens + 1]
        diverged = divergence(paths, text, args.window, args.rows)
    report(agreement, diverged, args.tokens, len(prompts))
    print(f"\n{time.monotonic() - began:.0f}s in all")
    if args.json is not None:
        figures = {
            "agreement": {k: {**asdict(v), "mean": v.mean} for k, v in agreement.items()},
            "divergence": {
                k: {**asdict(v), "kl_mean": v.kl_mean, "top1": v.top1, "perplexity": v.perplexity}
                for k, v in diverged.items()
            },
            "resume": {k: asdict(v) for k, v in resumed.items()},
        }
        args.json.write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()
