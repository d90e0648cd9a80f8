"""State copies between a sequence of a model context and immutable checkpoints, for every slot of an engine.

A capture is written by exactly one llama.cpp call into a buffer of the cache's pool (uninitialized, counted against
the budget), checked against the size llama.cpp promised, then frozen; extra state (a draft model's, a speculative
decoder's, any plugin's) is collected from the ``on_checkpoint_capture`` hook and stored with it. A restore hands the
same read-only buffer back to llama.cpp. Partial sizes are learned once per engine: every sequence of one context has
the same layout.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from .checkpoint import Checkpoint, ExtraState, freeze
from .errors import IncompatibleStateError, StateRestoreError
from .policy import MemoryKind, PartialSizes, partial_cells

if TYPE_CHECKING:
    from .hook_relay import HookRelay
    from .slot import Backend, Slot
    from .counters import Counters
    from .store import TieredStore

log = logging.getLogger("ckpt_plugin")


class Captures:
    """Captures and restores of one model's sequences.

    :param kind: The memory kind (where a restored window starts).
    :param fingerprint: The model and context a state belongs to; a state of another is refused.
    :param store: Its RAM tier's pool gives the buffers; its budget shrinks when an allocation fails.
    :param counters: Bytes copied, failures.
    :param hooks: ``on_capture_failed`` and ``on_checkpoint_capture``.
    """

    def __init__(self, kind: MemoryKind, fingerprint: str, store: TieredStore, counters: Counters,
                 hooks: HookRelay) -> None:
        self.kind = kind
        self.fingerprint = fingerprint
        self.store = store
        self.counters = counters
        self.hooks = hooks
        self.partial_sizes = PartialSizes()

    def capture(self, backend: Backend, slot: Slot, partial: bool) -> Checkpoint | None:
        """The state of ``slot``'s sequence now (``partial``: only what cannot be truncated), or ``None`` if it
        could not be taken (the hooks are told why)."""
        pos_min, pos_max = int(backend.pos_min()), int(backend.pos_max())
        cells = partial_cells(self.kind, pos_min, pos_max)
        expected = self.partial_sizes.expected(cells) if partial else None
        if expected is None:
            size = int(backend.state_size(partial))
            self.counters.state_size_queries += 1
        else:
            size = expected
        try:
            buffer = self.store.ram.pool.allocate(size)
        except MemoryError:
            # Make room by shrinking the cache budget instead of failing the request.
            shrunk = max(0, self.store.ram.resident_bytes - size)
            log.warning("allocation of %d state bytes failed; prompt-cache budget shrunk to %d", size, shrunk)
            self.store.resize(shrunk)
            self.counters.capture_failures += 1
            self.hooks.call(self.hooks.hook.on_capture_failed, slot=slot, expected=size, written=0)
            return None
        written = int(backend.read_state(buffer, partial))
        if expected is not None and written != size:
            # llama.cpp wrote another size than learned (0 if the buffer was too small): measure from now on.
            log.info("partial state of %d cells wrote %d bytes, not %d; sizing every capture again", cells, written,
                     size)
            self.partial_sizes.distrust()
            return self.capture(backend, slot, partial)
        if written != size:
            log.warning("state capture wrote %d of %d bytes; no checkpoint taken", written, size)
            self.counters.capture_failures += 1
            self.hooks.call(self.hooks.hook.on_capture_failed, slot=slot, expected=size, written=written)
            return None
        if partial and expected is None:
            self.partial_sizes.learn(cells, size)
        self.counters.bytes_captured += written
        extras: list[ExtraState | None] = self.hooks.call(self.hooks.hook.on_checkpoint_capture, slot=slot,
                                                          n_tokens=slot.n_tokens, partial=partial)
        by_kind = {extra.kind: extra.data for extra in extras if extra is not None} if extras else {}
        return Checkpoint(
            n_tokens=slot.n_tokens,
            pos_min=self.kind.restored_pos_min(pos_min, pos_max),
            pos_max=pos_max,
            partial=partial,
            target=freeze(buffer),
            fingerprint=self.fingerprint,
            draft=by_kind.get("draft"),
            speculative=by_kind.get("speculative"),
        )

    def check_fingerprint(self, fingerprint: str) -> None:
        """Refuse a state of another model or context.

        :raises IncompatibleStateError: It is one.
        """
        if fingerprint != self.fingerprint:
            raise IncompatibleStateError(
                f"state belongs to model/context {fingerprint}, this context is {self.fingerprint}"
            )

    def restore(self, backend: Backend, checkpoint: Checkpoint) -> None:
        """Load ``checkpoint`` into ``backend``'s sequence, without copying it.

        :raises IncompatibleStateError: It belongs to another model or context.
        :raises StateRestoreError: llama.cpp refused it; the sequence is then undefined (the caller clears it).
        """
        self.check_fingerprint(checkpoint.fingerprint)
        read = int(backend.write_state(checkpoint.target, checkpoint.partial))
        if read != checkpoint.target.nbytes:
            raise StateRestoreError(
                f"llama.cpp refused the state ({read} of {checkpoint.target.nbytes} bytes read); the slot was cleared"
            )
        self.counters.bytes_restored += read
