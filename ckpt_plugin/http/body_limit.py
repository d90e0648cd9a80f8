"""Request-body size limit for every route, and the one body reader the project's own routes use.

``BodyLimitMiddleware`` sits in front of the whole app: a request whose ``Content-Length`` exceeds the limit gets
a 413 before the app runs; a chunked body that grows past it is cut (the app sees a disconnect) and the client gets
the 413 if no response has started. The host's own routes are protected too: a 50 MB body to ``/extras/tokenize``
never reaches the event loop's JSON parser.
"""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["BodyLimitMiddleware", "BodyTooLarge", "ClientDisconnect", "error_response", "read_body"]

DEFAULT_MAX_BODY_BYTES = 32 << 20
"""Default limit: 32 MiB, far above any chat request (a 128k-token prompt is under 1 MiB of JSON)."""


class BodyTooLarge(Exception):
    """A request body exceeded its limit."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"request bodies are limited to {limit} bytes")
        self.limit = limit


class ClientDisconnect(Exception):
    """The client went away before its body was read."""


def error_response(status: int, code: str, message: str) -> JSONResponse:
    """The project's JSON error body: ``{"error": {"code": ..., "message": ...}}`` (OpenAI's shape)."""
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=status)


async def read_body(receive: Receive, limit: int) -> bytes:
    """Read a whole request body of at most ``limit`` bytes.

    :raises BodyTooLarge: The body is longer.
    :raises ClientDisconnect: The client disconnected first.
    """
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        body.extend(message.get("body", b""))
        if len(body) > limit:
            raise BodyTooLarge(limit)
        if not message.get("more_body", False):
            return bytes(body)


class BodyLimitMiddleware:
    """Refuse request bodies over ``max_bytes`` on every HTTP route with a 413 JSON error.

    :param app: The wrapped ASGI app.
    :param max_bytes: The limit.
    """

    def __init__(self, app: ASGIApp, max_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length")
        if declared is not None:
            if not declared.isascii() or not declared.isdigit():
                await error_response(400, "invalid_request", "Content-Length must be a number")(scope, receive, send)
                return
            if int(declared) > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
        received = 0
        started = False
        refused = False

        async def limited_receive() -> Message:
            nonlocal received, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    refused = True
                    if not started:
                        await self._refuse(scope, receive, send)
                    return {"type": "http.disconnect"}
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if refused:
                return
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        await self.app(scope, limited_receive, tracking_send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = error_response(413, "too_large", f"request bodies are limited to {self.max_bytes} bytes")
        await response(scope, receive, send)
