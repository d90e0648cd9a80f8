"""One generation request handed to the host: its body replayed, its client watched, its stream closed properly.

- The body the middleware already read is handed to the host as if it came from the client (:func:`replay_body`).
- The client is watched while the host works: when it disconnects, ``cancelled`` is set and the plugin's
  ``generate`` stops at the next token, streaming or not (the host alone keeps a non-streaming generation running
  for a client that is gone). The host still sees the disconnect when it asks for one.
- A streamed response whose generation fails after the stream started (a prompt longer than the context, say) ends
  with an error event and ``data: [DONE]`` instead of an empty, truncated stream.
- A generation that failed for want of capacity (:attr:`RequestScope.unavailable`: a full pool of cells) is a 503
  with ``Retry-After``, not the host's 500; in a stream that started, its error event says 503.
- A generation that the request's own input made impossible (:attr:`RequestScope.refused`: a grammar that matches
  nothing where the generation went) is that 4xx (422 ``invalid_grammar``), and so is its stream's error event.
"""

from __future__ import annotations

import json
import logging
import threading

import anyio
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ckpt_plugin.core.errors import GrammarDeadEnd, PoolFullError
from ckpt_plugin.core.request import Refused, RequestScope
from ckpt_plugin.http.body_limit import error_response

__all__ = ["Generation", "replay_body"]

log = logging.getLogger("ckpt_plugin")


def replay_body(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that hands the app the already-read body, then what ``receive`` gives (disconnects)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


class Generation:
    """Runs ``app`` for one generation request (see the module docstring).

    :param app: The host app (wrapped by whatever rewrites its response).
    :param cancelled: Set when the client disconnects.
    :param request_scope: The request's scope, whose ``unavailable`` turns the host's 500 into a 503, and whose
        ``refused`` into its 4xx.
    """

    def __init__(self, app: ASGIApp, cancelled: threading.Event, request_scope: RequestScope | None = None) -> None:
        self.app = app
        self.cancelled = cancelled
        self.request_scope = request_scope
        self.replaced = False  # the host's failed response was answered with a 503 or 4xx: its messages are dropped
        self.started = False
        self.done_sent = False
        self.closing: Message | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send, body: bytes, stream: bool) -> None:
        disconnected = anyio.Event()

        async def watch_client() -> None:
            # After the body, the only message a client sends is its disconnect.
            while (await receive())["type"] != "http.disconnect":
                pass
            self.cancelled.set()
            disconnected.set()

        async def disconnect() -> Message:
            await disconnected.wait()
            return {"type": "http.disconnect"}

        app_receive = replay_body(body, disconnect)  # the watcher alone reads the client's messages

        async def tracking_send(message: Message) -> None:
            if self.replaced:
                return
            if message["type"] == "http.response.start":
                if message["status"] >= 500 and self._refusal() is not None:
                    await self._refuse(scope, send)
                    return
                self.started = True
            elif message["type"] == "http.response.body":
                self.done_sent = self.done_sent or b"data: [DONE]" in message.get("body", b"")
                if stream and not message.get("more_body", False) and not self.done_sent:
                    # The host closes a failed stream before its error reaches this middleware: keep the close
                    # until it is known whether an error event must go first.
                    self.closing = message
                    return
            await send(message)

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(watch_client)
            try:
                await self.app(scope, app_receive, tracking_send)
            except Exception as exc:
                if not self.started and not self.replaced and self._refusal() is not None:
                    await self._refuse(scope, send)
                    return
                if not (stream and self.started) or disconnected.is_set():
                    raise
                log.warning("a streamed generation failed after its response started: %s", _innermost(exc))
                self.closing = {"type": "http.response.body", "body": _error_event(exc), "more_body": False}
            finally:
                tasks.cancel_scope.cancel()
        if self.closing is not None:
            await send(self.closing)

    def _refusal(self) -> Refused | None:
        """Why the host's failure is the client's 4xx or a 503, not a 500 (``None``: it is a 500)."""
        request = self.request_scope
        if request is None:
            return None
        if request.refused is not None:
            return request.refused
        if request.unavailable is not None:
            return Refused(503, "server_busy", request.unavailable)
        return None

    async def _refuse(self, scope: Scope, send: Send) -> None:
        self.replaced = True
        refusal = self._refusal()
        assert refusal is not None
        response = error_response(refusal.status, refusal.code, refusal.message)
        if refusal.status == 503:
            response.headers["Retry-After"] = "1"

        async def nothing() -> Message:
            return {"type": "http.disconnect"}

        await response(scope, nothing, send)


def _innermost(exc: BaseException) -> BaseException:
    while len(getattr(exc, "exceptions", ())) == 1:  # an exception group from the host's task group
        exc = exc.exceptions[0]  # type: ignore[attr-defined]
    return exc


def _error_event(exc: BaseException) -> bytes:
    """The SSE events that close a failed stream: the error (OpenAI's shape), then ``[DONE]``."""
    inner = _innermost(exc)
    message = str(inner) or type(inner).__name__
    if isinstance(inner, PoolFullError):
        status, kind = 503, "server_busy"
    elif isinstance(inner, GrammarDeadEnd):
        status, kind = 422, "invalid_grammar"
    elif "exceed context window" in message:
        status, kind = 400, "invalid_request_error"
    else:
        status, kind = 500, "server_error"
    error = {"error": {"message": message, "type": kind, "code": status}}
    return b"data: " + json.dumps(error).encode() + b"\r\n\r\ndata: [DONE]\r\n\r\n"
