"""The code the tests, the benchmarks and CI share, imported as ``harness.<module>``.

It lives at the repository's root beside ``bench/`` and ``tests/`` and is importable from there
as they are (``python -m`` and ``python -m pytest`` put the working directory on the path;
pytest's ``pythonpath`` setting does it for a bare ``pytest``): nothing edits ``sys.path``, and
it is not part of the ``lmspd`` wheel (docs/testing.md).

Processes, models and clients for the test tiers:

- ``models``: the test cache, the bundled model's catalog entry, the tiny random-weight models.
- ``wait``: ``wait_until``, the one polling loop, always with a deadline.
- ``engine_host``: one engine process shared by many in-process apps (TestClient).
- ``server``: a real ``lmspd serve`` process, ``free_port`` (the one definition), and
  ``spawn``/``serve``/``kill`` for any command in its own process group.
- ``postgres``: a real PostgreSQL in a temporary directory; ``durable_cluster`` for a run's own.
- ``history``: a finished task with a long event history, written through the store.
- ``sse``: reading a server-sent event stream's named events.
- ``generation``: engine commands and their collection, for the engine tier.
- ``families``: tokenizers for the tool-calling template families.
- ``openresponses``: validation against the Open Responses schema (in ``data/``).
- ``codex``, ``claude``: the captured Codex CLI and Claude Code requests (``data/``) and the
  pinned binaries; ``codex_capture``, ``claude_capture``: the stand-in servers that captured them;
  ``capture``: what those four share (a pinned CLI's lookup, the capture servers' command line).
- ``browser``, ``clients``, ``disk``: the browser tier's driver, the real clients' presence, a
  small filesystem.

The reliability runs (docs/reliability.md; CI runs them bounded, ``.ci/run``):

- ``chaos``: ``python -m harness.chaos``, kill -9 cycles and every invariant checked.
- ``fuzz`` (with ``fuzz_checks``, ``fuzz_attacks`` and ``fuzz.sh``): ``python -m harness.fuzz``.
- ``sse_abuse``: event streams dropped and never read; ``stall``: long prompts beside other
  clients; ``lifeline``: the engine gone as soon as its server is killed.
"""

from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"  # schemas and captured requests (offline)
