"""A cached prompt state (:class:`CacheEntry`): what every tier stores and every slot restores from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np

from ckpt_plugin.core.checkpoint import Checkpoint, StateBuffer

__all__ = ["CacheEntry", "DEFAULT_MAX_BYTES"]

DEFAULT_MAX_BYTES = 2 << 30
"""Default byte budget of a prompt cache: 2 GiB, llama-cpp-python's ``LlamaRAMCache`` default."""


@dataclass(eq=False)
class CacheEntry:
    """A cached prompt state: its full state plus the partial checkpoints of its lineage (both
    :class:`~ckpt_plugin.core.checkpoint.Checkpoint`, told apart by ``partial``).

    :ivar tokens: Read-only ``int32`` token ids the state holds.
    :ivar state: The full state: a checkpoint with ``partial`` false, holding the whole sequence at ``tokens``' end.
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

    def superseded_by(self, newer: CacheEntry) -> bool:
        """Whether ``newer`` serves every prompt this entry serves, but those that continue this entry's own last
        tokens past where ``newer`` left them: the two agree at least up to this entry's last checkpoint, and
        ``newer`` holds all of this entry's checkpoints.

        That is the turn after a reply the client sent back changed (reasoning or whitespace stripped, a fixed
        reply, an edit): the conversation went on from the checkpoint before the reply, and nobody asks for the
        reply this entry generated again. An entry without checkpoints (plain attention, which a full state serves
        at any length) is never superseded so, nor is one whose tokens ``newer`` holds in full (that is an ancestor).
        """
        if not self.checkpoints or newer.namespace != self.namespace or newer.fingerprint != self.fingerprint:
            return False
        last = self.checkpoints[-1].n_tokens
        n = min(len(self.tokens), len(newer.tokens))
        if n < last:
            return False
        differ = np.flatnonzero(self.tokens[:n] != newer.tokens[:n])
        common = int(differ[0]) if len(differ) else n
        if common < last or common >= len(self.tokens):
            return False
        theirs = {id(c) for c in newer.checkpoints}
        return all(id(c) in theirs for c in self.checkpoints)

    @property
    def nbytes(self) -> int:
        """Bytes of the unique buffers of this entry."""
        return sum(int(b.nbytes) for b in {id(b): b for b in self.buffers()}.values())
