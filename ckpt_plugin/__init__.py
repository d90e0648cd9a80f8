"""ckpt_plugin: shared, immutable context checkpoints and a prefix-indexed prompt cache for llama-cpp-python hosts.

Quick start::

    from llama_cpp import Llama
    import ckpt_plugin

    llama = Llama(str(ckpt_plugin.default_model_path()), n_ctx=4096)   # the built-in model, or any GGUF path
    manager = ckpt_plugin.attach(llama)      # the host's own calls now reuse prefixes through checkpoints
    llama.create_completion("...", max_tokens=32)
    print(manager.stats())
"""

from __future__ import annotations

from ckpt_plugin.core.entry import DEFAULT_MAX_BYTES, CacheEntry
from ckpt_plugin.tiers.ram import PromptCache
from ckpt_plugin.core.checkpoint import Checkpoint, ExtraState
from ckpt_plugin.core.config import CheckpointSettings, ServeSettings
from ckpt_plugin.tiers.disk import DiskTier
from ckpt_plugin.core.errors import (
    CaptureError,
    CheckpointError,
    ConfigError,
    CorruptFileError,
    EmptySlotError,
    ForeignNamespaceError,
    GrammarDeadEnd,
    IncompatibleStateError,
    OpaqueMemoryError,
    PluginError,
    PoolFullError,
    SlotFileNotFoundError,
    StateRestoreError,
    UnsafePathError,
    UnsupportedHostError,
)
from ckpt_plugin.plugins.hookspecs import PROJECT_NAME, hookimpl, hookspec
from ckpt_plugin.core.slot import Backend, Slot
from ckpt_plugin.engine.manager import CheckpointManager
from ckpt_plugin.persist.read import read_entry
from ckpt_plugin.persist.write import write_entry
from ckpt_plugin.core.memory import MemoryKind
from ckpt_plugin.services.publishing import publish
from ckpt_plugin.policy.schedule import CheckpointRules
from ckpt_plugin.tiers.shared.tier import SharedTier

__version__ = "0.1.0"


_LAZY = {
    "attach": "hosts.llama_cpp.attachment.attach",
    "detach": "hosts.llama_cpp.attachment.attach",
    "manager_of": "hosts.llama_cpp.attachment.attach",
    "SharedLlamaState": "hosts.llama_cpp.attachment.host_cache",
    "HostPromptCache": "hosts.llama_cpp.attachment.host_cache",
    "SequenceContext": "hosts.llama_cpp.parallel.sequences",
    "ParallelLlama": "hosts.llama_cpp.parallel.parallel_llama",
    "DraftModel": "hosts.llama_cpp.speculative.drafts",
    "DraftStatePlugin": "hosts.llama_cpp.speculative.drafts",
    "NgramDraft": "hosts.llama_cpp.speculative.drafts",
    "NgramStatePlugin": "hosts.llama_cpp.speculative.drafts",
    "enable_speculative": "hosts.llama_cpp.speculative.drafts",
    "CheckpointMiddleware": "http.middleware",
    "default_model_path": "hosts.llama_cpp.serving.default_model",
    "DEFAULT_CHAT_FORMAT": "hosts.llama_cpp.serving.chat_formats",
    "register_chat_formats": "hosts.llama_cpp.serving.chat_formats",
}


def __getattr__(name: str):
    # The llama_cpp-facing names load lazily so that policy, cache and hook code import without llama_cpp.
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ckpt_plugin' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f".{module}", __name__), name)


__all__ = [
    "__version__",
    "attach",
    "Backend",
    "CacheEntry",
    "CaptureError",
    "Checkpoint",
    "CheckpointError",
    "CheckpointManager",
    "CheckpointMiddleware",
    "CheckpointRules",
    "CheckpointSettings",
    "ConfigError",
    "CorruptFileError",
    "DEFAULT_CHAT_FORMAT",
    "DEFAULT_MAX_BYTES",
    "default_model_path",
    "detach",
    "DiskTier",
    "DraftModel",
    "DraftStatePlugin",
    "OpaqueMemoryError",
    "EmptySlotError",
    "enable_speculative",
    "ExtraState",
    "ForeignNamespaceError",
    "GrammarDeadEnd",
    "hookimpl",
    "hookspec",
    "HostPromptCache",
    "IncompatibleStateError",
    "manager_of",
    "MemoryKind",
    "NgramDraft",
    "NgramStatePlugin",
    "ParallelLlama",
    "PluginError",
    "PoolFullError",
    "PROJECT_NAME",
    "PromptCache",
    "publish",
    "read_entry",
    "register_chat_formats",
    "SequenceContext",
    "ServeSettings",
    "SharedLlamaState",
    "SharedTier",
    "Slot",
    "SlotFileNotFoundError",
    "StateRestoreError",
    "UnsafePathError",
    "UnsupportedHostError",
    "write_entry",
]
