"""Starlette ASGI middleware: admin API, Prometheus metrics, ``cached_tokens`` usage fields, tenant namespaces.

Mount it on any Starlette or FastAPI app whose ``Llama`` objects are attached::

    app.add_middleware(CheckpointMiddleware, managers={"my-model": manager}, settings=ServeSettings(admin=True))

Routes it answers itself (everything else goes to the app):

- ``GET /checkpoints``: slots, checkpoints (positions, sizes) and cache entries per model; admin only.
- ``GET /checkpoints/stats``: ``manager.stats()`` per model; admin only.
- ``DELETE /checkpoints``: drop every cache entry; admin only.
- ``GET /metrics``: Prometheus text (unless ``metrics`` is off).
- ``POST /slots/{id}?action=save|restore|erase`` with ``{"filename": ...}``: llama.cpp's slot file API, in the
  ``slot_save_path`` directory (off when unset); file names are confined to that directory.

At ASGI lifespan shutdown, every manager's live slot is put into its cache (and disk tier, if configured), so a
restarted server starts warm.

Admin routes are off (404) unless ``admin`` is set; when the host has an API key, admin routes and metrics require
``Authorization: Bearer <key>`` (401 otherwise).

Completion requests (``POST .../completions``) must carry a JSON object (400 otherwise, 413 over
``MAX_BODY_BYTES``) and pass the optional ``validators`` (422 with the error); the model is never reached with a body
it cannot parse. On their responses the middleware adds ``usage.prompt_tokens_details.cached_tokens`` (as OpenAI
and vLLM report it); for streamed responses requested with ``stream_options.include_usage`` it adds the final usage
chunk before ``data: [DONE]``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any, Callable, Mapping

from urllib.parse import parse_qsl

from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers, MutableHeaders
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .config import ServeSettings
from .errors import IncompatibleStateError
from .manager import CheckpointManager
from .metrics import CONTENT_TYPE, Metrics
from .persist import CorruptFileError, UnsafePathError, safe_path
from .request import RequestScope, current_request

Managers = Mapping[str, CheckpointManager]
Validator = Callable[[dict[str, Any]], None]
MAX_BODY_BYTES = 32 << 20


class CheckpointMiddleware:
    """Pure ASGI middleware exposing checkpoint managers and isolating tenants (see the module docstring).

    :param app: The wrapped ASGI app.
    :param managers: The attached managers by model name, or a callable returning them (models can change).
    :param settings: Admin, metrics and namespace settings.
    :param api_key: The host's API key, if it has one.
    :param validators: Request-body validators by path suffix (e.g. ``"/chat/completions"``); a validator raises
        ``ValueError`` (pydantic's ``ValidationError`` is one) to refuse a body with 422.
    """

    def __init__(
        self,
        app: ASGIApp,
        managers: Managers | Callable[[], Managers],
        settings: ServeSettings | None = None,
        api_key: str | None = None,
        validators: Mapping[str, Validator] | None = None,
    ) -> None:
        self.app = app
        self.validators = dict(validators or {})
        self.managers: Callable[[], Managers] = managers if callable(managers) else (lambda: managers)
        self.settings = settings or ServeSettings()
        self.api_key = api_key
        self.metrics = Metrics(self.managers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, self._flush_on_shutdown(receive), send)
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path, root = scope["path"], scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root):]
        headers = Headers(scope=scope)
        self._watch_managers()
        if path == "/checkpoints" or path.startswith("/checkpoints/"):
            response = self._admin(scope["method"], path, headers)
            await response(scope, receive, send)
            return
        if path.startswith("/slots/"):
            response = await self._slots(scope, path, headers, receive)
            await response(scope, receive, send)
            return
        if path == "/metrics" and self.settings.metrics:
            response = self._metrics(scope["method"], headers)
            await response(scope, receive, send)
            return
        request_scope = RequestScope(namespace=self._namespace(headers))
        token = current_request.set(request_scope)
        try:
            if scope["method"] == "POST" and path.endswith("/completions"):
                body, problem = await self._read_completion_request(path, receive)
                if problem is not None:
                    await problem(scope, receive, send)
                    return
                await _UsageRewriter(self.app, request_scope, body)(scope, _replay(body, receive), send)
            else:
                await self.app(scope, receive, send)
        finally:
            current_request.reset(token)

    async def _read_completion_request(self, path: str, receive: Receive) -> tuple[bytes, Response | None]:
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return bytes(body), _error(400, "disconnected", "the client went away")
            body.extend(message.get("body", b""))
            if len(body) > MAX_BODY_BYTES:
                return b"", _error(413, "too_large", f"request bodies are limited to {MAX_BODY_BYTES} bytes")
            if not message.get("more_body", False):
                break
        try:
            payload = json.loads(bytes(body))
        except ValueError as exc:
            return bytes(body), _error(400, "invalid_json", f"the request body is not valid JSON: {exc}")
        if not isinstance(payload, dict):
            return bytes(body), _error(400, "invalid_json", "the request body must be a JSON object")
        for suffix, validate in self.validators.items():
            if path.endswith(suffix):
                try:
                    validate(payload)
                except ValueError as exc:
                    return bytes(body), _error(422, "invalid_request", str(exc))
                break
        return bytes(body), None

    # -- tenants ----------------------------------------------------------------------------------------------------

    def _namespace(self, headers: Headers) -> str | None:
        mode = self.settings.namespaces
        if mode == "off":
            return None
        if mode == "api_key":
            value = _bearer(headers) or ""
            prefix = "key"
        else:
            value = headers.get(self.settings.namespace_header or "", "")
            prefix = "hdr"
        if not value:
            return f"{prefix}:anonymous"
        # A digest: the raw credential never sits in the cache's keys, logs or the admin view.
        return f"{prefix}:{hashlib.sha256(value.encode()).hexdigest()[:16]}"

    # -- admin and metrics ------------------------------------------------------------------------------------------

    def _authorized(self, headers: Headers) -> bool:
        if self.api_key is None:
            return True
        given = _bearer(headers) or ""
        return hmac.compare_digest(given.encode(), self.api_key.encode())

    def _admin(self, method: str, path: str, headers: Headers) -> Response:
        if not self.settings.admin:
            return _error(404, "not_found", "checkpoint admin routes are disabled (checkpoints.admin)")
        if not self._authorized(headers):
            return _error(401, "unauthorized", "a valid API key is required")
        managers = self.managers()
        if path == "/checkpoints":
            if method == "GET":
                return JSONResponse({"models": {name: m.describe() for name, m in managers.items()}})
            if method == "DELETE":
                return JSONResponse({"cleared": sum(m.clear_cache() for m in _unique(managers))})
            return _error(405, "method_not_allowed", f"{method} is not allowed on /checkpoints")
        if path == "/checkpoints/stats":
            if method == "GET":
                return JSONResponse({"models": {name: m.stats() for name, m in managers.items()}})
            return _error(405, "method_not_allowed", f"{method} is not allowed on /checkpoints/stats")
        return _error(404, "not_found", f"no route {path}")

    def _metrics(self, method: str, headers: Headers) -> Response:
        if method != "GET":
            return _error(405, "method_not_allowed", "use GET /metrics")
        if not self._authorized(headers):
            return _error(401, "unauthorized", "a valid API key is required")
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    async def _slots(self, scope: Scope, path: str, headers: Headers, receive: Receive) -> Response:
        directory = self.settings.slot_save_path
        if directory is None:
            return _error(404, "not_found", "slot files are disabled (--slot-save-path)")
        if not self._authorized(headers):
            return _error(401, "unauthorized", "a valid API key is required")
        if scope["method"] != "POST":
            return _error(405, "method_not_allowed", "use POST /slots/{id}?action=save|restore|erase")
        slot_text = path[len("/slots/"):]
        if not slot_text.isdigit():
            return _error(400, "invalid_request", f"slot id must be a number, got {slot_text!r}")
        managers = _unique(self.managers())
        slot_id = int(slot_text)
        if slot_id != 0 or not managers:
            return _error(404, "not_found", f"no slot {slot_id} (each loaded model has slot 0)")
        manager = managers[0]
        action = dict(parse_qsl(scope.get("query_string", b"").decode())).get("action", "")
        if action == "erase":
            result = await run_in_threadpool(manager.erase_slot)
            return JSONResponse({"id_slot": slot_id, **result})
        if action not in ("save", "restore"):
            return _error(400, "invalid_request", "action must be save, restore or erase")
        body = bytearray()
        while True:
            message = await receive()
            body.extend(message.get("body", b""))
            if len(body) > 1 << 16:
                return _error(413, "too_large", "slot requests are small JSON objects")
            if not message.get("more_body", False):
                break
        try:
            payload = json.loads(bytes(body) or b"{}")
            filename = payload["filename"]
            if not isinstance(filename, str):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            return _error(400, "invalid_request", 'the body must be a JSON object with a string "filename"')
        try:
            target = safe_path(directory, filename)
            if action == "save":
                result = await run_in_threadpool(manager.save_slot, target)
                return JSONResponse({"id_slot": slot_id, "filename": filename, "n_saved": result["n_saved"],
                                     "n_written": result["n_written"], "timings": {"save_ms": result["save_ms"]}})
            if not target.exists():
                return _error(404, "not_found", f"no slot file {filename!r}")
            result = await run_in_threadpool(manager.restore_slot, target)
        except UnsafePathError as exc:
            return _error(400, "invalid_request", str(exc))
        except (CorruptFileError, IncompatibleStateError) as exc:
            return _error(400, "invalid_slot_file", str(exc))
        return JSONResponse({"id_slot": slot_id, "filename": filename, "n_restored": result["n_restored"],
                             "n_read": result["n_read"], "timings": {"restore_ms": result["restore_ms"]}})

    def _flush_on_shutdown(self, receive: Receive) -> Receive:
        async def flushing_receive() -> Message:
            message = await receive()
            if message["type"] == "lifespan.shutdown":
                for manager in _unique(self.managers()):
                    await run_in_threadpool(manager.flush)
            return message

        return flushing_receive

    def _watch_managers(self) -> None:
        for name, manager in self.managers().items():
            if manager.plugins.get_plugin("ckpt_plugin.metrics") is None:
                self.metrics.watch(name, manager)


class _UsageRewriter:
    """Adds ``prompt_tokens_details.cached_tokens`` to one completion response."""

    def __init__(self, app: ASGIApp, request_scope: RequestScope, request_body: bytes) -> None:
        self.app = app
        self.request_scope = request_scope
        self.request_body = request_body
        self.start: Message | None = None
        self.body = bytearray()
        self.streaming = False
        self.pending = b""
        self.completion_chunks = 0
        self.last_chunk: dict[str, Any] = {}
        self.usage_sent = False
        self.passthrough = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def rewrite(message: Message) -> None:
            if message["type"] == "http.response.start":
                content_type = Headers(raw=message["headers"]).get("content-type", "")
                self.streaming = content_type.startswith("text/event-stream")
                if self.streaming or message["status"] != 200 or not content_type.startswith("application/json"):
                    self.streaming = self.streaming and message["status"] == 200
                    self.passthrough = not self.streaming
                    await send(message)
                    return
                self.start = message
                return
            if message["type"] != "http.response.body" or self.passthrough:
                await send(message)
                return
            if self.streaming:
                await send({**message, "body": self._rewrite_events(message.get("body", b""),
                                                                    more=message.get("more_body", False))})
                return
            self.body.extend(message.get("body", b""))
            if message.get("more_body", False):
                return
            body = self._rewrite_json(bytes(self.body))
            assert self.start is not None
            headers = MutableHeaders(raw=list(self.start["headers"]))
            headers["content-length"] = str(len(body))
            await send({**self.start, "headers": headers.raw})
            await send({"type": "http.response.body", "body": body, "more_body": False})

        await self.app(scope, receive, rewrite)

    def _details(self) -> dict[str, int]:
        return {"cached_tokens": self.request_scope.cached_tokens}

    def _rewrite_json(self, body: bytes) -> bytes:
        try:
            payload = json.loads(body)
        except ValueError:
            return body
        usage = payload.get("usage") if isinstance(payload, dict) else None
        if isinstance(usage, dict):
            usage["prompt_tokens_details"] = self._details()
            return json.dumps(payload).encode()
        return body

    def _wants_usage(self) -> bool:
        try:
            request = json.loads(self.request_body or b"{}")
        except ValueError:
            return False
        options = request.get("stream_options") if isinstance(request, dict) else None
        return isinstance(options, dict) and bool(options.get("include_usage"))

    def _rewrite_events(self, body: bytes, more: bool) -> bytes:
        data = self.pending + body
        separator = b"\r\n\r\n" if b"\r\n\r\n" in data else b"\n\n"
        *events, self.pending = data.split(separator)
        if not more and self.pending:
            events.append(self.pending)
            self.pending = b""
        out = []
        for event in events:
            out.append(self._rewrite_event(event))
        return b"".join(e + separator for e in out)

    def _rewrite_event(self, event: bytes) -> bytes:
        lines = event.split(b"\n")
        data_lines = [line for line in lines if line.strip().startswith(b"data:")]
        if not data_lines:
            return event
        data = b"".join(line.strip()[5:].strip() for line in data_lines)
        if data == b"[DONE]":
            if self._wants_usage() and not self.usage_sent:
                chunk = {k: self.last_chunk.get(k) for k in ("id", "object", "created", "model")}
                prompt = self.request_scope.prompt_tokens
                chunk.update(choices=[], usage={
                    "prompt_tokens": prompt, "completion_tokens": self.completion_chunks,
                    "total_tokens": prompt + self.completion_chunks, "prompt_tokens_details": self._details(),
                })
                self.usage_sent = True
                return b"data: " + json.dumps(chunk).encode() + b"\r\n\r\n" + event
            return event
        try:
            chunk = json.loads(data)
        except ValueError:
            return event
        if not isinstance(chunk, dict):
            return event
        self.last_chunk = chunk
        if any(_has_text(choice) for choice in chunk.get("choices") or []):
            self.completion_chunks += 1
        if isinstance(chunk.get("usage"), dict):
            chunk["usage"]["prompt_tokens_details"] = self._details()
            self.usage_sent = True
            return b"data: " + json.dumps(chunk).encode()
        return event


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that hands the app the already-read body, then the client's own messages (disconnects)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _has_text(choice: Any) -> bool:
    if not isinstance(choice, dict):
        return False
    delta = choice.get("delta")
    return bool(choice.get("text") or (isinstance(delta, dict) and delta.get("content")))


def _bearer(headers: Headers) -> str | None:
    value = headers.get("authorization", "")
    scheme, _, credentials = value.partition(" ")
    return credentials.strip() if scheme.lower() == "bearer" and credentials.strip() else None


def _error(status: int, code: str, message: str) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=status)


def _unique(managers: Managers) -> list[CheckpointManager]:
    return list({id(m): m for m in managers.values()}.values())
