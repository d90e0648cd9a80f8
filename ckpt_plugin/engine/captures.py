"""State copies between a sequence of a model context and immutable checkpoints, for every slot of an engine.

A capture is written by exactly one llama.cpp call into a buffer of the cache's pool (uninitialized, counted against
the budget), checked against the size llama.cpp promised, then frozen; extra states (a draft model's, a speculative
decoder's, any plugin's, each under its name) are collected from the ``on_checkpoint_capture`` hook and stored with
it. A restore hands the same read-only buffer back to llama.cpp. Partial sizes are learned once per engine: every
sequence of one context has the same layout.

Slots of one engine capture from their own threads. What they share here is updated under locks (the learned sizes,
the counters). Another slot's decode may take cells of the sequence being copied (those its next token no longer
sees) between the copy's steps: the copy then checks that the sequence did not move and is taken again if it did.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Sequence

from ckpt_plugin.core.checkpoint import Checkpoint, ExtraState, StateBuffer, freeze
from ckpt_plugin.core.pages import PagedState
from ckpt_plugin.core.errors import IncompatibleStateError, StateRestoreError
from ckpt_plugin.core.memory import MemoryKind, PartialSizes, partial_cells
from ckpt_plugin.engine.paging import StatePager

if TYPE_CHECKING:
    from ckpt_plugin.plugins.engine_hooks import EngineHooks
    from ckpt_plugin.core.slot import Backend, Slot
    from ckpt_plugin.core.counters import Counters
    from ckpt_plugin.tiers.store import TieredStore

__all__ = ["Captures"]

log = logging.getLogger("ckpt_plugin")

_COPY_ATTEMPTS = 4
"""Copies of one capture at most while other slots' decodes keep taking cells of the sequence meanwhile."""


class Captures:
    """Captures and restores of one model's sequences.

    :param kind: The memory kind (where a restored window starts).
    :param fingerprint: The model and context a state belongs to; a state of another is refused.
    :param store: Its RAM tier's pool gives the buffers; its budget shrinks when an allocation fails.
    :param counters: Bytes copied, failures.
    :param hooks: ``on_capture_failed`` and ``on_checkpoint_capture``.
    :param page_positions: Positions a page of a captured state covers (0: states stay whole).
    """

    def __init__(self, kind: MemoryKind, fingerprint: str, store: TieredStore, counters: Counters,
                 hooks: EngineHooks, page_positions: int = 0) -> None:
        self.kind = kind
        self.pager = StatePager(kind, fingerprint, page_positions, counters)
        self.fingerprint = fingerprint
        self.store = store
        self.counters = counters
        self.hooks = hooks
        self.partial_sizes = PartialSizes()
        # Slots learn and distrust sizes from their own threads: each use of the table is one step under this lock.
        self._sizes_lock = threading.Lock()

    def capture(self, backend: Backend, slot: Slot, partial: bool) -> Checkpoint | None:
        """The state of ``slot``'s sequence now (``partial``: only what cannot be truncated), or ``None`` if it
        could not be taken (the hooks are told why)."""
        copied = self._copy(backend, partial)
        if isinstance(copied, _Failed):
            if copied.no_memory:  # make room by shrinking the cache budget instead of failing the request
                shrunk = max(0, self.store.ram.resident_bytes - copied.expected)
                log.warning("allocation of %d state bytes failed; prompt-cache budget shrunk to %d", copied.expected,
                            shrunk)
                self.store.resize(shrunk)
            elif copied.moved:
                log.warning("other sequences kept taking cells of the one being copied; no checkpoint taken")
            else:
                log.warning("state capture wrote %d of %d bytes; no checkpoint taken", copied.written,
                            copied.expected)
            self.counters.add(capture_failures=1)
            self.hooks.call(self.hooks.hook.on_capture_failed, slot=slot, expected=copied.expected,
                            written=copied.written)
            return None
        buffer, pos_min, pos_max = copied
        extras: list[ExtraState | None] = self.hooks.call(self.hooks.hook.on_checkpoint_capture, slot=slot,
                                                          n_tokens=slot.n_tokens, partial=partial)
        return Checkpoint(
            n_tokens=slot.n_tokens,
            pos_min=self.kind.restored_pos_min(pos_min, pos_max),
            pos_max=pos_max,
            partial=partial,
            target=self.pager.page(freeze(buffer), slot.tokens, slot.namespace, partial),
            fingerprint=self.fingerprint,
            extra=_by_name(extras) if extras else None,
        )

    def _copy(self, backend: Backend, partial: bool,
              attempts: int = _COPY_ATTEMPTS) -> tuple[StateBuffer, int, int] | _Failed:
        """One state of the sequence's cells: the buffer written, ``pos_min`` and ``pos_max`` as they were during
        the copy; or what failed.

        Where sequences share a context's KV cells, a decode of another slot may take cells of this sequence (those
        its next token no longer sees) at any step: ``pos_min`` then rises and the state shrinks. A backend that
        names a ``memory_lock`` keeps those decodes out for the copy. Without one, a copy whose ``pos_min`` is the
        same after as before saw one state; one that is not is taken again, ``attempts`` times at most.
        """
        with getattr(backend, "memory_lock", None) or contextlib.nullcontext():
            return self._copy_once(backend, partial, attempts)

    def _copy_once(self, backend: Backend, partial: bool, attempts: int) -> tuple[StateBuffer, int, int] | _Failed:
        pos_min, pos_max = int(backend.pos_min()), int(backend.pos_max())
        cells = partial_cells(self.kind, pos_min, pos_max)
        expected = self._sized(lambda sizes: sizes.expected(cells)) if partial else None
        if expected is None:
            size = int(backend.state_size(partial))
            self.counters.add(state_size_queries=1)
        else:
            size = expected
        try:
            buffer = self.store.ram.pool.allocate(size)
        except MemoryError:
            return _Failed(size, 0, no_memory=True)
        written = int(backend.read_state(buffer, partial))
        if int(backend.pos_min()) != pos_min:  # another sequence took cells meanwhile: not a size to distrust
            if attempts > 1:
                return self._copy_once(backend, partial, attempts - 1)
            return _Failed(size, written, moved=True)
        if expected is not None and written != size:
            # llama.cpp wrote another size than learned (0 if the buffer was too small): measure from now on.
            log.info("partial state of %d cells wrote %d bytes, not %d; sizing every capture again", cells, written,
                     size)
            self._sized(lambda sizes: sizes.distrust())
            return self._copy_once(backend, partial, attempts)
        if written != size:
            return _Failed(size, written)
        if partial and expected is None:
            self._sized(lambda sizes: sizes.learn(cells, size))
        self.counters.add(bytes_captured=written)
        return buffer, pos_min, pos_max

    def _sized(self, use: Callable[[PartialSizes], Any]) -> Any:
        """``use(self.partial_sizes)`` under the table's lock."""
        with self._sizes_lock:
            return use(self.partial_sizes)

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
        target = checkpoint.target
        if isinstance(target, PagedState):  # assembled into a recycled buffer that lives for this restore only
            target = target.assemble(self.store.ram.pool.allocate(target.nbytes))
        read = int(backend.write_state(target, checkpoint.partial))
        if read != checkpoint.target.nbytes:
            raise StateRestoreError(
                f"llama.cpp refused the state ({read} of {checkpoint.target.nbytes} bytes read); the slot was cleared"
            )
        self.counters.add(bytes_restored=read)


class _Failed(NamedTuple):
    """A copy that failed: the bytes expected and written; whether no buffer could be had at all, or the sequence
    kept moving during the copies."""

    expected: int
    written: int
    no_memory: bool = False
    moved: bool = False


def _by_name(extras: Sequence[ExtraState | None]) -> dict[str, StateBuffer]:
    """The extra states plugins contributed, by name; a name given twice keeps the first answer (pluggy calls the
    plugin registered last first), with a warning: two plugins claim one name."""
    named: dict[str, StateBuffer] = {}
    for extra in extras:
        if extra is None:
            continue
        if not isinstance(extra, ExtraState):
            raise TypeError(f"on_checkpoint_capture must return an ExtraState or None, not {type(extra).__name__}")
        if extra.name in named:
            log.warning("two plugins contributed extra state %r to one checkpoint; keeping the first", extra.name)
            continue
        named[extra.name] = extra.data
    return named
