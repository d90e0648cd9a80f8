"""ckpt_plugin: shared, immutable context checkpoints and a prefix-indexed prompt cache for llama-cpp-python hosts.

Quick start::

    from llama_cpp import Llama
    import ckpt_plugin

    llama = Llama("model.gguf", n_ctx=4096)
    manager = ckpt_plugin.attach(llama)      # the host's own calls now reuse prefixes through checkpoints
    llama.create_completion("...", max_tokens=32)
    print(manager.stats())
"""

from __future__ import annotations

from .cache import DEFAULT_MAX_BYTES, CacheEntry, PromptCache, RadixIndex
from .checkpoint import Checkpoint, ExtraState, StateBuffer, StateBufferPool
from .config import CheckpointSettings, ServeSettings
from .disk_tier import DiskTier
from .errors import (
    CaptureError,
    CheckpointError,
    ConfigError,
    CorruptFileError,
    EmptySlotError,
    ForeignNamespaceError,
    IncompatibleStateError,
    PluginError,
    SlotFileNotFoundError,
    StateRestoreError,
    UnsafePathError,
    UnsupportedHostError,
)
from .persist import decode_entry, encode_entry, read_entry, safe_path, write_entry
from .hooks import PROJECT_NAME, hookimpl, hookspec
from .manager import Backend, CheckpointManager, Counters, Slot
from .policy import CheckpointRules, MemoryKind
from .publishing import publish
from .shared_tier import SharedTier

__version__ = "0.1.0"


_LAZY = {
    "attach": "llama_backend",
    "detach": "llama_backend",
    "manager_of": "llama_backend",
    "SharedLlamaState": "llama_backend",
    "HostPromptCache": "llama_backend",
    "LlamaBackend": "llama_backend",
    "DraftModel": "speculative",
    "DraftStatePlugin": "speculative",
    "NgramDraft": "speculative",
    "NgramStatePlugin": "speculative",
    "enable_speculative": "speculative",
    "CheckpointMiddleware": "middleware",
    "BodyLimitMiddleware": "body_limit",
    "CheckpointRoutes": "routes",
    "Tenants": "tenants",
}


def __getattr__(name: str):
    # The llama_cpp-facing names load lazily so that policy, cache and hook code import without llama_cpp.
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ckpt_plugin' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f".{module}", __name__), name)


__all__ = [
    "BodyLimitMiddleware",
    "CaptureError",
    "CheckpointRoutes",
    "ConfigError",
    "EmptySlotError",
    "ForeignNamespaceError",
    "SlotFileNotFoundError",
    "StateRestoreError",
    "Tenants",
    "CheckpointMiddleware",
    "CorruptFileError",
    "DiskTier",
    "DraftModel",
    "DraftStatePlugin",
    "NgramDraft",
    "NgramStatePlugin",
    "ServeSettings",
    "SharedTier",
    "StateBufferPool",
    "UnsafePathError",
    "enable_speculative",
    "decode_entry",
    "encode_entry",
    "publish",
    "read_entry",
    "safe_path",
    "write_entry",
    "DEFAULT_MAX_BYTES",
    "PROJECT_NAME",
    "Backend",
    "CacheEntry",
    "Checkpoint",
    "CheckpointError",
    "CheckpointManager",
    "CheckpointRules",
    "CheckpointSettings",
    "Counters",
    "ExtraState",
    "HostPromptCache",
    "IncompatibleStateError",
    "LlamaBackend",
    "MemoryKind",
    "PluginError",
    "PromptCache",
    "RadixIndex",
    "SharedLlamaState",
    "Slot",
    "StateBuffer",
    "UnsupportedHostError",
    "attach",
    "detach",
    "hookimpl",
    "hookspec",
    "manager_of",
    "__version__",
]
