"""Models over a long life on the real app: their state on both model lists, idle unload and
reload through tasks, operators' load, unload and pin, and what ordinary tokens get there."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from harness.engine_host import Host
from harness.wait import wait_until
from lmspd.cli.main import COMMANDS, build_parser
from lmspd.config import Config, EngineConfig, ModelEntry, ServerConfig
from lmspd.models.registry import ResolvedModel

TOKENS = {"alice": "alice-secret-token"}
ADMINS = {"ops": "ops-secret-token"}
ALICE = {"Authorization": f"Bearer {TOKENS['alice']}"}
OPS = {"Authorization": f"Bearer {ADMINS['ops']}"}

# tiny2 goes idle-unloaded half a second after its last request; tiny never (its own keep-alive).
ENGINE = EngineConfig(weight_dtype="quantized", max_loaded_models=2, max_concurrency=2, keep_alive_secs=0.5)


@pytest.fixture
def client(
    host: Host, tmp_path: Path, model_cache: Path, tiny_long: ResolvedModel, tiny2: ResolvedModel
) -> Iterator[TestClient]:
    config = Config(
        default_model="tiny",
        cache_dir=str(model_cache),
        models={
            "tiny": ModelEntry(path=str(tiny_long.path), keep_alive_secs=0),
            "tiny2": ModelEntry(path=str(tiny2.path)),
        },
        engine=ENGINE,
        server=ServerConfig(data_dir=str(tmp_path / "data"), tokens=TOKENS, admin_tokens=ADMINS),
    )
    with host.serve(config) as c:
        yield c


def models(client: TestClient, path: str = "/lmsp/v1/models") -> dict[str, dict[str, Any]]:
    r = client.get(path, headers=ALICE)
    assert r.status_code == 200, r.text
    return {m["id"]: m for m in r.json()["data"]}


def run_task(client: TestClient, model: str, max_tokens: int = 8) -> str:
    body = {
        "type": "response",
        "input": {"model": model, "input": "Hi", "temperature": 0, "max_output_tokens": max_tokens},
    }
    r = client.post("/lmsp/v1/tasks", json=body, headers=ALICE)
    assert r.status_code == 202, r.text
    task_id: str = r.json()["id"]
    return task_id


def wait_status(client: TestClient, task_id: str, statuses: tuple[str, ...]) -> str:
    def reached() -> str | None:
        status: str = client.get(f"/lmsp/v1/tasks/{task_id}", headers=ALICE).json()["status"]
        return status if status in statuses else None

    return wait_until(reached, f"task {task_id} to reach {statuses}", timeout=60)


def metric(client: TestClient, name: str, **labels: str) -> float:
    text = client.get("/metrics", headers=OPS).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0


def test_both_model_lists_show_each_models_state(client: TestClient) -> None:
    tiny = models(client)["tiny"]  # the default model, loaded at start, never idle-unloaded
    assert tiny["ready"] and tiny["loaded"] and tiny["weight_dtype"] == "quantized"
    assert tiny["resident_bytes"] > 0 and tiny["keep_alive_secs"] == 0 and tiny["unload_at"] is None
    assert tiny["last_used_at"] is not None and not tiny["pinned"]
    openai = models(client, "/v1/models")["tiny"]
    assert openai["object"] == "model" and openai["loaded"] and openai["resident_bytes"] == tiny["resident_bytes"]
    assert metric(client, "lmspd_model_resident_bytes", model="tiny") == tiny["resident_bytes"]
    assert metric(client, "lmspd_engine_rss_bytes") > tiny["resident_bytes"]


def test_an_idle_model_is_unloaded_and_the_next_task_loads_it(client: TestClient) -> None:
    idle_before = metric(client, "lmspd_model_unloads_total", reason="idle")
    loads_before = metric(client, "lmspd_model_loads_total", model="tiny2")
    assert wait_status(client, run_task(client, "tiny2"), ("succeeded", "failed")) == "succeeded"
    # The engine's own unload, seen on the list: no sleep, and then the counters agree.
    wait_until(lambda: not models(client)["tiny2"]["loaded"], "tiny2 to be unloaded for being idle", timeout=30)
    assert metric(client, "lmspd_model_unloads_total", reason="idle") >= idle_before + 1
    assert wait_status(client, run_task(client, "tiny2"), ("succeeded", "failed")) == "succeeded"
    assert metric(client, "lmspd_model_loads_total", model="tiny2") >= loads_before + 2
    assert models(client)["tiny"]["loaded"]  # keep_alive_secs = 0: never idle-unloaded


def test_ordinary_tokens_cannot_control_models_and_nothing_changes(client: TestClient) -> None:
    before = models(client)["tiny"]
    for action in ("load", "unload", "pin", "unpin"):
        r = client.post(f"/lmsp/v1/models/tiny/{action}", headers=ALICE)
        assert r.status_code == 403, r.text
        assert "operator" in r.json()["detail"]
        assert client.post(f"/lmsp/v1/models/tiny/{action}").status_code == 401
    after = models(client)["tiny"]
    assert (after["loaded"], after["pinned"]) == (before["loaded"], before["pinned"])
    r = client.post("/lmsp/v1/models/no-such-model/load", headers=OPS)
    assert r.status_code == 404 and "no-such-model" in r.json()["detail"]
    r = client.post("/lmsp/v1/models/tiny/unload?force=maybe", headers=OPS)
    assert r.status_code == 400 and r.json()["param"] == "force"
    assert models(client)["tiny"]["loaded"]


def test_operators_pin_load_and_unload(client: TestClient) -> None:
    pinned = client.post("/lmsp/v1/models/tiny2/pin", headers=OPS)
    assert pinned.status_code == 200 and pinned.json()["pinned"]
    loaded = client.post("/lmsp/v1/models/tiny2/load", headers=OPS).json()
    assert loaded["loaded"] and loaded["pinned"] and loaded["unload_at"] is None
    unpinned = client.post("/lmsp/v1/models/tiny2/unpin", headers=OPS).json()
    assert not unpinned["pinned"]
    gone = client.post("/lmsp/v1/models/tiny2/unload", headers=OPS)
    assert gone.status_code == 200 and not gone.json()["loaded"]
    assert metric(client, "lmspd_model_unloads_total", reason="operator") >= 1


def test_unloading_a_busy_model_is_refused_unless_forced(client: TestClient) -> None:
    task_id = run_task(client, "tiny", max_tokens=3000)
    wait_status(client, task_id, ("running",))
    r = client.post("/lmsp/v1/models/tiny/unload", headers=OPS)
    assert r.status_code == 409, r.text
    assert "1 running task" in r.json()["detail"]
    assert models(client)["tiny"]["loaded"]  # refused: nothing changed
    assert client.get(f"/lmsp/v1/tasks/{task_id}", headers=ALICE).json()["status"] == "running"
    r = client.post("/lmsp/v1/models/tiny/unload?force=true", headers=OPS)
    assert r.status_code == 200, r.text
    assert wait_status(client, task_id, ("succeeded", "failed", "cancelled")) == "cancelled"
    assert not models(client)["tiny"]["loaded"]
    # The next task loads it again.
    assert wait_status(client, run_task(client, "tiny"), ("succeeded", "failed")) == "succeeded"


def cli(client: TestClient, argv: list[str]) -> int:
    """Run an ``lmspd models`` command against this app (through the TestClient's transport)."""

    def forward(request: httpx.Request) -> httpx.Response:
        r = client.request(request.method, str(request.url), headers=request.headers, content=request.content)
        return httpx.Response(r.status_code, headers=r.headers, content=r.content)

    args = build_parser().parse_args(argv)
    args.transport = httpx.MockTransport(forward)
    args.url = "http://127.0.0.1"
    return COMMANDS[(args.command, args.models_command)](args)


def test_the_command_line_shows_and_controls_models(client: TestClient, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(client, ["models", "ps", "--token", TOKENS["alice"]]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("MODEL\tSTATE") and any(line.startswith("tiny\tloaded\t") for line in lines)
    assert cli(client, ["models", "pin", "tiny2", "--token", TOKENS["alice"]]) == 1
    assert "operator" in capsys.readouterr().err
    assert not models(client)["tiny2"]["pinned"]
    assert cli(client, ["models", "load", "tiny2", "--token", ADMINS["ops"]]) == 0
    assert capsys.readouterr().out.startswith("tiny2\tloaded\t")
    assert cli(client, ["models", "unload", "tiny2", "--force", "--token", ADMINS["ops"]]) == 0
    assert capsys.readouterr().out.startswith("tiny2\tready\t")
