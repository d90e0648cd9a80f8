"""The prompt a request to ``llama_cpp.server`` evaluates, in token ids, found without evaluating anything: what
vLLM's render routes and ``/tokenize`` answer on ckpt-serve.

The request runs through llama-cpp-python's own code (``Llama.create_chat_completion`` and the model's chat
handler, or ``Llama.create_completion``) on a prompt-only view of the model, up to where that code hands its prompt
to ``generate``: the view stops there with the tokens. The chat format or the GGUF's template, tools, BOS rules and
infill are then the ones the request itself gets, and cannot drift from them. The view shares the model and its
tokenizer, read-only (safe beside a running generation, as the tokenizer routes are), but none of the evaluation
bookkeeping: it has its own, its cache is off, and ``generate`` and ``eval`` on it evaluate nothing. No slot is
leased and no lock taken.

Multimodal chat handlers (llama-cpp-python's MTMD family: llava-1-5, llava-1-6, mtmd, ...) split the prompt into text
and media chunks with libmtmd (``mtmd_tokenize``), then clear the context and evaluate. The view's copy of the handler
stops right after the split: each media chunk's positions become the ids the engine stores them under
(:func:`~ckpt_plugin.hosts.llama_cpp.attachment.multimodal.media_prompt`: negative ids derived from the media's
content, which no vocabulary uses), the images keyed by content as the attachment keys them. A prompt whose media
the engine cannot key (positions that are not one per token, as Qwen2-VL's, a prompt that ends with an image, media
on a server drafting with a draft model) is refused: its media positions have no ids.

Where a chat handler makes several completions (function-calling formats that first decide whether to call a tool),
the prompt is the first one's: the one the request evaluates first.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
from llama_cpp.llama import Llama

from ckpt_plugin.hosts.llama_cpp.attachment.multimodal import MtmdRelay, is_mtmd_handler, media_prompt
from ckpt_plugin.hosts.llama_cpp.seam.compat import give_own_state, init_mtmd_context, serialize_bitmap_creation

__all__ = ["MediaSpan", "PromptNotRendered", "RenderedPrompt", "render_chat", "render_completion"]


@dataclass(frozen=True)
class MediaSpan:
    """One media chunk of a rendered prompt.

    :ivar kind: ``"image"`` or ``"audio"``.
    :ivar key: Its content digest (:func:`~ckpt_plugin.core.media.media_digest`), the key the engine stores it under.
    :ivar start: Its first position.
    :ivar end: The position after it.
    """

    kind: str
    key: str
    start: int
    end: int


@dataclass(frozen=True)
class RenderedPrompt:
    """The prompt a request evaluates: its token ids (media positions negative) and its media chunks."""

    tokens: list[int]
    media: tuple[MediaSpan, ...] = ()


class PromptNotRendered(ValueError):
    """The request's prompt cannot be given as token ids (see the module docstring)."""


class _Rendered(BaseException):
    """Carries the prompt out of llama-cpp-python's code where it reaches ``generate``. Not an ``Exception``: a chat
    handler's ``except Exception`` must not take it for a failure."""

    def __init__(self, prompt: RenderedPrompt) -> None:
        super().__init__()
        self.prompt = prompt


class _PromptOnly(Llama):
    """A view of a ``Llama`` that stops at its prompt (see the module docstring); made by :func:`_prompt_only`."""

    def generate(self, tokens: Sequence[int], *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        raise _Rendered(RenderedPrompt([int(token) for token in tokens]))

    def eval(self, tokens: Sequence[int]) -> None:
        # Only a handler that evaluates part of its prompt itself (not a known one, past the MTMD split) gets here.
        raise PromptNotRendered("this chat handler evaluates its prompt itself: it cannot be rendered without a slot")


def _prompt_only(llama: Llama) -> _PromptOnly:
    view = _PromptOnly.__new__(_PromptOnly)
    view.__dict__.update(llama.__dict__)
    for name in list(view.__dict__):
        # Methods patched on the instance (the plugin's, a slot view's) would evaluate: the class's own run instead.
        if inspect.isfunction(getattr(Llama, name, None)):
            del view.__dict__[name]
    # Its own exit stack: the view is closed when collected, and must not free the model with it.
    give_own_state(view, llama._ctx, contextlib.ExitStack())
    view.cache = None
    view.verbose = False  # a verbose Llama resets the shared context's timings before generating
    view.input_ids = np.zeros(0, dtype=np.intc)
    view.n_tokens = 0
    return view


def render_completion(llama: Llama, prompt: str, suffix: str | None = None) -> RenderedPrompt:
    """The prompt ``/v1/completions`` evaluates for ``prompt`` (and ``suffix``, where the model infills).

    :raises ValueError: llama-cpp-python refuses the prompt (longer than the context).
    """
    view = _prompt_only(llama)
    try:
        Llama.create_completion(view, prompt=prompt, suffix=suffix, max_tokens=1, stream=False)
    except _Rendered as rendered:
        return rendered.prompt
    raise PromptNotRendered("the completion answered without evaluating a prompt")


def render_chat(llama: Llama, request: Mapping[str, Any], *, media_ids: bool = True,
                host_handler_runs: bool = True) -> RenderedPrompt:
    """The prompt ``/v1/chat/completions`` evaluates for ``request``.

    :param request: ``Llama.create_chat_completion``'s arguments as the server passes them (``messages``, ``tools``,
        ``tool_choice``, ``functions``, ``response_format``, ...); ``stream`` is ignored.
    :param media_ids: Whether the engine keys media positions (not with a draft model): where not, a prompt with
        media is refused.
    :param host_handler_runs: The model's own chat handler serves requests (one slot); parallel slots each use a
        copy. A multimodal handler's image decoding then takes the lock the copies take (its output redirection is
        not safe across threads), so that a render beside a running request never interleaves with it.
    :raises PromptNotRendered: The prompt's media cannot be keyed, or the handler evaluates by itself.
    :raises ValueError: llama-cpp-python refuses the request (an unknown tool, a prompt longer than the context,
        an image it cannot read); jinja2 errors of the chat template pass through as they are.
    """
    view = _prompt_only(llama)
    handler = llama.chat_handler
    if is_mtmd_handler(handler):
        view.chat_handler = _stopping_handler(handler, llama, media_ids, host_handler_runs)
    arguments = {name: value for name, value in request.items() if name != "stream"}
    try:
        Llama.create_chat_completion(view, **arguments, stream=False)
    except _Rendered as rendered:
        return rendered.prompt
    raise PromptNotRendered("the chat handler answered without evaluating a prompt")


_SERIALIZED = "_ckpt_plugin_bitmaps_serialized"


def _serialize_once(handler: Any) -> None:
    # Twice would nest the same lock (a deadlock): a handler copied from a serialized one is serialized already.
    if not handler.__dict__.get(_SERIALIZED):
        serialize_bitmap_creation(handler)
        handler.__dict__[_SERIALIZED] = True


def _stopping_handler(handler: Any, llama: Llama, media_ids: bool, host_handler_runs: bool) -> Any:
    """A copy of an MTMD chat ``handler`` that stops after libmtmd's split (:class:`_StoppingRelay`)."""
    # As the handler's first call would (a no-op once done): on the model, so that the context lives as long as it.
    init_mtmd_context(handler, llama)
    if host_handler_runs:
        _serialize_once(handler)
    stopping = copy.copy(handler)
    module = handler._mtmd_cpp
    if isinstance(module, MtmdRelay):
        module = module._module
    stopping._mtmd_cpp = _StoppingRelay(module, handler.clip_model_path, media_ids)
    _serialize_once(stopping)
    return stopping


class _StoppingRelay(MtmdRelay):
    """The handler's ``mtmd_cpp`` module with bitmaps keyed by content (the attachment's relay does the same), and a
    ``mtmd_tokenize`` that ends the request with its prompt (:class:`_Rendered`) once libmtmd has split it."""

    def __init__(self, module: Any, projector_path: str, media_ids: bool) -> None:
        super().__init__(module, None, projector_path)  # type: ignore[arg-type]  # nothing is evaluated: no host
        self._media_ids = media_ids

    def mtmd_tokenize(self, mtmd_ctx: Any, chunks: Any, *rest: Any) -> int:
        mtmd = self._module
        status = int(mtmd.mtmd_tokenize(mtmd_ctx, chunks, *rest))
        if status != 0:
            return status  # the handler raises its own error
        prompt = media_prompt(mtmd, mtmd_ctx, chunks)
        if prompt is None:
            raise PromptNotRendered("this prompt's media positions cannot be given as token ids (positions that are "
                                    "not one per token, as Qwen2-VL's, or a prompt that ends with a media chunk)")
        tokens, spans = prompt
        if spans and not self._media_ids:
            raise PromptNotRendered("with a draft model the engine does not key media positions: a prompt with media "
                                    "has no token ids for them")
        kinds = _media_kinds(mtmd, chunks)
        media = tuple(MediaSpan(kind, key, start, end) for (kind, key), (start, end) in zip(kinds, spans))
        raise _Rendered(RenderedPrompt([int(token) for token in tokens], media))

    def mtmd_helper_eval_chunk_single(self, *args: Any) -> int:
        raise PromptNotRendered("a prompt is rendered without evaluating its media")


def _media_kinds(mtmd: Any, chunks: Any) -> list[tuple[str, str]]:
    """``(kind, key)`` of each media chunk of ``chunks``, in order."""
    found = []
    for index in range(int(mtmd.mtmd_input_chunks_size(chunks))):
        chunk = mtmd.mtmd_input_chunks_get(chunks, index)
        kind = mtmd.mtmd_input_chunk_get_type(chunk)
        if kind == mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT:
            continue
        key = mtmd.mtmd_input_chunk_get_id(chunk).decode("ascii", "replace")
        found.append(("audio" if kind == mtmd.MTMD_INPUT_CHUNK_TYPE_AUDIO else "image", key))
    return found
