"""A cached prompt state (:class:`CacheEntry`): what every tier stores and every slot restores from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np

from ckpt_plugin.core.checkpoint import Checkpoint, StateBuffer

DEFAULT_MAX_BYTES = 2 << 30
"""Default byte budget of a prompt cache: 2 GiB, llama-cpp-python's ``LlamaRAMCache`` default."""


@dataclass(eq=False)
class CacheEntry:
    """A cached prompt state: the full sequence state plus the checkpoints of its lineage.

    :ivar tokens: Read-only ``int32`` token ids the state holds.
    :ivar state: The full (non-partial) state checkpoint.
    :ivar checkpoints: Partial checkpoints of the lineage, oldest first (shared with slots and other entries).
    :ivar namespace: The tenant partition.
    """

    tokens: np.ndarray
    state: Checkpoint
    checkpoints: tuple[Checkpoint, ...]
    namespace: str = "default"
    hits: int = 0
    _node: Any = field(default=None, repr=False)  # its place in the radix index

    @property
    def fingerprint(self) -> str:
        return self.state.fingerprint

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @property
    def pos_min(self) -> int:
        return self.state.pos_min

    def buffers(self) -> Iterator[StateBuffer]:
        """Every buffer this entry references (a shared buffer may appear in several entries)."""
        yield from self.state.buffers()
        for checkpoint in self.checkpoints:
            yield from checkpoint.buffers()

    @property
    def nbytes(self) -> int:
        """Bytes of the unique buffers of this entry."""
        return sum(int(b.nbytes) for b in {id(b): b for b in self.buffers()}.values())
