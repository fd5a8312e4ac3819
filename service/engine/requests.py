"""The requests the engine has taken and owes an answer: where each one is (waiting for its
model's room, its grammar compiling, running in its model's batch), what each token adds to
its output (stop strings cut it), and how it ends (finished, failed, cancelled).

``Requests`` is handed the engine's ``send`` and its prompt cache; the residency, the
admission and the stepper are each handed it (worker.Engine composes them).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from lmspd.engine import protocol as p
from lmspd.engine.loaded import LoadedModel, Request

if TYPE_CHECKING:  # it imports MLX, which the server process never does (engine/worker.py)
    from lmspd.engine.prompt_cache import PromptCache

# How the engine's parts answer the server: one reply down the pipe (worker.Engine.send).
Send = Callable[[p.Reply], None]


class Requests:
    """Every request taken and not yet answered, by stage, and the replies that end them."""

    def __init__(self, send: Send, prompt_cache: PromptCache) -> None:
        self.send = send
        self.prompt_cache = prompt_cache
        self.waiting: deque[p.Generate] = deque()  # requests for a model that cannot load yet
        # Requests whose grammar compiles in the grammar thread (a large one takes a while:
        # the batch decodes on meanwhile), by request id.
        self.compiling: dict[str, tuple[p.Generate, Future[Any]]] = {}
        self.by_id: dict[str, tuple[LoadedModel, Request]] = {}  # running, in their model's batch
        # Sent after the step's deltas, which carry their last tokens.
        self.finished: list[p.Finished] = []
        # First tokens that needed no pass (a kept prompt end): sent before the next step runs.
        self.early: list[p.Delta] = []

    # --- where they are -----------------------------------------------------------------------

    def taken(self, request_id: str) -> bool:
        """Whether a request of this id is running or compiling its grammar."""
        return request_id in self.by_id or request_id in self.compiling

    def compiling_for(self) -> set[str]:
        """The models that a compiling grammar's request is about to run on."""
        return {cmd.model for cmd, _ in self.compiling.values()}

    def add(self, lm: LoadedModel, req: Request) -> None:
        lm.requests[req.uid] = req
        self.by_id[req.cmd.request_id] = (lm, req)

    def forget(self, request_id: str) -> None:
        """A request whose command failed before it could start (worker.Engine)."""
        self.by_id.pop(request_id, None)

    # --- how they end -----------------------------------------------------------------------

    def fail(self, cmd: p.Generate, code: str, message: str, param: str | None = None) -> None:
        self.send(p.Failed(request_id=cmd.request_id, code=code, message=message, param=param, model=cmd.model))

    def finish(
        self, lm: LoadedModel, req: Request, reason: p.FinishReason, text: str = "", stop_sequence: str | None = None
    ) -> None:
        del lm.requests[req.uid]
        del self.by_id[req.cmd.request_id]
        self.finished.append(
            p.Finished(
                request_id=req.cmd.request_id,
                reason=reason,
                prompt_tokens=len(req.cmd.prompt),
                completion_tokens=req.completion_tokens,
                cached_tokens=req.cached_tokens,
                text=text,
                stop_sequence=stop_sequence,
            )
        )

    def remove(self, lm: LoadedModel, req: Request) -> None:
        """Take a request out of the batch, keeping what its KV cache holds for later prompts."""
        found = lm.batch.remove([req.uid], return_prompt_caches=self.prompt_cache.enabled)
        if req.uid in found:
            cache, tokens = found[req.uid]
            if tokens and len(tokens) > req.cached_tokens:  # only a cache that learnt something
                self.prompt_cache.store((lm.fingerprint, req.cmd.cache_key), tokens, cache)

    def drop(
        self, lm: LoadedModel, req: Request, message: str, code: str = "server_error", in_batch: bool = True
    ) -> None:
        """Fail one running request (its logprobs or its grammar could not go on)."""
        if in_batch:
            lm.batch.remove([req.uid])
        del lm.requests[req.uid]
        del self.by_id[req.cmd.request_id]
        self.fail(req.cmd, code, message)

    def fail_model(self, lm: LoadedModel, message: str) -> None:
        """Fail every request running on a model whose batch cannot go on."""
        for req in list(lm.requests.values()):
            del lm.requests[req.uid]
            del self.by_id[req.cmd.request_id]
            self.fail(req.cmd, "server_error", message)

    def cancel(self, request_id: str) -> None:
        # Not in the batch yet: waiting for its model, or for its grammar to compile.
        compiling = self.compiling.pop(request_id, None)
        pending = compiling[0] if compiling is not None else None
        for i, cmd in enumerate(self.waiting):
            if cmd.request_id == request_id:
                del self.waiting[i]
                pending = cmd
                break
        if pending is not None:
            self.send(
                p.Finished(
                    request_id=request_id,
                    reason="cancelled",
                    prompt_tokens=len(pending.prompt),
                    completion_tokens=len(pending.generated),
                )
            )
            return
        found = self.by_id.get(request_id)
        if found is None:
            return  # already finished: its Finished reply is on its way
        lm, req = found
        self.remove(lm, req)
        self.finish(lm, req, "cancelled")

    def send_early(self) -> None:
        if self.early:
            self.send(p.Deltas(self.early))
            self.early = []

    def send_finished(self) -> None:
        for reply in self.finished:
            self.send(reply)
        self.finished.clear()

    # --- what a token does --------------------------------------------------------------------

    def on_token(
        self,
        lm: LoadedModel,
        req: Request,
        token: int,
        finish: str | None,
        deltas: list[p.Delta],
        logprob: p.TokenLogprob | None = None,
    ) -> None:
        """A request's next token (from the batch, or a first one that needed no pass): its
        text into ``deltas``, and its end when the token or a stop string ends it."""
        ids: list[int] = []
        text = ""
        if finish != "stop":  # a stop token ends the output without being part of it
            req.completion_tokens += 1
            ids = [token]
            text = req.detok.add(token)
        if finish is not None:
            text += req.detok.flush()
        text, hit = apply_stop_strings(req, text)
        if ids or text:
            logprobs = None if req.cmd.logprobs is None else ([logprob] if ids and logprob else [])
            deltas.append(p.Delta(req.cmd.request_id, ids, text, logprobs))
        if hit is not None:
            if finish is None:
                self.remove(lm, req)
            self.finish(lm, req, "stop", stop_sequence=hit)
        elif finish is not None:
            # No stop string matched after all: the held-back text is output.
            self.finish(lm, req, "stop" if finish == "stop" else "length", req.held)


def apply_stop_strings(req: Request, text: str) -> tuple[str, str | None]:
    """Cut text at the first stop string (returned: the one that matched, else None); hold
    back a suffix that may start one."""
    stops = req.cmd.stop
    if not stops:
        return text, None
    pending = req.held + text
    found = [(i, s) for s in stops if (i := pending.find(s)) >= 0]
    if found:
        cut, hit = min(found, key=lambda f: f[0])
        req.held = ""
        return pending[:cut], hit
    keep = max((k for s in stops for k in range(1, len(s)) if pending.endswith(s[:k])), default=0)
    req.held = pending[len(pending) - keep :] if keep else ""
    return pending[: len(pending) - keep], None
