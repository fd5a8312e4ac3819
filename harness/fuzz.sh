#!/usr/bin/env bash
# The full fuzz run behind the figures in docs/benchmarks.md: 10,000 schemathesis cases against real
# `lmspd serve` processes, the coverage phase (every field's boundary values) included.
# CI runs a bounded budget of the same (.ci/run). Extra arguments go to harness.fuzz (--seed N).
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-.venv/bin/python}" -m harness.fuzz --cases 10000 --coverage "$@"
