"""Helpers the test tiers share, imported as ``support.<module>`` (tests/conftest.py puts
tests/ on ``sys.path``; mypy finds them through ``mypy_path``).

- ``models``: the test cache, the bundled model's catalog entry, the tiny random-weight models.
- ``wait``: ``wait_until``, the one polling loop, always with a deadline.
- ``engine_host``: one engine process shared by many in-process apps (TestClient).
- ``server``: a real ``lmspd serve`` process on a tiny model, and HTTP helpers for it.
- ``generation``: engine commands and their collection, for the engine tier.
- ``families``: tokenizers for the tool-calling template families.
- ``openresponses``: validation against the Open Responses schema (in ``data/``).
- ``codex``: the captured Codex CLI requests (``data/codex/``), a raw streaming POST, the
  pinned ``codex`` binary; ``codex_capture``: the stand-in server that captured them.
"""

from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"  # schemas vendored for the tests (offline)
