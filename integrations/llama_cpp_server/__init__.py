"""ckpt_plugin for llama-cpp-python's OpenAI-compatible server (``llama_cpp.server``): ``ckpt-serve``."""

from __future__ import annotations

from ckpt_plugin_integrations.llama_cpp_server.app import create_app
from ckpt_plugin_integrations.llama_cpp_server.proxy import CheckpointLlamaProxy

__all__ = ["CheckpointLlamaProxy", "create_app"]
