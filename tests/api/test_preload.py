"""[engine] preload: the models are loaded and warmed before the app serves (so before /readyz
says ready, and so before systemd hears READY=1), and their first task loads nothing."""

from __future__ import annotations

from pathlib import Path

from support.engine_host import Host
from support.wait import wait_until

from lmspd.config import Config, EngineConfig, ModelEntry, ServerConfig
from lmspd.models.registry import ResolvedModel

ENGINE = EngineConfig(weight_dtype="quantized", max_loaded_models=2, max_concurrency=2, preload=["tiny2"])


def test_preloaded_models_are_resident_before_ready_and_their_first_task_loads_nothing(
    host: Host, tmp_path: Path, model_cache: Path, tiny: ResolvedModel, tiny2: ResolvedModel
) -> None:
    config = Config(
        default_model="tiny",
        cache_dir=str(model_cache),
        models={"tiny": ModelEntry(path=str(tiny.path)), "tiny2": ModelEntry(path=str(tiny2.path))},
        engine=ENGINE,
        server=ServerConfig(data_dir=str(tmp_path / "data")),
    )
    with host.serve(config) as client:
        # The app serves only once its lifespan (preload included) is done: the first answer
        # already finds the model loaded.
        assert client.get("/readyz").status_code == 200
        listed = {m["id"]: m for m in client.get("/lmsp/v1/models").json()["data"]}
        assert listed["tiny2"]["loaded"] and listed["tiny2"]["resident_bytes"] > 0
        body = {"type": "response", "input": {"model": "tiny2", "input": "Hi", "max_output_tokens": 4}}
        task_id = client.post("/lmsp/v1/tasks", json=body).json()["id"]

        def finished() -> str | None:
            status: str = client.get(f"/lmsp/v1/tasks/{task_id}").json()["status"]
            return status if status in ("succeeded", "failed", "cancelled") else None

        assert wait_until(finished, "the task to finish") == "succeeded"
        metrics = client.get("/metrics").text
        # Loaded once, by the preload (the shared engine had not loaded it before): the task loaded nothing.
        assert 'lmspd_model_loads_total{model="tiny2"} 1.0' in metrics
