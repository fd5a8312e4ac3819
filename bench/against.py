"""This checkout's server against another git revision's, side by side: bench.peers' rows.

    python -m bench.against REV [--rounds 10] [--model-dir DIR]

Starts ``lmspd serve`` from this checkout and from REV (a ``git worktree`` in a temporary
folder, imported ahead of this checkout's package), both on the bundled model (or
``--model-dir``) with their default config, and alternates between them, round by round, the
rows bench.peers measures against llama-server but the long prompt's (``bench.peers.measure``):
the first token of a repeated and of a distinct prompt, one stream's decode, and 4 and 8
streams at once. Each row prints both medians and the median of the rounds' ratios (this
checkout's over REV's, the better one above 1), so the machine's drift between rounds cancels.
Both servers stay up, each idle while the other answers. A last line per side says how many of
a repeated prompt's tokens came from the prompt cache.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

from bench.peers import LOWER_BETTER, ROWS, measure, stream
from bench.step_profile import default_model_dir
from harness.server import kill, serve

ROOT = Path(__file__).resolve().parent.parent


def worktree(rev: str, where: Path) -> Path:
    """REV checked out under ``where``, with an import root whose ``lmspd`` is its package."""
    tree = where / "tree"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), rev], check=True)
    root = where / "import"
    root.mkdir()
    (root / "lmspd").symlink_to(tree / "service")
    return root


def serve_from(work: Path, model_dir: Path, pythonpath: str | None) -> tuple[subprocess.Popen[bytes], int]:
    """``lmspd serve`` on the model, its package imported from ``pythonpath`` (None: this
    checkout's): the process and its port."""
    work.mkdir()
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    config = f'[models.bench]\npath = "{model_dir}"\n[server]\ndata_dir = "{work}"\n'
    proc, url = serve(work, config, env=env)
    return proc, int(url.rsplit(":", 1)[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rev")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--model-dir", type=Path, default=None)
    args = parser.parse_args()
    model_dir = (args.model_dir or default_model_dir()).resolve()
    this = "this checkout"
    runs: dict[str, list[dict[str, float]]] = {this: [], args.rev: []}
    cached: dict[str, tuple[int, int]] = {}
    with tempfile.TemporaryDirectory(prefix="lmspd-against-") as tmp:
        work = Path(tmp)
        procs = []
        try:
            root = worktree(args.rev, work)
            sides = {this: serve_from(work / "this", model_dir, None)}
            procs.append(sides[this][0])
            sides[args.rev] = serve_from(work / "rev", model_dir, str(root))
            procs.append(sides[args.rev][0])
            for _, port in sides.values():
                stream(port, "bench", "Warm up.", 4)
            for k in range(args.rounds):
                order = list(sides.items()) if k % 2 == 0 else list(sides.items())[::-1]
                for name, (_, port) in order:
                    runs[name].append(measure(port, "bench", k, ""))
                print(f"round {k + 1}: " + ", ".join(f"{n} {r[-1]['decode']:.1f} tok/s" for n, r in runs.items()))
            for name, (_, port) in sides.items():
                usage: dict[str, int] = {}
                stream(port, "bench", "Once more, please.", 2)
                stream(port, "bench", "Once more, please.", 2, usage=usage)
                cached[name] = (usage.get("cached_tokens", 0), usage.get("prompt_tokens", 0))
        finally:
            for proc in procs:
                kill(proc)
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(work / "tree")], check=False)
    print(f"\n{args.rounds} rounds alternating, {os.cpu_count()} CPUs")
    print(f"| | {this}, median | {args.rev}, median | {this} ahead by, median of rounds |")
    print("|---|---|---|---|")
    for label, key, ahead in ROWS:
        ours = [r[key] for r in runs[this] if key in r]
        theirs = [r[key] for r in runs[args.rev] if key in r]
        if not ours or not theirs:
            continue
        ratio = statistics.median(ahead(o, t) for o, t in zip(ours, theirs, strict=True))
        unit = " s" if key in LOWER_BETTER else ""
        medians = f"{statistics.median(ours):.3f}{unit} | {statistics.median(theirs):.3f}{unit}"
        print(f"| {label} | {medians} | {ratio:.3f}× |")
    for name, (hit, prompt) in cached.items():
        print(f"{name}: a repeated prompt, {hit} of its {prompt} tokens from the prompt cache")


if __name__ == "__main__":
    main()
