"""lmspd.api.guard's pieces alone: Host values parsed, the names a server answers to, and the
configuration that names more (docs/operations.md, "Security"). The whole app's answers are
tests/api/test_guard_api.py; a real browser's, tests/browser/test_cross_origin.py."""

from __future__ import annotations

import pytest

from lmspd.api.app import middleware
from lmspd.api.guard import HostPolicy, is_json, is_loopback, split_authority
from lmspd.config import Config, ServerConfig, load_config
from lmspd.errors import ConfigError


@pytest.mark.parametrize(
    ("value", "parsed"),
    [
        ("127.0.0.1:8080", ("127.0.0.1", 8080)),
        ("LocalHost.", ("localhost", None)),
        ("[::1]:8080", ("::1", 8080)),
        ("[::1]", ("::1", None)),
        ("example.com:", ("example.com", None)),
        ("a:b", None),
        ("[::1", None),
        ("[::1]x", None),
        ("", None),
        (":80", None),
        ("h:123456", None),
    ],
)
def test_host_values(value: str, parsed: tuple[str, int | None] | None) -> None:
    assert split_authority(value) == parsed


def test_loopback_names() -> None:
    assert all(is_loopback(h) for h in ("localhost", "app.localhost", "127.0.0.1", "127.8.9.10", "::1", "[::1]"))
    assert not any(is_loopback(h) for h in ("localhost.example", "0.0.0.0", "10.0.0.1", "example.com", "::"))


def test_a_loopback_server_answers_loopback_and_named_hosts_only() -> None:
    policy = HostPolicy(["lmspd.example", ".lan.example", "[fd00::1]"], listens_beyond_loopback=False)
    for name in ("localhost", "x.localhost", "127.0.0.1", "::1", "lmspd.example", "a.lan.example", "fd00::1"):
        assert policy.allows(name), name
    for name in ("rebind.test", "lan.example", "lmspd.example.evil", "192.168.1.5", "0.0.0.0", "10.0.0.1"):
        assert not policy.allows(name), name


def test_a_server_listening_beyond_loopback_answers_its_addresses() -> None:
    """No page can make an IP address its origin, so addresses are safe to answer there."""
    policy = HostPolicy([], listens_beyond_loopback=True)
    assert policy.allows("192.168.1.5") and policy.allows("fd00::1")
    assert not policy.allows("mac-mini.lan")
    assert HostPolicy(["*"], listens_beyond_loopback=False).allows("anything.example")


def test_json_types() -> None:
    assert is_json("application/json") and is_json("Application/JSON; charset=utf-8")
    assert is_json("application/merge-patch+json")
    assert not any(is_json(t) for t in ("text/plain", "application/x-www-form-urlencoded", "", "json"))


def test_the_allowed_lists_from_the_environment() -> None:
    env = {"LMSPD_ALLOWED_HOSTS": "mini.lan, .tail.example", "LMSPD_ALLOWED_ORIGINS": "https://app.example:8443"}
    config = load_config(environ=env)
    assert config.server.allowed_hosts == ["mini.lan", ".tail.example"]
    assert config.server.allowed_origins == ["https://app.example:8443"]


@pytest.mark.parametrize(
    ("env", "param"),
    [
        ({"LMSPD_ALLOWED_HOSTS": "http://mini.lan"}, "server.allowed_hosts"),
        ({"LMSPD_ALLOWED_HOSTS": "mini lan"}, "server.allowed_hosts"),
        ({"LMSPD_ALLOWED_ORIGINS": "app.example"}, "server.allowed_origins"),
        ({"LMSPD_ALLOWED_ORIGINS": "https://app.example/path"}, "server.allowed_origins"),
        ({"LMSPD_ALLOWED_ORIGINS": "*"}, "server.allowed_origins"),  # any page, and no token to stop it
    ],
)
def test_bad_entries_fail_at_start_naming_the_key(env: dict[str, str], param: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(environ=env)
    assert param in str(caught.value)


def test_any_origin_needs_tokens() -> None:
    config = load_config(environ={"LMSPD_ALLOWED_ORIGINS": "*", "LMSP_API_KEYS": "alice:secret-token"})
    assert config.server.allowed_origins == ["*"]


def test_the_name_the_server_binds_is_one_it_answers_to() -> None:
    """``host = "mini.lan"`` (a name, not loopback): the readiness probe and every client dial
    that name, so the guard the app builds answers to it without ``allowed_hosts``."""
    stack = middleware(Config(server=ServerConfig(host="mini.lan")))
    hosts = next(m.kwargs["hosts"] for m in stack if "hosts" in m.kwargs)  # the RequestGuard
    assert isinstance(hosts, HostPolicy)
    assert hosts.allows("mini.lan") and hosts.allows("127.0.0.1") and not hosts.allows("evil.example")
