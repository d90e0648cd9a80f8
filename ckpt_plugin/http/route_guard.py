"""What the middleware knows of a host route: how to check its body, and whether it generates.

A host integration hands :class:`~ckpt_plugin.http.middleware.CheckpointMiddleware` one :class:`RouteGuard` per route
path, chosen by what the route does (its endpoint), not by how its path ends: ``llama_cpp.server`` serves
completions under ``/v1/completions`` and ``/v1/engines/copilot-codex/completions`` alike. For a guarded ``POST``
the middleware reads the body, refuses one that is not JSON (415/400), runs :meth:`RouteGuard.check` in a worker
thread (it may compile a grammar or tokenize), lets :meth:`RouteGuard.answer` serve the route itself, and only then
hands the body to the host.
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol

from pydantic import BaseModel, ValidationError

from ckpt_plugin.http.request_checks import RequestRejected


class RouteGuard(Protocol):
    """Checks for one host route.

    :ivar generates: The route runs a generation: its response gets ``cached_tokens``, the request's limits and
        cancellation apply, and a streamed failure ends with an error event.
    """

    generates: bool

    def check(self, payload: dict[str, Any]) -> None:
        """Refuse a body the host must not see.

        :raises RequestRejected: With the status and error the client gets.
        :raises ValueError: A body the route's schema refuses (422; pydantic's ``ValidationError`` is one).
        """

    def answer(self, payload: dict[str, Any]) -> Any | None:
        """The route's JSON response, computed here (called in a worker thread), or ``None`` to let the host
        answer."""


class SchemaGuard:
    """A route whose body must validate against a pydantic model; the host answers it.

    :param schema: The route's request model.
    :param generates: See :class:`RouteGuard`.
    """

    def __init__(self, schema: type[BaseModel] | None = None, generates: bool = False) -> None:
        self.schema = schema
        self.generates = generates

    def check(self, payload: dict[str, Any]) -> None:
        if self.schema is not None:
            self.schema.model_validate(payload)

    def answer(self, payload: dict[str, Any]) -> Any | None:
        return None


def default_guards() -> Mapping[str, RouteGuard]:
    """The guards of an app that names none: OpenAI's two completion routes, JSON objects required."""
    return {"/v1/completions": SchemaGuard(generates=True), "/v1/chat/completions": SchemaGuard(generates=True)}


def validation_message(exc: ValidationError) -> str:
    """pydantic's errors in one line: ``field.path: message; ...`` (the input is never repeated)."""
    return "; ".join(
        f"{'.'.join(str(p) for p in error['loc']) or 'body'}: {error['msg']}" for error in exc.errors()[:10]
    )


__all__ = ["RouteGuard", "default_guards", "validation_message"]
