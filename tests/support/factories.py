"""Checkpoints, cache entries and their state buffers for tests, built by keyword.

``checkpoint(40, pos_min=9, target=random_bytes(300, seed=1), draft=random_bytes(50, seed=2))`` reads as what it
is; what a test leaves out takes the plain value: a partial checkpoint of positions ``0 .. n_tokens - 1`` with one
zero byte of state, of the fingerprint ``"fp"``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from ckpt_plugin.core.checkpoint import Checkpoint, StateBuffer, freeze
from ckpt_plugin.core.entry import CacheEntry
from ckpt_plugin.core.memory import MemoryKind

FINGERPRINT = "fp"


def zeros(n_bytes: int) -> StateBuffer:
    """``n_bytes`` read-only zero bytes."""
    return freeze(np.zeros(n_bytes, dtype=np.uint8))


def random_bytes(n_bytes: int, seed: int = 0) -> StateBuffer:
    """``n_bytes`` read-only random bytes, the same for the same ``seed``."""
    return freeze(np.random.default_rng(seed).integers(0, 256, n_bytes, dtype=np.uint8))


def token_run(first: int, n_tokens: int) -> np.ndarray:
    """The read-only ``int32`` tokens ``first, first + 1, ...`` (``n_tokens`` of them)."""
    tokens = np.arange(first, first + n_tokens, dtype=np.int32)
    tokens.flags.writeable = False
    return tokens


def checkpoint(n_tokens: int, *, pos_min: int = 0, pos_max: int | None = None, partial: bool = True,
               target: StateBuffer | None = None, n_bytes: int = 1, fingerprint: str = FINGERPRINT,
               extra: Mapping[str, StateBuffer] | None = None, draft: StateBuffer | None = None,
               speculative: StateBuffer | None = None) -> Checkpoint:
    """A checkpoint after ``n_tokens`` tokens.

    ``pos_max`` defaults to ``n_tokens - 1``, ``target`` to ``n_bytes`` zero bytes (an empty sequence holds no
    position: ``pos_min=-1``).
    """
    return Checkpoint(n_tokens=n_tokens, pos_min=pos_min, pos_max=n_tokens - 1 if pos_max is None else pos_max,
                      partial=partial, target=zeros(n_bytes) if target is None else target, fingerprint=fingerprint,
                      extra=extra, draft=draft, speculative=speculative)


def window_checkpoint(kind: MemoryKind, n_tokens: int, n_bytes: int = 1) -> Checkpoint:
    """The partial checkpoint a context of ``kind`` takes after ``n_tokens`` tokens: its window's positions (all of
    them, without a window), or the last position alone (a recurrent state)."""
    pos_min = max(0, n_tokens - kind.n_swa) if kind.swa else n_tokens - 1
    return checkpoint(n_tokens, pos_min=pos_min, n_bytes=n_bytes)


@dataclass(eq=False)
class Stored:
    """A candidate as the tiers hand them to the planner: tokens, a full state (4 bytes a token), checkpoints."""

    tokens: np.ndarray
    pos_min: int
    checkpoints: tuple[Checkpoint, ...] = field(default=())

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @property
    def state(self) -> Checkpoint:
        return checkpoint(self.n_tokens, pos_min=self.pos_min, partial=False, n_bytes=max(4 * self.n_tokens, 1))


def entry(tokens: Sequence[int] | np.ndarray, *, state: Checkpoint | None = None,
          checkpoints: Sequence[Checkpoint] = (), namespace: str = "default", n_bytes: int = 1,
          fingerprint: str = FINGERPRINT) -> CacheEntry:
    """A cache entry of ``tokens`` (made ``int32``); ``state`` defaults to a full state of them all (``n_bytes`` zero
    bytes)."""
    array = np.asarray(tokens, dtype=np.int32)
    if state is None:
        state = checkpoint(len(array), partial=False, n_bytes=n_bytes, fingerprint=fingerprint)
    return CacheEntry(array, state, tuple(checkpoints), namespace)
