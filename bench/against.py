"""Time to first token of this checkout against another git revision, side by side.

    python -m bench.ttft_against REV [--rounds 20] [--model-dir DIR]

Starts ``lmspd serve`` from this checkout and from REV (a ``git worktree`` in a temporary
folder, imported ahead of this checkout's package), both on the bundled model (or
``--model-dir``) with their default config, and alternates between them, round by round, the
rows bench.peers measures against llama-server: a repeated prompt (sent once, then timed when
sent again) and a distinct one (new each round). Each row prints both medians and the median
of the rounds' ratios (REV's over this checkout's), so the machine's drift between rounds
cancels. Both servers stay up, each idle while the other answers.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.peers import stream
from bench.serving import free_port, kill, spawn
from bench.step_profile import default_model_dir

ROOT = Path(__file__).resolve().parent.parent


def worktree(rev: str, where: Path) -> Path:
    """REV checked out under ``where``, with an import root whose ``lmspd`` is its package."""
    tree = where / "tree"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), rev], check=True)
    root = where / "import"
    root.mkdir()
    (root / "lmspd").symlink_to(tree / "service")
    return root


def serve(work: Path, model_dir: Path, pythonpath: str | None) -> tuple[subprocess.Popen[bytes], int]:
    work.mkdir()
    (work / "lmspd.toml").write_text(f'[models.bench]\npath = "{model_dir}"\n[server]\ndata_dir = "{work}"\n')
    port = free_port()
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    cmd = [sys.executable, "-m", "lmspd.cli", "serve", "--config", str(work / "lmspd.toml")]
    cmd += ["--port", str(port), "--model", "bench"]
    return spawn(cmd, f"http://127.0.0.1:{port}/readyz", work / "server.log", env=env), port


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rev")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--model-dir", type=Path, default=None)
    args = parser.parse_args()
    model_dir = (args.model_dir or default_model_dir()).resolve()
    rows: dict[str, dict[str, list[float]]] = {"repeated": {}, "distinct": {}}
    cached: dict[str, tuple[int, int]] = {}
    with tempfile.TemporaryDirectory(prefix="lmspd-ttft-against-") as tmp:
        work = Path(tmp)
        procs = []
        try:
            root = worktree(args.rev, work)
            sides = {"this checkout": serve(work / "this", model_dir, None)}
            procs.append(sides["this checkout"][0])
            sides[args.rev] = serve(work / "rev", model_dir, str(root))
            procs.append(sides[args.rev][0])
            for _, port in sides.values():
                stream(port, "bench", "Warm up.", 4)
            for k in range(args.rounds):
                order = list(sides.items()) if k % 2 == 0 else list(sides.items())[::-1]
                for name, (_, port) in order:
                    repeated = f"Tell me one fact about rivers (round {k})."
                    stream(port, "bench", repeated, 8)
                    usage: dict[str, int] = {}
                    rows["repeated"].setdefault(name, []).append(stream(port, "bench", repeated, 8, usage=usage)[0])
                    cached[name] = (usage.get("cached_tokens", 0), usage.get("prompt_tokens", 0))
                    distinct = f"Tell me one fact about lakes (round {k})."
                    rows["distinct"].setdefault(name, []).append(stream(port, "bench", distinct, 8)[0])
        finally:
            for proc in procs:
                kill(proc)
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(work / "tree")], check=False)
    print(f"\ntime to first token, {args.rounds} rounds alternating, {os.cpu_count()} CPUs")
    for name, (hit, prompt) in cached.items():
        print(f"{name}: the repeated prompt's last time, {hit} of {prompt} prompt tokens cached")
    print(f"| prompt | this checkout, median | {args.rev}, median | {args.rev} / this checkout, median of rounds |")
    print("|---|---|---|---|")
    for row, by in rows.items():
        ours, theirs = by["this checkout"], by[args.rev]
        ratio = statistics.median(t / o for o, t in zip(ours, theirs, strict=True))
        print(
            f"| {row} | {statistics.median(ours) * 1e3:.1f} ms | {statistics.median(theirs) * 1e3:.1f} ms "
            f"| {ratio:.2f}× |"
        )


if __name__ == "__main__":
    main()
