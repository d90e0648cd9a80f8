"""llama-server's health route, for load balancers, routers and Kubernetes probes: ``GET /health`` (also
``/v1/health``), answered as llama.cpp's ``llama-server`` answers it.

- ``200 {"status": "ok"}`` once the model is loaded;
- ``503 {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}`` while a model loads
  (in ckpt-serve: while it switches between the models of a config file; it opens its port only once the first one
  is loaded);
- with ``?fail_on_no_slot=1`` (any non-empty value, as llama-server reads it), ``503 {"error": {"code": 503,
  "message": "no slot available", "type": "unavailable_error"}}`` while no slot is free: a readiness answer.

The answer is made on the event loop from flags and counters (whether the model is loaded, which slots a generation
holds, what the admission queue holds), never behind the model lock, a slot or the admission queue: a server whose
slots all generate long replies still answers at once. The route is public, as llama-server's (no API key: a probe
carries none), and says nothing of any tenant: not which namespaces hold slots, only whether one is free.
"""

from __future__ import annotations

from typing import Callable
from urllib.parse import parse_qsl

from starlette.responses import JSONResponse
from starlette.types import Receive, Scope, Send

from ckpt_plugin.http.admission_queue import AdmissionQueue
from ckpt_plugin.http.body_limit import error_response

__all__ = ["HEALTH_PATHS", "HealthRoutes", "idle_slots", "no_slot_available", "unavailable", "wants_free_slot"]

HEALTH_PATHS = frozenset({"/health", "/v1/health"})
"""The paths llama-server answers its health check on."""

_METHODS = ("GET", "HEAD")


def unavailable(message: str) -> JSONResponse:
    """A 503 in llama-server's error shape (``format_error_response`` with ``ERROR_TYPE_UNAVAILABLE``): its probes
    and routers read ``error.type``, and its code is the number, not a name."""
    return JSONResponse({"error": {"code": 503, "message": message, "type": "unavailable_error"}}, status_code=503)


def no_slot_available() -> JSONResponse:
    """llama-server's answer to ``?fail_on_no_slot=1`` while every slot is busy."""
    return unavailable("no slot available")


def wants_free_slot(scope: Scope) -> bool:
    """Whether the request asks to fail while no slot is free: ``fail_on_no_slot`` with any non-empty value."""
    query = scope.get("query_string", b"").decode("latin-1")
    return any(name == "fail_on_no_slot" and value for name, value in parse_qsl(query, keep_blank_values=True))


def idle_slots(slot_busy: Callable[[], list[bool]], admission: AdmissionQueue | None) -> int:
    """How many generations would start at once now: the slots no generation holds and, with an admission queue, no
    more than it would admit without waiting (a request it admitted may not have taken its slot yet).

    :param slot_busy: Whether a generation holds each slot, every model's slots together.
    """
    idle = sum(not busy for busy in slot_busy())
    if admission is not None:
        idle = min(idle, max(0, admission.capacity - admission.running - admission.queued))
    return idle


class HealthRoutes:
    """The ASGI app of :data:`HEALTH_PATHS` (see the module docstring).

    :param loaded: Whether the model is loaded (``False`` while one loads).
    :param idle: How many slots a generation would get at once (:func:`idle_slots`).
    """

    def __init__(self, loaded: Callable[[], bool], idle: Callable[[], int]) -> None:
        self.loaded = loaded
        self.idle = idle

    @staticmethod
    def handles(path: str) -> bool:
        """Whether ``path`` is the health route."""
        return path in HEALTH_PATHS

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["method"] not in _METHODS:
            response = error_response(405, "method_not_allowed",
                                      f"{scope['method']} is not allowed on {scope['path']}; use GET")
            response.headers["allow"] = ", ".join(_METHODS)
        elif not self.loaded():
            response = unavailable("Loading model")
        elif wants_free_slot(scope) and self.idle() == 0:
            response = no_slot_available()
        else:
            response = JSONResponse({"status": "ok"})
        await response(scope, receive, send)
