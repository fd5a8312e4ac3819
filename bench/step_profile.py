"""Where a decode step, a prefill and a cached-prompt first token spend their time.

    python -m bench.step_profile [--model-dir DIR] [--weight-dtype quantized_float32] [--reps 15]

Loads the model as the engine does (the system BLAS, then MLX, the weight dtype) and times, on
the model's own layers and shapes, in milliseconds (medians of ``--reps``):

- a decode step at batch 1 and 8 (a ~100-token context): Python graph construction (the forward
  pass and the sampler called lazily), the graph's evaluation, and the step as the engine runs
  it (mlx-lm's ``BatchGenerator``, which evaluates step n while it builds step n + 1); then each
  kernel class alone at the step's shapes and counts (counted from the step's own graph,
  ``mx.export_to_dot``), and the fixed cost of one MLX primitive times the step's count;
- sampling, detokenizing one token, the engine's reply over a pipe, the prompt cache's copy;
- a 512- and a 2,000-token prefill in the engine's 512-token chunks, the dequantize and BLAS
  shares timed alone;
- a cached-prompt first token through ``BatchGenerator``: the cache copy, the forward passes.

The machine may be shared: the kernel classes are timed in alternating rounds, so a neighbour's
load spreads over all of them; read the rows as shares of one run, not as absolute speeds.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from functools import partial
from multiprocessing import Pipe
from pathlib import Path
from typing import Any

Fn = Callable[[], Any]
CONTEXT = 100  # decode-step context, tokens
CHUNK = 512  # the engine's prefill_step_size
TEXT = "The quick brown fox jumps over the lazy dog while the city of Rome sleeps under the stars. "
# Primitives that compute nothing on contiguous inputs (they share their input's buffer).
VIEWS = ("Broadcast", "Reshape", "ExpandDims", "Slice", "Transpose", "Contiguous", "Squeeze")


def median_ms(fn: Fn, reps: int) -> float:
    return alternating_ms({"": fn}, reps)[""]


def alternating_ms(fns: dict[str, Fn], reps: int) -> dict[str, float]:
    """Each function evaluated once per round, round after round."""
    import mlx.core as mx

    for fn in fns.values():
        mx.eval(fn())  # warm-up
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            mx.eval(fn())
            times[name].append(time.perf_counter() - start)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def primitives(outputs: Any) -> Counter[str]:
    """The primitives of the graph that computes ``outputs``, by name."""
    import mlx.core as mx

    with tempfile.NamedTemporaryFile(suffix=".dot") as f:
        mx.export_to_dot(f.name, outputs)
        return Counter(re.findall(r'label ="([^"(]+)', Path(f.name).read_text()))


def products(model: Any, grouped: bool = True) -> list[tuple[Any, int]]:
    """Every quantized product of one forward pass with its input size, the output head last.
    grouped: sibling layers that share one call at decode (packed.Siblings) as that one call,
    as the step runs them (else each layer alone)."""
    from lmspd.engine.packed import PackedEmbedding, PackedLinear

    layers: list[tuple[Any, int]] = []
    groups: set[int] = set()
    for _, m in model.named_modules():
        if type(m) is not PackedLinear:
            continue
        k = m.weight.shape[1] * 32 // m.bits
        siblings = getattr(m, "_siblings", None)
        if grouped and siblings is not None:
            if id(siblings) not in groups:
                groups.add(id(siblings))
                layers.append((_Siblings(siblings), k))
            continue
        layers.append((m, k))
    head = getattr(model, "lm_head", None)
    if not isinstance(head, PackedLinear):
        embed = model.model.embed_tokens
        assert isinstance(embed, PackedEmbedding)
        layers.append((_AsLinear(embed), embed.weight.shape[1] * 32 // embed.bits))
    return layers


class _Siblings:
    def __init__(self, siblings: Any) -> None:
        self.s = siblings

    def __call__(self, x: Any) -> Any:
        s = self.s
        return s._ext.quantized_matvecs(x, s.weight, s.scales, s.biases, s.group_size, s.bits, s.widths)


class _AsLinear:
    def __init__(self, embed: Any) -> None:
        self.embed = embed

    def __call__(self, x: Any) -> Any:
        return self.embed.as_linear(x)


def row(name: str, ms: float, total: float, note: str = "") -> None:
    print(f"  {name:<48}{ms:>9.2f}{100 * ms / total:>7.0f}%  {note}")


def decode_profile(model: Any, batch: int, reps: int, against: Any = None, against_rev: str = "") -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    args = model.args
    # The attention the model's layers call (packed.Attention where lmspd's kernels run;
    # the layers' own module: the attention's class is decode_block.DecodeBlockAttention there).
    layer_module = sys.modules[type(model.model.layers[0].mlp).__module__]
    scaled_dot_product_attention = layer_module.scaled_dot_product_attention
    swiglu = layer_module.swiglu  # the layers' own (packed.SwiGLU where lmspd's kernels run)
    generate = sys.modules["mlx_lm.generate"]
    sampling_mx = generate.mx  # mlx-lm's sampling's (upstream/logsumexp.py's where the kernels run)
    heads, kv_heads = args.num_attention_heads, args.num_key_value_heads
    head_dim = getattr(args, "head_dim", None) or args.hidden_size // heads
    cache = make_prompt_cache(model)
    tokens = mx.random.randint(0, 1000, (batch, CONTEXT), key=mx.random.key(batch))
    mx.eval(model(tokens, cache=cache))
    mx.eval([c.state for c in cache])
    y = mx.zeros((batch,), dtype=mx.int32)

    def build() -> tuple[Any, Any]:
        logits = model(y[:, None], cache=cache)[:, -1, :]
        logprobs = logits - generate.mx.logsumexp(logits, axis=-1, keepdims=True)  # as mlx-lm's step
        return mx.argmax(logprobs, axis=-1), logprobs

    graph = primitives(list(build()))
    trim_prompt_cache(cache, 1)
    builds, evals = [], []
    for _ in range(reps + 1):
        start = time.perf_counter()
        out = build()
        built = time.perf_counter()
        mx.eval(out)
        builds.append(built - start)
        evals.append(time.perf_counter() - built)
        trim_prompt_cache(cache, 1)
    build_ms, eval_ms = statistics.median(builds[1:]) * 1e3, statistics.median(evals[1:]) * 1e3
    engine_ms = batch_generator_step_ms(model, batch, reps)

    # Each class alone: its ops at the step's shapes, as many as the step has, in one graph.
    def x(shape: tuple[int, ...], seed: int) -> Any:
        return mx.random.normal(shape, key=mx.random.key(seed))

    prods = [(layer, x((batch, 1, k), i)) for i, (layer, k) in enumerate(products(model))]
    n_products = sum(len(layer.s.widths) if isinstance(layer, _Siblings) else 1 for layer, _ in prods)
    layers = args.num_hidden_layers
    block = model.model.layers[0]
    hidden = x((batch, 1, args.hidden_size), 1)
    q = x((batch, heads, 1, head_dim), 2)
    k = x((batch, kv_heads, CONTEXT + 1, head_dim), 3)
    v = x((batch, kv_heads, CONTEXT + 1, head_dim), 4)
    gate = x((batch, 1, args.intermediate_size), 5)
    logits = x((batch, args.vocab_size), 6)
    tiny = [mx.ones((1, 1)) + i for i in range(64)]
    mx.eval(tiny)
    fns: dict[str, Fn] = {
        "matvec": lambda: [layer(xi) for layer, xi in prods],
        # On the CPU, MLX's fast norm, rope and attention are its composed fallbacks.
        "attention": lambda: [
            scaled_dot_product_attention(q, k, v, cache=None, scale=head_dim**-0.5, mask=None) for _ in range(layers)
        ],
        "norms": lambda: [block.input_layernorm(hidden) for _ in range(2 * layers + 1)],
        "rope": lambda: [block.self_attn.rope(t, offset=CONTEXT) for t in (q, k[:, :, :1]) for _ in range(layers)],
        "elementwise (swiglu, residual adds)": lambda: (
            [swiglu(gate, gate) for _ in range(layers)] + [hidden + hidden for _ in range(2 * layers)]
        ),
        "sampling": lambda: mx.argmax(logits - generate.mx.logsumexp(logits, axis=-1, keepdims=True), axis=-1),
        "compute": lambda: [t * 2 for t in tiny],
        "view": lambda: [t.reshape(1, 1, 1) for t in tiny],
    }
    t = alternating_ms(fns, reps)
    compute_us, view_us = t.pop("compute") * 1e3 / 64, t.pop("view") * 1e3 / 64
    n_prims = sum(graph.values())
    n_views = sum(graph[n] for n in VIEWS)
    fixed = (compute_us * (n_prims - n_views) + view_us * n_views) / 1e3
    print(f"\ndecode step, batch {batch}, {CONTEXT}-token context ({n_prims} primitives in the step's graph)")
    print(f"  {'':<48}{'ms':>9}{'share':>8}")
    row("step as the engine runs it (BatchGenerator)", engine_ms, engine_ms, "builds step n+1 while n runs")
    row("Python graph construction", build_ms, engine_ms)
    row("graph evaluation", eval_ms, engine_ms)
    for name, ms in t.items():
        label = f"  matvec ({n_products} packed products, {len(prods)} calls)" if name == "matvec" else f"  {name}"
        row(label, ms, engine_ms)
    row("  the rest (KV cache updates, copies, reshapes)", eval_ms - sum(t.values()), engine_ms, "eval minus above")
    note = f"{compute_us:.1f} us per op, {view_us:.1f} per view; part of the rows above"
    row(f"  MLX per-primitive cost x {n_prims}", fixed, engine_ms, note)
    print("  primitives: " + ", ".join(f"{n} {c}" for n, c in graph.most_common(14)))
    # The same step with each of mlx-lm's functions that lmspd's kernels replace (packed.py:
    # Attention, SwiGLU; upstream/decode_block.py) put back alone, then all of them,
    # alternating step by step in this process, so a neighbour's load falls on every side alike.
    # (label, put lmspd's in, put mlx-lm's back) for each function a kernel took over.
    swaps: list[tuple[str, Callable[[], None], Callable[[], None]]] = []
    for n in ("scaled_dot_product_attention", "swiglu"):
        if hasattr(f := getattr(layer_module, n), "original"):
            swaps.append((n, partial(setattr, layer_module, n, f), partial(setattr, layer_module, n, f.original)))
    attentions = [layer.self_attn for layer in model.model.layers]
    block_class = type(attentions[0])
    if hasattr(block_class, "_block_inputs"):  # decode_block.DecodeBlockAttention
        mlx_class = block_class.__mro__[1]

        def classes(kind: type) -> None:
            for a in attentions:
                a.__class__ = kind

        swaps.append(("attention layer", partial(classes, block_class), partial(classes, mlx_class)))
    blocks = list(model.model.layers)
    fused_class = type(blocks[0])
    if hasattr(fused_class, "_fusable"):  # decode_block.DecodeBlock: norms, adds, swiglu in the products
        plain_class = fused_class.__mro__[1]

        def block_classes(kind: type) -> None:
            for b in blocks:
                b.__class__ = kind

        swaps.append(("block", partial(block_classes, fused_class), partial(block_classes, plain_class)))
    if sampling_mx is not mx:
        swaps.append(("logsumexp", partial(setattr, generate, "mx", sampling_mx), partial(setattr, generate, "mx", mx)))
    if swaps:
        sides: dict[str, list[bool]] = {"lmspd's kernels": [True] * len(swaps)}
        for i, (label, _, _) in enumerate(swaps):
            sides[f"mlx-lm's {label}"] = [j != i for j in range(len(swaps))]
        sides["mlx-lm's, all"] = [False] * len(swaps)
        steps: dict[str, list[float]] = {side: [] for side in sides}
        try:
            for _ in range(2 * reps):
                for side, ours in sides.items():
                    for (_, put_ours, put_theirs), use_ours in zip(swaps, ours, strict=True):
                        (put_ours if use_ours else put_theirs)()
                    start = time.perf_counter()
                    mx.eval(build())
                    steps[side].append(time.perf_counter() - start)
                    trim_prompt_cache(cache, 1)
        finally:
            for _, put_ours, _ in swaps:
                put_ours()
        base = statistics.median(steps["lmspd's kernels"]) * 1e3
        print(
            "  the step, alternating: "
            + ", ".join(
                f"{side} {statistics.median(v) * 1e3:.2f} ms ({statistics.median(v) * 1e3 / base:.2f}x)"
                for side, v in steps.items()
            )
        )
    # The same step with every packed product on the MLX stream thread alone (split off: no
    # chunks for the helper thread), alternating with both cores: what the second core buys;
    # and, with --against, on another revision's kernels.
    holders = kernel_holders(model)
    if holders:

        def step() -> None:
            mx.eval(build())
            trim_prompt_cache(cache, 1)

        ext = getattr(*holders[0])
        both, one = alternate_kernels(holders, [ext, _OneCore(ext)], step, reps)
        print(
            f"  the step, alternating: products on both cores {both:.2f} ms, "
            f"on one core {one:.2f} ms ({one / both:.2f}x)"
        )
        if against is not None:
            now, then = alternate_kernels(holders, [ext, against], step, reps)
            print(
                f"  the step, alternating: these kernels {now:.2f} ms, {against_rev}'s {then:.2f} ms "
                f"({then / now:.2f}x this tree's time; {len(holders)} holders swapped)"
            )
    # Whose CPU a step takes: this process's threads' CPU time over steps run back to back (the
    # helper's includes its spinning between products; the main thread's is graph construction
    # and MLX's dispatch of every primitive).
    import os

    runs = 4 * reps
    before, start = thread_cpu(), time.perf_counter()
    for _ in range(runs):
        mx.eval(build())
        trim_prompt_cache(cache, 1)
    wall = (time.perf_counter() - start) / runs * 1e3
    after = thread_cpu()
    used = {tid: (cpu - before.get(tid, 0.0)) / runs * 1e3 for tid, cpu in after.items()}
    main = used.pop(os.getpid(), 0.0)  # the main thread's id is the process's
    others = ", ".join(f"{ms:.2f}" for ms in sorted(used.values(), reverse=True) if ms >= 0.05)
    print(f"  CPU a step takes (wall {wall:.2f} ms): main thread {main:.2f} ms, other threads {others} ms")


KERNEL_DIR = "service/engine/kernels"


def build_revision(rev: str, work: Path) -> Any:
    """lmspd's kernels as they were at git revision rev, built in work (uncached) and loaded:
    ``--against REV`` here and in bench.matvec times them beside this tree's in one process."""
    import subprocess

    from lmspd.engine import kernels

    repo = Path(__file__).resolve().parent.parent
    # The revision's own file names: its sources may be laid out otherwise than this tree's
    # (before bindings.cpp, the one translation unit was quantized.cpp).
    listed = subprocess.run(
        ["git", "ls-tree", "--name-only", f"{rev}:{KERNEL_DIR}"], cwd=repo, check=True, capture_output=True, text=True
    ).stdout.split()
    names = [n for n in listed if n.endswith((".cpp", ".h"))]
    for name in names:
        text = subprocess.run(
            ["git", "show", f"{rev}:{KERNEL_DIR}/{name}"], cwd=repo, check=True, capture_output=True
        ).stdout
        (work / name).write_bytes(text)
    source = kernels.SOURCE.name if kernels.SOURCE.name in names else "quantized.cpp"
    print(f"building the kernels of {rev} (~30 s) ...", flush=True)
    return kernels.load_path(kernels.build_source(work / source, work))


def kernel_holders(model: Any) -> list[tuple[Any, str]]:
    """Every (object, attribute) through which a step reaches lmspd's kernels: the packed
    layers and their stacked siblings, the attention and block layers, the functions packed.py
    put in mlx-lm's modules, mlx-lm's sampling's logsumexp."""
    from types import ModuleType

    objects: list[Any] = [m for _, m in model.named_modules()]
    objects += [getattr(m, "_siblings", None) for m in objects]
    layer_module = sys.modules[type(model.model.layers[0].mlp).__module__]
    objects += [getattr(layer_module, n, None) for n in ("scaled_dot_product_attention", "swiglu")]
    objects.append(sys.modules["mlx_lm.generate"].mx)
    seen: set[tuple[int, str]] = set()
    found = []
    for o in objects:
        for attr in ("_ext", "_kernels"):
            if isinstance(getattr(o, attr, None), ModuleType) and (id(o), attr) not in seen:
                seen.add((id(o), attr))
                found.append((o, attr))
    return found


def alternate_kernels(holders: list[tuple[Any, str]], sides: list[Any], step: Fn, reps: int) -> list[float]:
    """Each side's median ms for step, with every holder pointed at that side's kernels, the
    sides alternating step by step (the holders given back their own after)."""
    own = [getattr(o, a) for o, a in holders]
    times: list[list[float]] = [[] for _ in sides]
    try:
        for _ in range(2 * reps):
            for kernels, spent in zip(sides, times, strict=True):
                for o, a in holders:
                    setattr(o, a, kernels)
                start = time.perf_counter()
                step()
                spent.append(time.perf_counter() - start)
    finally:
        for (o, a), kernels in zip(holders, own, strict=True):
            setattr(o, a, kernels)
    return [statistics.median(t) * 1e3 for t in times]


def thread_cpu(pid: int | str = "self") -> dict[int, float]:
    """CPU seconds (user + system) of each thread of a process, this one by default (Linux /proc)."""
    import os

    tick = os.sysconf("SC_CLK_TCK")
    out: dict[int, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick
    return out


class _OneCore:
    """lmspd's kernels with every product's columns on the calling thread (split=False)."""

    def __init__(self, ext: Any) -> None:
        self._ext = ext

    def quantized_matvec(self, *args: Any, **kwargs: Any) -> Any:
        return self._ext.quantized_matvec(*args, split=False, **kwargs)

    def quantized_matvecs(self, *args: Any, **kwargs: Any) -> Any:
        return self._ext.quantized_matvecs(*args, split=False, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ext, name)


class _Counting:
    """A model whose forward passes are counted (BatchGenerator calls it like the model)."""

    def __init__(self, model: Any) -> None:
        self.model, self.calls = model, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.model(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


def batch_generator_step_ms(model: Any, batch: int, reps: int) -> float:
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, completion_batch_size=batch, prefill_batch_size=batch, prefill_step_size=CHUNK)
    gen.insert([[(7 * i + j) % 900 + 3 for j in range(CONTEXT)] for i in range(batch)], max_tokens=[reps + 8] * batch)
    while not gen.next()[1]:
        pass  # prefill
    gen.next()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        gen.next()
        times.append(time.perf_counter() - start)
    gen.close()
    return statistics.median(times) * 1e3


def host_profile(model_dir: Path, batch: int, reps: int) -> None:
    from lmspd.engine import protocol as p
    from lmspd.models.tokenizer import IncrementalDetokenizer, Tokenizer

    tok = Tokenizer(model_dir)
    ids = tok.encode(TEXT * 4)[:128]
    detok = IncrementalDetokenizer(tok, [])
    start = time.perf_counter()
    for t in ids:
        detok.add(t)
    detok_ms = (time.perf_counter() - start) * 1e3 / len(ids)
    a, b = Pipe()
    deltas = p.Deltas([p.Delta(f"req-{i}", [ids[i]], "word", None) for i in range(batch)])
    start = time.perf_counter()
    for _ in range(reps * 10):
        a.send_bytes(p.reply_encoder.encode(deltas))
        p.reply_decoder.decode(b.recv_bytes())
    ipc_ms = (time.perf_counter() - start) * 1e3 / (reps * 10)
    print(
        f"  detokenizing, per token {detok_ms:.3f} ms (x{batch}: {detok_ms * batch:.2f}); "
        f"one step's reply over a pipe, encoded and decoded: {ipc_ms:.3f} ms"
    )


def prefill_profile(model: Any, tokens: int, reps: int) -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    prompt = mx.array([(7 * j) % 900 + 3 for j in range(tokens)])
    # The attention the model's layers call (packed.Attention where lmspd's kernels run), and
    # mlx-lm's own, to put back for the in-process A/B below.
    layer_module: Any = sys.modules[type(model.model.layers[0].mlp).__module__]
    scaled_dot_product_attention = layer_module.scaled_dot_product_attention
    upstream = getattr(scaled_dot_product_attention, "original", scaled_dot_product_attention)

    def prefill() -> Any:
        cache = make_prompt_cache(model)
        for s in range(0, tokens - 1, CHUNK):
            model(prompt[None, s : min(s + CHUNK, tokens - 1)], cache=cache)
            mx.eval([c.state for c in cache])
        out = model(prompt[None, -1:], cache=cache)
        mx.eval(out)
        return out

    def prefill_upstream() -> Any:
        layer_module.scaled_dot_product_attention = upstream
        try:
            return prefill()
        finally:
            layer_module.scaled_dot_product_attention = scaled_dot_product_attention

    reps = max(3, reps // 5)
    ab = alternating_ms({"ours": prefill, "upstream": prefill_upstream}, reps)
    total = ab["ours"]
    chunks = [min(CHUNK, tokens - 1 - s) for s in range(0, tokens - 1, CHUNK)]
    layers = [(m, k) for m, k in products(model, grouped=False)[:-1]]  # the head: the last token only
    dense = [m._ext.dequantize(m.weight, m.scales, m.biases, m.group_size, m.bits) for m, _ in layers]
    xs = {n: [mx.random.normal((n, k)) for _, k in layers] for n in set(chunks)}
    mx.eval(dense, xs)
    fns: dict[str, Fn] = {
        "dequantize": lambda: [
            m._ext.dequantize(m.weight, m.scales, m.biases, m.group_size, m.bits) for m, _ in layers
        ],
    }
    for n in set(chunks):
        fns[f"blas{n}"] = lambda n=n: [xi @ w.T for xi, w in zip(xs[n], dense, strict=True)]  # type: ignore[misc]
    a = model.args
    heads, kv_heads = a.num_attention_heads, a.num_key_value_heads
    head_dim = getattr(a, "head_dim", None) or a.hidden_size // heads
    for i, n in enumerate(chunks):  # each chunk's queries against every key so far, causal
        keys = sum(chunks[: i + 1])
        q = mx.random.normal((1, heads, n, head_dim))
        kv = mx.random.normal((1, kv_heads, keys, head_dim))
        mx.eval(q, kv)
        fns[f"attention{i}"] = lambda q=q, kv=kv: [  # type: ignore[misc]
            scaled_dot_product_attention(q, kv, kv, None, head_dim**-0.5, "causal") for _ in range(a.num_hidden_layers)
        ]
    t = alternating_ms(fns, reps)
    deq = t["dequantize"] * len(chunks)
    blas = sum(t[f"blas{n}"] for n in chunks)
    attention = sum(t[f"attention{i}"] for i in range(len(chunks)))
    print(f"\nprefill, {tokens} tokens in {len(chunks)} chunks: {total:.0f} ms, {1e3 * tokens / total:.0f} tok/s")
    row("dequantize to float32 (once per chunk)", deq, total)
    row("BLAS matmuls", blas, total)
    row("attention (the layers' own: matmuls, mask, softmax)", attention, total)
    row("norms, rope, elementwise, copies", total - deq - blas - attention, total, "total minus the above")
    if upstream is not scaled_dot_product_attention:
        up = ab["upstream"]
        print(
            f"  the same prefill, alternating, with mlx-lm's attention put back: {up:.0f} ms, "
            f"{1e3 * tokens / up:.0f} tok/s ({up / total:.2f}x lmspd's)"
        )


def short_prompt_profile(model: Any, reps: int) -> None:
    """A short new prompt after a cached one (a chat's next message): the whole forward pass of
    n new rows after 100 cached tokens, through the matvec kernel and through dequantize +
    BLAS, alternating (packed.KERNEL_ROWS: where the layers switch from one to the other)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from lmspd.engine import packed

    layers = [m for m in model.modules() if isinstance(m, packed.PackedLinear) and m._kernel_rows == packed.KERNEL_ROWS]
    cached = make_prompt_cache(model)
    mx.eval(model(mx.array([[(5 * j) % 900 + 3 for j in range(100)]]), cache=cached))

    def forward(rows: int, kernel_rows: int) -> Any:
        for m in layers:
            m._kernel_rows = kernel_rows
        try:
            cache = make_prompt_cache(model)
            for c, h in zip(cache, cached, strict=True):
                c.keys, c.values, c.offset = h.keys[..., :100, :] + 0, h.values[..., :100, :] + 0, 100
            out = model(mx.array([[(7 * j) % 900 + 3 for j in range(rows)]]), cache=cache)
            return [c.state for c in cache] + [out[:, -1]]
        finally:
            for m in layers:
                m._kernel_rows = packed.KERNEL_ROWS

    print(
        f"\nshort prompts after 100 cached tokens, the whole forward pass (the matvec up to {packed.KERNEL_ROWS} rows)"
    )
    for rows in (9, 16, 24, 32, 40, 48):
        t = alternating_ms({"kernel": partial(forward, rows, 1 << 20), "dense": partial(forward, rows, 0)}, reps)
        print(
            f"  {rows} rows: matvec kernel {t['kernel']:.1f} ms, dequantize + BLAS {t['dense']:.1f} ms "
            f"({t['dense'] / t['kernel']:.2f}x)"
        )


def cached_first_token(model: Any, reps: int, tokens: int = 40) -> None:
    """The first token of a cached prompt, with mlx-lm's own decode steps and with lmspd's
    (engine/upstream/stepping.py), alternating."""
    import importlib

    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from lmspd.engine.prompt_cache import PromptCache
    from lmspd.engine.upstream import batch_cache
    from lmspd.engine.upstream.stepping import StepNow

    generate: Any = importlib.import_module("mlx_lm.generate")
    upstream = generate.GenerationBatch
    prompt = [(7 * j) % 900 + 3 for j in range(tokens)]
    cache = make_prompt_cache(model)
    for at in range(0, tokens, CHUNK):  # prefilled in chunks, as the engine does
        mx.eval(model(mx.array(prompt[at : at + CHUNK])[None], cache=cache), [c.state for c in cache])
    pc = PromptCache(1 << 30)
    pc.store(("m", ""), prompt, cache)
    counting = _Counting(model)
    # (GenerationBatch, the batch's cache merged with room: upstream/batch_cache.py)
    kinds = {
        "mlx-lm's steps": (upstream, False),
        "lmspd's steps (StepNow)": (StepNow, False),
        "StepNow, the batch's cache merged with room": (StepNow, True),
    }
    fetches: list[float] = []
    firsts: dict[str, list[float]] = {k: [] for k in kinds}
    calls: dict[str, list[int]] = {k: [] for k in kinds}
    try:
        for _ in range(reps):
            for name, (batch_class, room) in kinds.items():
                generate.GenerationBatch = batch_class
                (batch_cache.install if room else batch_cache.uninstall)()
                start = time.perf_counter()
                hit = pc.fetch(("m", ""), prompt)
                mx.eval([c.state for c in hit.cache or []])
                fetched = time.perf_counter()
                gen = generate.BatchGenerator(
                    counting, completion_batch_size=8, prefill_batch_size=8, prefill_step_size=CHUNK
                )
                counting.calls = 0
                gen.insert(
                    [prompt[hit.cached :]], max_tokens=[4], caches=[hit.cache], all_tokens=[prompt[: hit.cached]]
                )
                while not gen.next()[1]:
                    pass
                firsts[name].append(time.perf_counter() - fetched)
                fetches.append(fetched - start)
                calls[name].append(counting.calls)
                gen.close()
    finally:
        generate.GenerationBatch = upstream
        batch_cache.uninstall()
    f = statistics.median(fetches) * 1e3
    print(f"\ncached-prompt first token ({tokens}-token prompt, {hit.cached} cached), prompt cache fetch {f:.2f} ms")
    for name in kinds:
        g = statistics.median(firsts[name]) * 1e3
        print(f"  {name}: {f + g:.1f} ms, {statistics.median(calls[name]):.0f} forward passes to the first token")


def default_model_dir() -> Path:
    """The configured default model's directory (the bundled SmolLM2 unless configured)."""
    from lmspd.config import load_config
    from lmspd.models.registry import ModelRegistry

    config = load_config()
    return Path(ModelRegistry(config).resolve(config.default_model).path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--weight-dtype", default="quantized_float32")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--skip-prefill", action="store_true")
    parser.add_argument("--skip-decode", action="store_true", help="the prefill rows alone")
    parser.add_argument("--against", metavar="REV", default="", help="a git revision's kernels, alternated")
    args = parser.parse_args()

    from lmspd.engine.upstream.blas import load as load_blas

    blas = load_blas("auto")  # before MLX, as the engine does
    import mlx.core as mx
    from mlx_lm.utils import load_model

    from lmspd.engine.loaded import bound_buffer_cache
    from lmspd.engine.weights import apply_weight_dtype

    model_dir = args.model_dir or default_model_dir()
    model, _ = load_model(Path(model_dir))
    dtype = apply_weight_dtype(model, args.weight_dtype)
    bound_buffer_cache()
    mx.eval(model.parameters())
    print(f"model {model_dir} | weights {dtype} | MLX {getattr(mx, '__version__', '?')} | BLAS {blas or 'bundled'}")
    against = None
    if args.against:
        work = tempfile.TemporaryDirectory(prefix="lmspd-kernels-")  # removed at exit
        against = build_revision(args.against, Path(work.name))
    for batch in () if args.skip_decode else (1, 8):
        decode_profile(model, batch, args.reps, against, args.against)
        host_profile(Path(model_dir), batch, args.reps)
    if not args.skip_prefill:
        short_prompt_profile(model, args.reps)
        for tokens in (512, 2000):
            prefill_profile(model, tokens, args.reps)
    if not args.skip_decode:
        for tokens in (40, 2000):
            cached_first_token(model, args.reps, tokens)


if __name__ == "__main__":
    main()
