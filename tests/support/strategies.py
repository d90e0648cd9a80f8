"""Hypothesis strategies for the planner's property tests: memory kinds, short prompts over a tiny vocabulary (so
that random prompts share prefixes), and stored candidates with checkpoints."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from ckpt_plugin.core.memory import MemoryKind

from support.factories import Stored, window_checkpoint

KINDS = [MemoryKind(), MemoryKind(n_swa=4), MemoryKind(recurrent=True, attention=False),
         MemoryKind(n_swa=4, recurrent=True)]
"""Plain attention, a 4-token sliding window, recurrent, hybrid."""

tokens = st.lists(st.integers(0, 2), min_size=0, max_size=14)


@st.composite
def stored(draw: st.DrawFn, kind: MemoryKind) -> Stored:
    """Tokens, a window start (a sliding window's memory may have lost the beginning) and up to three checkpoints
    of 1 to 64 bytes (sizes matter to the cost model)."""
    toks = np.asarray(draw(tokens), dtype=np.int32)
    positions = sorted(set(draw(st.lists(st.integers(1, max(1, len(toks))), max_size=3)))) if len(toks) else []
    pos_min = draw(st.integers(0, max(0, len(toks) - 1))) if kind.swa else 0
    sizes = draw(st.lists(st.integers(1, 64), min_size=len(positions), max_size=len(positions)))
    return Stored(toks, pos_min, tuple(window_checkpoint(kind, n, n_bytes=size)
                                       for n, size in zip(positions, sizes) if n <= len(toks)))
