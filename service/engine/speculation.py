"""Prompt-lookup drafts: the tokens that followed the last time a sequence's latest few tokens
appeared in it, proposed as its next ones (docs/speculation.md).

An agent's edit repeats long stretches of its prompt (the file it changes), a summary quotes it,
a list repeats its own phrases: there the continuation of an earlier occurrence is often the
model's own. ``StepNow`` (upstream/stepping.py) feeds such a draft behind the sequence's next
input in one pass of a few rows and keeps the drafted tokens the model itself picks, so greedy
output is the same token for token (the rows of a pass of up to ``packed.KERNEL_ROWS`` carry a
decode step's bits, kernels/attention.h's ``attend_each_row``); what it saves is a pass per
kept token. ``Drafter`` is what StepNow asks, one per request (worker.main hands
``upstream.stepping.install`` the way to make one: upstream/ imports nothing of lmspd's).

This module is only the lookup and its policy: plain Python over token ids, no MLX.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The longest n-gram looked up first: a longer match is likelier to go on as before.
NGRAM_MAX = 4
# A single repeated token proposes too much: its continuation is the model's own only by chance.
NGRAM_MIN = 2
# The longest run of steps without a draft after drafts the model kept none of.
MAX_PAUSE = 16
# Steps without a lookup after one found nothing: meanwhile the batch runs a pass ahead
# (upstream/stepping.py), which a step that may draft cannot.
MISS_PAUSE = 2


@dataclass
class Ngrams:
    """One sequence's tokens and where each of their n-grams last started (before the newest
    token's), so a lookup costs a dictionary probe per n, not a scan of the sequence."""

    tokens: list[int] = field(default_factory=list)
    last: dict[tuple[int, ...], int] = field(default_factory=dict)
    indexed: int = 0  # the n-grams ending before this index are in ``last``

    def extend(self, tokens: list[int]) -> None:
        self.tokens.extend(tokens)

    def truncate(self, length: int) -> None:
        """The sequence cut back to ``length`` tokens (drafts not kept)."""
        del self.tokens[length:]
        self.indexed = min(self.indexed, length)

    def draft(self, limit: int) -> list[int]:
        """Up to ``limit`` tokens that followed the latest earlier occurrence of the sequence's
        last ``NGRAM_MAX`` .. ``NGRAM_MIN`` tokens (the longest that occurred); [] if none did."""
        tokens = self.tokens
        # Index every n-gram that ends before the newest token: the newest one's own n-grams
        # would match themselves.
        for end in range(max(self.indexed, NGRAM_MIN), len(tokens)):
            for n in range(NGRAM_MIN, NGRAM_MAX + 1):
                if end >= n:
                    self.last[tuple(tokens[end - n : end])] = end - n
        self.indexed = len(tokens)
        if limit < 1:
            return []
        for n in range(NGRAM_MAX, NGRAM_MIN - 1, -1):
            if len(tokens) <= n:
                continue
            start = self.last.get(tuple(tokens[-n:]))
            # An entry from before a truncation may point past what is left, or no longer match.
            if start is None or start + n >= len(tokens) or tokens[start : start + n] != tokens[-n:]:
                continue
            return tokens[start + n : start + n + limit]
        return []


@dataclass
class PromptLookup:
    """The engine's drafting policy for one sequence: at most ``max_draft`` tokens a pass; the
    draft grows while the model keeps all of it and shrinks to what it kept otherwise; a draft
    the model keeps none of pauses drafting for a while, longer each time, so prose that
    rarely repeats pays for few rows it throws away (a pass's rows cost a fraction of a pass
    each: docs/speculation.md); a lookup that finds nothing pauses it for ``MISS_PAUSE`` steps,
    which run a pass ahead as a batch that does not draft does."""

    max_draft: int
    window: int = 0  # the next draft's length (0: not yet set)
    pause: int = 0  # steps left without a draft
    backoff: int = 0  # the next pause's length

    def waiting(self) -> bool:
        """Whether this step drafts nothing (paused)."""
        return self.pause > 0

    def wait(self) -> None:
        """A step gone by without a draft."""
        self.pause = max(0, self.pause - 1)

    def missed(self) -> None:
        """A lookup found nothing: a few steps without one."""
        self.pause = max(self.pause, MISS_PAUSE)

    def length(self) -> int:
        """The next draft's length."""
        if self.window == 0:
            self.window = min(4, self.max_draft)
        return self.window

    def kept(self, drafted: int, accepted: int) -> None:
        """How much of a draft the model kept: the next one's length follows."""
        if accepted == 0:
            self.backoff = min(MAX_PAUSE, 2 * self.backoff or 1)
            self.pause = self.backoff
        else:
            self.backoff = 0
        if accepted == drafted:
            self.window = min(self.max_draft, 2 * max(drafted, 1))
        else:
            self.window = max(1, min(self.max_draft, accepted + 1))


class Drafter:
    """One request's drafts: its n-grams, kept in step with the tokens its cache holds, and
    the policy."""

    def __init__(self, max_draft: int) -> None:
        self.ngrams = Ngrams()
        self.policy = PromptLookup(max_draft)

    def propose(self, context: list[int], inputs: list[int], room: int) -> list[int]:
        """The draft behind ``inputs`` (the next pass's input), ``context`` being the tokens the
        cache holds: at most ``room`` tokens, [] for none."""
        if self.policy.waiting():
            self.policy.wait()
            return []
        ngrams = self.ngrams
        known = len(ngrams.tokens) - len(inputs)  # what the last call saw of context
        if known < 0 or known > len(context) or (known > 0 and ngrams.tokens[known - 1] != context[known - 1]):
            self.ngrams = ngrams = Ngrams()  # the context is not the one indexed: start over
            known = 0
        ngrams.truncate(known)
        ngrams.extend(context[known:])
        ngrams.extend(inputs)
        draft = ngrams.draft(min(self.policy.length(), room))
        if not draft and room > 0:
            self.policy.missed()
        return draft

    def waiting(self) -> bool:
        """Whether the next steps draft nothing: the batch may run a pass ahead meanwhile."""
        return self.policy.waiting()

    def wait(self) -> None:
        """A step gone by (ahead) without a lookup."""
        self.policy.wait()

    def kept(self, drafted: int, accepted: int) -> None:
        self.policy.kept(drafted, accepted)
