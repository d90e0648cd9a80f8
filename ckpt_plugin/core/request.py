"""Per-request scope: the namespace a server derived for a request, and what the manager did for it.

A server (see :mod:`ckpt_plugin.http.middleware`) opens a :class:`RequestScope` around each request; the manager reads
the namespace from it and writes the prompt and cached token counts into it. Context variables follow the request
into the worker thread that runs the model (Starlette's and anyio's thread helpers copy the context).
"""

from __future__ import annotations

import threading
import time
from contextvars import ContextVar
from dataclasses import dataclass, field

__all__ = ["Refused", "RequestInterrupted", "RequestScope", "current_request"]


@dataclass(frozen=True)
class Refused:
    """A generation that its request's own input made impossible (a grammar that matches nothing where it went).

    :ivar status: The HTTP status (4xx).
    :ivar code: The error's machine-readable code.
    :ivar message: What went wrong, for a person.
    """

    status: int
    code: str
    message: str


@dataclass
class RequestScope:
    """What one request is allowed to see and what the manager did for it.

    :ivar namespace: Cache partition derived by the server (never chosen freely by the client); ``None`` for the
        manager's own namespace.
    :ivar prompt_tokens: Tokens of the last prompt prepared in this request.
    :ivar cached_tokens: Prompt tokens served from memory, a checkpoint or the cache (not evaluated).
    :ivar cancelled: Set when the client went away: the generation stops at its next token.
    :ivar deadline: ``time.monotonic()`` after which the generation stops (``None``: no limit).
    :ivar max_new_tokens: Tokens the generation may produce at most (``None``: what the request asks).
    :ivar completion_tokens: Tokens the request's generations produced, as the host counts them in ``usage`` (the
        tokens of a stop string included, an end-of-generation token not); ``None`` until a generation runs on an
        attached model.
    :ivar unavailable: Why the request failed for want of capacity, not through a fault (a full pool of cells): the
        server answers 503 with this message instead of the host's 500.
    :ivar refused: Why the request's own input failed its generation (:class:`Refused`): the server answers with
        its 4xx instead of the host's 500, or ends a stream that started with an error event of that status.
    :ivar ignore_eos: The request asked for ``ignore_eos``: end-of-generation tokens are never sampled, so that the
        reply runs to its ``max_tokens`` (or a stop string).
    """

    namespace: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    cancelled: threading.Event = field(default_factory=threading.Event)
    deadline: float | None = None
    max_new_tokens: int | None = None
    completion_tokens: int | None = None
    unavailable: str | None = None
    refused: Refused | None = None
    ignore_eos: bool = False

    def should_stop(self, generated: int) -> bool:
        """Whether a generation that produced ``generated`` tokens must stop before the next one."""
        return self.interrupted() or (self.max_new_tokens is not None and generated >= self.max_new_tokens)

    def interrupted(self) -> bool:
        """Whether the request's client left or its time is up: no more of its tokens, prompt or generated, are
        evaluated (checked between two chunks of a prompt)."""
        return self.cancelled.is_set() or (self.deadline is not None and time.monotonic() >= self.deadline)


class RequestInterrupted(Exception):
    """A prompt's evaluation stopped between two chunks because its request was interrupted
    (:meth:`RequestScope.interrupted`); the generation ends without a token, as if ``max_tokens`` was reached.

    :param evaluated: Tokens of the evaluation that were decoded before it stopped (the memory holds them).
    """

    def __init__(self, evaluated: int) -> None:
        super().__init__(f"the request was interrupted after {evaluated} tokens of its evaluation")
        self.evaluated = evaluated


current_request: ContextVar[RequestScope | None] = ContextVar("ckpt_plugin_request", default=None)
