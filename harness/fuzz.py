"""Fuzzing from the OpenAPI document: schemathesis against real ``lmspd serve`` processes.

    python -m harness.fuzz [--cases 1000] [--seed N] [--coverage]

Two servers on loopback, each on a tiny random-weight model (generation costs milliseconds):
one open (no tokens), one with tokens. Schemathesis reads each server's own ``/openapi.json``
and tests every operation, both surfaces (/v1 and its aliases, /lmsp/v1), in rounds of four
runs: the open server; the tokened one with a valid token; without a token; with a wrong one.
Rounds repeat with the next seed until ``--cases`` test cases have been sent. ``--coverage``
adds schemathesis' coverage phase (boundary values of every field, ~3,800 cases per run) to
the first round's runs with a valid token or none needed.

Invariants checked on every response: no 5xx; every error body is OpenAI's envelope on /v1
and a problem object on /lmsp/v1 (``harness.fuzz_checks``); status, content type and body as
the document says (SSE events included); without a valid token, only 401s. Prints a table;
exits non-zero on any failure.

Then the hand-written attacks (``harness.fuzz_attacks``: item references, forged seals, ``type``
fields that are no string, where schemathesis' bodies do not reach), each sent once to every
documented route that reads it, on both servers; a refusal must name the field it names.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from harness import fuzz_attacks
from harness.server import free_port, kill, spawn

ROOT = Path(__file__).resolve().parent.parent
CHECKS = (
    "not_a_server_error,status_code_conformance,content_type_conformance,"
    "response_schema_conformance,error_shape,auth_enforced"
)
TOKENS = {"alice": "fuzz-token-alice", "bob": "fuzz-token-bob"}


def bearer(owner: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKENS[owner]}"}


@dataclass
class Tally:
    cases: int = 0
    statuses: collections.Counter[int] = field(default_factory=collections.Counter)
    routes: set[str] = field(default_factory=set)
    failures: int = 0
    errors: int = 0  # requests that got no answer
    tool_errors: list[str] = field(default_factory=list)  # schemathesis' own crashes, not lmspd's

    def add(self, other: Tally) -> None:
        self.cases += other.cases
        self.statuses += other.statuses
        self.routes |= other.routes
        self.failures += other.failures
        self.errors += other.errors
        self.tool_errors += other.tool_errors


def tiny_model(dest: Path) -> Path:
    """The tests' tiny random-weight model (harness/models.py), with the bundled tokenizer."""
    from harness.models import CACHE, SMOL, make_tiny_model
    from lmspd.models.pull import pull_builtin

    smol = pull_builtin(SMOL, CACHE / "models")  # instant once the test suite has pulled it
    return make_tiny_model(dest, smol)


def config(data: Path, model: Path, tokens: dict[str, str]) -> Path:
    path = data / "lmspd.toml"
    token_lines = "".join(f'{name} = "{token}"\n' for name, token in tokens.items())
    path.write_text(
        'default_model = "tiny"\n'
        "[engine]\n"
        'weight_dtype = "quantized"\n'
        "prompt_cache_disk_max_bytes = 0\n"
        "[server]\n"
        f'data_dir = "{data}"\n'
        "default_max_output_tokens = 16\n"
        # Not what is tested: keep the many tasks the fuzzer creates from filling the queue.
        "max_queued_tasks = 100000\n"
        "[responses]\n"
        "background_max_jobs = 100000\n"
        "[models.tiny]\n"
        f'path = "{model}"\n' + (f"[server.tokens]\n{token_lines}" if tokens else "")
    )
    return path


def parse_report(path: Path) -> Tally:
    tally = Tally()
    with path.open() as lines:
        for line in lines:
            event = json.loads(line)
            for kind in ("NonFatalError", "FatalError"):
                if crash := event.get(kind):
                    value = crash.get("value", {})
                    where = crash.get("label") or crash.get("phase") or "?"
                    tally.tool_errors.append(f"{where}: {value.get('type')}: {value.get('message')}")
            finished = event.get("ScenarioFinished")
            if finished is None:
                continue
            recorder = finished["recorder"]
            cases = recorder.get("cases") or {}
            for case_id, interaction in (recorder.get("interactions") or {}).items():
                tally.cases += 1
                response = interaction.get("response")
                if response is None:
                    tally.errors += 1  # no answer at all (a timeout, a dropped connection)
                    continue
                tally.statuses[response["status_code"]] += 1
                case = cases[case_id]["value"]
                tally.routes.add(f"{case['method'].upper()} {case['path']}")
            for checks in (recorder.get("checks") or {}).values():
                tally.failures += sum(1 for check in checks if check["status"] == "failure")
    return tally


def run(
    name: str, url: str, out: Path, *, seed: int, examples: int, phases: str, header: str | None, unauthorized: bool
) -> Tally:
    """One schemathesis run; its ndjson report counted, its text output kept in ``out``."""
    report = out / f"{name}-{seed}"
    cmd = [
        str(Path(sys.executable).parent / "st"),
        "run",
        f"{url}/openapi.json",
        f"--checks={CHECKS}",
        f"--phases={phases}",
        f"--max-examples={examples}",
        f"--seed={seed}",
        "--workers=2",
        "--request-timeout=60",
        "--no-shrink",
        "--suppress-health-check=all",
        "--warnings=off",
        "--report=ndjson",
        f"--report-dir={report}",
    ]
    if header is not None:
        cmd.append(f"--header={header}")
    env = os.environ | {
        "SCHEMATHESIS_HOOKS": str(Path(__file__).with_name("fuzz_checks.py")),
        "LMSPD_FUZZ_EXPECT": "401" if unauthorized else "",
    }
    log = out / f"{name}-{seed}.txt"
    with log.open("wb") as sink:
        code = subprocess.run(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=out, check=False).returncode
    tally = parse_report(next(report.glob("*.ndjson")))
    if code != 0 and not tally.failures and not tally.tool_errors:
        tally.failures += 1  # schemathesis stopped for a reason its report does not say
    if code != 0:
        print(f"--- {name} (seed {seed}) failed; schemathesis said:\n{log.read_text()[-6000:]}", flush=True)
    return tally


def stored_item(client: httpx.Client, header: dict[str, str]) -> str:
    """The id of an item of a new stored response of the header's owner (one to reference)."""
    r = client.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 4}, headers=header)
    r.raise_for_status()
    return str(r.json()["output"][-1]["id"])


def attack(url: str, owner: dict[str, str], other: dict[str, str] | None, posts: set[str]) -> Tally:
    """The hand-written attacks on one server, as ``owner`` (``other``: another owner there)."""
    tally = Tally()
    with httpx.Client(base_url=url, timeout=60) as client:
        own = stored_item(client, owner)
        others = stored_item(client, other) if other is not None else None
        for case in fuzz_attacks.attacks(posts, own, others):
            try:
                response = client.post(case.path, json=case.body, headers=owner)
            except httpx.TransportError as exc:
                tally.errors += 1
                print(f"attack {case.name} on POST {case.path}: no answer ({exc!r})", flush=True)
                continue
            tally.cases += 1
            tally.statuses[response.status_code] += 1
            tally.routes.add(f"POST {case.path}")
            if (wrong := fuzz_attacks.fault(case, response)) is not None:
                tally.failures += 1
                print(f"attack {wrong}", flush=True)
    return tally


def table(rows: list[tuple[str, Tally]], documented: set[str]) -> str:
    statuses = sorted({s for _, t in rows for s in t.statuses})
    head = ["run", "cases", "routes", *map(str, statuses), "5xx", "failed"]
    lines = [head]
    for name, t in rows:
        fives = sum(n for s, n in t.statuses.items() if s >= 500) + t.errors
        counts = [str(t.statuses[s]) for s in statuses]
        reached = f"{len(t.routes & documented)}/{len(documented)}"
        lines.append([name, str(t.cases), reached, *counts, str(fives), str(t.failures)])
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    return "\n".join("  ".join([row[0].ljust(widths[0]), *map(str.rjust, row[1:], widths[1:])]) for row in lines)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", type=int, default=1000, help="test cases to send, all runs together")
    parser.add_argument("--seed", type=int, default=None, help="first round's seed (default: random)")
    parser.add_argument("--coverage", action="store_true", help="add the coverage phase to the first round")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs, reports)")
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "big")
    work = Path(tempfile.mkdtemp(prefix="lmspd-fuzz-"))
    servers: list[subprocess.Popen[bytes]] = []
    started = time.monotonic()
    try:
        model = tiny_model(work / "tiny")
        urls = {}
        for name, tokens in (("open", {}), ("tokens", TOKENS)):
            data = work / name
            data.mkdir()
            port = free_port()
            cmd = [sys.executable, "-m", "lmspd.cli", "serve", "--config", str(config(data, model, tokens))]
            servers.append(spawn([*cmd, "--port", str(port)], f"http://127.0.0.1:{port}/healthz", data / "server.log"))
            urls[name] = f"http://127.0.0.1:{port}"
        paths = httpx.get(f"{urls['open']}/openapi.json").json()["paths"]
        documented = {f"{method.upper()} {path}" for path, ops in paths.items() for method in ops}
        documented.discard("GET /openapi.json")  # schemathesis reads it, and tests the others
        rows: dict[str, Tally] = {}
        total = Tally()
        round_ = 0
        # Hypothesis' examples per operation: a round of ~70 per unit of ``examples`` (fuzzing
        # ~20 operations with bodies twice over, the stateful phase, the unauthorized runs).
        examples = max(3, min(25, args.cases // 60 + 1))
        while total.cases < args.cases:
            phases = "coverage,fuzzing,stateful" if args.coverage and round_ == 0 else "fuzzing,stateful"
            few = max(2, examples // 5)  # without a valid token every answer is the same 401
            plan = [
                ("open", urls["open"], None, examples, False),
                ("token", urls["tokens"], f"Authorization: Bearer {TOKENS['alice']}", examples, False),
                ("no token", urls["tokens"], None, few, True),
                ("wrong token", urls["tokens"], "Authorization: Bearer fuzz-token-mallory", few, True),
            ]
            for name, url, header, n, unauthorized in plan:
                tally = run(
                    name.replace(" ", "-"),
                    url,
                    work,
                    seed=seed + round_,
                    examples=n,
                    phases="fuzzing,stateful" if unauthorized else phases,  # every boundary value is a 401 there
                    header=header,
                    unauthorized=unauthorized,
                )
                rows.setdefault(name, Tally()).add(tally)
                total.add(tally)
            round_ += 1
        posts = {path for path, ops in paths.items() if "post" in ops and "{" not in path}
        for name, url, owner, other in (
            ("attacks open", urls["open"], {}, None),
            ("attacks token", urls["tokens"], bearer("alice"), bearer("bob")),
        ):
            tally = attack(url, owner, other, posts)
            rows[name] = tally
            total.add(tally)
        print(
            f"fuzz: schemathesis against lmspd's /openapi.json, {round_} round(s) from seed {seed}, "
            f"{time.monotonic() - started:.0f} s"
        )
        print(table([*rows.items(), ("total", total)], documented))
        if missed := sorted(documented - total.routes):
            print(f"operations no case reached: {', '.join(missed)}")
            return 1
        fives = sum(n for s, n in total.statuses.items() if s >= 500) + total.errors
        print(f"5xx: {fives}   failed checks: {total.failures}")
        for crash in total.tool_errors:  # the cases it did send still count; lmspd is not at fault
            print(f"schemathesis crashed (its own error, not lmspd's): {crash}")
        return 0 if fives == 0 and total.failures == 0 else 1
    finally:
        for proc in servers:
            kill(proc, signal.SIGTERM)
        if args.keep:
            print(f"work directory kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
