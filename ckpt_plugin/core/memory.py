"""What kind of memory a context has, and the token-prefix arithmetic every layer shares."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["MemoryKind", "PartialSizes", "common_prefix", "partial_cells"]


@dataclass(frozen=True, slots=True)
class MemoryKind:
    """What kind of memory a context has, as far as truncation is concerned.

    :ivar n_swa: The model's sliding-window size, 0 if no layer uses one.
    :ivar swa_full: The window cache is full-size (llama.cpp's ``swa_full``): the live memory keeps old positions,
        but a restored state still holds only the window, so checkpoints are taken all the same (they are small:
        the window's cells).
    :ivar recurrent: Some layers keep a recurrent state (Mamba, RWKV, hybrid models).
    :ivar attention: Some layers keep an attention KV cache (false for pure recurrent models).
    """

    n_swa: int = 0
    swa_full: bool = False
    recurrent: bool = False
    attention: bool = True

    @property
    def swa(self) -> bool:
        """True if a sliding window can lose positions that a truncation would need."""
        return self.n_swa > 0

    @property
    def needs_checkpoints(self) -> bool:
        """True if prefix reuse after a divergence needs checkpoints."""
        return self.swa or self.recurrent

    @property
    def partial_is_complete(self) -> bool:
        """True if a partial checkpoint holds the whole state (pure recurrent models)."""
        return self.recurrent and not self.attention

    @property
    def name(self) -> str:
        """A short name: ``plain``, ``swa``, ``recurrent`` or ``hybrid``."""
        if self.recurrent:
            return "hybrid" if self.attention else "recurrent"
        return "swa" if self.needs_checkpoints else "plain"

    def restored_pos_min(self, pos_min: int, pos_max: int) -> int:
        """The ``pos_min`` a captured state has once restored.

        llama.cpp serializes only the cells inside the window, so a restored sliding-window memory starts at
        ``pos_max - n_swa + 1`` even where the live memory still held older cells.
        """
        if self.swa and pos_max >= 0:
            return max(pos_min, pos_max - self.n_swa + 1)
        return pos_min


def partial_cells(kind: MemoryKind, pos_min: int, pos_max: int) -> int:
    """How many memory cells a partial capture serializes: what its size depends on.

    A recurrent state is one cell per sequence; a sliding window serializes the cells inside the window (see
    :meth:`MemoryKind.restored_pos_min`).
    """
    if kind.recurrent:
        return 1
    if pos_max < 0:
        return 0
    return pos_max - kind.restored_pos_min(pos_min, pos_max) + 1


class PartialSizes:
    """Sizes of partial captures by :func:`partial_cells`, learned from llama.cpp's own size answers.

    llama.cpp sizes a state by a dry-run serialization (about 4% of a checkpoint's cost on Gemma-3-270M). A partial
    state holds a fixed header plus the same bytes per cell, so once one capture of ``n`` cells has been measured,
    every later capture of ``n`` cells has that size. Every capture still checks the bytes written against it; one
    mismatch and the sizes are measured again from then on (:meth:`distrust`).
    """

    def __init__(self, max_known: int = 1 << 16) -> None:
        self.max_known = max_known
        self.trusted = True
        self._sizes: dict[int, int] = {}

    def expected(self, cells: int) -> int | None:
        """The size of a partial capture of ``cells`` cells, if known."""
        return self._sizes.get(cells) if self.trusted else None

    def learn(self, cells: int, n_bytes: int) -> None:
        """Record a measured size (a capture wrote exactly ``n_bytes``)."""
        if self.trusted and len(self._sizes) < self.max_known:
            self._sizes[cells] = n_bytes

    def distrust(self) -> None:
        """A capture wrote another size than expected: measure every size from now on."""
        self.trusted = False
        self._sizes.clear()


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two 1-D integer arrays (vectorized)."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = a[:n] != b[:n]
    first = int(differ.argmax())
    return n if not differ[first] else first
