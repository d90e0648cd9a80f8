"""Starlette ASGI middleware: checkpoint routes, tenant namespaces, body limits and ``cached_tokens`` usage fields.

Mount it on any Starlette or FastAPI app whose ``Llama`` objects are attached::

    app.add_middleware(CheckpointMiddleware, managers={"my-model": manager}, settings=ServeSettings(admin=True))

It is a thin composition of one-job pieces:

- :class:`~ckpt_plugin.http.body_limit.BodyLimitMiddleware`: every route refuses bodies over ``max_body_bytes`` (413);
- :class:`~ckpt_plugin.http.routes.CheckpointRoutes`: ``/checkpoints``, ``/checkpoints/stats``, ``/metrics`` and
  ``/slots/{id}`` (see that module);
- :class:`~ckpt_plugin.http.health.HealthRoutes`: llama-server's ``GET /health`` (with ``?fail_on_no_slot=1``, a
  readiness answer), answered from flags and counters before anything else, never behind a lock or a slot;
- :class:`~ckpt_plugin.http.tenants.Tenants`: the host's API key is checked on every ``POST`` before its body is read
  (401), and each request gets the namespace the server derives for it;
- host routes named in ``guards`` (:mod:`ckpt_plugin.http.route_guard`; by default OpenAI's two completion routes): a
  ``POST`` must carry a JSON object (415 for another media type, 400 for bad JSON or lone surrogates) that passes the
  route's checks (422): the host never sees a body it would answer with a 500 or die on; a large body is parsed in a
  worker thread, never on the event loop;
- generation routes run under the request's limits (``request_timeout``, ``request_max_tokens``) and stop at the
  next token when their client disconnects; a stream that fails ends with an error event
  (:class:`~ckpt_plugin.http.generation.Generation`); ``"ignore_eos": true`` (llama-server's and vLLM's field)
  keeps end-of-generation tokens from being sampled; ``max_completion_tokens`` reaches the host as ``max_tokens``
  (:mod:`~ckpt_plugin.http.token_limits`);
- with parallel slots, generations wait for a slot in arrival order, and past a bounded queue get 503
  (:class:`~ckpt_plugin.http.admission_queue.AdmissionQueue`);
- :class:`~ckpt_plugin.http.usage.UsageRewriter`: ``usage.prompt_tokens_details.cached_tokens`` on their responses;
- with a shared tier, once a completion's response is sent, the live slot is published to it
  (:func:`~ckpt_plugin.services.publishing.publish`), so the conversation's next turn can land on any replica.

At ASGI lifespan shutdown, every manager's live slot is put into its cache (and disk tier, if configured), so a
restarted server starts warm.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Mapping

from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ckpt_plugin.http.admission_queue import AdmissionQueue, ServerBusy
from ckpt_plugin.http.body_limit import BodyLimitMiddleware, BodyTooLarge, ClientDisconnect, error_response, read_body
from ckpt_plugin.core.config import ServeSettings
from ckpt_plugin.http.generation import Generation, replay_body
from ckpt_plugin.http.health import HealthRoutes, idle_slots
from ckpt_plugin.http.metrics import Metrics, ModelStats, live_stats
from ckpt_plugin.core.request import RequestScope, current_request
from ckpt_plugin.http.request_checks import (
    RequestRejected,
    check_content_type,
    check_generation_flags,
    parse_json_object,
)
from ckpt_plugin.http.route_guard import RouteGuard, default_guards, validation_message
from ckpt_plugin.http.routes import CheckpointRoutes, Managers, unique_managers
from ckpt_plugin.services.publishing import publish
from ckpt_plugin.http.tenants import Tenants
from ckpt_plugin.http.token_limits import with_max_completion_tokens
from ckpt_plugin.http.usage import UsageRewriter

__all__ = ["CheckpointMiddleware"]

log = logging.getLogger("ckpt_plugin")

_PARSE_ON_LOOP_BYTES = 256 << 10


class CheckpointMiddleware:
    """Pure ASGI middleware exposing checkpoint managers and isolating tenants (see the module docstring).

    :param app: The wrapped ASGI app.
    :param managers: The attached managers by model name, or a callable returning them (models can change).
    :param settings: Admin, metrics, namespace, slot-file and body-limit settings.
    :param api_key: The host's API key, if it has one.
    :param guards: The host's routes by path (after ``root_path``), each with its body checks; ``None`` for
        :func:`~ckpt_plugin.http.route_guard.default_guards`.
    :param admission: With parallel slots, the queue generations wait in for a slot (503 past it); ``None`` when
        the host serves one request at a time itself.
    :param model_stats: Returns ``stats()`` by model for ``/metrics`` and ``/checkpoints/stats``; by default the
        live managers'. A server that unloads models passes one that keeps listing them (ckpt-serve: their counters
        carry on across model switches).
    :param loaded: Whether the model is loaded, for ``/health`` (503 while not); by default always.
    """

    def __init__(
        self,
        app: ASGIApp,
        managers: Managers | Callable[[], Managers],
        settings: ServeSettings | None = None,
        api_key: str | None = None,
        guards: Mapping[str, RouteGuard] | None = None,
        admission: AdmissionQueue | None = None,
        model_stats: ModelStats | None = None,
        loaded: Callable[[], bool] | None = None,
    ) -> None:
        self.app = app
        self.admission = admission
        self.settings = settings or ServeSettings()
        self.guards = dict(default_guards() if guards is None else guards)
        self.managers: Callable[[], Managers] = managers if callable(managers) else (lambda: managers)
        self.api_key = api_key
        self.tenants = Tenants(self.settings, api_key)
        self.model_stats: ModelStats = model_stats or live_stats(self.managers)
        self.metrics = Metrics(self.managers, self.model_stats)
        self.routes = CheckpointRoutes(self.managers, self.settings, self.tenants, self.metrics, self.model_stats)
        self.health = HealthRoutes(loaded or (lambda: True), lambda: idle_slots(self._slots_busy, admission))
        self._limited = BodyLimitMiddleware(self._dispatch, self.settings.max_body_bytes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, self._flush_on_shutdown(receive), send)
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await self._limited(scope, receive, send)

    async def _dispatch(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = _route_path(scope)
        if HealthRoutes.handles(path):
            await self.health(scope, receive, send)
            return
        self._watch_managers()
        if CheckpointRoutes.handles(path, self.settings):
            await self.routes({**scope, "path": path, "root_path": ""}, receive, send)
            return
        caller = self.tenants.caller(Headers(scope=scope))
        if scope["method"] == "POST" and not caller.authorized:
            # The host would refuse it too, but only after parsing the body: refuse before reading it.
            await error_response(401, "unauthorized", "a valid API key is required")(scope, receive, send)
            return
        request_scope = RequestScope(namespace=caller.namespace)
        token = current_request.set(request_scope)
        try:
            guard = self.guards.get(path)
            if scope["method"] == "POST" and guard is not None:
                await self._guarded(scope, receive, send, guard, request_scope)
            else:
                await self.app(scope, receive, send)
        finally:
            current_request.reset(token)

    async def _guarded(
        self, scope: Scope, receive: Receive, send: Send, guard: RouteGuard, request_scope: RequestScope
    ) -> None:
        try:
            content_type = Headers(scope=scope).get("content-type")
            check_content_type(content_type)
            if not content_type:
                scope = _json_content_type(scope)
            body = await read_body(receive, self.settings.max_body_bytes)
            payload = await _off_loop_if_large(len(body), parse_json_object, body)
            if guard.generates:
                check_generation_flags(payload)
                read = body
                payload, body = await _off_loop_if_large(len(body), with_max_completion_tokens, payload, body)
                if body is not read:
                    scope = _with_content_length(scope, len(body))
            answer = await run_in_threadpool(_check_and_answer, guard, payload)
        except RequestRejected as exc:
            await error_response(exc.status, exc.code, exc.message)(scope, receive, send)
            return
        except BodyTooLarge as exc:
            await error_response(413, "too_large", str(exc))(scope, receive, send)
            return
        except ClientDisconnect:
            return
        if answer is not None:
            await JSONResponse(answer)(scope, receive, send)
            return
        if not guard.generates:
            await self.app(scope, replay_body(body, receive), send)
            return
        settings = self.settings
        if settings.request_timeout is not None:
            request_scope.deadline = time.monotonic() + settings.request_timeout
        request_scope.max_new_tokens = settings.request_max_tokens
        request_scope.ignore_eos = payload.get("ignore_eos") is True
        admission = self.admission
        if admission is not None:
            try:
                if not await admission.enter(receive):
                    return  # the client left while waiting for a slot
            except ServerBusy as exc:
                await error_response(503, "server_busy", str(exc))(scope, receive, send)
                return
        try:
            generation = Generation(UsageRewriter(self.app, request_scope, body), request_scope.cancelled,
                                    request_scope)
            await generation(scope, receive, send, body, stream=payload.get("stream") is True)
        finally:
            if admission is not None:
                admission.leave()
        await run_in_threadpool(self._publish)

    def _publish(self) -> None:
        # After the response: the request's own limits (its client has gone, its time is up) no longer apply to what
        # publishing evaluates (a draft model catching up before its state is captured).
        current_request.set(None)
        for manager in unique_managers(self.managers()):
            if manager.store.shared is not None:
                try:
                    publish(manager)
                except Exception:  # the response is sent; the next turn merely misses the shared tier
                    log.exception("publishing the slot to the shared tier failed")

    def _flush_on_shutdown(self, receive: Receive) -> Receive:
        async def flushing_receive() -> Message:
            message = await receive()
            if message["type"] == "lifespan.shutdown":
                for manager in unique_managers(self.managers()):
                    await run_in_threadpool(manager.flush)
            return message

        return flushing_receive

    def _slots_busy(self) -> list[bool]:
        return [controller.busy for manager in unique_managers(self.managers()) for controller in manager.controllers]

    def _watch_managers(self) -> None:
        for name, manager in self.managers().items():
            if manager.plugins.get_plugin("ckpt_plugin.http.metrics") is None:
                self.metrics.watch(name, manager)


def _json_content_type(scope: Scope) -> Scope:
    """``scope`` with ``Content-Type: application/json`` in place of a missing or empty one: the body is taken as
    JSON here, and the host parses a body by its declared type (FastAPI hands a body without one to pydantic as
    bytes, a 500)."""
    headers = [(name, value) for name, value in scope["headers"] if name.lower() != b"content-type"]
    return {**scope, "headers": [*headers, (b"content-type", b"application/json")]}


def _with_content_length(scope: Scope, length: int) -> Scope:
    """``scope`` declaring a body of ``length`` bytes: the one the host gets, rewritten, not the one the client
    sent."""
    headers = [(name, value) for name, value in scope["headers"]
               if name.lower() not in (b"content-length", b"transfer-encoding")]
    return {**scope, "headers": [*headers, (b"content-length", str(length).encode())]}


def _check_and_answer(guard: RouteGuard, payload: dict[str, Any]) -> Any | None:
    """The guard's checks, then its own answer (``None``: the host answers), in one trip to a worker thread."""
    try:
        guard.check(payload)
    except RequestRejected:
        raise
    except RecursionError:
        raise RequestRejected(400, "invalid_json", "the request body is nested too deeply") from None
    except ValidationError as exc:
        raise RequestRejected(422, "invalid_request", validation_message(exc)) from None
    except ValueError as exc:
        raise RequestRejected(422, "invalid_request", str(exc)) from None
    return guard.answer(payload)


async def _off_loop_if_large(size: int, function: Callable[..., Any], *args: Any) -> Any:
    """Parse small bodies on the event loop (a thread hop costs more), large ones in a worker thread: a 20 MB body
    parsed on the loop holds every other request for a second."""
    if size <= _PARSE_ON_LOOP_BYTES:
        return function(*args)
    return await run_in_threadpool(function, *args)


def _route_path(scope: Scope) -> str:
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path
