"""A model before its first request: [engine] preload loads and warms it before the app serves
(so before /readyz says ready, and so before systemd hears READY=1), and its first task loads
nothing; [engine] max_memory_bytes refuses at intake a model that cannot fit even alone, and a
default model that cannot leaves the server serving but not ready, saying why."""

from __future__ import annotations

from pathlib import Path

from starlette.testclient import TestClient

from harness.engine_host import Host
from harness.wait import wait_until
from lmspd.config import Config, EngineConfig, ModelEntry, ServerConfig
from lmspd.models.footprint import estimate_or_zero
from lmspd.models.registry import ResolvedModel

# Room for the tiny models (a few MB each), not for the bundled one (about 100 MB).
BUDGET = 40 * 1024**2
ENGINE = EngineConfig(
    weight_dtype="quantized", max_loaded_models=2, max_concurrency=2, preload=["tiny2"], max_memory_bytes=BUDGET
)


def config_for(
    data: Path, model_cache: Path, tiny: ResolvedModel, tiny2: ResolvedModel, default: str = "tiny"
) -> Config:
    return Config(
        default_model=default,
        cache_dir=str(model_cache),
        models={"tiny": ModelEntry(path=str(tiny.path)), "tiny2": ModelEntry(path=str(tiny2.path))},
        engine=ENGINE,
        server=ServerConfig(data_dir=str(data)),
    )


def finished_task(client: TestClient, model: str) -> str:
    """Run a short task on ``model``; the status it ends in."""
    body = {"type": "response", "input": {"model": model, "input": "Hi", "max_output_tokens": 4}}
    task_id = client.post("/lmsp/v1/tasks", json=body).json()["id"]

    def finished() -> str | None:
        status: str = client.get(f"/lmsp/v1/tasks/{task_id}").json()["status"]
        return status if status in ("succeeded", "failed", "cancelled") else None

    return wait_until(finished, "the task to finish")


def test_preloaded_models_are_resident_before_ready_and_their_first_task_loads_nothing(
    host: Host, tmp_path: Path, model_cache: Path, tiny: ResolvedModel, tiny2: ResolvedModel
) -> None:
    with host.serve(config_for(tmp_path / "data", model_cache, tiny, tiny2)) as client:
        # The app serves only once its lifespan (preload included) is done: the first answer
        # already finds the model loaded.
        assert client.get("/readyz").status_code == 200
        listed = {m["id"]: m for m in client.get("/lmsp/v1/models").json()["data"]}
        assert listed["tiny2"]["loaded"] and listed["tiny2"]["resident_bytes"] > 0
        assert finished_task(client, "tiny2") == "succeeded"
        metrics = client.get("/metrics").text
        # Loaded once, by the preload (the shared engine had not loaded it before): the task loaded nothing.
        assert 'lmspd_model_loads_total{model="tiny2"} 1.0' in metrics


def test_a_model_that_cannot_fit_alone_is_refused_at_intake_and_nothing_is_queued(
    host: Host, tmp_path: Path, model_cache: Path, tiny: ResolvedModel, tiny2: ResolvedModel, smol: ResolvedModel
) -> None:
    needs = estimate_or_zero(smol.path, ENGINE).total
    assert needs > BUDGET
    with host.serve(config_for(tmp_path / "data", model_cache, tiny, tiny2)) as client:
        for path, body in (
            ("/lmsp/v1/tasks", {"type": "response", "input": {"model": smol.name, "input": "Hi"}}),
            ("/v1/responses", {"model": smol.name, "input": "Hi"}),
        ):
            r = client.post(path, json=body)
            assert r.status_code == 400, r.text
            detail = r.json()["detail"] if path.startswith("/lmsp") else r.json()["error"]["message"]
            assert smol.name in detail and str(needs) in detail and str(BUDGET) in detail
        assert client.get("/lmsp/v1/tasks").json()["data"] == []
        assert not {m["id"]: m for m in client.get("/lmsp/v1/models").json()["data"]}[smol.name]["loaded"]


def test_a_default_model_that_cannot_fit_leaves_the_server_serving_but_not_ready(
    host: Host, tmp_path: Path, model_cache: Path, tiny: ResolvedModel, tiny2: ResolvedModel, smol: ResolvedModel
) -> None:
    needs = estimate_or_zero(smol.path, ENGINE).total
    with host.serve(config_for(tmp_path / "data", model_cache, tiny, tiny2, default=smol.name)) as client:
        # The app answers only once its start (the default model's preload) is done.
        r = client.get("/readyz")
        assert r.status_code == 503, r.text
        assert r.json()["status"] == "not_ready"
        reason = r.json()["reason"]
        assert "default model" in reason and smol.name in reason and str(needs) in reason and str(BUDGET) in reason
        assert client.get("/healthz").json() == {"status": "ok"}  # alive: only not ready
        assert client.get("/lmsp/v1/summary").json()["ready"] is False
        assert not {m["id"]: m for m in client.get("/lmsp/v1/models").json()["data"]}[smol.name]["loaded"]
        # It serves what can load: a task on a model that fits runs.
        assert finished_task(client, "tiny2") == "succeeded"
        assert client.get("/readyz").json()["reason"] == reason  # still: nothing made it fit
        # No load of it was tried, at the start or since.
        assert f'lmspd_model_loads_total{{model="{smol.name}"}}' not in client.get("/metrics").text
    with host.serve(config_for(tmp_path / "data", model_cache, tiny, tiny2)) as client:
        assert client.get("/readyz").json() == {"status": "ready"}  # no reason when ready
