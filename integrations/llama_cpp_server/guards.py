"""Route guards for every route ``llama_cpp.server`` serves, chosen by the route's endpoint (not its path).

Each guard validates the body against the host's own request model, then checks what only the model can tell:
token ids against the vocabulary, ``logit_bias`` keys, grammars (compiled and sampled with first in a child process
by :class:`~ckpt_plugin.http.grammar_guard.GrammarGuard`), whether the model computes embeddings, and whether a prompt's
text is too long for the context whatever its tokens (refused before it is tokenized). The tokenizer routes
are answered here, in a worker thread: the host tokenizes on the event loop, where a 20 MB body held every other
request for seconds.

Token ids of a model that is not loaded are checked against its vocabulary as the grammar child reads it. On a
server with several models the tokenizer routes stay the host's (it switches models under its own lock).
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import llama_cpp.server.app as host
from llama_cpp.server.types import (
    CreateChatCompletionRequest,
    CreateCompletionRequest,
    CreateEmbeddingRequest,
    DetokenizeInputRequest,
    TokenizeInputRequest,
)
from pydantic import BaseModel

from ckpt_plugin.hosts.llama_cpp.seam import compat as host_compat
from ckpt_plugin.core.errors import UnsupportedHostError
from ckpt_plugin.http.grammar_guard import GrammarGuard
from ckpt_plugin.http.message_checks import check_media_readable, check_messages_given
from ckpt_plugin.http.request_checks import (
    GrammarSource,
    RequestRejected,
    chat_grammars,
    check_logit_bias,
    check_numbers_given,
    check_prompt_fits,
    check_reply_fits,
    check_token_ids,
    completion_grammars,
    prompt_text_bytes,
)
from ckpt_plugin.http.route_guard import RouteGuard

from ckpt_plugin_integrations.llama_cpp_server.model_checks import MULTIMODAL_CHAT_FORMATS


class RouteKind(enum.Enum):
    """What a host route does."""

    COMPLETION = "completion"
    CHAT = "chat"
    EMBEDDING = "embedding"
    TOKENIZE = "tokenize"
    TOKEN_COUNT = "token_count"
    DETOKENIZE = "detokenize"


_SCHEMAS: dict[RouteKind, type[BaseModel]] = {
    RouteKind.COMPLETION: CreateCompletionRequest,
    RouteKind.CHAT: CreateChatCompletionRequest,
    RouteKind.EMBEDDING: CreateEmbeddingRequest,
    RouteKind.TOKENIZE: TokenizeInputRequest,
    RouteKind.TOKEN_COUNT: TokenizeInputRequest,
    RouteKind.DETOKENIZE: DetokenizeInputRequest,
}


MEDIA_HINT = ("llama_cpp.server's chat handlers read text parts, and image_url parts with a multimodal projector: "
              "start ckpt-serve with --clip_model_path PROJECTOR.gguf and a multimodal --chat_format (llava-1-5, "
              "llava-1-6, mtmd, qwen2.5-vl, ...), or set clip_model_path and chat_format in the config file's model.")
"""What a refused image, audio or file part's message says the server reads, and what enables images
(docs/server.md, "Images and audio")."""

# Optional in the host's schema, but handed to llama.cpp's sampler as they are: null is a ctypes error there.
_SAMPLER_NUMBERS = ("presence_penalty", "frequency_penalty")


def route_kinds() -> dict[Callable[..., Any], RouteKind]:
    """The host's endpoint functions and what each does."""
    return {
        host.create_completion: RouteKind.COMPLETION,
        host.create_chat_completion: RouteKind.CHAT,
        host.create_embedding: RouteKind.EMBEDDING,
        host.tokenize: RouteKind.TOKENIZE,
        host.count_query_tokens: RouteKind.TOKEN_COUNT,
        host.detokenize: RouteKind.DETOKENIZE,
    }


@dataclass(frozen=True)
class ModelView:
    """What the checks need of the model a request names.

    :ivar model_path: Its GGUF file (the grammar child loads its vocabulary).
    :ivar embeddings: Whether it was loaded to compute embeddings.
    :ivar llama: The loaded ``Llama`` when it is the one the server holds now (``None``: not loaded).
    :ivar only_model: The server has no other model, so the loaded one cannot be switched away meanwhile.
    :ivar n_ctx: The most tokens a request's prompt and reply hold (a slot's, with parallel slots; 0: unknown until
        the model loads).
    :ivar multimodal: Its chat handler reads images: a multimodal chat format with its projector
        (``clip_model_path``).
    """

    model_path: str
    embeddings: bool
    llama: Any
    only_model: bool
    n_ctx: int = 0
    multimodal: bool = False


class ModelViews:
    """Resolves a request's ``model`` field as the host's proxy would, without loading anything.

    :param proxy: The server's ``LlamaProxy`` (after the app is built).
    """

    def __init__(self, proxy: Any) -> None:
        self.proxy = proxy

    def __call__(self, name: Any) -> ModelView:
        proxy = self.proxy
        alias = host_compat.proxy_model_alias(proxy, name if isinstance(name, str) else None)
        settings = host_compat.proxy_model_settings(proxy, alias)
        loaded = host_compat.proxy_current_model(proxy) if host_compat.proxy_current_alias(proxy) == alias else None
        n_ctx = int(loaded.n_ctx()) if loaded is not None else int(settings.n_ctx or 0)
        multimodal = settings.chat_format in MULTIMODAL_CHAT_FORMATS and settings.clip_model_path is not None
        return ModelView(model_path=settings.model, embeddings=bool(settings.embedding), llama=loaded,
                         only_model=len(list(proxy)) == 1, n_ctx=n_ctx, multimodal=multimodal)


class HostRouteGuard:
    """The guard of one ``llama_cpp.server`` route.

    :param kind: What the route does.
    :param models: Resolves the model a request names.
    :param grammars: Compiles grammars out of process.
    """

    def __init__(self, kind: RouteKind, models: Callable[[Any], ModelView], grammars: GrammarGuard) -> None:
        self.kind = kind
        self.models = models
        self.grammars = grammars
        self.generates = kind in (RouteKind.COMPLETION, RouteKind.CHAT)
        self.schema = _SCHEMAS[kind]

    def _n_vocab(self, model: ModelView) -> int:
        if model.llama is not None:
            return int(model.llama.n_vocab())
        return self.grammars.vocab_size(model.model_path)

    def check(self, payload: dict[str, Any]) -> None:
        if self.kind is RouteKind.CHAT:
            # Before the schema: it refuses audio and file parts with a dozen errors that never say why.
            check_messages_given(payload)
            check_media_readable(payload, self.models(payload.get("model")).multimodal, MEDIA_HINT)
        self.schema.model_validate(payload)
        model = self.models(payload.get("model"))
        if self.kind is RouteKind.COMPLETION:
            prompt = payload.get("prompt")
            if isinstance(prompt, list) and len(prompt) > 1:
                raise RequestRejected(422, "invalid_request", "one prompt per request: prompt lists hold one string")
            self._check_generation(payload, model, completion_grammars(payload))
        elif self.kind is RouteKind.CHAT:
            self._check_generation(payload, model, chat_grammars(payload))
        elif self.kind is RouteKind.EMBEDDING and not model.embeddings:
            raise RequestRejected(400, "embeddings_disabled",
                                  "this model does not compute embeddings (start the server with --embedding true)")
        elif self.kind is RouteKind.DETOKENIZE:
            check_token_ids(payload.get("tokens"), self._n_vocab(model), "tokens")

    def _check_generation(self, payload: dict[str, Any], model: ModelView, grammars: Iterable[GrammarSource]) -> None:
        check_numbers_given(payload, _SAMPLER_NUMBERS)
        n_bytes = prompt_text_bytes(payload)
        if model.n_ctx and n_bytes > model.n_ctx:  # a token stands for a byte at least: only then ask the vocabulary
            check_prompt_fits(n_bytes, model.n_ctx, self.grammars.longest_token_bytes(model.model_path))
        if payload.get("logit_bias"):
            check_logit_bias(payload.get("logit_bias"), payload.get("logit_bias_type"), self._n_vocab(model))
        for source in grammars:
            if source.least_size and model.n_ctx:
                check_reply_fits(source, model.n_ctx, self.grammars.longest_token_bytes(model.model_path))
            problem = self.grammars.problem(model.model_path, source)
            if problem is not None:
                raise RequestRejected(422, "invalid_grammar", f"{source.field}: {problem}")

    def answer(self, payload: dict[str, Any]) -> Any | None:
        if self.kind not in (RouteKind.TOKENIZE, RouteKind.TOKEN_COUNT, RouteKind.DETOKENIZE):
            return None
        model = self.models(payload.get("model"))
        if model.llama is None or not model.only_model:
            return None  # the host loads or switches the model under its own lock
        llama = model.llama
        if self.kind is RouteKind.DETOKENIZE:
            # The host decodes strictly and answers a token that ends inside a UTF-8 sequence with a 500.
            return {"text": llama.detokenize(payload["tokens"]).decode("utf-8", errors="replace")}
        tokens = llama.tokenize(payload["input"].encode("utf-8"), special=True)
        return {"count": len(tokens)} if self.kind is RouteKind.TOKEN_COUNT else {"tokens": tokens}


def host_route_guards(app: Any, proxy: Any, grammars: GrammarGuard) -> dict[str, RouteGuard]:
    """A guard for every ``POST`` route of ``app`` whose endpoint is one of the host's (aliases included)."""
    kinds = route_kinds()
    models = ModelViews(proxy)
    guards: dict[str, RouteGuard] = {}
    for path, route in _endpoint_routes(app.routes, ""):
        kind = kinds.get(route.endpoint)
        if kind is not None and "POST" in (getattr(route, "methods", None) or ()):
            guards[path] = HostRouteGuard(kind, models, grammars)
    missing = set(RouteKind) - {guard.kind for guard in guards.values()}  # type: ignore[attr-defined]
    if missing:
        # An unguarded route would reach the host with bodies that can kill it: refuse to serve instead.
        raise UnsupportedHostError(f"llama_cpp.server routes not found for {sorted(k.value for k in missing)}")
    return guards


def _endpoint_routes(routes: Iterable[Any], prefix: str) -> Iterable[tuple[str, Any]]:
    """``(full path, route)`` of every route with an endpoint, through included routers (FastAPI keeps them as
    ``_IncludedRouter`` entries with their prefix since 0.16x) and mounts."""
    for route in routes:
        if hasattr(route, "endpoint") and hasattr(route, "path"):
            yield prefix + route.path, route
        elif hasattr(route, "original_router"):
            context = getattr(route, "include_context", None)
            yield from _endpoint_routes(route.original_router.routes, prefix + getattr(context, "prefix", ""))
        elif hasattr(route, "routes") and hasattr(route, "path"):
            yield from _endpoint_routes(route.routes, prefix + route.path)


def warm_up(grammars: GrammarGuard, proxy: Any) -> None:
    """Start the grammar child and load the default model's vocabulary in the background, so the first request
    with a grammar does not pay for it."""
    view = ModelViews(proxy)(None)

    def warm() -> None:
        grammars.problem(view.model_path, GrammarSource('root ::= "a"', False, "warm-up"))
        grammars.longest_token_bytes(view.model_path)

    threading.Thread(target=warm, name="ckpt-grammar-warm-up", daemon=True).start()
