"""The slot: one live sequence's tokens, lineage and checkpoints, and what the manager needs from a model context."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from ckpt_plugin.core.checkpoint import Checkpoint
from ckpt_plugin.core.memory import MemoryKind, common_prefix

__all__ = ["Backend", "Slot"]


class Backend(Protocol):
    """What the manager needs from a model context (implemented by :mod:`ckpt_plugin.hosts.llama_cpp`).

    A backend whose context other sequences decode into at the same time may also have ``memory_lock``: a lock that,
    held, keeps every other call on the context out, so that a capture sees one state of the sequence's cells.
    """

    kind: MemoryKind
    fingerprint: str
    n_ctx: int

    def state_size(self, partial: bool) -> int:
        """Bytes a capture of sequence 0 needs."""

    def read_state(self, buffer: np.ndarray, partial: bool) -> int:
        """Serialize sequence 0 into ``buffer`` with one call; return the bytes written."""

    def write_state(self, buffer: np.ndarray, partial: bool) -> int:
        """Load sequence 0 from ``buffer`` without copying it; return the bytes read (0 on failure)."""

    def pos_min(self) -> int:
        """Smallest position held for sequence 0 (-1 if empty)."""

    def pos_max(self) -> int:
        """Largest position held for sequence 0 (-1 if empty)."""

    def truncate(self, n_keep: int) -> bool:
        """Remove positions ``>= n_keep`` of sequence 0."""

    def clear(self) -> None:
        """Empty sequence 0."""

    def decode(self, tokens: np.ndarray) -> None:
        """Evaluate ``tokens`` after the memory's end (host bookkeeping included)."""


class Slot:
    """One live sequence: the tokens its memory holds, its lineage and its checkpoints (oldest first).

    The lineage is the token sequence the checkpoints were taken on; the memory holds a prefix of it. Truncating
    the memory keeps the lineage (and so the checkpoints past the cut stay usable); evaluating tokens that differ
    from the lineage rewrites it, and the checkpoints past the divergence are erased.

    :ivar id: Slot id (sequence id in the context).
    :ivar n_tokens: Tokens the memory holds.
    :ivar checkpoints: Partial checkpoints of the lineage.
    :ivar version: Incremented on every change of the memory, so cached captures know when they are stale.
    """

    def __init__(self, slot_id: int, capacity: int) -> None:
        self.id = slot_id
        self._tokens = np.zeros(max(capacity, 1), dtype=np.int32)
        self.n_tokens = 0
        self.n_lineage = 0
        self.checkpoints: list[Checkpoint] = []
        self.version = 0
        self.namespace = "default"

    @staticmethod
    def _readonly(view: np.ndarray) -> np.ndarray:
        view.flags.writeable = False
        return view

    @property
    def tokens(self) -> np.ndarray:
        """Read-only view of the tokens in memory."""
        return self._readonly(self._tokens[: self.n_tokens])

    @property
    def lineage(self) -> np.ndarray:
        """Read-only view of the lineage (``tokens`` is a prefix of it)."""
        return self._readonly(self._tokens[: self.n_lineage])

    def _reserve(self, n: int) -> None:
        if n > len(self._tokens):
            self._tokens = np.resize(self._tokens, max(n, 2 * len(self._tokens)))

    def set_lineage(self, lineage: np.ndarray, n_memory: int | None = None) -> None:
        """Hold ``lineage[:n_memory]`` (all of it by default) in a new lineage."""
        n = len(lineage)
        self._reserve(n)
        self._tokens[:n] = lineage
        self.n_lineage = n
        self.n_tokens = n if n_memory is None else min(n_memory, n)
        self.version += 1

    def append(self, tokens: np.ndarray) -> int | None:
        """Append evaluated tokens; return where the lineage was rewritten from, or ``None`` if it was not."""
        start, end = self.n_tokens, self.n_tokens + len(tokens)
        self.version += 1
        overlap = max(0, min(end, self.n_lineage) - start)
        same = common_prefix(self._tokens[start : start + overlap], tokens[:overlap]) if overlap else 0
        if same == len(tokens):
            self.n_tokens = end
            return None
        self._reserve(end)
        self._tokens[start:end] = tokens
        self.n_tokens = self.n_lineage = end
        return start + same

    def truncate(self, n_keep: int) -> None:
        """Hold at most ``n_keep`` tokens; the lineage stays."""
        self.n_tokens = min(self.n_tokens, n_keep)
        self.version += 1
