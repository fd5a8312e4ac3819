"""What a client can send that used to answer 500 or be misread: deep JSON, odd digits, long
names, template keyword collisions, huge integers, the wrong Content-Type (issue 12)."""

from __future__ import annotations

import gc
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from starlette.testclient import TestClient

from harness.engine_host import Host, tiny_config
from harness.wait import wait_until
from lmspd.config import Config, EngineConfig, ModelEntry, ServerConfig
from lmspd.errors import InvalidRequestError, ModelNotFoundError
from lmspd.models.registry import ModelRegistry, ResolvedModel
from lmspd.models.tokenizer import Tokenizer, _shrink_bound
from lmspd.prompting.prompt import build_prompt
from lmspd.responses.schema import ResponseRequest

TOKENS = {"alice": "alice-secret-token"}
ALICE = {"Authorization": f"Bearer {TOKENS['alice']}"}
ENGINE = EngineConfig(weight_dtype="quantized")  # test_api_tasks' engine: one host for both
QUICK: dict[str, Any] = {"input": "Hi", "temperature": 0, "max_output_tokens": 2}


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory, model_cache: Path, tiny_long: ResolvedModel) -> Config:
    return tiny_config(
        tiny_long, model_cache, tmp_path_factory.mktemp("intake") / "data", ENGINE, tokens=TOKENS, keepalive_secs=0.5
    )


@pytest.fixture(scope="module")
def client(host: Host, config: Config) -> Iterator[TestClient]:
    with host.serve(config) as c:
        yield c


def error_of(r: Any) -> tuple[int, str | None, str | None]:
    """(status, code, param) from a problem object or an OpenAI envelope."""
    body = r.json()
    if "error" in body and isinstance(body["error"], dict):
        return r.status_code, body["error"]["code"], body["error"]["param"]
    return r.status_code, body.get("code"), body.get("param")


def as_task(request: dict[str, Any]) -> dict[str, Any]:
    return {"type": "response", "input": request}


def as_compact(request: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in request.items() if k in ("model", "input", "max_output_tokens")}


def as_chat(request: dict[str, Any]) -> dict[str, Any]:
    chat = {k: v for k, v in request.items() if k not in ("input", "max_output_tokens")}
    if "max_output_tokens" in request:
        chat["max_tokens"] = request["max_output_tokens"]
    return {"messages": [{"role": "user", "content": request["input"]}], **chat}


def same(request: dict[str, Any]) -> dict[str, Any]:
    return request


# Every POST route that takes a JSON body, with how it carries a Responses-shaped request.
POSTS: list[tuple[str, Any]] = [
    ("/v1/responses", same),
    ("/v1/responses/input_tokens", same),
    ("/v1/responses/compact", as_compact),
    ("/v1/chat/completions", as_chat),
    ("/lmsp/v1/tasks", as_task),
    ("/lmsp/v1/responses", same),
]


@pytest.mark.parametrize(("route", "wrap"), POSTS, ids=[p for p, _ in POSTS])
def test_json_nested_too_deep_is_a_400_naming_the_field(client: TestClient, route: str, wrap: Any) -> None:
    deep = b"[" * 5000 + b"]" * 5000
    request = wrap({"input": "hi"}) if route.endswith("/chat/completions") else wrap({"input": ["x"]})
    if route.endswith("/chat/completions"):
        request["response_format"] = {"type": "json_schema", "json_schema": ["x"]}
    raw = msgspec.json.encode(request).replace(b'["x"]', deep)
    r = client.post(route, content=raw, headers={**ALICE, "Content-Type": "application/json"})
    status, _, param = error_of(r)
    assert status == 400, r.text
    named = {"/lmsp/v1/tasks": "input.input", "/v1/chat/completions": "response_format.json_schema"}
    expected = named.get(route, "input")
    assert param == expected, r.text


@pytest.mark.parametrize(("route", "wrap"), POSTS, ids=[p for p, _ in POSTS])
def test_a_body_that_is_not_json_by_its_content_type_is_a_415(client: TestClient, route: str, wrap: Any) -> None:
    raw = msgspec.json.encode(wrap(QUICK))
    for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        r = client.post(route, content=raw, headers={**ALICE, "Content-Type": kind})
        assert error_of(r)[0::2] == (415, "Content-Type"), r.text
        assert r.headers["content-type"] == ("application/problem+json" if "lmsp" in route else "application/json")
    # JSON by any of its names, with or without a charset, is JSON.
    for kind in ("application/json; charset=utf-8", "Application/JSON"):
        r = client.post(route, content=raw, headers={**ALICE, "Content-Type": kind})
        assert r.status_code in (200, 202) or error_of(r)[0:2] == (400, "context_length_exceeded"), r.text


def test_a_model_name_longer_than_a_file_name_is_not_found(client: TestClient) -> None:
    for name in ("m" * 300, "a/" + "b" * 300, "/tmp/" + "c" * 4000):
        for route, wrap in POSTS:
            r = client.post(route, json=wrap({**QUICK, "model": name}), headers=ALICE)
            assert error_of(r)[0::2] == (404, "model"), (route, r.text)


@pytest.mark.parametrize("kwarg", ["pad_token", "unk_token", "bos_token", "messages", "raise_exception"])
def test_chat_template_kwargs_may_not_collide_with_the_renderers(client: TestClient, kwarg: str) -> None:
    request = {**QUICK, "chat_template_kwargs": {kwarg: "x"}}
    for route, wrap in POSTS:
        if route.endswith(("/compact", "/chat/completions")):
            continue  # they take no chat_template_kwargs
        r = client.post(route, json=wrap(request), headers=ALICE)
        status, _, param = error_of(r)
        assert status == 400 and param is not None and param.endswith("chat_template_kwargs"), (route, r.text)


def test_integers_beyond_what_the_engine_takes_are_refused(client: TestClient) -> None:
    for value in (2**31, 2**64, 10**30):
        for route, wrap in POSTS:
            body = wrap({**QUICK, "max_output_tokens": value})
            param = "max_tokens" if route.endswith("/chat/completions") else "max_output_tokens"
            r = client.post(route, json=body, headers=ALICE)
            status, _, got = error_of(r)
            assert status == 400 and got is not None and got.endswith(param), (route, r.text)


@pytest.mark.parametrize("value", ["\u00b2", "\u0661", "+3", "1_0", " 3", "3 ", "-0", "0x1", "", "1e1"])
def test_list_limits_take_ascii_digits_only(client: TestClient, value: str) -> None:
    value = value.encode().decode("unicode_escape")
    response = client.post("/v1/responses", json=QUICK, headers=ALICE).json()
    for path in ("/lmsp/v1/tasks", f"/v1/responses/{response['id']}/input_items"):
        r = client.get(path, params={"limit": value}, headers=ALICE)
        assert error_of(r)[0::2] == (400, "limit"), (path, r.text)
        assert client.get(path, params={"limit": "3"}, headers=ALICE).status_code == 200


@pytest.mark.parametrize("value", ["+0", "0_0", "\\u0660", " 0", "0 ", "--1", "0x0"])
def test_event_resume_points_take_ascii_digits_only(client: TestClient, value: str) -> None:
    value = value.encode().decode("unicode_escape")
    task = client.post("/lmsp/v1/tasks", json=as_task({**QUICK, "max_output_tokens": 16}), headers=ALICE).json()
    header = {**ALICE, "Last-Event-ID": value.encode()}  # as a client's raw bytes
    r = client.get(f"/lmsp/v1/tasks/{task['id']}/events", headers=header)  # type: ignore[arg-type]
    assert error_of(r)[0::2] == (400, "Last-Event-ID"), r.text
    r = client.get(f"/lmsp/v1/tasks/{task['id']}/events", params={"after": value}, headers=ALICE)
    assert error_of(r)[0::2] == (400, "after"), r.text
    background = client.post("/v1/responses", json={**QUICK, "background": True}, headers=ALICE).json()
    r = client.get(
        f"/v1/responses/{background['id']}", params={"stream": "true", "starting_after": value}, headers=ALICE
    )
    assert error_of(r)[0::2] == (400, "starting_after"), r.text


def test_a_task_list_cursor_must_be_a_task_id(client: TestClient) -> None:
    for after in ("garbage", "task_", "resp_01JABCDEFGHJKMNPQRSTVWXYZ0", "task_01jabcdefghjkmnpqrstvwxyz0"):
        r = client.get("/lmsp/v1/tasks", params={"after": after}, headers=ALICE)
        assert error_of(r)[0::2] == (400, "after"), r.text
    task = client.post("/lmsp/v1/tasks", json=as_task(QUICK), headers=ALICE).json()
    r = client.get("/lmsp/v1/tasks", params={"after": task["id"]}, headers=ALICE)
    assert r.status_code == 200 and task["id"] not in [t["id"] for t in r.json()["data"]]


def test_the_hub_keeps_nothing_for_tasks_no_one_follows(client: TestClient) -> None:
    hub = client.app.state.lmsp.core.hub  # type: ignore[attr-defined]
    for i in range(6):  # sync responses wait on their task; streams and task reads follow it
        client.post("/v1/responses", json={**QUICK, "input": f"Hi {i}"}, headers=ALICE)
        task = client.post("/lmsp/v1/tasks", json=as_task(QUICK), headers=ALICE).json()
        with client.stream("GET", f"/lmsp/v1/tasks/{task['id']}/events", headers=ALICE) as r:
            r.read()
    gc.collect()  # not needed in CPython today; keeps the count from depending on when cycles go
    assert len(hub) == 0


def test_the_size_bound_never_refuses_a_prompt_that_fits(smol_dir: Path) -> None:
    tok = Tokenizer(smol_dir)
    per = tok.max_bytes_per_token
    assert per is not None
    longest = max(tok.vocab, key=len)  # byte-level: its characters spell bytes
    texts = [tok.decode([tok.vocab[longest]]) * 50, "=" * 5000, " " * 5000, "\u00e9\u6f22\U0001f600" * 500, "ab1" * 999]
    for text in texts:
        assert tok.count(text) * per >= len(text.encode()), text[:20]


@pytest.mark.parametrize(
    ("spec", "bound"),
    [
        ({"model": {"type": "BPE"}, "pre_tokenizer": {"type": "ByteLevel"}}, 1.0),
        ({"model": {"type": "WordPiece"}}, None),  # one [UNK] stands for a whole word
        ({"model": {"type": "BPE"}, "pre_tokenizer": {"type": "Whitespace"}}, None),  # drops spaces
        ({"model": {"type": "BPE", "fuse_unk": True}, "pre_tokenizer": {"type": "Metaspace"}}, None),
        (
            {
                "model": {"type": "BPE", "byte_fallback": True, "fuse_unk": True},
                "normalizer": {
                    "type": "Sequence",
                    "normalizers": [
                        {"type": "NFKC"},
                        {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"},
                    ],
                },
            },
            3.0,
        ),
        ({"model": {"type": "BPE"}, "normalizer": {"type": "Strip"}}, None),
    ],
)
def test_which_tokenizers_give_a_size_bound(spec: dict[str, Any], bound: float | None) -> None:
    assert _shrink_bound(spec) == bound


# --- models a request may name (allow_model_paths on: directories, and hub ids already cached)


@pytest.fixture(scope="module")
def paths_client(
    host: Host,
    tmp_path_factory: pytest.TempPathFactory,
    model_cache: Path,
    tiny_long: ResolvedModel,
    tiny2: ResolvedModel,
) -> Iterator[TestClient]:
    config = Config(
        default_model="tiny",
        cache_dir=str(model_cache),
        models={"tiny": ModelEntry(path=str(tiny_long.path)), "other": ModelEntry(path=str(tiny2.path))},
        engine=ENGINE,
        server=ServerConfig(
            data_dir=str(tmp_path_factory.mktemp("paths") / "data"),
            tokens=TOKENS,
            keepalive_secs=0.5,
            allow_model_paths=True,
        ),
    )
    with host.serve(config) as c:
        yield c


def spellings(path: Path, tmp: Path) -> list[str]:
    link = tmp / "link"
    link.symlink_to(path)
    return [str(path), f"{path}/", f"{path}/./", f"{path.parent}/../{path.parent.name}/{path.name}", str(link)]


def test_each_spelling_of_a_directory_is_one_model(
    tmp_path: Path, tiny_long: ResolvedModel, tiny2: ResolvedModel, model_cache: Path
) -> None:
    config = Config(cache_dir=str(model_cache), models={"tiny": ModelEntry(path=str(tiny_long.path))})
    registry = ModelRegistry(config)
    assert {registry.resolve(s).name for s in ["tiny", *spellings(tiny_long.path, tmp_path)]} == {"tiny"}
    (tmp_path / "two").mkdir()
    names = {registry.resolve(s).name for s in spellings(tiny2.path, tmp_path / "two")}
    assert names == {str(tiny2.path.resolve())}


def test_a_hub_id_a_request_names_is_never_downloaded(
    tmp_path: Path, model_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))

    def no_network(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a download was attempted")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    config = Config(cache_dir=str(model_cache), server=ServerConfig(allow_model_paths=True))
    registry = ModelRegistry(config)
    registry.check_requested("someone/some-model")
    with pytest.raises(ModelNotFoundError, match="local Hugging Face cache"):
        registry.resolve_local("someone/some-model")
    with pytest.raises(ModelNotFoundError, match="local Hugging Face cache"):
        registry.resolve("someone/some-model")


def test_requests_name_models_by_any_spelling_without_reloads(
    paths_client: TestClient, host: Host, tmp_path: Path, tiny_long: ResolvedModel
) -> None:
    before = set(host.engine.loaded)
    for model in spellings(tiny_long.path, tmp_path):
        r = paths_client.post("/v1/responses", json={**QUICK, "model": model}, headers=ALICE)
        assert r.status_code == 200 and r.json()["status"] in ("completed", "incomplete"), r.text
        assert r.json()["model"] == model  # echoed as the client named it
    assert set(host.engine.loaded) - before <= {"tiny"}  # one model, under its alias
    # A hub id not in the local cache, a name no file system takes, a NUL: 404 at once,
    # not a 200 with a failed response after a download attempt.
    for model in ("someone/not-cached-here", "a/" + "b" * 300, "m" * 300, "bad\x00name", "/no/such/dir"):
        for route, wrap in POSTS:
            r = paths_client.post(route, json=wrap({**QUICK, "model": model}), headers=ALICE)
            assert error_of(r)[0::2] == (404, "model"), (route, model, r.text)


def test_max_loaded_models_is_a_hard_bound(paths_client: TestClient) -> None:
    """One model resident (ENGINE's max_loaded_models = 1): a task on another model waits in
    ``loading`` while the first generates, and runs once it is done."""
    slots = paths_client.app.state.lmsp.core.supervisor.slots  # type: ignore[attr-defined]

    def task(task_id: str) -> dict[str, Any]:
        return dict(paths_client.get(f"/lmsp/v1/tasks/{task_id}", headers=ALICE).json())

    def waits_for_a_slot(task_id: str) -> bool:
        """Queued for a model slot (ModelSlots.acquire), not admitted: the event that proves
        the bound holds it back, where a pause would only hope the model had time to load."""
        assert (found := task(task_id))["status"] in ("queued", "loading"), f"it went on: {found}"
        return any(holder == task_id and not admitted.done() for holder, _, admitted in list(slots._queue))

    long = as_task({**QUICK, "input": "Tell me a story.", "max_output_tokens": 3000})
    first = paths_client.post("/lmsp/v1/tasks", json=long, headers=ALICE).json()
    wait_until(lambda: task(first["id"])["status"] == "running", "the first task to run")
    second = paths_client.post("/lmsp/v1/tasks", json=as_task({**QUICK, "model": "other"}), headers=ALICE).json()
    wait_until(lambda: waits_for_a_slot(second["id"]), "the second task to wait for a model slot")
    assert task(second["id"])["status"] == "loading"
    assert task(first["id"])["status"] == "running"
    assert len(slots.in_use()) == 1  # the first task's model, held while it generates
    paths_client.post(f"/lmsp/v1/tasks/{first['id']}/cancel", headers=ALICE)
    wait_until(lambda: task(second["id"])["status"] in ("succeeded", "failed"), "the second task to end")
    assert task(second["id"])["status"] == "succeeded", task(second["id"])


@pytest.mark.parametrize(
    ("template", "kwargs", "param"),
    [
        ("{{ tools | length }}{{ messages[0]['content'] }}", {"tools": 5}, "chat_template_kwargs"),
        ("{% for m in messages %}{{ m['content'] + extra }}{% endfor %}", {"extra": 5}, "chat_template_kwargs"),
        ("{{ raise_exception('Conversation roles must alternate') }}", {}, "input"),
    ],
)
def test_a_template_that_cannot_render_a_request_is_a_400(
    smol_dir: Path, template: str, kwargs: dict[str, Any], param: str
) -> None:
    tok = Tokenizer(smol_dir)
    tok.chat_template = template
    request = ResponseRequest(input="Hi", chat_template_kwargs=kwargs or None)
    with pytest.raises(InvalidRequestError) as caught:
        build_prompt(tok, request, [])
    assert caught.value.param == param and caught.value.status == 400
