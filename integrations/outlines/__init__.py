"""Checkpoints for outlines' llama.cpp model (``outlines.from_llamacpp``, ``outlines.models.LlamaCpp``).

outlines calls ``Llama.reset()`` after every generation, so on its own it evaluates every prompt from the first
token; attached, a prompt that shares a prefix with an earlier one (a long instruction before each input of a
structured-generation job, a growing chat) is served from the cache or a checkpoint::

    import outlines
    from llama_cpp import Llama
    from ckpt_plugin_integrations import outlines as ckpt_outlines

    model = ckpt_outlines.from_llamacpp(Llama("model.gguf", **ckpt_outlines.llama_kwargs()))
    result = model(instructions + document, MySchema, max_tokens=200)

Install with ``pip install 'ckpt_plugin[outlines]'``. See ``docs/integrations/outlines.md``.
"""

from __future__ import annotations

from typing import Any

from llama_cpp import Llama

from ckpt_plugin_integrations.library_support import HeldLlama, attach_llama, llama_kwargs, require

__all__ = ["attach", "detach", "from_llamacpp", "llama_kwargs", "llama_of"]

llama_of, attach, detach = HeldLlama("model", "an outlines LlamaCpp model").functions()


def from_llamacpp(llama: Llama, chat_mode: bool = True, **settings: Any) -> Any:
    """``outlines.from_llamacpp(llama, chat_mode)`` with ``llama`` attached first (``settings`` as for
    :func:`ckpt_plugin.attach`).

    Every input of a job becomes a prompt-cache entry: with many long inputs, bound the cache with
    ``cache_max_bytes`` (or ``cache_max_tokens``); the least recently used entries go first, so the shared
    instructions stay.
    """
    outlines = require("outlines", "outlines")
    attach_llama(llama, **settings)
    return outlines.from_llamacpp(llama, chat_mode=chat_mode)
