"""The engine group's pure parts (docs/distributed.md): how layers are shared out, how a host
names its ring endpoint, the settings a group refuses, and the unit for a joining host."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lmspd.config import EngineConfig
from lmspd.engine.group.pipeline import layer_counts
from lmspd.engine.group.ring import DEFAULT_PORT, endpoint
from lmspd.errors import ConfigError, EngineGroupError

GIB = 1 << 30


def test_layers_follow_memory_and_every_host_holds_one() -> None:
    assert layer_counts(30, [16 * GIB, 16 * GIB], []) == [15, 15]
    assert layer_counts(30, [32 * GIB, 16 * GIB], []) == [20, 10]
    assert layer_counts(31, [16 * GIB, 16 * GIB], []) == [16, 15]  # the remainder to the first
    assert layer_counts(3, [64 * GIB, 1, 1], []) == [1, 1, 1]
    assert sum(layer_counts(22, [24 * GIB, 16 * GIB, 8 * GIB], [])) == 22


def test_configured_layers_are_taken_as_they_are_or_refused() -> None:
    assert layer_counts(30, [GIB, GIB], [10, 20]) == [10, 20]
    with pytest.raises(EngineGroupError, match="sums to 29; the model has 30 layers"):
        layer_counts(30, [GIB, GIB], [10, 19])
    with pytest.raises(EngineGroupError, match="fewer than the group's 3 hosts"):
        layer_counts(2, [GIB, GIB, GIB], [])


def test_a_host_names_an_address_and_a_port() -> None:
    assert endpoint("127.0.0.1") == f"127.0.0.1:{DEFAULT_PORT}"
    assert endpoint("localhost:47555") == "127.0.0.1:47555"
    with pytest.raises(EngineGroupError, match=r"cannot resolve 'no-such-host\.invalid'"):
        endpoint("no-such-host.invalid:1")


@pytest.mark.parametrize(
    ("settings", "param"),
    [
        ({"hosts": ["10.0.0.1"]}, "engine.hosts"),
        ({"hosts": ["10.0.0.1", "10.0.0.2"], "host_layers": [10]}, "engine.host_layers"),
        ({"hosts": ["10.0.0.1", "10.0.0.2"], "host_layers": [0, 30]}, "engine.host_layers"),
        ({"hosts": ["10.0.0.1", "10.0.0.2"], "group_timeout_secs": 0}, "engine.group_timeout_secs"),
    ],
)
def test_a_group_config_that_cannot_work_is_refused(settings: dict[str, object], param: str) -> None:
    with pytest.raises(ConfigError) as refused:
        EngineConfig(**settings)  # type: ignore[arg-type]
    assert refused.value.param == param


def test_service_print_join_writes_the_joining_hosts_unit(tmp_path: Path) -> None:
    config = tmp_path / "lmspd.toml"
    config.write_text('[engine]\nhosts = ["10.0.0.1", "10.0.0.2"]\n')
    run = [sys.executable, "-m", "lmspd.cli", "service", "print", "--config", str(config)]
    unit = subprocess.run([*run, "--systemd", "--join", "1"], capture_output=True, text=True, timeout=60)
    assert unit.returncode == 0, unit.stderr
    assert "lmspd engine join --rank 1\n" in unit.stdout and "Type=simple" in unit.stdout
    plist = subprocess.run([*run, "--launchd", "--join", "1"], capture_output=True, text=True, timeout=60)
    assert "<string>com.lmspd.join</string>" in plist.stdout and "<string>join</string>" in plist.stdout
    bad = subprocess.run([*run, "--systemd", "--join", "2"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--join 2: the ranks that join are 1..1" in bad.stderr


def test_a_group_without_a_budget_leaves_the_refusal_to_its_engine(smol_dir: Path) -> None:
    """The hosts' budgets summed are the group's, known to its engine only: the server's
    intake refuses no model for this host's memory; a configured budget still binds."""
    from lmspd.errors import ModelTooLargeError
    from lmspd.models.footprint import refuse_oversized

    group = EngineConfig(hosts=["10.0.0.1", "10.0.0.2"])
    assert refuse_oversized("smol", smol_dir, group).total > 0
    with pytest.raises(ModelTooLargeError):
        refuse_oversized("smol", smol_dir, EngineConfig(hosts=["10.0.0.1", "10.0.0.2"], max_memory_bytes=1 << 20))
