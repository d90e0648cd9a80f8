"""The routes the checkpoint middleware answers itself: admin API, Prometheus metrics and llama.cpp's slot files.

- ``GET /checkpoints``: slots, checkpoints and cache entries per model, of the caller's namespace (every namespace
  for the operator key, or when namespaces are off); ``DELETE /checkpoints`` drops those cache entries and live slots,
  once the generations using those slots have finished (409 if one still runs after ``request_timeout``). Admin
  only.
- ``GET /checkpoints/stats``: ``manager.stats()`` per model (aggregates over tenants: with namespaces on, only for
  the operator key). Admin only.
- ``GET /metrics``: Prometheus text.
- ``GET /slots``: every slot (``is_processing``, ``n_ctx``; ``n_tokens`` and ``n_checkpoints`` of the caller's own
  state only); with ``?fail_on_no_slot=1``, llama-server's 503 while every slot is processing.
- ``POST /slots/{id}?action=save|restore|erase`` with ``{"filename": ...}``: slot files in ``slot_save_path`` (in a
  subdirectory per tenant when namespaces are on); a tenant never reads, overwrites or lists another's files.

Every manager call runs in a worker thread (it may wait for the model lock); every failure is a 4xx JSON error
(:func:`error_for`), except storage failures of the server itself (507).
"""

from __future__ import annotations

import errno
import json
import logging
import re
from pathlib import Path
from typing import Any, Awaitable, Callable, Mapping
from urllib.parse import parse_qsl

from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, Router

from ckpt_plugin.http.body_limit import BodyTooLarge, ClientDisconnect, error_response, read_body
from ckpt_plugin.core.config import ServeSettings
from ckpt_plugin.core.errors import (
    CheckpointError,
    CorruptFileError,
    EmptySlotError,
    ForeignNamespaceError,
    IncompatibleStateError,
    OpaqueMemoryError,
    SlotBusyError,
    SlotFileNotFoundError,
    StateRestoreError,
    UnsafePathError,
)
from ckpt_plugin.engine.manager import CheckpointManager
from ckpt_plugin.http.health import no_slot_available, wants_free_slot
from ckpt_plugin.http.metrics import CONTENT_TYPE, Metrics, ModelStats, live_stats
from ckpt_plugin.persist.paths import safe_path
from ckpt_plugin.http.request_checks import RequestRejected, check_content_type
from ckpt_plugin.core.counters import Cleared
from ckpt_plugin.core.pages import PAGES
from ckpt_plugin.http.tenants import Caller, Tenants

__all__ = ["CheckpointRoutes", "Managers", "unique_managers"]

log = logging.getLogger("ckpt_plugin")

Managers = Mapping[str, CheckpointManager]
SLOT_REQUEST_MAX_BYTES = 1 << 16
# The methods each route answers; any other (TRACE, CONNECT, FOO, ...) gets a JSON 405 with ``Allow`` before the
# router sees it (Starlette's own 405 is plain text, and methods it does not know never reach an endpoint).
_ALLOWED: dict[str, tuple[str, ...]] = {
    "/checkpoints": ("GET", "DELETE"),
    "/checkpoints/stats": ("GET",),
    "/metrics": ("GET",),
    "/slots": ("GET",),
    "/slots/": ("POST",),
}
_SLOT_ID = re.compile(r"0|[1-9][0-9]{0,8}")  # ASCII digits only: no "00", no full-width or superscript digits


def unique_managers(managers: Managers) -> list[CheckpointManager]:
    """Each manager once (several model names may share one)."""
    return list({id(m): m for m in managers.values()}.values())


# (exception type, status, code), most specific first; the message is the exception's own.
_STATUSES: tuple[tuple[type[BaseException], int, str], ...] = (
    (UnsafePathError, 400, "invalid_request"),
    (SlotFileNotFoundError, 404, "not_found"),
    (CorruptFileError, 400, "invalid_slot_file"),
    (IncompatibleStateError, 400, "incompatible_slot_file"),
    (ForeignNamespaceError, 403, "forbidden"),
    (EmptySlotError, 409, "slot_empty"),
    (OpaqueMemoryError, 409, "slot_not_saveable"),
    (SlotBusyError, 409, "slot_busy"),
    (StateRestoreError, 409, "restore_failed"),
    (CheckpointError, 400, "invalid_request"),
)


def error_for(exc: BaseException) -> JSONResponse:
    """The HTTP error for an exception raised while serving a slot or admin request."""
    for kind, status, code in _STATUSES:
        if isinstance(exc, kind):
            return error_response(status, code, str(exc))
    if isinstance(exc, IsADirectoryError):
        return error_response(400, "invalid_request", "the file name names a directory")
    if isinstance(exc, OSError):
        # The server's own storage failed (disk full, permissions): not the client's fault, but no state was lost.
        log.warning("slot file storage error: %s", exc)
        code = "insufficient_storage" if exc.errno == errno.ENOSPC else "storage_error"
        return error_response(507, code, f"the slot file could not be written or read: {exc.strerror or exc}")
    raise exc


def tenant_directory(base: str | Path, namespace: str | None) -> Path:
    """Where one tenant's slot files live: ``base`` itself when namespaces are off, else a subdirectory named after
    the namespace digest (created on first use)."""
    directory = Path(base)
    if namespace is not None:
        directory = directory / ("ns-" + re.sub(r"[^A-Za-z0-9_-]", "-", namespace))
    directory.mkdir(parents=True, exist_ok=True)
    return directory


class CheckpointRoutes:
    """The Starlette ``Router`` of the middleware's own routes.

    :param managers: Returns the live managers by model name.
    :param settings: What is enabled.
    :param tenants: Derives the caller of a request.
    :param metrics: The Prometheus registry of these managers.
    :param model_stats: Returns the stats by model for ``/checkpoints/stats`` (by default the live managers').
    """

    def __init__(
        self, managers: Callable[[], Managers], settings: ServeSettings, tenants: Tenants, metrics: Metrics,
        model_stats: ModelStats | None = None,
    ) -> None:
        self.managers = managers
        self.model_stats = model_stats or live_stats(managers)
        self.settings = settings
        self.tenants = tenants
        self.metrics = metrics
        self.router = Router(
            routes=[
                Route("/checkpoints", self._guard(self.checkpoints, admin=True), methods=_ALLOWED["/checkpoints"]),
                Route("/checkpoints/stats", self._guard(self.stats, admin=True),
                      methods=_ALLOWED["/checkpoints/stats"]),
                Route("/metrics", self._guard(self.prometheus, metrics=True), methods=_ALLOWED["/metrics"]),
                Route("/slots", self._guard(self.slot_list), methods=_ALLOWED["/slots"]),
                Route("/slots/{slot_id:path}", self._guard(self.slots, slots=True), methods=_ALLOWED["/slots/"]),
            ],
            default=self._not_found,
        )

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        """Answer a method the route does not take with a JSON 405 and ``Allow``, else route the request."""
        path = scope["path"]
        allowed = _ALLOWED.get(path) or (_ALLOWED["/slots/"] if path.startswith("/slots/") else None)
        if allowed is not None and scope["method"] not in allowed and not (scope["method"] == "HEAD" and "GET" in allowed):
            response = error_response(405, "method_not_allowed",
                                      f"{scope['method']} is not allowed on {path}; use {', '.join(allowed)}")
            response.headers["allow"] = ", ".join(allowed)
            await response(scope, receive, send)
            return
        await self.router(scope, receive, send)

    @staticmethod
    def handles(path: str, settings: ServeSettings) -> bool:
        """Whether ``path`` is one of these routes (``/metrics`` only while metrics are on)."""
        return (
            path in ("/checkpoints", "/checkpoints/stats", "/slots")
            or path.startswith(("/checkpoints/", "/slots/"))
            or (path == "/metrics" and settings.metrics)
        )

    @staticmethod
    async def _not_found(scope: Any, receive: Any, send: Any) -> None:
        await error_response(404, "not_found", f"no route {scope['path']}")(scope, receive, send)

    def _guard(
        self, endpoint: Callable[[Request, Caller], Awaitable[Response]], admin: bool = False, slots: bool = False,
        metrics: bool = False,
    ) -> Callable[[Request], Awaitable[Response]]:
        """Check enablement and credentials before the endpoint reads anything of the request."""

        async def guarded(request: Request) -> Response:
            if admin and not self.settings.admin:
                return error_response(404, "not_found", "checkpoint admin routes are disabled: start the server with "
                                      "--admin true (checkpoints.admin in the config file, CKPT_ADMIN=true)")
            if slots and self.settings.slot_save_path is None:
                return error_response(404, "not_found", "slot files are disabled (--slot-save-path)")
            caller = self.tenants.caller(Headers(scope=request.scope))
            if not caller.authorized:
                return error_response(401, "unauthorized", "a valid API key is required")
            if (admin or slots) and caller.anonymous and not caller.operator:
                return error_response(403, "forbidden", "namespaces are on: this route needs a tenant identity")
            if metrics and self._metrics_need_operator() and not caller.operator:
                # The counters add up every tenant's traffic: with tenants, they are the operator's to read.
                return error_response(403, "forbidden", "namespaces are on: /metrics needs the operator key (admin_key)")
            try:
                return await endpoint(request, caller)
            except BodyTooLarge as exc:
                return error_response(413, "too_large", str(exc))
            except ClientDisconnect:
                return error_response(400, "disconnected", "the client went away")
            except (CheckpointError, OSError) as exc:
                return error_for(exc)

        return guarded

    def _metrics_need_operator(self) -> bool:
        return self.settings.namespaces != "off" and self.settings.admin_key is not None

    @staticmethod
    def _scope_of(caller: Caller) -> str | None:
        """The namespace a caller's admin view is limited to (``None``: every namespace)."""
        return None if caller.operator or caller.namespace is None else caller.namespace

    async def checkpoints(self, request: Request, caller: Caller) -> Response:
        managers = self.managers()
        namespace = self._scope_of(caller)
        if request.method == "GET":
            views = await run_in_threadpool(lambda: {name: m.describe(namespace) for name, m in managers.items()})
            return JSONResponse({"models": views})
        else:  # DELETE (the only other method the route takes)
            # Generations using the slots it empties finish first; none runs longer than request_timeout.
            wait = self.settings.request_timeout
            cleared = await run_in_threadpool(
                lambda: Cleared.combine(m.clear_cache(namespace, wait) for m in unique_managers(managers))
            )
            PAGES.cleared(namespace)  # the KV events: AllBlocksCleared, or the namespace's shared pages removed
            return JSONResponse(cleared.as_json())

    async def stats(self, request: Request, caller: Caller) -> Response:
        if caller.namespace is not None and not caller.operator:
            return error_response(403, "forbidden", "stats cover every tenant: they need the operator key (admin_key)")
        views = await run_in_threadpool(lambda: dict(self.model_stats()))
        return JSONResponse({"models": views})

    async def prometheus(self, request: Request, caller: Caller) -> Response:
        return Response(await run_in_threadpool(self.metrics.render), media_type=CONTENT_TYPE)

    async def slot_list(self, request: Request, caller: Caller) -> Response:
        """Every slot of every model, as llama.cpp's server lists them: whether a request holds it, its context,
        and (for the caller's own state only) the tokens and checkpoints it holds."""
        namespace = self._scope_of(caller)
        views = []
        for name, manager in self.managers().items():
            for controller in manager.controllers:
                slot = controller.slot
                view: dict[str, Any] = {"id": slot.id, "model": name, "is_processing": controller.busy,
                                        "n_ctx": controller.backend.n_ctx}
                if namespace is None or slot.namespace == namespace:
                    view.update(n_tokens=slot.n_tokens, n_checkpoints=len(list(slot.checkpoints)))
                views.append(view)
        if wants_free_slot(request.scope) and all(view["is_processing"] for view in views):
            return no_slot_available()
        return JSONResponse(views)

    async def slots(self, request: Request, caller: Caller) -> Response:
        slot_text = request.path_params["slot_id"]
        if not _SLOT_ID.fullmatch(slot_text):
            return error_response(400, "invalid_request", f"slot id must be a decimal number, got {slot_text!r}")
        managers = unique_managers(self.managers())
        slot_id = int(slot_text)
        n_slots = len(managers[0].controllers) if managers else 0
        if slot_id >= n_slots:
            return error_response(404, "not_found", f"no slot {slot_id} (the loaded model has {n_slots})")
        manager = managers[0]
        if manager.controllers[slot_id].busy:
            # A generation owns the slot's memory until its last token: a file action now would tear it.
            return error_response(409, "slot_busy", f"slot {slot_id} is generating; retry when it is idle")
        action = dict(parse_qsl(request.url.query)).get("action", "")
        if action == "erase":
            result = await run_in_threadpool(manager.erase_slot, caller.namespace, slot_id)
            return JSONResponse({"id_slot": slot_id, **result})
        if action not in ("save", "restore"):
            return error_response(400, "invalid_request", "action must be save, restore or erase")
        try:
            check_content_type(request.headers.get("content-type"))
        except RequestRejected as exc:
            return error_response(exc.status, exc.code, exc.message)
        body = await read_body(request.receive, SLOT_REQUEST_MAX_BYTES)
        try:
            payload = json.loads(body or b"{}")
            filename = payload["filename"]
            if not isinstance(filename, str):
                raise TypeError
        except (ValueError, RecursionError, KeyError, TypeError):
            return error_response(400, "invalid_request", 'the body must be a JSON object with a string "filename"')
        directory = tenant_directory(self.settings.slot_save_path or ".", caller.namespace)
        target = safe_path(directory, filename)
        if action == "save":
            if target.is_dir():
                return error_response(400, "invalid_request", "the file name names a directory")
            result = await run_in_threadpool(manager.save_slot, target, caller.namespace, slot_id)
            return JSONResponse({"id_slot": slot_id, "filename": filename, "n_saved": result["n_saved"],
                                 "n_written": result["n_written"], "timings": {"save_ms": result["save_ms"]}})
        if target.is_dir():
            return error_response(400, "invalid_request", "the file name names a directory")
        if not target.is_file():
            raise SlotFileNotFoundError(f"no slot file {filename!r}")
        result = await run_in_threadpool(manager.restore_slot, target, caller.namespace, slot_id)
        return JSONResponse({"id_slot": slot_id, "filename": filename, "n_restored": result["n_restored"],
                             "n_read": result["n_read"], "timings": {"restore_ms": result["restore_ms"]}})
