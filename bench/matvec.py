"""lmspd's matvec kernel per layer shape, against the memory-bandwidth bound of what it reads.

    python -m bench.matvec [--model-dir DIR] [--rounds 7] [--rows 1 8] [--against REV] [--numerics fast]

For each distinct packed product of the model (shape, bits, group; the output head too), enough
copies of its real weights that one pass over them streams from memory rather than the caches
(64 MiB, twice a typical L3), timed per product at 1 and 8 rows of x, the portable kernel
(``simd=False``: GCC/Clang vector extensions) and the SIMD one (``simd=True``: AVX2 or NEON),
in alternating rounds. The bound is the bytes one product reads (packed weights, scales,
biases, x) at the machine's read bandwidth, measured here on both cores
(``read_seconds``); ``bound/simd`` is the share of that speed the kernel reaches. Per step: each
shape times its count in one forward pass. ``hot`` is the SIMD kernel on one copy again and
again, its weights in the caches: where it is as slow as the streamed pass, the kernel is bound by
its arithmetic (its bit-for-bit order), not by memory.

``--against REV`` builds the kernels' sources as they were at git revision REV (uncached, in a
temporary directory) and adds their SIMD kernel as one more side of the alternating rounds: a
kernel change's speed-up measured in one process, on the same weights, in the same minute.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any

STREAM_BYTES = 64 << 20


def bandwidth(ext: Any) -> float:
    import mlx.core as mx

    a = mx.zeros((256 << 20) // 4, dtype=mx.uint32)
    mx.eval(a)
    return float(a.nbytes / min(ext.read_seconds(a) for _ in range(7)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--against", metavar="REV", default="", help="a git revision's kernels, alternated")
    parser.add_argument("--numerics", choices=["exact", "fast"], default="exact", help="the products' (numerics.md)")
    args = parser.parse_args()
    from lmspd.engine.upstream.blas import load as load_blas

    load_blas("auto")  # before MLX is imported, as the engine does
    if args.against:
        import tempfile

        from bench.step_profile import build_revision

        with tempfile.TemporaryDirectory(prefix="lmspd-kernels-") as tmp:
            run(args, build_revision(args.against, Path(tmp)))
    else:
        run(args, None)


def run(args: argparse.Namespace, other: Any) -> None:
    import mlx.core as mx
    from mlx_lm.utils import load_model

    from bench.step_profile import default_model_dir, products
    from lmspd.engine import kernels
    from lmspd.engine.weights import apply_weight_dtype

    ext = kernels.load()
    for kernel in (ext, other):
        if kernel is not None:
            kernel.set_numerics(args.numerics)
    model_dir = args.model_dir or default_model_dir()
    model, _ = load_model(Path(model_dir))
    apply_weight_dtype(model, "quantized_float32")
    layers: dict[tuple[int, int, int, int], Any] = {}
    count: Counter[tuple[int, int, int, int]] = Counter()
    for layer, k in products(model, grouped=False):
        m = getattr(layer, "embed", layer)
        key = (m.weight.shape[0], k, m.bits, m.group_size)
        layers.setdefault(key, m)
        count[key] += 1
    bw = bandwidth(ext)
    print(f"model {model_dir} | kernel {ext.simd()} | read bandwidth, both cores: {bw / 1e9:.1f} GB/s")
    against = f"{args.against[:10]} ms" if other is not None else ""
    print(
        f"\n{'layer (out x in, bits/group)':<30}{'rows':>5}{'MB':>7}{'portable ms':>13}{'simd ms':>9}"
        f"{'speed-up':>9}{'bound ms':>9}{'bound/simd':>11}{'hot ms':>8}{'x/step':>7}"
        + (f"{against:>15}{'it/simd':>9}" if other is not None else "")
    )
    totals: dict[int, list[float]] = {r: [0.0, 0.0, 0.0, 0.0, 0.0] for r in args.rows}
    for key, m in sorted(layers.items()):
        n, k, bits, group = key
        nbytes = m.weight.nbytes + m.scales.nbytes + m.biases.nbytes
        copies = max(2, -(-STREAM_BYTES // nbytes))
        ws = [(m.weight + 0, m.scales + 0, m.biases + 0) for _ in range(copies)]  # distinct buffers
        mx.eval(ws)
        for rows in args.rows:
            x = mx.random.normal((rows, k), key=mx.random.key(rows))
            mx.eval(x)
            sides = ["portable", "simd", "hot"] + (["against"] if other is not None else [])
            times: dict[str, list[float]] = {side: [] for side in sides}
            for r in range(args.rounds + 1):
                for side in times:
                    # hot: the SIMD kernel on one copy again and again, its weights in the caches
                    sources = [ws[0]] * copies if side == "hot" else ws
                    kernel = other if side == "against" else ext
                    start = time.perf_counter()
                    mx.eval(
                        [
                            kernel.quantized_matvec(x, w, s, b, group, bits, True, side != "portable")
                            for w, s, b in sources
                        ]
                    )
                    if r:  # the first round warms up
                        times[side].append((time.perf_counter() - start) / copies)
            port, simd_t, hot, before = (
                statistics.median(times[s]) * 1e3 if s in times else 0.0 for s in ("portable", "simd", "hot", "against")
            )
            bound = (nbytes + x.nbytes) / bw * 1e3
            label = f"{n} x {k}, {bits}/{group}"
            print(
                f"{label:<30}{rows:>5}{nbytes / 1e6:>7.2f}{port:>13.3f}{simd_t:>9.3f}{port / simd_t:>8.2f}x"
                f"{bound:>9.3f}{bound / simd_t:>10.2f}{hot:>9.3f}{count[key]:>7}"
                + (f"{before:>15.3f}{before / simd_t:>8.2f}x" if other is not None else "")
            )
            for i, v in enumerate((port, simd_t, bound, hot, before)):
                totals[rows][i] += v * count[key]
    for rows, (port, simd_t, bound, hot, before) in totals.items():
        print(
            f"one step's {sum(count.values())} products at {rows} row(s): portable {port:.2f} ms, simd "
            f"{simd_t:.2f} ms ({port / simd_t:.2f}x), bound {bound:.2f} ms (simd at {bound / simd_t:.2f} of it), "
            f"hot {hot:.2f} ms (streamed / hot {simd_t / hot:.2f}: near 1, the arithmetic bounds it, not memory)"
            + (f"; {args.against}'s simd {before:.2f} ms ({before / simd_t:.2f}x this one's time)" if other else "")
        )


if __name__ == "__main__":
    main()
