"""``--kv-events-config`` on ckpt-serve: the publisher started before the models load, listening on the page store,
and vLLM's ``GET /kv_event_sources`` answered from it (docs/server.md, "KV events")."""

from __future__ import annotations

import atexit
from typing import Any

from ckpt_plugin.core.config import ServeSettings
from ckpt_plugin.core.errors import ConfigError
from ckpt_plugin.core.kv_events_config import KvEventsConfig
from ckpt_plugin.core.pages import PAGES

__all__ = ["kv_events_text", "mount_kv_event_sources", "start_kv_events"]


def start_kv_events(settings: ServeSettings) -> Any | None:
    """The running publisher of ``settings.kv_events_config`` (``None`` when events are off), listening on the
    process's page store until the process exits.

    :raises ConfigError: The kv-events extra is missing, or an endpoint cannot be bound or connected.
    """
    config = settings.kv_events_config
    if config is None or not config.publishing:
        return None
    try:
        import zmq

        from ckpt_plugin.services.kv_publisher import KvEventPublisher
    except ImportError as exc:
        raise ConfigError(f"kv_events_config needs pyzmq and msgspec ({exc.name} is missing): "
                          "pip install 'ckpt_plugin[kv-events]'") from None
    try:
        publisher = KvEventPublisher(config)
    except zmq.ZMQError as exc:
        raise ConfigError(f"kv_events_config: cannot open {_endpoints(config)}: {exc}") from None
    PAGES.listen(publisher)

    def stop() -> None:
        PAGES.listen(None)
        publisher.close()

    atexit.register(stop)
    return publisher


def _endpoints(config: KvEventsConfig) -> str:
    return config.endpoint + (f" and {config.replay_endpoint}" if config.replay_endpoint else "")


def mount_kv_event_sources(app: Any, publisher: Any | None) -> None:
    """``GET /kv_event_sources`` as vLLM answers it: the publisher's configuration by data-parallel rank (``{}``
    when events are off), for routers that find a worker's event sockets by asking it (vllm-router's kv_aware)."""

    async def kv_event_sources() -> dict[str, Any]:
        return publisher.sources() if publisher is not None else {}

    app.add_api_route("/kv_event_sources", kv_event_sources, methods=["GET"], include_in_schema=False)


def kv_events_text(publisher: Any | None) -> str | None:
    """What the start-up line says of the events: where they are published, or nothing when they are off."""
    if publisher is None:
        return None
    replay = f", replay {publisher.replay_endpoint}" if publisher.replay_endpoint else ""
    return f"kv events {publisher.endpoint}{replay}"
