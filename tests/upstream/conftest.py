"""Runs llama-cpp-python's own tests/test_llama.py with local models instead of Hugging Face downloads, and, with
CKPT_UPSTREAM_ATTACH=1, with every Llama attached as it is created (see tests/test_upstream_suite.py).

Copied next to the extracted test file; reads the model paths from CKPT_UPSTREAM_MODELS (JSON: repo_id/filename ->
local path). Embedding and vocab-only models are left unattached (attach refuses them by design)."""

from __future__ import annotations

import json
import os

import huggingface_hub

_MODELS = json.loads(os.environ["CKPT_UPSTREAM_MODELS"])


def _local(repo_id: str, filename: str, *args: object, **kwargs: object) -> str:
    return _MODELS.get(f"{repo_id}/{filename}", _MODELS["default"])


huggingface_hub.hf_hub_download = _local

if os.environ.get("CKPT_UPSTREAM_ATTACH") == "1":
    import llama_cpp

    import ckpt_plugin

    _init = llama_cpp.Llama.__init__

    def _attached_init(self: llama_cpp.Llama, *args: object, **kwargs: object) -> None:
        _init(self, *args, **kwargs)
        if not kwargs.get("vocab_only") and not kwargs.get("embedding"):
            ckpt_plugin.attach(self, load_entrypoints=False)

    llama_cpp.Llama.__init__ = _attached_init  # type: ignore[method-assign]
