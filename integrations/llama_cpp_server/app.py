"""Build ``llama_cpp.server``'s FastAPI app with checkpoints on every model and the checkpoint middleware."""

from __future__ import annotations

import functools
from typing import Any

import llama_cpp.server.app as host
from llama_cpp.server.settings import ModelSettings, ServerSettings

from ckpt_plugin import host_compat
from ckpt_plugin.config import ServeSettings
from ckpt_plugin.grammar_guard import GrammarGuard
from ckpt_plugin.middleware import CheckpointMiddleware

from .guards import host_route_guards, warm_up
from .proxy import CheckpointLlamaProxy


def create_app(
    server_settings: ServerSettings,
    model_settings: list[ModelSettings],
    checkpoint_settings: ServeSettings | None = None,
) -> Any:
    """``llama_cpp.server.app.create_app`` with a :class:`CheckpointLlamaProxy` and :class:`CheckpointMiddleware`.

    :return: The FastAPI app; ``app.state.llama_proxy`` is the proxy (its ``managers`` are the live managers).
    """
    settings = checkpoint_settings or ServeSettings()
    original = host.LlamaProxy
    # The host builds its proxy by this module-level name; swap it only while the app is built.
    host.LlamaProxy = functools.partial(CheckpointLlamaProxy, settings=settings)  # type: ignore[misc]
    try:
        app = host.create_app(server_settings=server_settings, model_settings=model_settings)
    finally:
        host.LlamaProxy = original  # type: ignore[misc]
    proxy: CheckpointLlamaProxy = host_compat.server_llama_proxy(host)
    app.state.llama_proxy = proxy
    grammars = GrammarGuard()
    app.state.grammar_guard = grammars
    # Every route the host serves is guarded by what it does: llama_cpp.server answers a bad body with a 500, and a
    # few (a grammar it cannot compile, a token id outside the vocabulary) with a dead process.
    app.add_middleware(
        CheckpointMiddleware,
        managers=lambda: proxy.managers,
        settings=settings,
        api_key=server_settings.api_key,
        guards=host_route_guards(app, proxy, grammars),
    )
    warm_up(grammars, proxy)
    return app
