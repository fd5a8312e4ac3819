"""The real-client tier's rule for a missing client (``tests/clients/``): skipped on a
developer's machine, a failure under CI (``CI=true``), where ``.ci/run`` installs every
client first, so that a skip never hides a failure there."""

from __future__ import annotations

import os
from typing import TypeVar

import pytest

T = TypeVar("T")

IN_CI = os.environ.get("CI", "").lower() in ("true", "1")


def require(what: str, found: T | None) -> T:
    """``found``, or a skip (a failure under CI) saying that ``what`` is missing."""
    if found is None:
        if IN_CI:
            pytest.fail(f"{what} is missing: under CI the real-client tests must run (.ci/run installs it)")
        pytest.skip(f"{what} is not installed (.ci/run installs it)")
    return found


def require_module(name: str) -> None:
    """At a test module's top: skip the module when ``name`` cannot be imported, except under
    CI, where the import that follows then fails the module."""
    if not IN_CI:
        pytest.importorskip(name, reason=f"{name} is not installed (.ci/run installs it)")
