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
from .policy import MemoryKind
from .schedule import CheckpointRules
from .publishing import publish
from .shared_tier import SharedTier

__version__ = "0.1.0"


_LAZY = {
    "attach": "hosts.llama_cpp.attach",
    "detach": "hosts.llama_cpp.attach",
    "manager_of": "hosts.llama_cpp.attach",
    "SharedLlamaState": "hosts.llama_cpp.host_cache",
    "HostPromptCache": "hosts.llama_cpp.host_cache",
    "LlamaBackend": "hosts.llama_cpp.backend",
    "SequenceContext": "hosts.llama_cpp.sequences",
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
    "__version__",
    "attach",
    "Backend",
    "BodyLimitMiddleware",
    "CacheEntry",
    "CaptureError",
    "Checkpoint",
    "CheckpointError",
    "CheckpointManager",
    "CheckpointMiddleware",
    "CheckpointRoutes",
    "CheckpointRules",
    "CheckpointSettings",
    "ConfigError",
    "CorruptFileError",
    "Counters",
    "decode_entry",
    "DEFAULT_MAX_BYTES",
    "detach",
    "DiskTier",
    "DraftModel",
    "DraftStatePlugin",
    "EmptySlotError",
    "enable_speculative",
    "encode_entry",
    "ExtraState",
    "ForeignNamespaceError",
    "hookimpl",
    "hookspec",
    "HostPromptCache",
    "IncompatibleStateError",
    "LlamaBackend",
    "manager_of",
    "MemoryKind",
    "NgramDraft",
    "NgramStatePlugin",
    "PluginError",
    "PROJECT_NAME",
    "PromptCache",
    "publish",
    "RadixIndex",
    "read_entry",
    "safe_path",
    "SequenceContext",
    "ServeSettings",
    "SharedLlamaState",
    "SharedTier",
    "Slot",
    "SlotFileNotFoundError",
    "StateBuffer",
    "StateBufferPool",
    "StateRestoreError",
    "Tenants",
    "UnsafePathError",
    "UnsupportedHostError",
    "write_entry",
]
