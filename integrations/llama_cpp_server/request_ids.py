"""``X-Request-Id``: the id a client or router gives a request is kept and echoed, whatever its form.

llama_cpp.server installs starlette_context's ``RequestIdPlugin``, which takes UUIDs only: a request whose id a router
forwarded as the client sent it (``req-123``, a trace id) got a 400 with an empty body, and no route answered it.
ckpt-serve checks the header itself, in front of every route (the checkpoint routes and the middleware's refusals
included), and hands the host's plugin an id it takes as it is:

- an id of 1 to :data:`MAX_CHARS` visible ASCII characters (no spaces, no control characters) is kept and echoed in
  the response's ``X-Request-ID``;
- a request without one (or with an empty one) gets a new one, as before (a UUID4 in hex), echoed the same way;
- any other is refused with a 400 JSON error ``invalid_request_id`` (it carries a new id in the header, which logs
  can name): an id that a log or a trace cannot hold as it is would be worse replaced in silence.
"""

from __future__ import annotations

import re
import uuid
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send
from starlette_context.middleware import RawContextMiddleware
from starlette_context.plugins import RequestIdPlugin

from ckpt_plugin.http.body_limit import error_response

HEADER = b"x-request-id"
ECHOED = b"X-Request-ID"  # as the host's plugin spells it
MAX_CHARS = 200
"""The longest id kept: room for a UUID, a W3C ``traceparent`` (55) or an AWS trace id with its parent (about 90)."""

_VALID = re.compile(rf"[\x21-\x7e]{{1,{MAX_CHARS}}}")


class RequestIds:
    """Pure ASGI middleware that gives every HTTP request a checked ``X-Request-Id`` and echoes it (see the module
    docstring).

    :param app: The wrapped app (ckpt-serve's whole app, the host's plugin inside).
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((value for name, value in scope["headers"] if name.lower() == HEADER), b"").strip()
        if given and not _VALID.fullmatch(given.decode("latin-1")):
            why = f"is {len(given)} bytes long" if len(given) > MAX_CHARS else \
                "holds a space, a tab or a byte outside ASCII"
            response = error_response(
                400, "invalid_request_id",
                f"X-Request-Id must be 1 to {MAX_CHARS} visible ASCII characters (letters, digits, punctuation), and "
                f"this one {why}: send another, or none and the server makes one")
            response.headers["X-Request-ID"] = uuid.uuid4().hex
            await response(scope, receive, send)
            return
        request_id = given or uuid.uuid4().hex.encode()
        headers = [(name, value) for name, value in scope["headers"] if name.lower() != HEADER]
        scope = {**scope, "headers": [*headers, (HEADER, request_id)]}

        async def echo(message: Message) -> None:
            if message["type"] == "http.response.start":
                sent = list(message.get("headers", []))
                if not any(name.lower() == HEADER for name, _ in sent):  # the host's plugin echoes on its routes
                    message = {**message, "headers": [*sent, (ECHOED, request_id)]}
            await send(message)

        await self.app(scope, receive, echo)


def accept_any_request_id(app: Any) -> None:
    """Let the host's ``RawContextMiddleware`` take the id :class:`RequestIds` checked as it is (its plugin would
    refuse any id but a UUID with a bare 400). Call before the app serves its first request."""
    for entry in app.user_middleware:
        if entry.cls is RawContextMiddleware:
            plugins = tuple(RequestIdPlugin(validate=False) if isinstance(plugin, RequestIdPlugin) else plugin
                            for plugin in entry.kwargs.get("plugins", ()))
            entry.kwargs["plugins"] = plugins
