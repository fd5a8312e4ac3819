"""The logs: JSON lines and the ``--log-format`` switch (the request log and /metrics are
tested on a real app in test_api_tasks.py, which has an engine to share)."""

from __future__ import annotations

import io
import logging

import msgspec
import pytest

from lmspd.cli.main import build_parser
from lmspd.logs import JsonFormatter, current_format, formatter


def test_json_log_lines_carry_the_fields() -> None:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(formatter("json"))
    logger = logging.getLogger("lmspd.test.json")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        logger.warning("GET %s %d", "/healthz", 200, extra={"path": "/healthz", "status": 200, "ms": 0.4})
        try:
            raise ValueError("boom")
        except ValueError:
            logger.exception("failed")
    finally:
        logger.removeHandler(handler)
    first, second = (msgspec.json.decode(line) for line in out.getvalue().splitlines())
    assert first["msg"] == "GET /healthz 200" and first["level"] == "WARNING" and first["logger"] == "lmspd.test.json"
    assert (first["path"], first["status"], first["ms"]) == ("/healthz", 200, 0.4)
    assert first["ts"].endswith("+00:00") and "T" in first["ts"]
    assert second["level"] == "ERROR" and "ValueError: boom" in second["exc"]


def test_log_format_flag_and_what_the_engine_is_told(monkeypatch: pytest.MonkeyPatch) -> None:
    assert build_parser().parse_args(["serve", "--log-format", "json"]).log_format == "json"
    assert build_parser().parse_args(["serve"]).log_format == "text"
    monkeypatch.setenv("LMSPD_LOG_FORMAT", "json")
    assert build_parser().parse_args(["serve"]).log_format == "json"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--log-format", "xml"])
    root = logging.getLogger()
    assert current_format() == "text"
    handler = logging.NullHandler()
    handler.setFormatter(JsonFormatter())
    root.addHandler(handler)
    try:
        assert current_format() == "json"
    finally:
        root.removeHandler(handler)
