"""Every exception ckpt_plugin raises, named for what happened.

The HTTP layer maps them to statuses (``ckpt_plugin.http.routes``): bad input is a 4xx with a JSON body, never a 500.
"""

from __future__ import annotations

import os

__all__ = [
    "CaptureError",
    "CheckpointError",
    "ConfigError",
    "CorruptFileError",
    "EmptySlotError",
    "ForeignNamespaceError",
    "GrammarDeadEnd",
    "IncompatibleStateError",
    "OpaqueMemoryError",
    "PluginError",
    "PoolFullError",
    "SlotBusyError",
    "SlotFileNotFoundError",
    "StateRestoreError",
    "UnsafePathError",
    "UnsupportedHostError",
]


class CheckpointError(RuntimeError):
    """Base class of every ckpt_plugin error."""


class ConfigError(CheckpointError, ValueError):
    """The command line, environment or config file is invalid; the message says where."""


class UnsupportedHostError(CheckpointError):
    """The object or the llama-cpp-python version cannot be attached to; nothing was patched."""


class IncompatibleStateError(CheckpointError):
    """A checkpoint, entry or file belongs to another model or context and was refused; nothing changed."""


class StateRestoreError(CheckpointError):
    """llama.cpp refused to load a state or to truncate the memory; the slot was cleared (it is consistent and
    empty, the next request evaluates its prompt in full)."""


class PoolFullError(StateRestoreError):
    """Slots sharing one pool of cells (``--kv-unified``) had no cell left for a step, with every idle slot's cells
    already freed: the busy slots hold them all. Servers answer 503 (retry later); the request's slot is reconciled
    with its memory like any refused step."""


class GrammarDeadEnd(CheckpointError):
    """A request's grammar left no token of the model to choose: it matches nothing at the point the generation
    reached (an inverted range such as ``[z-a]``, a character no token holds). Nothing was accepted: llama.cpp's
    grammar sampler would abort the process on a token it refuses. Servers answer 422 ``invalid_grammar`` (an error
    event with code 422 in a stream that started).

    :ivar generated: Tokens the generation had produced when it reached the dead end.
    """

    def __init__(self, generated: int) -> None:
        where = "at its start" if generated == 0 else f"after {generated} generated tokens"
        super().__init__(f"the grammar matches nothing {where}: no token of the model can follow it (an inverted "
                         "range such as [z-a], or a character no token holds)")
        self.generated = generated


class CaptureError(CheckpointError, MemoryError):
    """The slot's state could not be captured (allocation failed or llama.cpp wrote fewer bytes than it said)."""


class OpaqueMemoryError(CaptureError):
    """The slot's memory holds positions that no token id names (image embeddings, a ``llama_decode`` made outside
    the engine): its state cannot be saved, cached, published or written to a slot file under token ids, and a
    completion that would have to evaluate the host's stale ids in their place is refused."""


class CorruptFileError(CheckpointError):
    """A slot file is malformed: truncated, corrupted, not a slot file, or of an unsupported format version.

    :ivar path: The file.
    :ivar offset: Byte offset of the problem, when it has one.
    """

    def __init__(self, message: str, *, path: str | os.PathLike[str] | None = None, offset: int | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.offset = offset


class UnsafePathError(CheckpointError):
    """A client-supplied file name would leave the configured directory (or is not a plain file name)."""


class SlotFileNotFoundError(CheckpointError):
    """No slot file of that name exists for the caller (files of other tenants are not visible)."""


class ForeignNamespaceError(CheckpointError):
    """A slot file or state belongs to another tenant's namespace and was refused; nothing changed."""


class EmptySlotError(CheckpointError):
    """The slot holds no state of the caller's namespace to save."""


class SlotBusyError(CheckpointError):
    """A generation still used a slot when an action on it had waited as long as it may; nothing changed."""


class PluginError(CheckpointError):
    """A plugin's hook implementation raised; the slot is left consistent.

    :ivar plugin: The name the plugin was registered under.
    :ivar hook: The hook name.
    """

    def __init__(self, plugin: str, hook: str, exc: BaseException) -> None:
        super().__init__(f"plugin {plugin!r} failed in hook {hook!r}: {type(exc).__name__}: {exc}")
        self.plugin = plugin
        self.hook = hook
