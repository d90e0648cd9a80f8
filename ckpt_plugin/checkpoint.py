"""The import path earlier releases documented for checkpoints, extra-state names and state buffers: :mod:`ckpt_plugin.core.checkpoint`."""

from ckpt_plugin.core import checkpoint as _home
from ckpt_plugin.core.checkpoint import (
    Checkpoint,
    DEFAULT_POOL,
    DRAFT,
    EXTRA_NAME,
    ExtraState,
    SPECULATIVE,
    StateBuffer,
    StateBufferPool,
    TARGET,
    allocate_state_buffer,
    as_state_buffer,
    check_extra_name,
    freeze,
)

# The names its home exports, no more (the home module is the one list of them).
__all__ = list(_home.__all__)
