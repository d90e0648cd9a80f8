"""vLLM's prompt-rendering routes on ckpt-serve, for routers that place requests by their prompt's tokens
(vllm-router's ``cache_aware`` policy reads ``token_ids`` from ``POST /v1/chat/completions/render``):

- ``POST /v1/chat/completions/render``: a chat completion request's body; answers vLLM's ``GenerateRequest`` (its
  ``token_ids``, ``features`` with the media chunks' digests and places, ``sampling_params``, ``model``,
  ``stream``, ...);
- ``POST /v1/completions/render``: a completion request's body; answers a list of one ``GenerateRequest``;
- ``POST /tokenize``: vLLM's tokenizer route, with ``prompt`` (``add_special_tokens``, default true: the BOS
  ``/v1/completions`` adds) or ``messages`` (and ``tools``: the chat prompt); answers ``count``, ``max_model_len``,
  ``tokens`` and, with ``return_token_strs``, ``token_strs``.

The token ids are those the same request then evaluates: the server's own chat format and handler build them
(:mod:`ckpt_plugin.hosts.llama_cpp.serving.rendering`), with images as the ids their positions are stored under.
A body gets the checks its generation route gets (:class:`~.guards.HostRouteGuard`: 4xx for what that route
refuses), and fields the generation route ignores are ignored here too (vllm-router sends vLLM's own). The
middleware answers these routes as guarded routes (:meth:`RenderGuard.answer`, in a worker thread): no slot is
leased, no lock taken, and no tenant's namespace plays a part (a render shows only the caller's own body, tokenized).

A server with several models does not render (501): the model a request names may be switched away while it
renders.
"""

from __future__ import annotations

import enum
import logging
import uuid
from typing import Any

from llama_cpp.server.types import CreateChatCompletionRequest, CreateCompletionRequest
from pydantic import BaseModel

from ckpt_plugin.hosts.llama_cpp.serving.rendering import (
    PromptNotRendered,
    RenderedPrompt,
    render_chat,
    render_completion,
)
from ckpt_plugin.http.grammar_guard import GrammarGuard
from ckpt_plugin.http.request_checks import RequestRejected
from ckpt_plugin.http.route_guard import RouteGuard

from ckpt_plugin_integrations.llama_cpp_server.guards import HostRouteGuard, ModelView, ModelViews, RouteKind

__all__ = ["RENDER_PATHS", "RenderGuard", "RenderRoute", "render_guards"]

log = logging.getLogger("ckpt_plugin")


class RenderRoute(enum.Enum):
    """What a render route answers."""

    CHAT = "/v1/chat/completions/render"
    COMPLETION = "/v1/completions/render"
    TOKENIZE = "/tokenize"


RENDER_PATHS = tuple(route.value for route in RenderRoute)

# What the host leaves out of the arguments of Llama.create_chat_completion (llama_cpp.server.app), and what decides
# only sampling: none of them changes the prompt, and a grammar, logit bias or logprobs would only be prepared for a
# generation that never comes.
_HOST_EXCLUDES = {"n", "logit_bias_type", "user", "min_tokens"}
_SAMPLING_ONLY = {"stream", "logit_bias", "grammar", "logprobs", "top_logprobs", "seed"}
MEDIA_MARKER = "<__media__>"
"""What ``token_strs`` shows for a media position (libmtmd's default marker, where the prompt's text had it)."""


class TokenizeChat(BaseModel):
    """vLLM's ``TokenizeChatRequest``, the fields that change the prompt."""

    model: str | None = None
    messages: list[Any]
    tools: list[Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    return_token_strs: bool | None = False


class TokenizePrompt(BaseModel):
    """vLLM's ``TokenizeCompletionRequest``."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class RenderGuard:
    """A render route as a guarded route of the middleware: :meth:`check` refuses what the route's generation
    counterpart refuses, :meth:`answer` renders.

    :param route: Which render route.
    :param proxy: The server's ``CheckpointLlamaProxy``.
    :param grammars: The grammar checks the generation routes use.
    """

    generates = False

    def __init__(self, route: RenderRoute, proxy: Any, grammars: GrammarGuard) -> None:
        self.route = route
        self.proxy = proxy
        self.models = ModelViews(proxy)
        self.chat = HostRouteGuard(RouteKind.CHAT, self.models, grammars)
        self.completion = HostRouteGuard(RouteKind.COMPLETION, self.models, grammars)

    def check(self, payload: dict[str, Any]) -> None:
        if self.route is RenderRoute.CHAT:
            self.chat.check(payload)
        elif self.route is RenderRoute.COMPLETION:
            self.completion.check(payload)
        elif "messages" in payload:
            self.chat.check(_tokenize_chat(payload))
        else:
            TokenizePrompt.model_validate(payload)

    def answer(self, payload: dict[str, Any]) -> Any:
        model = self._model(payload.get("model"))
        try:
            if self.route is RenderRoute.CHAT:
                return self._render_chat(model, payload)
            if self.route is RenderRoute.COMPLETION:
                return [self._render_completion(model, payload)]
            return self._tokenize(model, payload)
        except RequestRejected:
            raise
        except PromptNotRendered as exc:
            raise RequestRejected(422, "not_renderable", str(exc)) from None
        except Exception as exc:  # noqa: BLE001 - a template's raise_exception, an unreadable image, a prompt over
            # the context: the request's own, and its generation fails alike
            log.debug("rendering failed", exc_info=True)
            raise RequestRejected(400, "invalid_request", f"the prompt cannot be built: {exc}") from None

    def _model(self, name: Any) -> ModelView:
        model = self.models(name)
        if not model.only_model:
            raise RequestRejected(501, "not_supported", "this server has several models and renders none: the model "
                                  "a request names may be switched while it renders; serve one model per server")
        if model.llama is None:
            raise RequestRejected(503, "model_not_loaded", "the model is loading; retry when /health answers 200")
        return model

    def _chat_prompt(self, model: ModelView, payload: dict[str, Any]) -> tuple[CreateChatCompletionRequest,
                                                                              RenderedPrompt]:
        body = CreateChatCompletionRequest.model_validate(payload)
        arguments = body.model_dump(exclude=_HOST_EXCLUDES | _SAMPLING_ONLY)
        proxy = self.proxy
        return body, render_chat(model.llama, arguments, media_ids=proxy.draft_model is None,
                                 host_handler_runs=proxy.parallel is None)

    def _render_chat(self, model: ModelView, payload: dict[str, Any]) -> dict[str, Any]:
        body, prompt = self._chat_prompt(model, payload)
        return _generate_request("chatcmpl", prompt, body, payload, logprobs=body.top_logprobs if body.logprobs
                                 else None)

    def _render_completion(self, model: ModelView, payload: dict[str, Any]) -> dict[str, Any]:
        body = CreateCompletionRequest.model_validate(payload)
        text = body.prompt if isinstance(body.prompt, str) else (body.prompt[0] if body.prompt else "")
        return _generate_request("cmpl", render_completion(model.llama, text, body.suffix), body, payload,
                                 logprobs=body.logprobs)

    def _tokenize(self, model: ModelView, payload: dict[str, Any]) -> dict[str, Any]:
        llama = model.llama
        if "messages" in payload:
            request = TokenizeChat.model_validate(payload)
            tokens = self._chat_prompt(model, _tokenize_chat(payload))[1].tokens
        else:
            request = TokenizePrompt.model_validate(payload)
            if request.add_special_tokens:
                tokens = render_completion(llama, request.prompt).tokens
            else:
                tokens = llama.tokenize(request.prompt.encode("utf-8"), add_bos=False, special=True)
        strings = None
        if request.return_token_strs:
            strings = [MEDIA_MARKER if token < 0 else
                       llama.detokenize([token], special=True).decode("utf-8", errors="replace") for token in tokens]
        return {"count": len(tokens), "max_model_len": model.n_ctx, "tokens": tokens, "token_strs": strings}


def _tokenize_chat(payload: dict[str, Any]) -> dict[str, Any]:
    """The chat request whose prompt ``/tokenize`` gives for ``messages``.

    :raises RequestRejected: 422 for what would make the tokens differ from that prompt (the server's chat formats
        always add the generation prompt and their own special tokens, and take no template per request).
    """
    request = TokenizeChat.model_validate(payload)
    differs = [
        name for name, given in (
            ("add_generation_prompt: false", not request.add_generation_prompt),
            ("continue_final_message: true", request.continue_final_message),
            ("add_special_tokens: true", request.add_special_tokens),
            ("chat_template", request.chat_template is not None),
        ) if given
    ]
    if differs:
        raise RequestRejected(422, "not_supported", f"{', '.join(differs)}: the tokens would not be the prompt the "
                              "server evaluates for these messages (its chat format adds the generation prompt and "
                              "its special tokens, and takes no template per request)")
    chat: dict[str, Any] = {"messages": payload["messages"]}
    for name in ("model", "tools"):
        if payload.get(name) is not None:
            chat[name] = payload[name]
    return chat


def _generate_request(prefix: str, prompt: RenderedPrompt, body: Any, payload: dict[str, Any],
                      logprobs: int | None) -> dict[str, Any]:
    """vLLM's ``GenerateRequest`` for a rendered prompt."""
    stream = bool(body.stream)
    stop = body.stop if isinstance(body.stop, list) else [body.stop] if body.stop else []
    max_tokens = body.max_tokens
    if max_tokens is None and isinstance(payload.get("max_completion_tokens"), int):
        max_tokens = payload["max_completion_tokens"]
    salt, priority = payload.get("cache_salt"), payload.get("priority")
    return {
        "request_id": f"{prefix}-{uuid.uuid4().hex}",
        "token_ids": prompt.tokens,
        "features": _features(prompt),
        "sampling_params": {
            "n": 1, "max_tokens": max_tokens, "temperature": body.temperature, "top_p": body.top_p,
            "top_k": body.top_k, "min_p": body.min_p, "presence_penalty": body.presence_penalty,
            "frequency_penalty": body.frequency_penalty, "repetition_penalty": body.repeat_penalty,
            "seed": body.seed, "stop": stop, "logprobs": logprobs,
        },
        "model": body.model,
        "stream": stream,
        "stream_options": payload.get("stream_options") if stream else None,
        "cache_salt": salt if isinstance(salt, str) else None,
        "priority": priority if isinstance(priority, int) and not isinstance(priority, bool) else 0,
        "kv_transfer_params": None,
    }


def _features(prompt: RenderedPrompt) -> dict[str, Any] | None:
    """vLLM's ``MultiModalFeatures`` of the prompt's media chunks (``None`` for a prompt of text)."""
    if not prompt.media:
        return None
    hashes: dict[str, list[str]] = {}
    places: dict[str, list[dict[str, int]]] = {}
    for span in prompt.media:
        hashes.setdefault(span.kind, []).append(span.key)
        places.setdefault(span.kind, []).append({"offset": span.start, "length": span.end - span.start})
    return {"mm_hashes": hashes, "mm_placeholders": places, "kwargs_data": None}


def render_guards(proxy: Any, grammars: GrammarGuard) -> dict[str, RouteGuard]:
    """A guard for each render route, by path."""
    return {route.value: RenderGuard(route, proxy, grammars) for route in RenderRoute}
