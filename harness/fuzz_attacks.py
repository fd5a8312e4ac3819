"""Hand-written attacks for ``harness.fuzz``: bodies schemathesis' generation does not reach, sent
to every documented route that reads them (issue 41 found each answering 500, or accepted where
create refuses it).

- item references (typed and untyped; to no item, to another owner's, to the caller's own) at
  the top of ``input``, inside a compaction item's payload, and on ``/responses/compact``;
- reasoning seals lmspd never made, on every route that reads ``input`` (``/compact`` too);
- ``type`` fields that are no string (a list, an object): a tool's, an input item's, a content
  part's, a payload item's.

Each answer is held to the run's invariants (no 5xx; the surface's error shape,
:func:`harness.fuzz_checks.check_error`) and, where the attack says which field a refusal names,
to a 400 naming it.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from harness.fuzz_checks import check_error

NOT_STRINGS: list[Any] = [[], {}, ["function"], {"type": "function"}]
FORGED_SEALS = ["lmspd.r1.not-a-real-seal", "lmspd.r1.", "lmspd.r1." + "A" * 64, "gAAAA-openai-sealed"]
USER = {"role": "user", "content": "Hi"}
ANSWER = {"role": "assistant", "content": "Hello."}
FUNCTION = {"type": "function", "name": "lookup", "parameters": {"type": "object", "properties": {}}}
CHAT_FUNCTION = {"type": "function", "function": {k: v for k, v in FUNCTION.items() if k != "type"}}
MAX_TOKENS = 4  # the answer is not what is tested


@dataclass(frozen=True)
class Attack:
    name: str
    path: str  # a documented route, POSTed
    body: dict[str, Any]
    param: str | None  # the field of the request a 400 must name; None: any answer but a 5xx
    within: str = ""  # where the route holds the request (a task's is its envelope's "input.")

    def names(self, param: str | None) -> bool:
        # A task's intake names a field within the envelope; the core's refusals (a reference,
        # a seal) name it within the request, as on the other routes: either is the field.
        return self.param is None or param in (self.param, self.within + self.param)


class Answer(Protocol):
    """What :func:`fault` reads of a response (httpx's, or a Starlette TestClient's)."""

    @property
    def status_code(self) -> int: ...
    @property
    def headers(self) -> Mapping[str, str]: ...
    @property
    def text(self) -> str: ...
    def json(self) -> Any: ...


def payload(items: list[Any]) -> str:
    """A compaction item's ``encrypted_content`` (lmspd.responses.inputs.encode_payload's format)."""
    raw = json.dumps({"summary": "Earlier: a greeting.", "items": items}).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def compaction(items: list[Any]) -> dict[str, Any]:
    return {"type": "compaction", "encrypted_content": payload(items)}


def inputs(own: str | None, others: str | None) -> list[tuple[str, list[Any], str | None]]:
    """(name, input, the param its refusal names) of the attacks on a request's ``input``.
    ``own``: an item id of the caller's stored responses; ``others``: another owner's."""
    cases: list[tuple[str, list[Any], str | None]] = []
    targets: list[tuple[str, str, str | None]] = [("no item", "msg_fuzz_no_such_item", "input[1].id")]
    targets += [("another owner's", others, "input[1].id")] if others else []
    targets += [("the caller's", own, None)] if own else []  # resolves: any answer but a 5xx
    for whose, target, param in targets:
        for form, reference in (("typed", {"type": "item_reference", "id": target}), ("untyped", {"id": target})):
            cases.append((f"{form} reference to {whose}", [USER, reference], param))
            # Never resolved inside a payload (lmspd writes the items there, not references to them).
            inside = [compaction([USER, reference]), USER]
            cases.append((f"{form} reference to {whose} in a compaction payload", inside, "input[0].encrypted_content"))
    for token in FORGED_SEALS:
        sealed = {"type": "reasoning", "summary": [], "encrypted_content": token}
        cases.append((f"forged seal {token[:16]!r}", [USER, sealed, ANSWER, USER], "input[1].encrypted_content"))
    for kind in NOT_STRINGS:
        cases += [
            (f"item type {kind!r}", [USER, {"type": kind}], "input[1].type"),
            (f"message type {kind!r}", [USER, {**USER, "type": kind}], "input[1].type"),
            (
                f"content part type {kind!r}",
                [{"role": "user", "content": [{"type": kind, "text": "Hi"}]}],
                "input[0].content[0].type",
            ),
            (f"payload item type {kind!r}", [compaction([{"type": kind}]), USER], "input[0].encrypted_content"),
        ]
    return cases


def tools() -> list[tuple[str, list[Any], str | None]]:
    """(name, tools, the param its refusal names) of the attacks on a request's ``tools``."""
    cases: list[tuple[str, list[Any], str | None]] = []
    for kind in NOT_STRINGS:
        cases.append((f"tool type {kind!r}", [FUNCTION, {"type": kind, "name": "x"}], "tools[1].type"))
        namespace = {"type": "namespace", "name": "ns", "tools": [{"type": kind, "name": "x"}]}
        cases.append((f"namespaced tool type {kind!r}", [FUNCTION, namespace], None))
    return cases


def _wrap(path: str, request: dict[str, Any]) -> tuple[dict[str, Any], str] | None:
    """``request`` as ``path`` takes it, and where it holds the request (:attr:`Attack.within`);
    None: not a route that reads a Responses request."""
    if path.endswith(("/responses", "/responses/input_tokens")):
        return request, ""
    if path.endswith("/responses/compact"):
        return {k: v for k, v in request.items() if k in ("input", "max_output_tokens")}, ""
    if path == "/lmsp/v1/tasks":
        return {"type": "response", "input": request}, "input."
    return None


def attacks(paths: Iterable[str], own: str | None = None, others: str | None = None) -> list[Attack]:
    """Every attack on every route of ``paths`` (the document's POST routes) that reads it."""
    found: list[Attack] = []
    for path in sorted(paths):
        for name, items, param in inputs(own, others):
            if (wrapped := _wrap(path, {"input": items, "max_output_tokens": MAX_TOKENS})) is not None:
                body, within = wrapped
                found.append(Attack(name, path, body, param, within))
        if path.endswith("/responses/compact"):
            continue  # takes no tools
        for name, sent, param in tools():
            if (wrapped := _wrap(path, {"input": "Hi", "tools": sent, "max_output_tokens": MAX_TOKENS})) is not None:
                body, within = wrapped
                found.append(Attack(name, path, body, param, within))
        if path.endswith("/chat/completions"):
            for kind in NOT_STRINGS:
                chat_tools = [CHAT_FUNCTION, {"type": kind, "function": {"name": "x"}}]
                chat = {"messages": [USER], "tools": chat_tools, "max_tokens": MAX_TOKENS}
                found.append(Attack(f"tool type {kind!r}", path, chat, "tools[1]"))
    return found


def fault(attack: Attack, response: Answer) -> str | None:
    """What is wrong with ``response`` to ``attack``, or None."""
    where = f"{attack.name} on POST {attack.path}"
    status = response.status_code
    if status >= 500:
        return f"{where}: {status} {response.text[:300]}"
    body = None
    if status >= 400:
        media = response.headers.get("content-type", "").partition(";")[0].strip()
        authenticate = response.headers.get("www-authenticate")
        try:
            body = response.json()
            check_error(attack.path, status, media, body, [authenticate] if authenticate else [])
        except (AssertionError, ValueError) as exc:
            return f"{where}: {exc}"
    if attack.param is None:
        return None
    if status != 400 or not isinstance(body, dict):
        return f"{where}: {status}, not a 400 naming {attack.param}"
    named = body["error"]["param"] if "error" in body else body.get("param")
    return None if attack.names(named) else f"{where}: a 400 naming {named!r}, not {attack.param!r}"
