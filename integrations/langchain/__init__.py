"""Checkpoints for LangChain's llama.cpp models (``langchain-community``: ``ChatLlamaCpp`` and ``LlamaCpp``).

Both keep their ``llama_cpp.Llama`` in ``.client``; the model's own calls (``invoke``, ``stream``, ``batch``) are
unchanged once it is attached::

    from langchain_community.chat_models import ChatLlamaCpp
    from ckpt_plugin_integrations import langchain as ckpt_langchain

    llm = ChatLlamaCpp(model_path="model.gguf", temperature=0, **ckpt_langchain.model_kwargs())
    manager = ckpt_langchain.attach(llm)

Install with ``pip install 'ckpt_plugin[langchain]'``. See ``docs/integrations/langchain.md``.
"""

from __future__ import annotations

from typing import Any

from ckpt_plugin_integrations.library_support import DEFAULT_N_BATCH, DEFAULT_N_CTX, HeldLlama, llama_kwargs

__all__ = ["attach", "detach", "llama_of", "model_kwargs"]

llama_of, attach, detach = HeldLlama("client", "a langchain_community ChatLlamaCpp or LlamaCpp").functions()


def model_kwargs(
    n_ctx: int = DEFAULT_N_CTX, n_batch: int = DEFAULT_N_BATCH, swa_full: bool = False, **llama_arguments: Any
) -> dict[str, Any]:
    """Constructor arguments of ``ChatLlamaCpp`` / ``LlamaCpp`` for prefix reuse.

    LangChain's defaults are ``n_ctx=512`` (too short for a conversation) and ``n_batch=8`` (prompts evaluated 8
    tokens at a time); ``swa_full`` and any other ``Llama`` argument (``llama_arguments``) go through the model's
    ``model_kwargs``, the only way LangChain passes arguments it has no field for.
    """
    arguments = llama_kwargs(n_ctx, n_batch, swa_full)
    return {
        "n_ctx": arguments.pop("n_ctx"),
        "n_batch": arguments.pop("n_batch"),
        "model_kwargs": {**arguments, **llama_arguments},
    }
