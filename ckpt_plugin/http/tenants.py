"""Who is calling: the host's API key check, the operator key, and the tenant namespace a server derives.

A namespace is derived by the server from the request (a digest of the bearer key, or of a header the operator's
gateway sets), never taken from a field a client picks freely. Credentials are compared in constant time and
never stored: namespaces hold a digest.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from starlette.datastructures import Headers

from ckpt_plugin.core.config import ServeSettings

__all__ = ["Caller", "Tenants", "namespace_for"]

ANONYMOUS = "anonymous"


def bearer(headers: Headers) -> str | None:
    """The credentials of an ``Authorization: Bearer ...`` header, if any."""
    value = headers.get("authorization", "")
    scheme, _, credentials = value.partition(" ")
    return credentials.strip() if scheme.lower() == "bearer" and credentials.strip() else None


def _same(given: str | None, expected: str) -> bool:
    return given is not None and hmac.compare_digest(given.encode(), expected.encode())


@dataclass(frozen=True)
class Caller:
    """What one request may do.

    :ivar authorized: It passes the host's API key check (always, when the host has none).
    :ivar operator: It presented the operator key (``checkpoints.admin_key``): admin routes show every namespace.
    :ivar namespace: Its cache partition; ``None`` when namespaces are off (one shared partition).
    :ivar anonymous: Namespaces are on and the request carries no tenant identity.
    """

    authorized: bool
    operator: bool
    namespace: str | None
    anonymous: bool


class Tenants:
    """Derives a :class:`Caller` from request headers.

    :param settings: Namespace mode, header name and operator key.
    :param api_key: The host's API key, if it has one.
    """

    def __init__(self, settings: ServeSettings, api_key: str | None) -> None:
        self.settings = settings
        self.api_key = api_key
        self.admin_key = settings.admin_key.get_secret_value() if settings.admin_key is not None else None

    def caller(self, headers: Headers) -> Caller:
        given = bearer(headers)
        operator = self.admin_key is not None and _same(given, self.admin_key)
        authorized = self.api_key is None or operator or _same(given, self.api_key)
        namespace, anonymous = self._namespace(headers, given)
        return Caller(authorized=authorized, operator=operator, namespace=namespace, anonymous=anonymous)

    def _namespace(self, headers: Headers, given: str | None) -> tuple[str | None, bool]:
        mode = self.settings.namespaces
        if mode == "off":
            return None, False
        value = given if mode == "api_key" else headers.get(self.settings.namespace_header or "", "")
        return namespace_for(mode, value), not value


NAMESPACE_PREFIXES = {"api_key": "key", "header": "hdr"}
"""The prefix of a namespace by the ``namespaces`` mode that derived it."""


def namespace_for(mode: str, value: str | None) -> str:
    """The namespace a server with ``namespaces=mode`` derives from a bearer token (``"api_key"``) or a header value
    (``"header"``): the prefix (``key:``, ``hdr:``) and the first 16 hex digits of the value's SHA-256 digest, or
    ``anonymous`` for no value.

    :raises ValueError: ``mode`` is not ``"api_key"`` or ``"header"`` (``"off"`` derives no namespace).
    """
    prefix = NAMESPACE_PREFIXES.get(mode)
    if prefix is None:
        raise ValueError(f"namespaces={mode!r} derives no namespace; use 'api_key' or 'header'")
    if not value:
        return f"{prefix}:{ANONYMOUS}"
    # A digest: the raw credential never sits in the cache's keys, logs, files or the admin view.
    return f"{prefix}:{hashlib.sha256(value.encode()).hexdigest()[:16]}"
