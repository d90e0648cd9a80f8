"""Build ``llama_cpp.server``'s FastAPI app with checkpoints on every model and the checkpoint middleware."""

from __future__ import annotations

import contextlib
import functools
from typing import Any, AsyncIterator

import anyio
import llama_cpp.server.app as host
from llama_cpp.server.settings import ModelSettings, ServerSettings

from ckpt_plugin.hosts.llama_cpp.seam import compat as host_compat
from ckpt_plugin.http.admission_queue import AdmissionQueue
from ckpt_plugin.core.config import ServeSettings
from ckpt_plugin.http.grammar_guard import GrammarGuard
from ckpt_plugin.http.middleware import CheckpointMiddleware

from ckpt_plugin_integrations.llama_cpp_server.guards import host_route_guards, warm_up
from ckpt_plugin_integrations.llama_cpp_server.interrupted_streams import report_interruptions
from ckpt_plugin_integrations.llama_cpp_server.kv_events import mount_kv_event_sources, start_kv_events
from ckpt_plugin_integrations.llama_cpp_server.model_checks import check_parallel
from ckpt_plugin_integrations.llama_cpp_server.proxy import CheckpointLlamaProxy, RequestViews
from ckpt_plugin_integrations.llama_cpp_server.read_ahead import collect_streams, iterate_chunks, stop_streams
from ckpt_plugin_integrations.llama_cpp_server.render import render_guards
from ckpt_plugin_integrations.llama_cpp_server.request_ids import RequestIds, accept_any_request_id


def create_app(
    server_settings: ServerSettings,
    model_settings: list[ModelSettings],
    checkpoint_settings: ServeSettings | None = None,
) -> Any:
    """``llama_cpp.server.app.create_app`` with a :class:`CheckpointLlamaProxy` and :class:`CheckpointMiddleware`;
    any reasonable ``X-Request-Id`` is kept (:mod:`.request_ids`), and a stream that ``interrupt_requests`` cuts
    short ends with an error event (:mod:`.interrupted_streams`). The middleware also answers llama-server's
    ``/health`` and vLLM's render routes and ``/tokenize`` (:mod:`.render`).

    With ``kv_events_config``, the KV events are published (:mod:`.kv_events`) and ``GET /kv_event_sources`` says
    where.

    :return: The FastAPI app; ``app.state.llama_proxy`` is the proxy (its ``managers`` are the live managers),
        ``app.state.kv_events`` the KV events' publisher (``None`` when they are off).
    """
    settings = checkpoint_settings or ServeSettings()
    check_parallel(model_settings, settings.parallel, draft_model=settings.draft_model)
    # Before the models load: a busy port is refused at once, and the first capture is announced.
    kv_events = start_kv_events(settings)
    original = host.LlamaProxy
    # The host builds its proxy by this module-level name; swap it only while the app is built.
    host.LlamaProxy = functools.partial(CheckpointLlamaProxy, settings=settings)  # type: ignore[misc]
    try:
        app = host.create_app(server_settings=server_settings, model_settings=model_settings)
    finally:
        host.LlamaProxy = original  # type: ignore[misc]
    proxy: CheckpointLlamaProxy = host_compat.server_llama_proxy(host)
    app.state.llama_proxy = proxy
    app.state.kv_events = kv_events
    mount_kv_event_sources(app, kv_events)
    grammars = GrammarGuard(timeout=settings.grammar_check_seconds, step_budget=settings.grammar_max_step_seconds)
    app.state.grammar_guard = grammars
    admission = None
    if settings.parallel > 1:
        admission = AdmissionQueue(settings.parallel, settings.max_queued)
        serve_without_the_host_lock(app)
    app.state.admission = admission
    # Every route the host serves is guarded by what it does: llama_cpp.server answers a bad body with a 500, and a
    # few (a grammar it cannot compile, a token id outside the vocabulary) with a dead process.
    app.add_middleware(
        CheckpointMiddleware,
        managers=lambda: proxy.managers,
        settings=settings,
        api_key=server_settings.api_key,
        guards={**host_route_guards(app, proxy, grammars), **render_guards(proxy, grammars)},
        admission=admission,
        model_stats=proxy.model_stats,
        # None while the proxy loads a model (a switch between the models of a config file).
        loaded=lambda: host_compat.proxy_current_model(proxy) is not None,
    )
    # Outermost: every response carries the request's id, the middleware's own refusals included.
    accept_any_request_id(app)
    app.add_middleware(RequestIds)
    report_interruptions()
    warm_up(grammars, proxy)
    return app


def serve_without_the_host_lock(app: Any) -> None:
    """Let requests reach a parallel proxy at once.

    ``llama_cpp.server`` hands its model proxy out under two module-level locks, so that one request runs at a time
    (and, with ``interrupt_requests``, a waiting request cuts the running stream short). With parallel slots, the
    middleware's admission queue bounds the requests in flight and each gets its own slot: the proxy is handed out
    without the locks, as a :class:`RequestViews` whose views are closed when the request ends. Models without
    parallel slots are still served under the host's locks.

    Streams are read ahead (:mod:`.read_ahead`): each slot's next token is submitted as soon as its chunk is made,
    not after the event loop has taken the chunk, so that a batched step does not wait for the event loop to serve
    every slot in turn.
    """
    locked = getattr(host.get_llama_proxy, "__wrapped__", host.get_llama_proxy)

    async def get_llama_proxy() -> AsyncIterator[Any]:
        proxy = host_compat.server_llama_proxy(host)
        if getattr(proxy, "parallel", None) is not None:
            views = RequestViews(proxy)
            streams = collect_streams()
            try:
                yield views
            finally:
                stop_streams(streams)
                # Also when the request was cancelled (its client left): the slot must not wait for the collector.
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(views.close)
            return
        async with contextlib.asynccontextmanager(locked)() as held:
            yield held

    get_llama_proxy.__wrapped__ = locked  # type: ignore[attr-defined]
    # The routes call the module-level names; their ``Depends`` captured the original function.
    host.get_llama_proxy = get_llama_proxy
    host.iterate_in_threadpool = iterate_chunks
    app.dependency_overrides[locked] = get_llama_proxy
