"""Messages between the server and the engine process (msgpack over a pipe).

Commands flow to the engine, replies flow back. Each is a tagged
``msgspec.Struct`` so one decoder per direction validates every message.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from lmspd.models.sampling import KEYS as SAMPLING_KEYS
from lmspd.models.sampling import out_of_range

FinishReason = Literal["stop", "length", "cancelled"]

# OpenAI's bound on top_logprobs (Responses and Chat Completions alike).
MAX_TOP_LOGPROBS = 20


def validate_top_logprobs(k: int | None, param: str = "top_logprobs") -> None:
    """Raise InvalidRequestError unless k is None (no logprobs) or in 0..MAX_TOP_LOGPROBS."""
    from lmspd.errors import InvalidRequestError

    if k is not None and not 0 <= k <= MAX_TOP_LOGPROBS:
        raise InvalidRequestError(f"{param} must be between 0 and {MAX_TOP_LOGPROBS}, got {k}", param=param)


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    # With temperature > 0, the request draws from its own generator seeded with this, so
    # the same seed, prompt and parameters give the same tokens whatever else is running.
    # None: MLX's shared generator (not reproducible). Ignored by greedy decoding.
    seed: int | None = None

    def validate(self) -> None:
        """Raise InvalidRequestError naming the first out-of-range parameter."""
        from lmspd.errors import InvalidRequestError

        for name in SAMPLING_KEYS:
            if (why := out_of_range(name, getattr(self, name))) is not None:
                raise InvalidRequestError(why, param=name)
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise InvalidRequestError(f"seed must be a 64-bit integer, got {self.seed}", param="seed")


# --- commands -------------------------------------------------------------------------------


class LoadModel(msgspec.Struct, tag=True, frozen=True):
    model: str  # the name clients use
    path: str  # the resolved mlx-lm directory
    # Seconds the model may stay idle before it is unloaded (0: never); None: the engine's
    # keep_alive_secs. Remembered by name, so a reload after an idle unload keeps it.
    keep_alive_secs: float | None = None


class Generate(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    request_id: str
    model: str
    path: str
    prompt: list[int]
    # Tokens a previous attempt already generated: the engine continues after them
    # exactly as if it had never stopped (resume from a snapshot).
    generated: list[int] = []
    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop_token_ids: list[int] = []
    stop: list[str] = []
    # None: no logprobs. k in 0..MAX_TOP_LOGPROBS: each generated token's logprob and the
    # k most likely tokens at its position (what OpenAI's top_logprobs=k returns).
    logprobs: int | None = None
    # A llguidance (lark) grammar the output must match; None: free text.
    grammar: str | None = None
    # The prompt cache's namespace within the model: requests share cached prefixes only
    # with requests of the same key (the server keys by client, so no client can time
    # another's prompts).
    cache_key: str = ""


class Cancel(msgspec.Struct, tag=True, frozen=True):
    request_id: str


class Shutdown(msgspec.Struct, tag=True, frozen=True):
    pass


class UnloadModel(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Unload a model now (an operator's call). Its running requests are cancelled when
    ``force``; without it a busy model stays (the server checked it was idle)."""

    model: str
    force: bool = False


class PinModel(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """A pinned model is never unloaded for being idle (loaded or not: remembered by name)."""

    model: str
    pinned: bool


class Status(msgspec.Struct, tag=True, frozen=True):
    """Ask for an :class:`EngineStatus`; answered in order with the commands before it."""

    query: int


Command = LoadModel | Generate | Cancel | Shutdown | UnloadModel | PinModel | Status


# --- replies --------------------------------------------------------------------------------


class GroupHost(msgspec.Struct, frozen=True, kw_only=True):
    """One host of the engine's group (engine/group): its rank, as configured, its memory,
    and the ring's speed measured when the group formed."""

    rank: int
    host: str
    memory_bytes: int
    link_bytes_per_sec: float


class Ready(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    pid: int
    backend: str  # "cpu" | "gpu"
    mlx_version: str
    blas: str = ""  # the BLAS library MLX's CPU backend runs on (a path, or the bundled reference)
    hosts: list[GroupHost] = []  # the engine's group, rank 0 first ([]: one process)
    # Configured for a group, serving alone (engine.group_continue_alone): why ("": not so).
    alone: str = ""


class ModelLoading(msgspec.Struct, tag=True, frozen=True):
    model: str


UnloadReason = Literal["idle", "budget", "operator", "failed"]


class ModelEvicted(msgspec.Struct, tag=True, frozen=True):
    """The model left memory: idle past its keep-alive, to make room for another (budget),
    by an operator's call, or after a failed step."""

    model: str
    reason: UnloadReason = "budget"


class ModelLoaded(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    model: str
    weight_dtype: str
    numerics: str = "exact"  # its products' (docs/numerics.md)
    seconds: float
    resident_bytes: int = 0  # its weights as held in memory (rank 0's, in a group)
    hosts: list[HostShare] = []  # split over a group: each host's part, rank 0 first


class HostShare(msgspec.Struct, frozen=True, kw_only=True):
    """One host's part of a model split over the engine's group (docs/distributed.md)."""

    rank: int
    host: str
    layers: list[int]  # [first, end): the model's layers it holds
    resident_bytes: int  # its weights as it holds them (the embeddings and head in each)
    memory_bytes: int  # the host's physical memory
    link_bytes_per_sec: float  # the ring's speed, measured when the group formed


class ModelState(msgspec.Struct, frozen=True, kw_only=True):
    """One model the engine holds or has been told about (pinned, or a keep-alive)."""

    model: str
    loaded: bool
    resident_bytes: int = 0
    weight_dtype: str = ""
    numerics: str = ""
    running: int = 0  # requests in its batch
    idle_secs: float | None = None  # since its last request ended (None: busy, or not loaded)
    unload_in_secs: float | None = None  # None: not loaded, busy, pinned or keep-alive 0
    keep_alive_secs: float = 0.0
    pinned: bool = False
    hosts: list[HostShare] = []  # split over a group: each host's part, rank 0 first


class EngineStatus(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    query: int
    rss_bytes: int  # the engine process's resident set
    models: list[ModelState]
    prompt_cache_bytes: int = 0
    # MLX's own accounting: bytes its live arrays hold, and freed buffers it keeps for reuse
    # (its buffer cache, bounded on the CPU: engine/loaded.py).
    mlx_active_bytes: int = 0
    mlx_cache_bytes: int = 0


class TopLogprob(msgspec.Struct, array_like=True, frozen=True):
    token: str  # see TokenLogprob.token
    logprob: float
    bytes: list[int]


class TokenLogprob(msgspec.Struct, array_like=True, frozen=True):
    """One generated token's log-probability, in OpenAI's shape.

    ``bytes`` are the token's exact UTF-8 bytes (a byte-level BPE token may hold part
    of a character; concatenating consecutive entries' bytes rebuilds the text).
    ``token`` is those bytes as text, with bytes that are not valid UTF-8 on their own
    written as ``\\xNN`` escapes, as OpenAI does, rather than U+FFFD, which would make
    distinct partial tokens look alike. ``logprob`` is finite: -9999.0 stands for a
    token that cannot be chosen (OpenAI's convention; JSON has no -Infinity).
    ``top_logprobs`` are the k most likely tokens at this position, most likely first.
    """

    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class Delta(msgspec.Struct, array_like=True, frozen=True):
    request_id: str
    token_ids: list[int]
    text: str
    # One entry per id in token_ids when the request asked for logprobs; None otherwise.
    # Last and optional so that the array encoding of a Delta without it is unchanged.
    logprobs: list[TokenLogprob] | None = None


class Deltas(msgspec.Struct, tag=True, frozen=True):
    """Every request's new tokens from one decode step, in one message."""

    items: list[Delta]


class Finished(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    request_id: str
    reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    text: str = ""  # text held back until the end (an incomplete UTF-8 tail)
    cached_tokens: int = 0  # prompt tokens whose KV came from the prompt cache
    stop_sequence: str | None = None  # the stop string that ended it (reason "stop"), if one did


class Failed(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    request_id: str | None  # None: a failure not tied to one request (e.g. a model load)
    code: str
    message: str
    param: str | None = None
    model: str | None = None


Reply = Ready | ModelLoading | ModelLoaded | ModelEvicted | Deltas | Finished | Failed | EngineStatus

command_encoder = msgspec.msgpack.Encoder()
command_decoder = msgspec.msgpack.Decoder(Command)
reply_encoder = msgspec.msgpack.Encoder()
reply_decoder = msgspec.msgpack.Decoder(Reply)
