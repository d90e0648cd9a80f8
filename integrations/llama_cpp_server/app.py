"""Build ``llama_cpp.server``'s FastAPI app with checkpoints on every model and the checkpoint middleware."""

from __future__ import annotations

import functools
from typing import Any

import llama_cpp.server.app as host
from llama_cpp.server.settings import ModelSettings, ServerSettings
from llama_cpp.server.types import CreateChatCompletionRequest, CreateCompletionRequest

from ckpt_plugin import host_compat
from ckpt_plugin.config import ServeSettings
from ckpt_plugin.llama_backend import grammar_error
from ckpt_plugin.middleware import CheckpointMiddleware

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
    app.add_middleware(
        CheckpointMiddleware,
        managers=lambda: proxy.managers,
        settings=settings,
        api_key=server_settings.api_key,
        # llama_cpp.server answers an invalid body with a 500; refuse it with a 422 before the model is touched.
        validators={
            "/chat/completions": _validator(CreateChatCompletionRequest, proxy),
            "/v1/completions": _validator(CreateCompletionRequest, proxy),
        },
    )
    return app


def _validator(model: Any, proxy: CheckpointLlamaProxy) -> Any:
    """The host's request schema, and a grammar llama.cpp can parse (the host itself dies on one it cannot)."""

    def validate(payload: dict[str, Any]) -> None:
        model.model_validate(payload)
        grammar = payload.get("grammar")
        if isinstance(grammar, str):
            for manager in list(proxy.managers.values())[:1]:
                problem = grammar_error(manager.backend.llama, grammar)
                if problem is not None:
                    raise ValueError(f"grammar: {problem}")

    return validate
