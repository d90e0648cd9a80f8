"""The memory of one slot of an engine: a sequence of the model context, its lineage and checkpoints.

The engine (:class:`~ckpt_plugin.engine.manager.CheckpointManager`) holds the parts every slot shares (settings, the
store, the counters, the hooks, the captures); a :class:`SlotMemory` changes one sequence through its own
:class:`~ckpt_plugin.core.slot.Backend` and keeps the slot's record (:class:`~ckpt_plugin.core.slot.Slot`), its
checkpoints and the store's pins consistent with it. It decides nothing: which state to restore and where to pause
for checkpoints is the request path's. Checkpoints and cache entries are immutable and shared by reference between
slots and the cache: an entry saved from one slot restores into any other slot of the same context.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Protocol, Sequence

import numpy as np

from ckpt_plugin.core.entry import CacheEntry
from ckpt_plugin.core.checkpoint import Checkpoint
from ckpt_plugin.core.config import CheckpointSettings
from ckpt_plugin.policy.costs import RAM, CostModel
from ckpt_plugin.core.errors import CaptureError, OpaqueMemoryError, StateRestoreError
from ckpt_plugin.policy.eviction import checkpoints_to_erase, slot_checkpoint_limit
from ckpt_plugin.core.memory import MemoryKind
from ckpt_plugin.policy.plan import Candidate, Plan, swa_threshold
from ckpt_plugin.core.renamed import Renamed
from ckpt_plugin.core.slot import Backend, Slot

if TYPE_CHECKING:
    from ckpt_plugin.engine.captures import Captures
    from ckpt_plugin.plugins.engine_hooks import EngineHooks
    from ckpt_plugin.core.counters import Counters
    from ckpt_plugin.tiers.store import TieredStore

__all__ = ["CellSource", "SlotMemory"]

log = logging.getLogger("ckpt_plugin")


class CellSource(Candidate, Protocol):
    """Another live sequence of the same KV cache, offered to the planner (its ``peers``): the tokens its cells hold
    from position 0, which a slot can take over without copying (``llama_memory_seq_cp`` in a unified cache)."""

    def share_into(self, backend: Backend, n_keep: int) -> bool:
        """Make ``backend``'s sequence hold this sequence's first ``n_keep`` cells (and nothing else); ``False``
        if they no longer hold :attr:`tokens` (the other slot changed its memory since it was offered)."""



class SlotMemory:
    """The memory of one slot (sequence ``slot_id`` of the context behind ``backend``): captures, restores,
    truncations, checkpoints and what the store pins for it.

    :param slot_id: The slot's id (its sequence id).
    :param backend: The sequence.
    :param settings: The engine's settings.
    :param store: The engine's tiers.
    :param counters: The engine's counters.
    :param hooks: The engine's hooks (plugins receive this slot's :class:`~ckpt_plugin.core.slot.Slot`).
    :param captures: The engine's state copies.
    :param costs: The engine's measured rates (captures and restores are observed into it).
    :ivar opaque: The memory holds positions past ``slot.n_tokens`` that no token id names (written from outside).
    :ivar last_restore_seconds: What the latest restore took.
    """

    def __init__(self, *, slot_id: int, backend: Backend, settings: CheckpointSettings, store: TieredStore,
                 counters: Counters, hooks: EngineHooks, captures: Captures, costs: CostModel) -> None:
        self.backend = backend
        self.settings = settings
        self.store = store
        self.counters = counters
        self.hooks = hooks
        self.captures = captures
        self.costs = costs
        self.slot = Slot(slot_id, backend.n_ctx)
        self.slot.namespace = settings.namespace
        self.last_restore_seconds = 0.0
        self.opaque = False
        # (slot version, full state) of the latest full capture or load: saving an unchanged memory copies nothing.
        self._full_capture: tuple[int, Checkpoint] | None = None
        self._loaded_from_cache = -1

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

    def capture(self, partial: bool) -> Checkpoint | None:
        """A new checkpoint of the sequence as it is (``None`` if the capture failed); not kept by the slot."""
        started = time.perf_counter()
        captured = self.captures.capture(self.backend, self.slot, partial)
        if captured is not None:
            self.costs.observe_capture(captured.target.nbytes, time.perf_counter() - started, partial,
                                       captured.n_tokens)
        return captured

    def restore(self, checkpoint: Checkpoint) -> None:
        """Load ``checkpoint`` into the sequence (the slot's record is the caller's to adjust).

        :raises StateRestoreError: llama.cpp refused it; the slot was cleared.
        """
        started = time.perf_counter()
        try:
            self.captures.restore(self.backend, checkpoint)
        except StateRestoreError:
            # llama.cpp leaves the sequence undefined after a failed load: start from an empty one.
            self.clear()
            raise
        self.costs.observe_transfer(RAM, checkpoint.target.nbytes, time.perf_counter() - started)

    def checkpoint(self) -> Checkpoint | None:
        """Take a partial checkpoint of the slot now and keep it (``None`` if the capture failed)."""
        slot = self.slot
        checkpoint = self.capture(partial=True)
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

    def pin(self) -> None:
        """Count what the slot holds outside the cache (checkpoints, last full capture) against the budget."""
        buffers = [b for c in self.slot.checkpoints for b in c.buffers()]
        if self._full_capture is not None:
            buffers.extend(self._full_capture[1].buffers())
        self.store.pin(self.slot, buffers)

    def _erased(self, checkpoint: Checkpoint, reason: str) -> None:
        self.counters.add(checkpoints_erased=1)
        self.hooks.call(self.hooks.hook.on_checkpoint_erased, slot=self.slot, checkpoint=checkpoint, reason=reason)

    def clear(self) -> None:
        """Empty the memory and the slot (tokens, checkpoints, the cached full capture)."""
        self.backend.clear()
        self.opaque = False
        self._drop_slot_state("cleared")

    def _drop_slot_state(self, reason: str) -> None:
        slot = self.slot
        dropped, slot.checkpoints = slot.checkpoints, []
        slot.set_lineage(slot.tokens[:0])
        self._full_capture = None
        self.pin()
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
            captured = self.capture(partial=False)
            if captured is None:
                raise CaptureError("the slot's state could not be captured")
            state = captured
            self._full_capture = (slot.version, state)
            self.pin()
        tokens = slot.tokens.copy()
        tokens.flags.writeable = False
        checkpoints = tuple(c for c in slot.checkpoints if c.n_tokens <= slot.n_tokens)
        return CacheEntry(tokens, state, checkpoints, slot.namespace)

    def load(self, entry: CacheEntry) -> int:
        """Restore a saved entry into the slot (the entry stays valid); return the tokens now in memory."""
        self.captures.check_fingerprint(entry.fingerprint)
        started = time.perf_counter()
        self.restore(entry.state)
        self.opaque = False
        self.adopt(entry.tokens, entry.checkpoints, len(entry.tokens))
        self._full_capture = (self.slot.version, entry.state)
        self.pin()
        if self.store.contains(entry):
            # A host that consults its cache itself (``Llama.load_state(cache[key])``) hits through here.
            self.count_lookup(hit=True)
            self.store.touch(entry)
            self._loaded_from_cache = self.slot.version
        self.restored(time.perf_counter() - started, None, entry)
        return self.slot.n_tokens

    def count_lookup(self, hit: bool) -> None:
        """Count a prompt served from a cache entry (``cache_hits``) or one the slot's memory and the stores could not
        serve (``cache_misses``): the one place the engine counts either."""
        if hit:
            self.counters.add(cache_hits=1)
        else:
            self.counters.add(cache_misses=1)

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
            slot.truncate(known)
            self._full_capture = None
        self.opaque = held > known

    def discard_opaque(self) -> None:
        """Cut the memory back to the tokens the slot names (drop positions written from outside); a memory that
        cannot drop its last positions (recurrent) is emptied instead: the prompt that follows is served from the
        checkpoints and the stores."""
        if self.opaque:
            self.counters.add(outside_writes_dropped=1)
            try:
                self.cut(self.slot.n_tokens)
            except StateRestoreError:
                log.debug("positions written from outside dropped by emptying the memory (it cannot be cut)")

    def adopt_memory(self, tokens: np.ndarray) -> None:
        """The memory was loaded outside the manager and holds ``tokens``: forget the old lineage."""
        old = self.slot.checkpoints
        self.slot.checkpoints = []
        self.slot.set_lineage(np.asarray(tokens, dtype=np.int32))
        self.opaque = False
        self._full_capture = None
        self.pin()
        for checkpoint in old:
            self._erased(checkpoint, "invalidated")

    def adopt(self, lineage: np.ndarray, checkpoints: Sequence[Checkpoint], n_keep: int) -> None:
        """Make the slot hold ``lineage[:n_keep]`` with the lineage's checkpoints."""
        slot = self.slot
        old = slot.checkpoints
        slot.set_lineage(lineage, n_keep)
        slot.checkpoints = list(checkpoints)
        kept = {id(c) for c in slot.checkpoints}
        for checkpoint in old:
            if id(checkpoint) not in kept:
                self._erased(checkpoint, "invalidated")

    def share(self, source: CellSource, n_keep: int) -> None:
        """Take over ``source``'s first ``n_keep`` cells in place of the memory (no copy, no evaluation).

        :raises StateRestoreError: ``source`` no longer holds them; the slot was cleared.
        """
        self._full_capture = None
        self.opaque = False
        if not source.share_into(self.backend, n_keep):
            self.clear()
            raise StateRestoreError(f"another slot's memory changed before its {n_keep} tokens could be shared")
        self.adopt(source.tokens, (), n_keep)
        self.counters.add(kv_shares=1, tokens_shared=n_keep)

    def invalidate_after(self, position: int) -> None:
        """Erase the slot's checkpoints past ``position`` (its lineage changes there)."""
        slot = self.slot
        dropped = [c for c in slot.checkpoints if c.n_tokens > position]
        if dropped:
            slot.checkpoints = [c for c in slot.checkpoints if c.n_tokens <= position]
            for checkpoint in dropped:
                self._erased(checkpoint, "invalidated")

    def cut(self, n_keep: int) -> None:
        """Truncate the memory to ``n_keep`` tokens."""
        self._full_capture = None
        self.opaque = False
        if n_keep == 0:
            self.backend.clear()
        elif not self.backend.truncate(n_keep):
            self.clear()
            raise StateRestoreError(f"llama.cpp could not truncate the sequence to {n_keep} tokens; the slot was cleared")
        self.slot.truncate(n_keep)

    def append(self, chunk: np.ndarray) -> None:
        """``chunk`` was just evaluated after the slot's end: record it (checkpoints of a rewritten lineage go)."""
        rewritten_from = self.slot.append(chunk)
        if rewritten_from is not None:
            self.invalidate_after(rewritten_from)
        # The last full capture describes the old memory: do not keep its bytes alive for nothing.
        self._full_capture = None
        self.offer_cells()

    def offer_cells(self) -> None:
        """Tell a backend whose cells other sequences may share what they hold now (record and memory agree)."""
        offer = getattr(self.backend, "offer_cells", None)
        if offer is not None:
            offer(self.slot.namespace, self.slot.tokens)

    publish = Renamed("offer_cells")  # deprecated: "publish" is the shared tier's word (docs/design.md, "Words")

    def drop_full_capture(self) -> None:
        """Release the latest full capture kept for :meth:`save` (the next save captures the memory again)."""
        self._full_capture = None

    def just_loaded_from_cache(self) -> bool:
        """Whether the memory is what a host's own cache lookup loaded (:meth:`load` of a stored entry)."""
        return self._loaded_from_cache == self.slot.version

    def restored(self, seconds: float, checkpoint: Checkpoint | None, entry: CacheEntry | None) -> None:
        """A restore of ``entry`` and/or ``checkpoint`` took ``seconds``: time it, count it, tell the plugins."""
        self.last_restore_seconds = seconds
        self.offer_cells()
        self.counters.add(restore_seconds=seconds)
        self.hooks.call(self.hooks.hook.on_slot_restore, slot=self.slot, checkpoint=checkpoint, entry=entry,
                        n_tokens=self.slot.n_tokens)

    def window_serves(self, n_keep: int) -> bool:
        """Whether the memory, cut to ``n_keep`` tokens, holds the window the token at ``n_keep`` sees (-1: the cut
        left nothing of a window taken past it)."""
        if not self.kind.swa or n_keep == 0:
            return True
        return 0 <= int(self.backend.pos_min()) <= swa_threshold(self.kind, n_keep)

    def apply(self, plan: Plan[CacheEntry]) -> None:
        """Make the memory hold ``plan.n_keep`` tokens: truncate, take another sequence's cells, or restore the
        entry and/or a checkpoint (counted, timed, and told to the plugins)."""
        memory, slot, entry, n_keep = self, self.slot, plan.entry, plan.n_keep
        if not plan.needs_restore:
            if n_keep < slot.n_tokens:
                memory.cut(n_keep)
            return
        if plan.peer is not None:
            memory.share(plan.peer, n_keep)
            return
        started = time.perf_counter()
        if entry is not None:
            self.count_lookup(hit=True)
            self.hooks.call(self.hooks.hook.on_cache_hit, slot=slot, entry=entry, n_tokens=n_keep)
            if plan.restore_state:
                memory.restore(entry.state)
            self.store.touch(entry)
        if plan.checkpoint is not None:
            memory.restore(plan.checkpoint)
            self.counters.add(checkpoints_restored=1)
        memory.cut(n_keep)
        if entry is not None:
            memory.adopt(entry.tokens, entry.checkpoints, n_keep)
        memory.restored(time.perf_counter() - started, plan.checkpoint, entry)
