"""One Config, loaded from TOML, overridden by environment variables and flags.

Precedence: command-line flags > environment > config file > defaults. Every
section rejects unknown keys so a typo fails loudly, naming the key.
"""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path
from typing import Any, Literal

import msgspec

from lmspd.errors import ConfigError

WeightDtype = Literal["auto", "quantized", "quantized_float32", "float32", "float16", "bfloat16"]
NumericsSetting = Literal["auto", "exact", "fast"]
DEFAULT_MODEL = "smollm2-135m-instruct"
# A draft and the input before it in one pass of at most packed.KERNEL_ROWS (32) rows.
MAX_SPECULATIVE_TOKENS = 31


class EngineConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    max_concurrency: int = 8
    max_loaded_models: int = 1
    weight_dtype: WeightDtype = "auto"
    # lmspd's kernels' products (docs/numerics.md): "exact" computes MLX's own bits; "fast" takes
    # 8-bit activations for 4-bit weights, judged by bench.quality; "auto" is fast for a model of
    # 256 MiB of weights or more, exact below (docs/numerics.md, "What auto runs"; env
    # LMSPD_NUMERICS).
    numerics: NumericsSetting = "auto"
    # A lone greedy request verifies prompt-lookup drafts of up to this many tokens in one pass
    # and keeps those the model itself picks: the same tokens, fewer passes where the answer
    # repeats its prompt (docs/speculation.md; 0: off; env LMSPD_SPECULATIVE_TOKENS).
    speculative_tokens: int = 16
    prefill_step_size: int = 512
    # While other requests are decoding, a prefill step is sized to take about this long, so
    # their tokens keep coming while a long prompt is admitted (0: always prefill_step_size).
    prefill_interleave_ms: int = 250
    # BLAS for MLX's CPU backend on Linux: "auto" (the system's OpenBLAS when installed, else
    # the reference BLAS bundled with mlx), "none", or a library path (env LMSPD_BLAS).
    blas: str = "auto"
    # Where the engine builds lmspd's quantized CPU kernels ("": <cache_dir>/.kernels when
    # cache_dir is set, else ~/.cache/lmspd/kernels; env LMSPD_KERNEL_DIR).
    kernel_dir: str = ""
    # KV caches of earlier prompts kept for reuse, in bytes (0 turns the prompt cache off).
    prompt_cache_max_bytes: int = 2 * 1024**3
    # The hottest of them kept in the data directory across restarts (0: none).
    prompt_cache_disk_max_bytes: int = 2 * 1024**3
    # ...never using the last this many bytes of the disk they share with the database: a
    # cache file is not written where it would leave less free (the tier waits for room).
    prompt_cache_disk_min_free_bytes: int = 512 * 1024**2
    # A model idle (no request) this long is unloaded and its memory returned; the next
    # request loads it again (0: never; per model: [models.<alias>] keep_alive_secs).
    keep_alive_secs: float = 1800.0
    # Models loaded and warmed (one short prefill) before the server says it is ready.
    preload: list[str] = msgspec.field(default_factory=list)
    # What the engine's models (weights + KV budgeted for max_concurrency streams) and prompt
    # caches may hold together; None: 60% of physical memory (lmspd.models.footprint).
    max_memory_bytes: int | None = None
    # The engine is replaced while serving once it is this old (0: never), or once its RSS is
    # above this many bytes (0: never); its running generations get recycle_drain_secs to
    # finish, then resume on the next engine (lmspd.core.recycle).
    recycle_after_secs: float = 0.0
    recycle_above_rss_bytes: int = 0
    recycle_drain_secs: float = 60.0
    # One model over several hosts (docs/distributed.md): each host "ip[:port]" of an MLX ring
    # group, this server's engine first (rank 0); every other host runs `lmspd engine join
    # --rank N` with the same list. Empty: one process. Names resolve to their first address.
    hosts: list[str] = msgspec.field(default_factory=list)
    # Layers each host holds, in hosts' order (empty: in proportion to each host's memory).
    host_layers: list[int] = msgspec.field(default_factory=list)
    # A host silent this long in the middle of a step (or its model's load) is lost: the engine
    # exits and each task follows its on_restart policy once the group is whole again.
    group_timeout_secs: float = 30.0
    # A group that cannot form (a host missing when the engine starts) runs the models on this
    # host alone, where they fit, until the engine next starts (`lmspd engine recycle` once the
    # host is back); off: the engine waits for every host, and the server is not ready.
    group_continue_alone: bool = False

    def __post_init__(self) -> None:
        if self.hosts and len(self.hosts) < 2:
            raise ConfigError(
                "engine.hosts names one host: a group needs two or more (leave it empty for one process)",
                param="engine.hosts",
            )
        if self.host_layers and len(self.host_layers) != len(self.hosts):
            raise ConfigError(
                f"engine.host_layers has {len(self.host_layers)} entries for {len(self.hosts)} hosts",
                param="engine.host_layers",
            )
        if any(n <= 0 for n in self.host_layers):
            raise ConfigError("engine.host_layers: every host holds at least one layer", param="engine.host_layers")
        if self.group_timeout_secs <= 0:
            raise ConfigError("engine.group_timeout_secs must be > 0", param="engine.group_timeout_secs")
        if self.max_memory_bytes is not None:
            _positive("engine.max_memory_bytes", self.max_memory_bytes)
        for key in ("recycle_after_secs", "recycle_above_rss_bytes", "recycle_drain_secs"):
            if getattr(self, key) < 0:
                raise ConfigError(f"engine.{key} must be >= 0", param=f"engine.{key}")
        if self.keep_alive_secs < 0:
            raise ConfigError("engine.keep_alive_secs must be >= 0", param="engine.keep_alive_secs")
        for key in ("prompt_cache_max_bytes", "prompt_cache_disk_max_bytes", "prompt_cache_disk_min_free_bytes"):
            if getattr(self, key) < 0:
                raise ConfigError(f"engine.{key} must be >= 0", param=f"engine.{key}")
        _positive("engine.max_concurrency", self.max_concurrency)
        _positive("engine.max_loaded_models", self.max_loaded_models)
        _positive("engine.prefill_step_size", self.prefill_step_size)
        if not 0 <= self.speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            # A pass of more rows than the decode kernels take would not carry decoding's bits.
            raise ConfigError(
                f"engine.speculative_tokens must be in [0, {MAX_SPECULATIVE_TOKENS}], got {self.speculative_tokens}",
                param="engine.speculative_tokens",
            )
        if self.prefill_interleave_ms < 0:
            raise ConfigError("engine.prefill_interleave_ms must be >= 0", param="engine.prefill_interleave_ms")


class ServerConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    host: str = "127.0.0.1"
    port: int = 8080
    data_dir: str | None = None
    # name -> bearer token. Empty: no auth, and the server only binds to loopback.
    tokens: dict[str, str] = msgspec.field(default_factory=dict)
    # name -> bearer token of operators: they may also load, unload and pin models
    # (/lmsp/v1/models/{name}/...); an ordinary token there is refused with 403.
    admin_tokens: dict[str, str] = msgspec.field(default_factory=dict)
    allow_unauthenticated_remote: bool = False
    # Host names (beyond loopback's) this server answers to; ".example.com" takes its
    # subdomains too, "*" any name (behind a proxy that checks Host). A page that rebinds a
    # name of its own to 127.0.0.1 sends its name, and is refused (docs/operations.md,
    # "Security"; env LMSPD_ALLOWED_HOSTS, comma-separated).
    allowed_hosts: list[str] = msgspec.field(default_factory=list)
    # Browser origins ("https://app.example:8443") that may call every route and read the
    # answers (CORS). Pages of any other origin may not change anything here; the console's
    # own origin needs no entry (env LMSPD_ALLOWED_ORIGINS, comma-separated).
    allowed_origins: list[str] = msgspec.field(default_factory=list)
    max_body_bytes: int = 8 * 1024 * 1024
    max_queued_tasks: int = 1000
    event_retention_secs: int = 86400
    task_retention_secs: int = 7 * 86400
    idempotency_retention_secs: int = 86400
    janitor_interval_secs: int = 300
    keepalive_secs: float = 15.0
    shutdown_grace_secs: float = 10.0
    default_max_output_tokens: int = 4096
    # Let requests name a model by local directory or Hugging Face repo id. Off: clients may
    # name only configured aliases and built-in models, never make the server read a path.
    allow_model_paths: bool = False

    def __post_init__(self) -> None:
        _one_owner_per_name(self.tokens, self.admin_tokens)
        for key in (
            "max_body_bytes",
            "max_queued_tasks",
            "event_retention_secs",
            "task_retention_secs",
            "idempotency_retention_secs",
            "janitor_interval_secs",
            "default_max_output_tokens",
        ):
            _positive(f"server.{key}", getattr(self, key))
        if not 0 < self.port < 65536:
            raise ConfigError(f"server.port must be 1-65535, got {self.port}", param="server.port")
        for host in self.allowed_hosts:
            if not _HOST_ENTRY.fullmatch(host):
                raise ConfigError(
                    f"server.allowed_hosts: {host!r} is not a host name, '.suffix' or '*'", param="server.allowed_hosts"
                )
        for origin in self.allowed_origins:
            if origin == "*" and not (self.tokens or self.admin_tokens):
                raise ConfigError(
                    "server.allowed_origins = ['*'] lets any web page drive a server without tokens: "
                    "name the origins, or configure server.tokens",
                    param="server.allowed_origins",
                )
            if origin != "*" and not _ORIGIN.fullmatch(origin):
                raise ConfigError(
                    f"server.allowed_origins: {origin!r} is not an origin (scheme://host[:port], no path)",
                    param="server.allowed_origins",
                )

    @property
    def database_path(self) -> Path:
        if self.data_dir:
            return Path(self.data_dir).expanduser() / "lmspd.db"
        base = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
        return Path(base) / "lmspd" / "lmspd.db"

    @property
    def prompt_cache_dir(self) -> Path:
        """Where the engine keeps prompt caches across restarts, next to the database."""
        return self.database_path.parent / "prompt-cache"


class ResponsesConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The seed's store flags (``--responses-store-max-entries`` is ``store_max_entries`` here)."""

    store_max_entries: int = 1024  # 0 disables storing responses
    store_max_bytes: int = 268435456  # rough JSON budget; 0 evicts stored responses at once
    store_ttl_secs: int = 3600  # 0 disables the TTL
    background_max_jobs: int = 64  # active background responses; 0 disables background mode
    background_ephemeral_ttl_secs: int = 600  # store:false background results stay readable this long
    conversation_store_max_entries: int = 256  # 0 disables conversations
    conversation_store_max_bytes: int = 67108864  # 0 evicts transcripts at once
    conversation_store_ttl_secs: int = 3600  # 0 disables the TTL
    # Reasoning items remembered per assistant turn so a turn sent back without one renders
    # as generated (the seed's MLXCEL_REASONING_ECHO_MAX_BYTES; 0 disables; needs the prompt cache).
    reasoning_echo_max_bytes: int = 16 * 1024**2
    # What one request's tools and JSON schemas may hold: its grammar is compiled, and every
    # decode step masked, within a bound (docs/reliability.md#grammar-and-schema-attacks).
    max_tools: int = 128  # tools per request (OpenAI's limit for Chat Completions functions)
    max_schema_nodes: int = 2000  # JSON objects, arrays and array entries over all the request's schemas
    max_schema_chars: int = 100_000  # characters of their keys and strings (patterns, enums, names...)
    max_schema_depth: int = 64  # JSON nesting of one schema (llguidance reads up to 128)
    # OpenAI's hosted tools (web_search, ...) in a request: "refuse" (400, the seed's rule) or
    # "omit" (left out of the prompt, said in a response header and the log; env LMSPD_HOSTED_TOOLS).
    hosted_tools: Literal["refuse", "omit"] = "refuse"

    def __post_init__(self) -> None:
        for key in self.__struct_fields__:
            value = getattr(self, key)
            if isinstance(value, int) and value < 0:
                raise ConfigError(f"responses.{key} must be >= 0", param=f"responses.{key}")
        for key in (
            "background_ephemeral_ttl_secs",
            "max_tools",
            "max_schema_nodes",
            "max_schema_chars",
            "max_schema_depth",
        ):
            _positive(f"responses.{key}", getattr(self, key))


# The seed's flags, their config keys and their environment variables.
RESPONSES_FLAGS = {
    "--responses-store-max-entries": ("store_max_entries", "LLAMA_ARG_RESPONSES_STORE_MAX_ENTRIES"),
    "--responses-store-max-bytes": ("store_max_bytes", "MLXCEL_RESPONSES_STORE_MAX_BYTES"),
    "--responses-store-ttl-secs": ("store_ttl_secs", "LLAMA_ARG_RESPONSES_STORE_TTL_SECS"),
    "--responses-background-max-jobs": ("background_max_jobs", "MLXCEL_RESPONSES_BACKGROUND_MAX_JOBS"),
    "--responses-background-ephemeral-ttl-secs": (
        "background_ephemeral_ttl_secs",
        "MLXCEL_RESPONSES_BACKGROUND_EPHEMERAL_TTL_SECS",
    ),
    "--conversation-store-max-entries": ("conversation_store_max_entries", "LLAMA_ARG_CONVERSATION_STORE_MAX_ENTRIES"),
    "--conversation-store-max-bytes": ("conversation_store_max_bytes", "MLXCEL_CONVERSATION_STORE_MAX_BYTES"),
    "--conversation-store-ttl-secs": ("conversation_store_ttl_secs", "LLAMA_ARG_CONVERSATION_STORE_TTL_SECS"),
    "--reasoning-echo-max-bytes": ("reasoning_echo_max_bytes", "MLXCEL_REASONING_ECHO_MAX_BYTES"),
}


class ModelEntry(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    # A local mlx-lm directory, a Hugging Face repo id, or a built-in model name.
    path: str
    # Overrides [engine] keep_alive_secs for this model (0: never unloaded for being idle).
    keep_alive_secs: float | None = None

    def __post_init__(self) -> None:
        if self.keep_alive_secs is not None and self.keep_alive_secs < 0:
            raise ConfigError("models.<alias>.keep_alive_secs must be >= 0", param="keep_alive_secs")


class StoreConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    # Unset or sqlite:///path: the embedded SQLite file (default: [server] data_dir's lmspd.db);
    # postgresql://…: a PostgreSQL >= 15 shared by every node (docs/operations.md, "Several nodes").
    url: str | None = None

    def __post_init__(self) -> None:
        if self.url and not self.url.startswith(("sqlite:", "postgresql:", "postgres:")):
            raise ConfigError("store.url must be sqlite:///… or postgresql://…", param="store.url")


class ClusterConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Nodes sharing one PostgreSQL (docs/operations.md, "Several nodes"): each renews its lease every heartbeat."""

    # This node's name among the others; default host:port. Stable across restarts, so a node
    # that restarts settles what its previous run left at once, without waiting for its lease.
    node_id: str | None = None
    heartbeat_secs: float = 2.0
    lease_secs: float = 10.0

    def __post_init__(self) -> None:
        if not 0 < self.heartbeat_secs < self.lease_secs:
            raise ConfigError(
                "cluster.heartbeat_secs must be > 0 and below cluster.lease_secs", param="cluster.heartbeat_secs"
            )


class Config(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    default_model: str = DEFAULT_MODEL
    cache_dir: str | None = None
    # What a request that names no temperature (top_p, top_k) samples with: "model", each
    # model's own defaults (its generation_config.json, the catalog's for a built-in);
    # "openai", OpenAI's 1.0 and 1.0 for every model, as lmspd did before models had their own
    # (docs/operations.md, "Sampling defaults").
    sampling_defaults: Literal["model", "openai"] = "model"
    engine: EngineConfig = msgspec.field(default_factory=EngineConfig)
    server: ServerConfig = msgspec.field(default_factory=ServerConfig)
    responses: ResponsesConfig = msgspec.field(default_factory=ResponsesConfig)
    store: StoreConfig = msgspec.field(default_factory=StoreConfig)
    cluster: ClusterConfig = msgspec.field(default_factory=ClusterConfig)
    models: dict[str, ModelEntry] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        # A service's one cache directory (systemd's CacheDirectory; its home is read-only)
        # holds the kernels too.
        if not self.engine.kernel_dir and self.cache_dir:
            self.engine.kernel_dir = str(Path(self.cache_dir).expanduser() / ".kernels")

    @property
    def model_cache_dir(self) -> Path:
        if self.cache_dir:
            return Path(self.cache_dir).expanduser()
        base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        return Path(base) / "lmspd" / "models"


_HOST_ENTRY = re.compile(r"\*|\.?[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*\.?|\[[0-9A-Fa-f:.]+\]")
_ORIGIN = re.compile(r"https?://([A-Za-z0-9_.-]+|\[[0-9A-Fa-f:.]+\])(:[0-9]{1,5})?")


def _one_owner_per_name(tokens: dict[str, str], admin_tokens: dict[str, str]) -> None:
    """A token's name owns what the token creates (docs/lmsp.md §9.1). A name with both an
    ordinary and an operator token would be one owner under two tokens (the operator's then
    owning the other's tasks), and one token under two names would be whichever matched last:
    both are refused at start, naming the key (LMSP_API_KEYS replaces ``tokens``, so it is held
    to the same rule). The token itself is never named."""
    if both := sorted(tokens.keys() & admin_tokens.keys()):
        raise ConfigError(
            f"server.admin_tokens.{both[0]}: the name {both[0]!r} is also in server.tokens (or "
            "LMSP_API_KEYS); each name owns what its token creates: give the operator a name of its own",
            param=f"server.admin_tokens.{both[0]}",
        )
    named: dict[str, str] = {}
    for key, token in [
        *((f"server.tokens.{n}", t) for n, t in tokens.items()),
        *((f"server.admin_tokens.{n}", t) for n, t in admin_tokens.items()),
    ]:
        if (first := named.setdefault(token, key)) != key:
            raise ConfigError(f"{key} has the same token as {first}: each token must be its own", param=key)


def _positive(key: str, value: int) -> None:
    if value < 1:
        raise ConfigError(f"{key} must be >= 1, got {value}", param=key)


# Environment variables, each mapped to its dotted config key.
ENV_VARS = {
    "LMSPD_CACHE_DIR": "cache_dir",
    "LMSPD_DEFAULT_MODEL": "default_model",
    "LMSPD_SAMPLING_DEFAULTS": "sampling_defaults",
    "LMSPD_MAX_CONCURRENCY": "engine.max_concurrency",
    "LMSPD_MAX_LOADED_MODELS": "engine.max_loaded_models",
    "LMSPD_WEIGHT_DTYPE": "engine.weight_dtype",
    "LMSPD_NUMERICS": "engine.numerics",
    "LMSPD_SPECULATIVE_TOKENS": "engine.speculative_tokens",
    "LMSPD_BLAS": "engine.blas",
    "LMSPD_KERNEL_DIR": "engine.kernel_dir",
    "LMSPD_PREFILL_INTERLEAVE_MS": "engine.prefill_interleave_ms",
    "LMSPD_PROMPT_CACHE_MAX_BYTES": "engine.prompt_cache_max_bytes",
    "LMSPD_PROMPT_CACHE_DISK_MAX_BYTES": "engine.prompt_cache_disk_max_bytes",
    "LMSPD_PROMPT_CACHE_DISK_MIN_FREE_BYTES": "engine.prompt_cache_disk_min_free_bytes",
    "LMSPD_KEEP_ALIVE_SECS": "engine.keep_alive_secs",
    "LMSPD_MAX_MEMORY_BYTES": "engine.max_memory_bytes",
    "LMSPD_RECYCLE_AFTER_SECS": "engine.recycle_after_secs",
    "LMSPD_RECYCLE_ABOVE_RSS_BYTES": "engine.recycle_above_rss_bytes",
    "LMSPD_HOST": "server.host",
    "LMSPD_PORT": "server.port",
    "LMSPD_DATA_DIR": "server.data_dir",
    "LMSPD_HOSTED_TOOLS": "responses.hosted_tools",
    "LMSPD_STORE_URL": "store.url",
    **{env: f"responses.{key}" for key, env in RESPONSES_FLAGS.values()},
}


LIST_ENV_VARS = {"LMSPD_ALLOWED_HOSTS": "server.allowed_hosts", "LMSPD_ALLOWED_ORIGINS": "server.allowed_origins"}


def _set(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for part in parents:
        tree = tree.setdefault(part, {})
    tree[leaf] = value


def load_config(
    path: Path | None = None,
    *,
    overrides: dict[str, Any] | None = None,
    environ: dict[str, str] | None = None,
) -> Config:
    """Build the Config; ``overrides`` are dotted keys from command-line flags."""
    environ = dict(os.environ) if environ is None else environ
    tree: dict[str, Any] = {}
    path = path or (Path(environ["LMSPD_CONFIG"]) if environ.get("LMSPD_CONFIG") else None)
    if path is not None:
        try:
            tree = tomllib.loads(path.read_text())
        except FileNotFoundError as exc:
            raise ConfigError(f"config file {path} does not exist") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from exc
    for var, key in ENV_VARS.items():
        if var in environ:
            _set(tree, key, environ[var])
    for var, key in LIST_ENV_VARS.items():  # comma-separated, as OLLAMA_ORIGINS
        if var in environ:
            _set(tree, key, [entry.strip() for entry in environ[var].split(",") if entry.strip()])
    if environ.get("LMSP_API_KEYS"):
        _set(tree, "server.tokens", parse_api_keys(environ["LMSP_API_KEYS"]))
    for key, value in (overrides or {}).items():
        if value is not None:
            _set(tree, key, value)
    try:
        # strict=False lets environment strings like "8" become ints.
        return msgspec.convert(tree, Config, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"invalid configuration: {exc}") from exc


def parse_api_keys(value: str) -> dict[str, str]:
    """``LMSP_API_KEYS``: comma-separated ``name:token`` (or bare tokens, named key1, key2, ...)."""
    tokens: dict[str, str] = {}
    for i, entry in enumerate(e.strip() for e in value.split(",") if e.strip()):
        name, sep, token = entry.partition(":")
        if not sep:
            name, token = f"key{i + 1}", entry
        if not token:
            raise ConfigError(f"LMSP_API_KEYS entry {i + 1} has an empty token", param="LMSP_API_KEYS")
        tokens[name] = token
    return tokens
