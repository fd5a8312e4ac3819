"""Messages between the server and the engine process (msgpack over a pipe).

Commands flow to the engine, replies flow back. Each is a tagged
``msgspec.Struct`` so one decoder per direction validates every message.
"""

from __future__ import annotations

from typing import Literal

import msgspec

FinishReason = Literal["stop", "length", "cancelled"]


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0

    def validate(self) -> None:
        """Raise InvalidRequestError naming the first out-of-range parameter."""
        from service.errors import InvalidRequestError

        if not 0.0 <= self.temperature <= 2.0:
            raise InvalidRequestError(
                f"temperature must be between 0 and 2, got {self.temperature}", param="temperature"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}", param="top_p")
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k must be >= 0, got {self.top_k}", param="top_k")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}", param="min_p")


# --- commands -------------------------------------------------------------------------------


class LoadModel(msgspec.Struct, tag=True, frozen=True):
    model: str  # the name clients use
    path: str  # the resolved mlx-lm directory


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


class Cancel(msgspec.Struct, tag=True, frozen=True):
    request_id: str


class Shutdown(msgspec.Struct, tag=True, frozen=True):
    pass


Command = LoadModel | Generate | Cancel | Shutdown


# --- replies --------------------------------------------------------------------------------


class Ready(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    pid: int
    backend: str  # "cpu" | "gpu"
    mlx_version: str


class ModelLoading(msgspec.Struct, tag=True, frozen=True):
    model: str


class ModelLoaded(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    model: str
    weight_dtype: str
    seconds: float


class Delta(msgspec.Struct, array_like=True, frozen=True):
    request_id: str
    token_ids: list[int]
    text: str


class Deltas(msgspec.Struct, tag=True, frozen=True):
    """Every request's new tokens from one decode step, in one message."""

    items: list[Delta]


class Finished(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    request_id: str
    reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    text: str = ""  # text held back until the end (an incomplete UTF-8 tail)


class Failed(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    request_id: str | None  # None: a failure not tied to one request (e.g. a model load)
    code: str
    message: str
    param: str | None = None
    model: str | None = None


Reply = Ready | ModelLoading | ModelLoaded | Deltas | Finished | Failed

command_encoder = msgspec.msgpack.Encoder()
command_decoder = msgspec.msgpack.Decoder(Command)
reply_encoder = msgspec.msgpack.Encoder()
reply_decoder = msgspec.msgpack.Decoder(Reply)
