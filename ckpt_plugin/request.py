"""Per-request scope: the namespace a server derived for a request, and what the manager did for it.

A server (see :mod:`ckpt_plugin.middleware`) opens a :class:`RequestScope` around each request; the manager reads
the namespace from it and writes the prompt and cached token counts into it. Context variables follow the request
into the worker thread that runs the model (Starlette's and anyio's thread helpers copy the context).
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass


@dataclass
class RequestScope:
    """What one request is allowed to see and what the manager did for it.

    :ivar namespace: Cache partition derived by the server (never chosen freely by the client); ``None`` for the
        manager's own namespace.
    :ivar prompt_tokens: Tokens of the last prompt prepared in this request.
    :ivar cached_tokens: Prompt tokens served from memory, a checkpoint or the cache (not evaluated).
    """

    namespace: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0


current_request: ContextVar[RequestScope | None] = ContextVar("ckpt_plugin_request", default=None)
