"""The checkpoint manager: ties the policy, the prompt cache and the hooks to one model's memory.

Data flows one way: the host asks the manager to :meth:`~CheckpointManager.prepare` a prompt (restore the best state
for it) and to :meth:`~CheckpointManager.process` the tokens that remain; the manager calls the backend (the only
code that touches llama.cpp) and the hooks, and keeps the slot, its checkpoints and the cache consistent.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Protocol, Sequence

import numpy as np
import pluggy

from . import hooks
from .cache import CacheEntry, PromptCache
from .checkpoint import Checkpoint, ExtraState, freeze
from .config import CheckpointSettings
from .disk_tier import DiskTier
from .errors import (
    CaptureError,
    EmptySlotError,
    ForeignNamespaceError,
    IncompatibleStateError,
    PluginError,
    StateRestoreError,
)
from .persist import read_entry, write_entry
from .hooks import PROJECT_NAME, hookimpl
from .request import current_request
from .policy import (
    CheckpointRules,
    MemoryKind,
    Reuse,
    best_reuse,
    checkpoints_to_erase,
    slot_checkpoint_limit,
    common_prefix,
    default_min_step,
    pause_points,
    want_checkpoint,
)

log = logging.getLogger("ckpt_plugin")

DEFAULT_PLUGIN_NAME = "ckpt_plugin.default"


class Backend(Protocol):
    """What the manager needs from a model context (implemented by :mod:`ckpt_plugin.llama_backend`)."""

    kind: MemoryKind
    fingerprint: str
    n_ctx: int

    def state_size(self, partial: bool) -> int:
        """Bytes a capture of sequence 0 needs."""

    def read_state(self, buffer: np.ndarray, partial: bool) -> int:
        """Serialize sequence 0 into ``buffer`` with one call; return the bytes written."""

    def write_state(self, buffer: np.ndarray, partial: bool) -> int:
        """Load sequence 0 from ``buffer`` without copying it; return the bytes read (0 on failure)."""

    def pos_min(self) -> int:
        """Smallest position held for sequence 0 (-1 if empty)."""

    def pos_max(self) -> int:
        """Largest position held for sequence 0 (-1 if empty)."""

    def truncate(self, n_keep: int) -> bool:
        """Remove positions ``>= n_keep`` of sequence 0."""

    def clear(self) -> None:
        """Empty sequence 0."""

    def decode(self, tokens: np.ndarray) -> None:
        """Evaluate ``tokens`` after the memory's end (host bookkeeping included)."""


class Slot:
    """One live sequence: the tokens its memory holds, its lineage and its checkpoints (oldest first).

    The lineage is the token sequence the checkpoints were taken on; the memory holds a prefix of it. Truncating
    the memory keeps the lineage (and so the checkpoints past the cut stay usable); evaluating tokens that differ
    from the lineage rewrites it, and the checkpoints past the divergence are erased.

    :ivar id: Slot id (sequence id in the context).
    :ivar n_tokens: Tokens the memory holds.
    :ivar checkpoints: Partial checkpoints of the lineage.
    :ivar version: Incremented on every change of the memory, so cached captures know when they are stale.
    """

    def __init__(self, slot_id: int, capacity: int) -> None:
        self.id = slot_id
        self._tokens = np.zeros(max(capacity, 1), dtype=np.int32)
        self.n_tokens = 0
        self.n_lineage = 0
        self.checkpoints: list[Checkpoint] = []
        self.version = 0
        self.namespace = "default"

    @staticmethod
    def _readonly(view: np.ndarray) -> np.ndarray:
        view.flags.writeable = False
        return view

    @property
    def tokens(self) -> np.ndarray:
        """Read-only view of the tokens in memory."""
        return self._readonly(self._tokens[: self.n_tokens])

    @property
    def lineage(self) -> np.ndarray:
        """Read-only view of the lineage (``tokens`` is a prefix of it)."""
        return self._readonly(self._tokens[: self.n_lineage])

    def _reserve(self, n: int) -> None:
        if n > len(self._tokens):
            self._tokens = np.resize(self._tokens, max(n, 2 * len(self._tokens)))

    def _set(self, lineage: np.ndarray, n_memory: int | None = None) -> None:
        n = len(lineage)
        self._reserve(n)
        self._tokens[:n] = lineage
        self.n_lineage = n
        self.n_tokens = n if n_memory is None else min(n_memory, n)
        self.version += 1

    def _append(self, tokens: np.ndarray) -> int | None:
        """Append evaluated tokens; return where the lineage was rewritten from, or ``None`` if it was not."""
        start, end = self.n_tokens, self.n_tokens + len(tokens)
        self.version += 1
        overlap = max(0, min(end, self.n_lineage) - start)
        same = common_prefix(self._tokens[start : start + overlap], tokens[:overlap]) if overlap else 0
        if same == len(tokens):
            self.n_tokens = end
            return None
        self._reserve(end)
        self._tokens[start:end] = tokens
        self.n_tokens = self.n_lineage = end
        return start + same

    def _truncate(self, n_keep: int) -> None:
        self.n_tokens = min(self.n_tokens, n_keep)
        self.version += 1


@dataclass
class Counters:
    """Monotonic counters of a manager (see :meth:`CheckpointManager.stats`)."""

    prompts: int = 0
    tokens_evaluated: int = 0
    tokens_reused: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    cache_saves: int = 0
    cache_evictions: int = 0
    checkpoints_created: int = 0
    checkpoints_restored: int = 0
    checkpoints_erased: int = 0
    forced_reprocess: int = 0
    tokens_reprocessed: int = 0
    capture_failures: int = 0
    bytes_captured: int = 0
    bytes_restored: int = 0
    restore_seconds: float = 0.0
    disk_hits: int = 0
    restore_failures: int = 0
    draft_dropped: int = 0


class DefaultPlugin:
    """The manager's own behaviour, registered as ``ckpt_plugin.default`` and called last."""

    @hookimpl(trylast=True)
    def checkpoint_wanted(self, manager: CheckpointManager, slot: Slot, position: int, prompt_end: int) -> bool:
        return want_checkpoint(
            manager.kind, manager.rules, slot.checkpoints, position, prompt_end, manager.backend.pos_min()
        )

    @hookimpl(trylast=True)
    def on_prompt_processed(
        self, manager: CheckpointManager, slot: Slot, start: int, end: int, prompt_end: int
    ) -> None:
        if manager.call_hook("checkpoint_wanted", manager=manager, slot=slot, position=end, prompt_end=prompt_end):
            manager.checkpoint()

    @hookimpl(trylast=True)
    def on_cache_alloc(self, manager: CheckpointManager, namespace: str, n_tokens: int, n_bytes: int) -> bool:
        return True

    @hookimpl(trylast=True)
    def select_cache_victims(
        self, manager: CheckpointManager, entries: Sequence[CacheEntry], n_bytes: int
    ) -> list[CacheEntry]:
        victims, freed = [], 0
        for entry in entries:
            if freed >= n_bytes:
                break
            victims.append(entry)
            freed += entry.nbytes
        return victims


class CheckpointManager:
    """Checkpoints and prompt cache for one model context.

    Usually made by :func:`ckpt_plugin.attach`; can be built on any :class:`Backend`.

    :param backend: The model context.
    :param settings: Settings; keyword overrides are applied on top.
    :param cache: A prompt cache to share with other managers of the same model; a private one by default.
    :param disk: A disk tier to share likewise; by default one in ``settings.disk_dir`` if that is set.
    :ivar lock: Held by the host-facing layer while a request uses the slot, and by the slot file operations.
    """

    def __init__(
        self,
        backend: Backend,
        settings: CheckpointSettings | None = None,
        cache: PromptCache | None = None,
        disk: DiskTier | None = None,
        **overrides: Any,
    ) -> None:
        base = settings.model_dump() if settings is not None else {}
        self.settings = CheckpointSettings(**{**base, **overrides})
        self.backend = backend
        self.kind = backend.kind
        self.fingerprint = backend.fingerprint
        min_step = self.settings.checkpoint_min_step or default_min_step(self.kind)
        self.rules = CheckpointRules(self.settings.max_checkpoints, min_step)
        self.cache = cache if cache is not None else PromptCache(
            self.settings.cache_max_bytes, self.settings.cache_max_tokens
        )
        if disk is None and self.settings.disk_dir is not None:
            disk = DiskTier(self.settings.disk_dir, self.settings.disk_max_bytes)
        self.disk = disk
        self.lock = threading.Lock()
        self.slot = Slot(0, backend.n_ctx)
        self.slot.namespace = self.settings.namespace
        self.last_restore_seconds = 0.0
        self.counters = Counters()
        self._full_capture: tuple[int, Checkpoint] | None = None
        self._loaded_from_cache = -1
        self.plugins = pluggy.PluginManager(PROJECT_NAME)
        self.plugins.add_hookspecs(hooks)
        self.plugins.register(DefaultPlugin(), name=DEFAULT_PLUGIN_NAME)
        if self.settings.load_entrypoints:
            self.plugins.load_setuptools_entrypoints(PROJECT_NAME)
            # A misspelled hook implementation in an installed plugin fails here, not silently.
            self.plugins.check_pending()

    # ---------------------------------------------------------------------------------------------------------------
    # hooks

    def call_hook(self, name: str, **kwargs: Any) -> Any:
        """Call hook ``name``; an implementation's exception becomes a :class:`PluginError` naming the plugin."""
        caller = getattr(self.plugins.hook, name)
        try:
            return caller(**kwargs)
        except PluginError:
            raise
        except Exception as exc:
            raise PluginError(self._culprit(caller, exc), name, exc) from exc

    @staticmethod
    def _culprit(caller: Any, exc: BaseException) -> str:
        owners = {}
        for impl in caller.get_hookimpls():
            code = getattr(impl.function, "__code__", None)
            if code is not None:
                owners[code] = impl.plugin_name
        tb = exc.__traceback__
        while tb is not None:
            name = owners.get(tb.tb_frame.f_code)
            if name is not None:
                return name
            tb = tb.tb_next
        return "<unknown>"

    # ---------------------------------------------------------------------------------------------------------------
    # captures and restores

    def _capture(self, partial: bool) -> Checkpoint | None:
        slot = self.slot
        size = int(self.backend.state_size(partial))
        try:
            buffer = self.cache.pool.allocate(size)
        except MemoryError:
            # Make room by shrinking the cache budget instead of failing the request.
            shrunk = max(0, self.cache.resident_bytes - size)
            log.warning("allocation of %d state bytes failed; prompt-cache budget shrunk to %d", size, shrunk)
            self._note_evictions(self.cache.resize(shrunk, self._select_victims), "budget")
            self.counters.capture_failures += 1
            self.call_hook("on_capture_failed", manager=self, slot=slot, expected=size, written=0)
            return None
        written = int(self.backend.read_state(buffer, partial))
        if written != size:
            log.warning("state capture wrote %d of %d bytes; no checkpoint taken", written, size)
            self.counters.capture_failures += 1
            self.call_hook("on_capture_failed", manager=self, slot=slot, expected=size, written=written)
            return None
        self.counters.bytes_captured += written
        extras: list[ExtraState] = [
            e for e in self.call_hook(
                "on_checkpoint_capture", manager=self, slot=slot, n_tokens=slot.n_tokens, partial=partial
            ) if e is not None
        ]
        by_kind = {extra.kind: extra.data for extra in extras}
        pos_max = int(self.backend.pos_max())
        return Checkpoint(
            n_tokens=slot.n_tokens,
            pos_min=self.kind.restored_pos_min(int(self.backend.pos_min()), pos_max),
            pos_max=pos_max,
            partial=partial,
            target=freeze(buffer),
            fingerprint=self.fingerprint,
            draft=by_kind.get("draft"),
            speculative=by_kind.get("speculative"),
        )

    def _restore(self, checkpoint: Checkpoint) -> None:
        if checkpoint.fingerprint != self.fingerprint:
            raise IncompatibleStateError(
                f"state belongs to model/context {checkpoint.fingerprint}, this context is {self.fingerprint}"
            )
        read = int(self.backend.write_state(checkpoint.target, checkpoint.partial))
        if read != checkpoint.target.nbytes:
            # llama.cpp leaves the sequence undefined after a failed load: start from an empty one.
            self._clear_slot()
            raise StateRestoreError(
                f"llama.cpp refused the state ({read} of {checkpoint.target.nbytes} bytes read); the slot was cleared"
            )
        self.counters.bytes_restored += read

    def checkpoint(self) -> Checkpoint | None:
        """Take a partial checkpoint of the slot now and keep it (``None`` if the capture failed)."""
        slot = self.slot
        checkpoint = self._capture(partial=True)
        if checkpoint is None:
            return None
        slot.checkpoints.append(checkpoint)
        self.counters.checkpoints_created += 1
        limit = slot_checkpoint_limit(self.settings.max_checkpoints, self.cache.entry_budget, checkpoint.nbytes)
        for victim in checkpoints_to_erase(slot.checkpoints, limit):
            slot.checkpoints.remove(victim)
            self._erased(victim, "limit")
        self._pin_slot()
        self.call_hook("on_checkpoint_created", manager=self, slot=slot, checkpoint=checkpoint)
        return checkpoint

    def _pin_slot(self) -> None:
        """Count what the slot holds outside the cache (checkpoints, last full capture) against the budget."""
        buffers = [b for c in self.slot.checkpoints for b in c.buffers()]
        if self._full_capture is not None:
            buffers.extend(self._full_capture[1].buffers())
        for victim, reason in self.cache.pin(self.slot, buffers, self._select_victims):
            self._note_evictions([victim], reason)

    def _select_victims(self, entries: Sequence[CacheEntry], n_bytes: int) -> Sequence[CacheEntry]:
        return self.call_hook("select_cache_victims", manager=self, entries=entries, n_bytes=n_bytes) or []

    def _erased(self, checkpoint: Checkpoint, reason: str) -> None:
        self.counters.checkpoints_erased += 1
        self.call_hook("on_checkpoint_erased", manager=self, slot=self.slot, checkpoint=checkpoint, reason=reason)

    def _clear_slot(self) -> None:
        """Empty the memory and the slot (tokens, checkpoints, the cached full capture)."""
        self.backend.clear()
        self._drop_slot_state("cleared")

    def _drop_slot_state(self, reason: str) -> None:
        slot = self.slot
        dropped, slot.checkpoints = slot.checkpoints, []
        slot._set(slot.tokens[:0])
        self._full_capture = None
        self._pin_slot()
        for checkpoint in dropped:
            self._erased(checkpoint, reason)

    def save(self) -> CacheEntry:
        """Capture the slot's full state with its checkpoints, as an entry (not inserted in the cache).

        The capture is reused while the memory does not change, so saving twice copies nothing the second time.
        """
        slot = self.slot
        if self._full_capture is not None and self._full_capture[0] == slot.version:
            state = self._full_capture[1]
        else:
            captured = self._capture(partial=False)
            if captured is None:
                raise CaptureError("the slot's state could not be captured")
            state = captured
            self._full_capture = (slot.version, state)
            self._pin_slot()
        tokens = slot.tokens.copy()
        tokens.flags.writeable = False
        checkpoints = tuple(c for c in slot.checkpoints if c.n_tokens <= slot.n_tokens)
        return CacheEntry(tokens, state, checkpoints, slot.namespace)

    def load(self, entry: CacheEntry) -> int:
        """Restore a saved entry into the slot (the entry stays valid); return the tokens now in memory."""
        if entry.fingerprint != self.fingerprint:
            raise IncompatibleStateError(
                f"state belongs to model/context {entry.fingerprint}, this context is {self.fingerprint}"
            )
        started = time.perf_counter()
        self._restore(entry.state)
        self._adopt(entry.tokens, entry.checkpoints, len(entry.tokens))
        self._full_capture = (self.slot.version, entry.state)
        self._pin_slot()
        if self.cache.contains(entry):
            # A host that consults its cache itself (``Llama.load_state(cache[key])``) hits through here.
            self.counters.cache_hits += 1
            self.cache.touch(entry)
            self._loaded_from_cache = self.slot.version
        self.last_restore_seconds = time.perf_counter() - started
        self.counters.restore_seconds += self.last_restore_seconds
        self.call_hook("on_slot_restore", manager=self, slot=self.slot, checkpoint=None, entry=entry,
                       n_tokens=self.slot.n_tokens)
        return self.slot.n_tokens

    def save_to_cache(self) -> CacheEntry | None:
        """Put the slot's state into the prompt cache (in the slot's namespace); return the entry, or ``None`` if it
        was not admitted."""
        entry = self.save()
        return entry if self.admit(entry) else None

    def use_shared_tiers(self, cache: PromptCache, disk: DiskTier | None = None) -> None:
        """Serve from ``cache`` (and ``disk``) from now on, e.g. a cache shared with other managers; the entries of
        the cache used so far move over (within the new budget)."""
        if cache is not self.cache:
            old, self.cache = self.cache, cache
            old.pin(self.slot, ())
            for entry in old.clear():
                self.admit(entry, write_through=False)
            self._pin_slot()
        if disk is not None:
            self.disk = disk

    def admit(self, entry: CacheEntry, write_through: bool = True) -> bool:
        """Offer ``entry`` to the prompt cache through the ``on_cache_alloc`` veto and ``select_cache_victims``
        (evictions fire ``on_cache_evict``), and write it through to the disk tier; return whether a tier holds it.
        """
        admitted, removed = self.cache.insert(
            entry,
            admit=lambda n_bytes: self.call_hook(
                "on_cache_alloc", manager=self, namespace=entry.namespace, n_tokens=entry.n_tokens, n_bytes=n_bytes
            ) is not False,
            select_victims=self._select_victims,
        )
        for victim, reason in removed:
            self._note_evictions([victim], reason)
        if admitted:
            self.counters.cache_saves += 1
        if self.disk is not None and write_through:
            admitted = self.disk.store(entry) or admitted
        return admitted

    def _note_evictions(self, entries: Iterable[CacheEntry], reason: str) -> None:
        for entry in entries:
            if reason == "budget":
                self.counters.cache_evictions += 1
            self.call_hook("on_cache_evict", manager=self, entry=entry, reason=reason)

    def clear_cache(self, namespace: str | None = None) -> int:
        """Drop every prompt-cache entry (of ``namespace`` only, if given); return how many there were."""
        entries = self.cache.clear(namespace)
        self._note_evictions(entries, "cleared")
        return len(entries)

    # ---------------------------------------------------------------------------------------------------------------
    # the request path

    def reconcile(self) -> None:
        """Bring the slot in line with the memory if something outside the manager changed it."""
        slot = self.slot
        held = int(self.backend.pos_max()) + 1
        if held == slot.n_tokens:
            return
        if held < slot.n_tokens:
            slot._truncate(held)
        else:
            # Tokens we never saw: their identity is unknown, so the memory cannot be reused safely.
            self.backend.clear()
            slot._truncate(0)

    def adopt_memory(self, tokens: np.ndarray) -> None:
        """The memory was loaded outside the manager and holds ``tokens``: forget the old lineage."""
        old = self.slot.checkpoints
        self.slot.checkpoints = []
        self.slot._set(np.asarray(tokens, dtype=np.int32))
        self._full_capture = None
        self._pin_slot()
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

    def resize_cache(self, max_bytes: int) -> None:
        """Change the prompt cache's byte budget (validated like ``cache_max_bytes``), evicting to fit."""
        self.settings.cache_max_bytes = max_bytes
        self._note_evictions(self.cache.resize(max_bytes, self._select_victims), "budget")

    def current_namespace(self) -> str:
        """The namespace of the request being served (the manager's own outside a request scope)."""
        scope = current_request.get()
        return scope.namespace if scope is not None and scope.namespace else self.settings.namespace

    def _enter_namespace(self, namespace: str) -> None:
        """Never let one tenant reuse another's live state: park it in its owner's partition first."""
        slot = self.slot
        if slot.namespace == namespace:
            return
        if slot.n_tokens >= self.settings.cache_min_tokens:
            self.save_to_cache()
        self._clear_slot()
        slot.namespace = namespace

    def plan(self, prompt: np.ndarray) -> tuple[CacheEntry | None, Reuse, Reuse, bool]:
        """How ``prompt`` would be served: ``(entry or None, chosen reuse, reuse of the live memory, from disk)``.

        Changes nothing but the disk tier's mappings: counting, promotion and restores are :meth:`prepare`'s.
        """
        slot = self.slot
        limit = max(len(prompt) - 1, 0)
        live = best_reuse(
            self.kind, slot.lineage, slot.n_tokens, int(self.backend.pos_min()), slot.checkpoints, prompt, limit
        )
        chosen_entry, chosen, from_disk = None, live, False

        def consider(entry: CacheEntry) -> bool:
            nonlocal chosen_entry, chosen
            reuse = best_reuse(self.kind, entry.tokens, entry.n_tokens, entry.pos_min, entry.checkpoints, prompt, limit)
            if reuse.n_keep <= chosen.n_keep:
                return False
            chosen_entry, chosen = entry, reuse
            return True

        if live.n_keep < limit:
            for entry, _ in self.cache.lookup(slot.namespace, self.fingerprint, prompt):
                consider(entry)
        if self.disk is not None and chosen.n_keep < limit:
            for record, n_common in self.disk.lookup(slot.namespace, self.fingerprint, prompt):
                if min(n_common, limit) <= chosen.n_keep:
                    continue
                entry = self.disk.load(record)
                if entry is not None and consider(entry):
                    from_disk = True
        return chosen_entry, chosen, live, from_disk

    def prepare(self, prompt: Sequence[int] | np.ndarray) -> int:
        """Make the memory hold the longest prefix of ``prompt`` that can be served without evaluation.

        Looks at the live memory, the slot's checkpoints and the prompt cache; saves the live state into the cache
        first when the new prompt would discard enough of it. At least one prompt token is always left to evaluate.

        :return: ``n_keep``: the memory now holds ``prompt[:n_keep]``.
        """
        prompt = np.asarray(prompt, dtype=np.int32)
        slot = self.slot
        self.reconcile()
        self._enter_namespace(self.current_namespace())
        self.counters.prompts += 1
        just_loaded = self._loaded_from_cache == slot.version
        entry, chosen, live, from_disk = self.plan(prompt)
        if entry is not None and from_disk:
            self.counters.disk_hits += 1
            # Back into RAM through the same admission as any entry; the mapped pages are the buffers, no copy.
            self.admit(entry, write_through=False)
        n_keep = chosen.n_keep
        kept_live = n_keep if entry is None else 0
        discarded = slot.n_tokens - kept_live
        if discarded >= self.settings.cache_min_discard and slot.n_tokens >= self.settings.cache_min_tokens:
            self.save_to_cache()
        try:
            self._apply(entry, chosen)
        except StateRestoreError as exc:
            # The slot was cleared: serve the request by evaluating its whole prompt, as the host alone would.
            log.warning("restore failed, evaluating the whole prompt: %s", exc)
            self.counters.restore_failures += 1
            entry, n_keep = None, 0
        if entry is None and n_keep < live.n_common:
            self.counters.forced_reprocess += 1
            self.counters.tokens_reprocessed += live.n_common - n_keep
            reason = (
                "recurrent state cannot be truncated" if self.kind.recurrent else "sliding window lost the prefix"
            )
            log.info("re-processing %d tokens the memory shared with the prompt: %s", live.n_common - n_keep, reason)
            self.call_hook("on_full_reprocess", manager=self, slot=slot, n_common=live.n_common, reason=reason)
        if entry is None and live.n_keep < max(len(prompt) - 1, 0) and not just_loaded:
            self.counters.cache_misses += 1
        self.counters.tokens_reused += n_keep
        self._pin_slot()
        scope = current_request.get()
        if scope is not None:
            scope.prompt_tokens, scope.cached_tokens = len(prompt), n_keep
        return n_keep

    def _apply(self, entry: CacheEntry | None, chosen: Reuse) -> None:
        """Make the memory hold ``chosen.n_keep`` tokens: truncate, or restore ``entry`` and/or a checkpoint."""
        slot, n_keep = self.slot, chosen.n_keep
        if entry is None and chosen.checkpoint is None:
            if n_keep < slot.n_tokens:
                self._cut(n_keep)
            return
        started = time.perf_counter()
        if entry is not None:
            self.counters.cache_hits += 1
            self.call_hook("on_cache_hit", manager=self, slot=slot, entry=entry, n_tokens=n_keep)
            if not (self.kind.partial_is_complete and chosen.checkpoint is not None):
                self._restore(entry.state)
            self.cache.touch(entry)
        if chosen.checkpoint is not None:
            self._restore(chosen.checkpoint)
            self.counters.checkpoints_restored += 1
        self._cut(n_keep)
        if entry is not None:
            self._adopt(entry.tokens, entry.checkpoints, n_keep)
        self.last_restore_seconds = time.perf_counter() - started
        self.counters.restore_seconds += self.last_restore_seconds
        self.call_hook("on_slot_restore", manager=self, slot=slot, checkpoint=chosen.checkpoint, entry=entry,
                       n_tokens=n_keep)

    def _cut(self, n_keep: int) -> None:
        """Truncate the memory to ``n_keep`` tokens."""
        self._full_capture = None
        if n_keep == 0:
            self.backend.clear()
        elif not self.backend.truncate(n_keep):
            self._clear_slot()
            raise StateRestoreError(f"llama.cpp could not truncate the sequence to {n_keep} tokens; the slot was cleared")
        self.slot._truncate(n_keep)

    def process(self, tokens: Sequence[int] | np.ndarray, prompt_end: int | None = None) -> None:
        """Evaluate ``tokens`` after the slot's end, pausing where checkpoints may be taken.

        :param tokens: Tokens to evaluate.
        :param prompt_end: Length of the prompt these tokens belong to; tokens past it are generated tokens and get
            no checkpoints. Defaults to the end of ``tokens``.
        """
        tokens = np.asarray(tokens, dtype=np.int32)
        slot = self.slot
        start = slot.n_tokens
        end = start + len(tokens)
        if prompt_end is None:
            prompt_end = end
        # Checkpoints past ``start`` belong to a lineage these tokens may rewrite: space from the valid ones.
        last = max((c.n_tokens for c in slot.checkpoints if c.n_tokens <= start), default=0)
        bounds = [start, *pause_points(self.kind, self.rules, start, end, prompt_end, last), end]
        for a, b in zip(bounds, bounds[1:]):
            if a == b:
                continue
            chunk = tokens[a - start : b - start]
            self.backend.decode(chunk)
            rewritten_from = slot._append(chunk)
            if rewritten_from is not None:
                self._invalidate_after(rewritten_from)
            self.counters.tokens_evaluated += len(chunk)
            # The last full capture describes the old memory: do not keep its bytes alive for nothing.
            self._full_capture = None
            if a < prompt_end:
                self.call_hook("on_prompt_processed", manager=self, slot=slot, start=a, end=b, prompt_end=prompt_end)
        self._pin_slot()

    # ---------------------------------------------------------------------------------------------------------------
    # introspection

    def stats(self) -> dict[str, Any]:
        """Counters plus memory figures (safe to call from any thread while the model runs).

        ``resident_bytes`` counts each state buffer held by the slot or the cache once; ``referenced_bytes`` counts
        it once per holder (what a copying cache would hold). Their ratio is 1.0 when nothing is duplicated.
        """
        checkpoints = list(self.slot.checkpoints)
        entries = self.cache.entries()
        holders: list[Iterable[np.ndarray]] = [c.buffers() for c in checkpoints]
        holders += [entry.buffers() for entry in entries]
        unique: dict[int, int] = {}
        referenced = 0
        for buffers in holders:
            for buffer in buffers:
                unique[id(buffer)] = int(buffer.nbytes)
                referenced += int(buffer.nbytes)
        slot_only = self.cache.pinned_only_bytes()
        out: dict[str, Any] = asdict(self.counters)
        out.update(
            bytes_copied=self.counters.bytes_captured + self.counters.bytes_restored,
            resident_bytes=sum(unique.values()),
            slot_only_bytes=slot_only,
            pool_free_bytes=self.cache.pool.free_bytes,
            state_bytes=self.cache.state_bytes,
            state_budget_bytes=self.cache.max_bytes,
            referenced_bytes=referenced,
            cache_entries=len(entries),
            cache_bytes=self.cache.resident_bytes - slot_only,
            cache_tokens=self.cache.n_tokens,
            slot_tokens=self.slot.n_tokens,
            lineage_tokens=self.slot.n_lineage,
            slot_checkpoints=len(checkpoints),
            memory_kind=self.kind.name,
            disk_entries=len(self.disk) if self.disk is not None else 0,
            disk_bytes=self.disk.resident_bytes if self.disk is not None else 0,
        )
        return out

    def describe(self, namespace: str | None = None) -> dict[str, Any]:
        """A JSON-able view of the slot, its checkpoints and the cache entries; of ``namespace`` only, if given
        (the slot is shown only while it holds that namespace's state)."""

        def checkpoint_view(c: Checkpoint) -> dict[str, Any]:
            return {"n_tokens": c.n_tokens, "pos_min": c.pos_min, "pos_max": c.pos_max, "partial": c.partial,
                    "bytes": c.nbytes}

        slot = self.slot
        slots = []
        if namespace is None or slot.namespace == namespace:
            slots.append({"id": slot.id, "n_tokens": slot.n_tokens, "namespace": slot.namespace,
                          "checkpoints": [checkpoint_view(c) for c in list(slot.checkpoints)]})
        return {
            "fingerprint": self.fingerprint,
            "memory_kind": self.kind.name,
            "slots": slots,
            "cache": [{"namespace": e.namespace, "n_tokens": e.n_tokens, "bytes": e.nbytes, "hits": e.hits,
                       "checkpoints": len(e.checkpoints)} for e in self.cache.entries(namespace)],
        }

    # ---------------------------------------------------------------------------------------------------------------
    # slot files

    def save_slot(self, path: str | os.PathLike[str], namespace: str | None = None) -> dict[str, Any]:
        """Write the slot (tokens, full state, checkpoints, draft and speculative state) to ``path`` atomically.

        :param namespace: The caller's namespace (the manager's own by default); the file records it.
        :raises EmptySlotError: The slot holds nothing of ``namespace`` (another tenant's state is never saved).
        :return: ``{"n_saved": tokens, "n_written": bytes, "save_ms": ...}``.
        """
        started = time.perf_counter()
        namespace = namespace or self.settings.namespace
        with self.lock:
            self.reconcile()
            if self.slot.namespace != namespace or self.slot.n_tokens == 0:
                raise EmptySlotError("the slot holds no state of this caller to save")
            entry = self.save()
            written = write_entry(path, entry, model_fingerprint=self.fingerprint)
        return {"n_saved": entry.n_tokens, "n_written": written, "save_ms": (time.perf_counter() - started) * 1e3}

    def restore_slot(self, path: str | os.PathLike[str], namespace: str | None = None) -> dict[str, Any]:
        """Restore the slot from a slot file; a file that is corrupt, made for another model or context, or saved by
        another namespace is refused and the slot stays exactly as it was.

        :param namespace: The caller's namespace (the manager's own by default); it must be the file's.
        :return: ``{"n_restored": tokens, "n_read": bytes, "restore_ms": ...}``.
        """
        started = time.perf_counter()
        namespace = namespace or self.settings.namespace
        entry = read_entry(path, expected_fingerprint=self.fingerprint)
        if entry.namespace != namespace:
            raise ForeignNamespaceError("the slot file was saved by another namespace")
        with self.lock:
            self.reconcile()
            # Another tenant's live state is parked in its own partition, never handed over.
            self._enter_namespace(namespace)
            previous = self.save() if self.slot.n_tokens else None
            try:
                self.load(entry)
            except (IncompatibleStateError, StateRestoreError):
                if previous is not None:
                    self.load(previous)
                raise
        n_read = sum(int(b.nbytes) for b in {id(b): b for b in entry.buffers()}.values())
        return {"n_restored": entry.n_tokens, "n_read": n_read, "restore_ms": (time.perf_counter() - started) * 1e3}

    def erase_slot(self, namespace: str | None = None) -> dict[str, Any]:
        """Empty the slot (memory and checkpoints) if it holds ``namespace``'s state; the prompt cache keeps its
        entries. Another namespace's live state is left alone (``n_erased`` 0)."""
        namespace = namespace or self.settings.namespace
        with self.lock:
            if self.slot.namespace != namespace:
                return {"n_erased": 0}
            self.reconcile()
            n_erased = self.slot.n_tokens
            self._clear_slot()
        return {"n_erased": n_erased}

    def flush(self) -> None:
        """Put the live slot into the cache (and so into the disk tier), e.g. before the process exits."""
        with self.lock:
            self.reconcile()
            if self.slot.n_tokens >= self.settings.cache_min_tokens:
                self.save_to_cache()

    def close(self) -> None:
        """Drop the slot's checkpoints and tell the plugins the manager is going away."""
        self._drop_slot_state("cleared")
        self.cache.pin(self.slot, ())
        self.call_hook("on_detach", manager=self)
