"""The memory of one slot of an engine: a sequence id of the model context, its lineage and checkpoints.

The engine (:class:`~ckpt_plugin.engine.manager.CheckpointManager`) holds the parts every slot shares (settings, the store,
the counters, the hooks, the captures); each slot applies plans to its own sequence through its own
:class:`~ckpt_plugin.core.slot.Backend`. Checkpoints and cache entries are immutable and shared by reference between slots
and the cache: an entry saved from one slot restores into any other slot of the same context.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Sequence

import numpy as np

from ckpt_plugin.core.entry import CacheEntry
from ckpt_plugin.core.checkpoint import Checkpoint
from ckpt_plugin.core.config import CheckpointSettings
from ckpt_plugin.policy.costs import RAM, PlanClock
from ckpt_plugin.core.errors import CaptureError, OpaqueMemoryError, StateRestoreError
from ckpt_plugin.policy.eviction import checkpoints_to_erase, slot_checkpoint_limit
from ckpt_plugin.policy.plan import MemoryKind
from ckpt_plugin.policy.schedule import CheckpointRules
from ckpt_plugin.core.slot import Backend, Slot

if TYPE_CHECKING:
    from ckpt_plugin.engine.captures import Captures
    from ckpt_plugin.plugins.engine_hooks import EngineHooks
    from ckpt_plugin.core.counters import Counters
    from ckpt_plugin.tiers.store import TieredStore

log = logging.getLogger("ckpt_plugin")


class SlotMemory:
    """The memory of one slot (sequence ``slot_id`` of the context behind ``backend``): captures, restores,
    checkpoints and what the store pins for it. :class:`SlotController` adds the request path.

    :param slot_id: The slot's id (its sequence id).
    :param backend: The sequence.
    :param settings: The engine's settings.
    :param rules: Checkpoint spacing and count.
    :param store: The engine's tiers.
    :param counters: The engine's counters.
    :param hooks: The engine's hooks (plugins receive the engine and this slot's :class:`~ckpt_plugin.core.slot.Slot`).
    :param captures: The engine's state copies.
    :ivar lock: Held by the host-facing layer while a request uses the slot, and by the slot file operations.
    :ivar branch_point: Where the prompt last prepared leaves the longest prefix it shares with a stored state, when
        a restore could not serve all of it: a checkpoint is taken there (``schedule.branch_point``; 0: none).
    """

    def __init__(self, slot_id: int, backend: Backend, settings: CheckpointSettings, rules: CheckpointRules,
                 store: TieredStore, counters: Counters, hooks: EngineHooks, captures: Captures) -> None:
        self.backend = backend
        self.settings = settings
        self.rules = rules
        self.store = store
        self.counters = counters
        self.hooks = hooks
        self.captures = captures
        # Reentrant: a slot changing hands keeps it from its prepare to its prompt's submission, across the host's
        # calls that take it again (see BatchScheduler.held_until_submitted).
        self.lock = threading.RLock()
        # Set by the host-facing layer while a generation holds the slot (across its tokens, not only its calls).
        self.busy = False
        self.slot = Slot(slot_id, backend.n_ctx)
        self.slot.namespace = settings.namespace
        self.last_restore_seconds = 0.0
        self._full_capture: tuple[int, Checkpoint] | None = None
        self.branch_point = 0
        self._loaded_from_cache = -1
        # Whether the memory holds positions past ``slot.n_tokens`` that no token id names (written from outside).
        self.opaque = False
        # The engine's measured rates (one model in the engine's rules, switched on or off by the engine).
        self.costs = rules.costs
        self.plan_clock: PlanClock | None = None
        self.fetch_seconds = 0.0

    @property
    def kind(self) -> MemoryKind:
        """The memory kind of the engine's context."""
        return self.captures.kind

    @property
    def fingerprint(self) -> str:
        """The fingerprint of the engine's context (one source: the captures stamp every state with it)."""
        return self.captures.fingerprint

    def close(self) -> None:
        """Drop the slot's checkpoints and its pins."""
        self._drop_slot_state("cleared")
        self.store.ram.pin(self.slot, ())

    def _capture(self, partial: bool) -> Checkpoint | None:
        started = time.perf_counter()
        captured = self.captures.capture(self.backend, self.slot, partial)
        if captured is not None:
            self.costs.observe_capture(captured.target.nbytes, time.perf_counter() - started, partial,
                                       captured.n_tokens)
        return captured

    def _restore(self, checkpoint: Checkpoint) -> None:
        started = time.perf_counter()
        try:
            self.captures.restore(self.backend, checkpoint)
        except StateRestoreError:
            # llama.cpp leaves the sequence undefined after a failed load: start from an empty one.
            self.clear_slot()
            raise
        self.costs.observe_transfer(RAM, checkpoint.target.nbytes, time.perf_counter() - started)

    def checkpoint(self) -> Checkpoint | None:
        """Take a partial checkpoint of the slot now and keep it (``None`` if the capture failed)."""
        slot = self.slot
        checkpoint = self._capture(partial=True)
        if checkpoint is None:
            return None
        slot.checkpoints.append(checkpoint)
        self.counters.add(checkpoints_created=1)
        limit = slot_checkpoint_limit(self.settings.max_checkpoints, self.store.ram.entry_budget, checkpoint.nbytes)
        released = []
        for victim in checkpoints_to_erase(slot.checkpoints, limit):
            slot.checkpoints.remove(victim)
            released.extend(victim.buffers())
            self._erased(victim, "limit")
        self.store.pin_changes(slot, list(checkpoint.buffers()), released)
        self.hooks.call(self.hooks.hook.on_checkpoint_created, slot=slot, checkpoint=checkpoint)
        return checkpoint

    def pin_slot(self) -> None:
        """Count what the slot holds outside the cache (checkpoints, last full capture) against the budget."""
        buffers = [b for c in self.slot.checkpoints for b in c.buffers()]
        if self._full_capture is not None:
            buffers.extend(self._full_capture[1].buffers())
        self.store.pin(self.slot, buffers)

    def _erased(self, checkpoint: Checkpoint, reason: str) -> None:
        self.counters.add(checkpoints_erased=1)
        self.hooks.call(self.hooks.hook.on_checkpoint_erased, slot=self.slot, checkpoint=checkpoint, reason=reason)

    def clear_slot(self) -> None:
        """Empty the memory and the slot (tokens, checkpoints, the cached full capture)."""
        self.backend.clear()
        self.opaque = False
        self._drop_slot_state("cleared")

    def _drop_slot_state(self, reason: str) -> None:
        slot = self.slot
        dropped, slot.checkpoints = slot.checkpoints, []
        slot._set(slot.tokens[:0])
        self._full_capture = None
        self.pin_slot()
        for checkpoint in dropped:
            self._erased(checkpoint, reason)

    def save(self) -> CacheEntry:
        """Capture the slot's full state with its checkpoints, as an entry (not inserted in the cache).

        The capture is reused while the memory does not change, so saving twice copies nothing the second time.

        :raises OpaqueMemoryError: The memory holds positions no token id names (see :meth:`reconcile`).
        """
        slot = self.slot
        if self.opaque:
            raise OpaqueMemoryError("the memory holds positions written outside the engine (embeddings or a direct "
                                    "decode) that no token id names")
        if self._full_capture is not None and self._full_capture[0] == slot.version:
            state = self._full_capture[1]
        else:
            captured = self._capture(partial=False)
            if captured is None:
                raise CaptureError("the slot's state could not be captured")
            state = captured
            self._full_capture = (slot.version, state)
            self.pin_slot()
        tokens = slot.tokens.copy()
        tokens.flags.writeable = False
        checkpoints = tuple(c for c in slot.checkpoints if c.n_tokens <= slot.n_tokens)
        return CacheEntry(tokens, state, checkpoints, slot.namespace)

    def load(self, entry: CacheEntry) -> int:
        """Restore a saved entry into the slot (the entry stays valid); return the tokens now in memory."""
        self.captures.check_fingerprint(entry.fingerprint)
        started = time.perf_counter()
        self._restore(entry.state)
        self.opaque = False
        self._adopt(entry.tokens, entry.checkpoints, len(entry.tokens))
        self._full_capture = (self.slot.version, entry.state)
        self.pin_slot()
        if self.store.contains(entry):
            # A host that consults its cache itself (``Llama.load_state(cache[key])``) hits through here.
            self.counters.add(cache_hits=1)
            self.store.touch(entry)
            self._loaded_from_cache = self.slot.version
        self.last_restore_seconds = time.perf_counter() - started
        self.counters.add(restore_seconds=self.last_restore_seconds)
        self.hooks.call(self.hooks.hook.on_slot_restore, slot=self.slot, checkpoint=None, entry=entry,
                        n_tokens=self.slot.n_tokens)
        return self.slot.n_tokens

    def save_to_cache(self) -> CacheEntry | None:
        """Put the slot's state into the prompt cache (in the slot's namespace); return the entry, or ``None`` if it
        was not admitted."""
        entry = self.save()
        return entry if self.store.admit(entry) else None

    def reconcile(self) -> None:
        """Bring the slot in line with the memory if something outside the manager changed it.

        The slot keeps only the tokens the memory still holds that nothing wrote over since (the backend reports the
        first position written from outside, where it can see such writes). Positions the memory holds past those
        are of unknown content: kept (the host that wrote them may be about to use them) and marked :attr:`opaque`,
        never matched as tokens, saved or published until the memory is cut back to what the slot names.
        """
        slot = self.slot
        held = int(self.backend.pos_max()) + 1
        known = min(slot.n_tokens, held)
        take_outside_write = getattr(self.backend, "take_outside_write", None)
        if take_outside_write is not None:
            known = min(known, take_outside_write())
        if known < slot.n_tokens:
            slot._truncate(known)
            self._full_capture = None
        self.opaque = held > known

    def discard_opaque(self) -> None:
        """Cut the memory back to the tokens the slot names (drop positions written from outside)."""
        if self.opaque:
            self.counters.add(outside_writes_dropped=1)
            self._cut(self.slot.n_tokens)

    def adopt_memory(self, tokens: np.ndarray) -> None:
        """The memory was loaded outside the manager and holds ``tokens``: forget the old lineage."""
        old = self.slot.checkpoints
        self.slot.checkpoints = []
        self.slot._set(np.asarray(tokens, dtype=np.int32))
        self.opaque = False
        self._full_capture = None
        self.pin_slot()
        for checkpoint in old:
            self._erased(checkpoint, "invalidated")

    def _adopt(self, lineage: np.ndarray, checkpoints: Sequence[Checkpoint], n_keep: int) -> None:
        """Make the slot hold ``lineage[:n_keep]`` with the lineage's checkpoints."""
        slot = self.slot
        old = slot.checkpoints
        slot._set(lineage, n_keep)
        slot.checkpoints = list(checkpoints)
        kept = {id(c) for c in slot.checkpoints}
        for checkpoint in old:
            if id(checkpoint) not in kept:
                self._erased(checkpoint, "invalidated")

    def _invalidate_after(self, position: int) -> None:
        slot = self.slot
        dropped = [c for c in slot.checkpoints if c.n_tokens > position]
        if dropped:
            slot.checkpoints = [c for c in slot.checkpoints if c.n_tokens <= position]
            for checkpoint in dropped:
                self._erased(checkpoint, "invalidated")

    def _cut(self, n_keep: int) -> None:
        """Truncate the memory to ``n_keep`` tokens."""
        self._full_capture = None
        self.opaque = False
        if n_keep == 0:
            self.backend.clear()
        elif not self.backend.truncate(n_keep):
            self.clear_slot()
            raise StateRestoreError(f"llama.cpp could not truncate the sequence to {n_keep} tokens; the slot was cleared")
        self.slot._truncate(n_keep)
