"""ckpt_plugin for llama-cpp-python's OpenAI-compatible server (``llama_cpp.server``): ``ckpt-serve``."""

from __future__ import annotations

from .app import create_app
from .proxy import CheckpointLlamaProxy

__all__ = ["CheckpointLlamaProxy", "create_app"]
