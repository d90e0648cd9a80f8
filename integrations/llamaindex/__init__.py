"""Checkpoints for LlamaIndex's llama.cpp model (``llama-index-llms-llama-cpp``: ``LlamaCPP``).

``LlamaCPP`` keeps its ``llama_cpp.Llama`` in the private attribute ``_model``; its own calls (``complete``,
``chat``, ``stream_chat``, query engines and agents built on it) are unchanged once it is attached::

    from llama_index.llms.llama_cpp import LlamaCPP
    from ckpt_plugin_integrations import llamaindex as ckpt_llamaindex

    llm = LlamaCPP(model_path="model.gguf", temperature=0.1, **ckpt_llamaindex.model_kwargs())
    manager = ckpt_llamaindex.attach(llm)

Install with ``pip install 'ckpt_plugin[llamaindex]'``. See ``docs/integrations/llamaindex.md``.
"""

from __future__ import annotations

from typing import Any

from ckpt_plugin_integrations.library_support import DEFAULT_N_BATCH, DEFAULT_N_CTX, HeldLlama, llama_kwargs

__all__ = ["attach", "detach", "llama_of", "model_kwargs"]

llama_of, attach, detach = HeldLlama("_model", "a llama_index LlamaCPP").functions()


def model_kwargs(
    n_ctx: int = DEFAULT_N_CTX, n_batch: int = DEFAULT_N_BATCH, swa_full: bool = False, **llama_arguments: Any
) -> dict[str, Any]:
    """Constructor arguments of ``LlamaCPP`` for prefix reuse: ``context_window`` and ``model_kwargs``.

    ``LlamaCPP`` passes ``context_window`` as ``n_ctx`` and everything else through ``model_kwargs`` (merge your own
    ``Llama`` arguments in through ``llama_arguments``, e.g. ``n_gpu_layers=-1``).
    """
    arguments = llama_kwargs(n_ctx, n_batch, swa_full)
    return {"context_window": arguments.pop("n_ctx"), "model_kwargs": {**arguments, **llama_arguments}}
