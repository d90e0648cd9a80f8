"""Every access to llama-cpp-python's private attributes, in one place.

llama-cpp-python keeps part of what a prompt-cache layer must keep in step in private attributes of ``Llama`` (the
sampling seed, whether the last token still needs evaluation) and of its server (the module-level model proxy, the
proxy's current model). Nothing else in ckpt_plugin reads or writes them, so a new llama-cpp-python release is
checked here and only here.

Checked against llama-cpp-python 0.3.36 (``attach`` refuses versions outside
:data:`ckpt_plugin.hosts.llama_cpp.attachment.attach.TESTED_VERSIONS`). This module imports nothing from ``llama_cpp``:
it takes the host's objects as arguments.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

__all__ = [
    "COMPLETION_METHOD",
    "SERVER_CHAT_FORMATS",
    "context_alive",
    "decode_handles",
    "give_own_state",
    "has_context",
    "init_mtmd_context",
    "model_wrapper",
    "proxy_current_alias",
    "proxy_current_model",
    "proxy_model_alias",
    "proxy_model_settings",
    "seed",
    "serialize_bitmap_creation",
    "server_llama_proxy",
    "set_evaluated_prefix",
    "set_logits_current",
    "set_seed",
    "wants_all_logits",
]

CHECKED_VERSION = "0.3.36"
"""The llama-cpp-python release whose private attributes this module was checked against."""


def has_context(llama: Any) -> bool:
    """Whether ``llama`` holds a llama.cpp context (``False`` once closed, and for ``vocab_only`` models)."""
    return getattr(llama, "_ctx", None) is not None


def context_alive(llama: Any) -> bool:
    """Whether ``llama``'s llama.cpp context is still allocated (``Llama.close`` frees it and sets
    ``LlamaContext.ctx`` to ``None``; so does garbage collection, in any order, of a ``Llama`` in a cycle)."""
    context = getattr(llama, "_ctx", None)
    return context is not None and getattr(context, "ctx", None) is not None


def seed(llama: Any) -> int:
    """The seed ``llama`` samples with (``Llama._seed``), as ``LlamaState.seed`` records it."""
    return int(llama._seed)


def set_seed(llama: Any, value: int) -> None:
    """Set the sampling seed, as ``Llama.load_state`` does."""
    llama._seed = value


def set_evaluated_prefix(llama: Any, tokens: np.ndarray, n_keep: int) -> None:
    """Tell ``llama`` its memory holds ``tokens[:n_keep]`` and that the next token must be evaluated.

    ``Llama.generate`` compares its ``input_ids[:n_tokens]`` with the prompt to decide what to evaluate; after the
    manager restored a state, those must describe the memory. ``_requires_eval`` makes ``generate`` evaluate at least
    one token (fresh logits) even when the whole prompt matches.
    """
    llama.input_ids[:n_keep] = tokens[:n_keep]
    llama.n_tokens = n_keep
    llama._requires_eval = True


def set_logits_current(llama: Any, current: bool) -> None:
    """Tell ``llama`` whether the context's logits are those of its last token (``Llama._requires_eval``, negated):
    ``generate`` given exactly the tokens it holds then samples from them without evaluating anything."""
    llama._requires_eval = not current


def model_wrapper(llama: Any) -> Any:
    """The ``LlamaModel`` that ``llama`` holds (``Llama._model``): one object per loaded model, shared by every view
    of it, gone when the model is freed."""
    return llama._model


def give_own_state(view: Any, context: Any, stack: Any) -> None:
    """Make a shallow copy of a ``Llama`` independent of it: its own context wrapper (``_ctx``), exit stack
    (``_stack``: closing the copy must not free the original's model), no sampler, and its next token evaluated."""
    view._ctx = context
    view._stack = stack
    view._sampler = None
    view._requires_eval = True


def server_llama_proxy(server_app_module: Any) -> Any:
    """The model proxy ``llama_cpp.server.app.create_app`` stored in its module (``_llama_proxy``)."""
    return server_app_module._llama_proxy


def proxy_model_alias(proxy: Any, model: str | None) -> str:
    """The alias ``LlamaProxy.__call__(model)`` would serve (unknown names fall back to the default model)."""
    return model if model in proxy._model_settings_dict else proxy._default_model_alias


def proxy_current_alias(proxy: Any) -> str | None:
    """The alias of the model the proxy holds now (``None`` before the first request)."""
    return proxy._current_model_alias


def proxy_current_model(proxy: Any) -> Any:
    """The ``Llama`` the proxy holds now (``None`` before the first request)."""
    return proxy._current_model


def proxy_model_settings(proxy: Any, alias: str) -> Any:
    """The ``ModelSettings`` of ``alias``."""
    return proxy._model_settings_dict[alias]


def decode_handles(llama: Any) -> tuple[Any, Any]:
    """``(llama._ctx, llama._batch)``: the context wrapper and the batch that ``Llama.eval`` decodes with."""
    return llama._ctx, llama._batch


def wants_all_logits(llama: Any) -> bool:
    """``Llama._logits_all``: whether the host asked for every token's logits (forced on with a draft model)."""
    return bool(llama._logits_all)


def init_mtmd_context(handler: Any, llama: Any) -> None:
    """Load an MTMD chat handler's libmtmd context for ``llama`` now (``_init_mtmd_context``; a no-op once loaded).

    The handler loads it at its first call, on the ``Llama`` it is called with, and registers its freeing on that
    ``Llama``'s exit stack: called first on a per-request view, the context would be freed with the view (while
    other requests use it) and loaded again for the next. Loaded here on the host's ``Llama``, it lives as long as
    the model.
    """
    handler._init_mtmd_context(llama)


_STDIO_REDIRECTS = threading.Lock()


def serialize_bitmap_creation(handler: Any) -> None:
    """Make an MTMD chat handler's ``_create_bitmap_from_bytes`` (called once per image of every request) take a
    process-wide lock, for a handler called from several threads at once (parallel slots' views).

    It decodes the image inside llama-cpp-python's ``suppress_stdout_stderr``, which points the process's file
    descriptors 1 and 2 at ``/dev/null`` and back with ``dup2``: two threads interleaving there leave them on
    ``/dev/null`` for good (every later line of the server's log lost) and close descriptors twice. One at a time,
    each restores what it saved.
    """
    create = handler._create_bitmap_from_bytes

    def one_at_a_time(image_bytes: bytes) -> Any:
        with _STDIO_REDIRECTS:
            return create(image_bytes)

    handler._create_bitmap_from_bytes = one_at_a_time


COMPLETION_METHOD = "_create_completion"
"""The ``Llama`` method every completion goes through (``create_completion``, ``__call__`` and the chat handlers),
with its ``logprobs`` and ``echo`` arguments: patched on the instance to learn which logits a request reads."""


SERVER_CHAT_FORMATS = frozenset({
    "gemma4", "hf-autotokenizer", "hf-tokenizer-config", "llama-3-vision-alpha", "llava-1-5", "llava-1-6",
    "minicpm-v-2.6", "moondream", "mtmd", "nanollava", "obsidian", "qwen2.5-vl",
})
"""Chat formats ``llama_cpp.server``'s ``LlamaProxy.load_llama_from_model_settings`` builds by name (multimodal and
tokenizer-based handlers), besides llama-cpp-python's chat-format registry (0.3.36)."""
