"""Starlette ASGI middleware: checkpoint routes, tenant namespaces, body limits and ``cached_tokens`` usage fields.

Mount it on any Starlette or FastAPI app whose ``Llama`` objects are attached::

    app.add_middleware(CheckpointMiddleware, managers={"my-model": manager}, settings=ServeSettings(admin=True))

It is a thin composition of one-job pieces:

- :class:`~ckpt_plugin.body_limit.BodyLimitMiddleware`: every route refuses bodies over ``max_body_bytes`` (413);
- :class:`~ckpt_plugin.routes.CheckpointRoutes`: ``/checkpoints``, ``/checkpoints/stats``, ``/metrics`` and
  ``/slots/{id}`` (see that module);
- :class:`~ckpt_plugin.tenants.Tenants`: the host's API key is checked on every ``POST`` before its body is read
  (401), and each request gets the namespace the server derives for it;
- completion requests (``POST .../completions``) must carry a JSON object (400 otherwise) that passes the optional
  ``validators`` (422): the model is never reached with a body it cannot parse;
- :class:`~ckpt_plugin.usage.UsageRewriter`: ``usage.prompt_tokens_details.cached_tokens`` on their responses;
- with a shared tier, once a completion's response is sent, the live slot is offered to it
  (:func:`~ckpt_plugin.shared_tier.publish`), so the conversation's next turn can land on any replica.

At ASGI lifespan shutdown, every manager's live slot is put into its cache (and disk tier, if configured), so a
restarted server starts warm.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Callable, Mapping

from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .body_limit import BodyLimitMiddleware, BodyTooLarge, ClientDisconnect, error_response, read_body
from .config import ServeSettings
from .metrics import Metrics
from .request import RequestScope, current_request
from .routes import CheckpointRoutes, Managers, unique_managers
from .shared_tier import publish
from .tenants import Tenants
from .usage import UsageRewriter

Validator = Callable[[dict[str, Any]], None]

log = logging.getLogger("ckpt_plugin")


class CheckpointMiddleware:
    """Pure ASGI middleware exposing checkpoint managers and isolating tenants (see the module docstring).

    :param app: The wrapped ASGI app.
    :param managers: The attached managers by model name, or a callable returning them (models can change).
    :param settings: Admin, metrics, namespace, slot-file and body-limit settings.
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
        self.settings = settings or ServeSettings()
        self.validators = dict(validators or {})
        self.managers: Callable[[], Managers] = managers if callable(managers) else (lambda: managers)
        self.api_key = api_key
        self.tenants = Tenants(self.settings, api_key)
        self.metrics = Metrics(self.managers)
        self.routes = CheckpointRoutes(self.managers, self.settings, self.tenants, self.metrics)
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
        self._watch_managers()
        if CheckpointRoutes.handles(path, self.settings):
            await self.routes.router({**scope, "path": path, "root_path": ""}, receive, send)
            return
        caller = self.tenants.caller(Headers(scope=scope))
        if scope["method"] == "POST" and not caller.authorized:
            # The host would refuse it too, but only after parsing the body: refuse before reading it.
            await error_response(401, "unauthorized", "a valid API key is required")(scope, receive, send)
            return
        request_scope = RequestScope(namespace=caller.namespace)
        token = current_request.set(request_scope)
        try:
            if scope["method"] == "POST" and path.endswith("/completions"):
                await self._completion(scope, receive, send, path, request_scope)
            else:
                await self.app(scope, receive, send)
        finally:
            current_request.reset(token)

    async def _completion(
        self, scope: Scope, receive: Receive, send: Send, path: str, request_scope: RequestScope
    ) -> None:
        try:
            body = await read_body(receive, self.settings.max_body_bytes)
        except BodyTooLarge as exc:
            await error_response(413, "too_large", str(exc))(scope, receive, send)
            return
        except ClientDisconnect:
            return
        problem = self._check_completion_body(path, body)
        if problem is not None:
            await problem(scope, receive, send)
            return
        await UsageRewriter(self.app, request_scope, body)(scope, _replay(body, receive), send)
        await run_in_threadpool(self._publish)

    def _publish(self) -> None:
        for manager in unique_managers(self.managers()):
            if manager.store.shared is not None:
                try:
                    publish(manager)
                except Exception:  # the response is sent; the next turn merely misses the shared tier
                    log.exception("offering the slot to the shared tier failed")

    def _check_completion_body(self, path: str, body: bytes) -> Any:
        try:
            payload = json.loads(body)
        except RecursionError:
            return error_response(400, "invalid_json", "the request body is nested too deeply")
        except ValueError as exc:
            return error_response(400, "invalid_json", f"the request body is not valid JSON: {exc}")
        if not isinstance(payload, dict):
            return error_response(400, "invalid_json", "the request body must be a JSON object")
        for suffix, validate in self.validators.items():
            if path.endswith(suffix):
                try:
                    validate(payload)
                except RecursionError:
                    return error_response(400, "invalid_json", "the request body is nested too deeply")
                except ValueError as exc:
                    return error_response(422, "invalid_request", str(exc))
                break
        return None

    def _flush_on_shutdown(self, receive: Receive) -> Receive:
        async def flushing_receive() -> Message:
            message = await receive()
            if message["type"] == "lifespan.shutdown":
                for manager in unique_managers(self.managers()):
                    await run_in_threadpool(manager.flush)
            return message

        return flushing_receive

    def _watch_managers(self) -> None:
        for name, manager in self.managers().items():
            if manager.plugins.get_plugin("ckpt_plugin.metrics") is None:
                self.metrics.watch(name, manager)


def _route_path(scope: Scope) -> str:
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


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
