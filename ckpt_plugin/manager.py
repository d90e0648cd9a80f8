"""The checkpoint manager: the coordinator that applies plans to one model's memory.

Data flows one way: the host asks the manager to :meth:`~CheckpointManager.prepare` a prompt and to
:meth:`~CheckpointManager.process` the tokens that remain. The plan comes from :func:`~ckpt_plugin.policy.plan_prompt`
over the candidates of the :class:`~ckpt_plugin.store.TieredStore`; the manager captures and restores through the
backend (the only code that touches llama.cpp), fires the hooks through its :class:`~ckpt_plugin.hook_relay.HookRelay`,
counts, and keeps the slot, its checkpoints and the store consistent.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Sequence

import numpy as np

from . import hooks
from .cache import CacheEntry, PromptCache
from .checkpoint import Checkpoint, ExtraState, freeze
from .config import CheckpointSettings
from .default_plugin import DEFAULT_PLUGIN_NAME, DefaultPlugin
from .disk_tier import DiskTier
from .errors import CaptureError, IncompatibleStateError, StateRestoreError
from .hook_relay import HookRelay, ProjectPlugins
from .hooks import PROJECT_NAME
from .policy import (
    CheckpointRules,
    LiveMemory,
    PartialSizes,
    Plan,
    branch_point,
    checkpoints_to_erase,
    default_min_step,
    partial_cells,
    pause_points,
    plan_prompt,
    slot_checkpoint_limit,
)
from .request import current_request
from .shared_tier import SharedTier, shared_tier_for
from .slot import Backend, Slot
from .slot_files import erase_slot, restore_slot, save_slot
from .stats import Cleared, Counters, describe, manager_stats
from .store import TieredStore

__all__ = ["Backend", "CheckpointManager", "Counters", "DEFAULT_PLUGIN_NAME", "DefaultPlugin", "Slot"]

log = logging.getLogger("ckpt_plugin")


class CheckpointManager:
    """Checkpoints and prompt cache for one model context.

    Usually made by :func:`ckpt_plugin.attach`; can be built on any :class:`Backend`.

    :param backend: The model context.
    :param settings: Settings; keyword overrides are applied on top.
    :param cache: A prompt cache to share with other managers of the same model; a private one by default.
    :param disk: A disk tier to share likewise; by default one in ``settings.disk_dir`` if that is set.
    :param shared: A shared tier (Redis); by default the process's one for ``settings.redis_url`` if that is set.
    :ivar lock: Held by the host-facing layer while a request uses the slot, and by the slot file operations.
    :ivar branch_point: Where the prompt last prepared leaves the longest prefix it shares with a stored state, when
        a restore could not serve all of it: a checkpoint is taken there (``policy.branch_point``; 0: none).
    """

    def __init__(
        self,
        backend: Backend,
        settings: CheckpointSettings | None = None,
        cache: PromptCache | None = None,
        disk: DiskTier | None = None,
        shared: SharedTier | None = None,
        **overrides: Any,
    ) -> None:
        base = settings.model_dump() if settings is not None else {}
        self.settings = CheckpointSettings(**{**base, **overrides})
        self.backend = backend
        self.kind = backend.kind
        self.fingerprint = backend.fingerprint
        min_step = self.settings.checkpoint_min_step or default_min_step(self.kind)
        self.rules = CheckpointRules(self.settings.max_checkpoints, min_step)
        if cache is None:
            cache = PromptCache(self.settings.cache_max_bytes, self.settings.cache_max_tokens)
        if disk is None and self.settings.disk_dir is not None:
            disk = DiskTier(self.settings.disk_dir, self.settings.disk_max_bytes)
        self.store = TieredStore(cache, disk, self, shared or shared_tier_for(self.settings))
        self.lock = threading.Lock()
        self.slot = Slot(0, backend.n_ctx)
        self.slot.namespace = self.settings.namespace
        self.last_restore_seconds = 0.0
        self.counters = Counters()
        self._full_capture: tuple[int, Checkpoint] | None = None
        self._partial_sizes = PartialSizes()
        # Where the prompt being served leaves the longest stored prefix it shares (policy.branch_point; 0: none).
        self.branch_point = 0
        self._loaded_from_cache = -1
        self.plugins = ProjectPlugins(PROJECT_NAME)
        self.plugins.add_hookspecs(hooks)
        self.plugins.register(DefaultPlugin(), name=DEFAULT_PLUGIN_NAME)
        self.hooks = HookRelay(self.plugins, self)
        if self.settings.load_entrypoints:
            self.plugins.load_setuptools_entrypoints(PROJECT_NAME)
            # A misspelled hook implementation in an installed plugin fails here, not silently.
            self.plugins.check_pending()

    # ---------------------------------------------------------------------------------------------------------------
    # hooks

    def call_hook(self, name: str, **kwargs: Any) -> Any:
        """Call hook ``name`` (a plugin's own hook too) with ``manager`` bound; see :class:`HookRelay`."""
        kwargs.pop("manager", None)
        return self.hooks.call(getattr(self.plugins.hook, name), **kwargs)

    @property
    def cache(self) -> PromptCache:
        """The RAM tier (the budget of every state byte)."""
        return self.store.ram

    @property
    def disk(self) -> DiskTier | None:
        """The disk tier, if any."""
        return self.store.disk

    # store events (see ckpt_plugin.store.StoreEvents)

    def allow_admission(self, entry: CacheEntry, n_bytes: int) -> bool:
        return self.hooks.on_cache_alloc(namespace=entry.namespace, n_tokens=entry.n_tokens, n_bytes=n_bytes)

    def select_victims(self, entries: Sequence[CacheEntry], n_bytes: int) -> Sequence[CacheEntry]:
        return self.hooks.select_cache_victims(entries, n_bytes)

    def evicted(self, entry: CacheEntry, reason: str) -> None:
        if reason == "budget":
            self.counters.cache_evictions += 1
        self.hooks.on_cache_evict(entry, reason)

    def admitted(self, entry: CacheEntry) -> None:
        self.counters.cache_saves += 1

    # ---------------------------------------------------------------------------------------------------------------
    # captures and restores

    def _capture(self, partial: bool) -> Checkpoint | None:
        slot = self.slot
        pos_min, pos_max = int(self.backend.pos_min()), int(self.backend.pos_max())
        cells = partial_cells(self.kind, pos_min, pos_max)
        expected = self._partial_sizes.expected(cells) if partial else None
        if expected is None:
            size = int(self.backend.state_size(partial))
            self.counters.state_size_queries += 1
        else:
            size = expected
        try:
            buffer = self.cache.pool.allocate(size)
        except MemoryError:
            # Make room by shrinking the cache budget instead of failing the request.
            shrunk = max(0, self.cache.resident_bytes - size)
            log.warning("allocation of %d state bytes failed; prompt-cache budget shrunk to %d", size, shrunk)
            self.store.resize(shrunk)
            self.counters.capture_failures += 1
            self.hooks.on_capture_failed(slot, expected=size, written=0)
            return None
        written = int(self.backend.read_state(buffer, partial))
        if expected is not None and written != size:
            # llama.cpp wrote another size than learned (0 if the buffer was too small): measure from now on.
            log.info("partial state of %d cells wrote %d bytes, not %d; sizing every capture again", cells, written,
                     size)
            self._partial_sizes.distrust()
            return self._capture(partial)
        if written != size:
            log.warning("state capture wrote %d of %d bytes; no checkpoint taken", written, size)
            self.counters.capture_failures += 1
            self.hooks.on_capture_failed(slot, expected=size, written=written)
            return None
        if partial and expected is None:
            self._partial_sizes.learn(cells, size)
        self.counters.bytes_captured += written
        extras: list[ExtraState] = self.hooks.on_checkpoint_capture(slot, n_tokens=slot.n_tokens, partial=partial)
        by_kind = {extra.kind: extra.data for extra in extras} if extras else {}
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

    def _restore(self, checkpoint: Checkpoint) -> None:
        if checkpoint.fingerprint != self.fingerprint:
            raise IncompatibleStateError(
                f"state belongs to model/context {checkpoint.fingerprint}, this context is {self.fingerprint}"
            )
        read = int(self.backend.write_state(checkpoint.target, checkpoint.partial))
        if read != checkpoint.target.nbytes:
            # llama.cpp leaves the sequence undefined after a failed load: start from an empty one.
            self.clear_slot()
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
        released = []
        for victim in checkpoints_to_erase(slot.checkpoints, limit):
            slot.checkpoints.remove(victim)
            released.extend(victim.buffers())
            self._erased(victim, "limit")
        self.store.pin_changes(slot, list(checkpoint.buffers()), released)
        self.hooks.on_checkpoint_created(slot, checkpoint)
        return checkpoint

    def _pin_slot(self) -> None:
        """Count what the slot holds outside the cache (checkpoints, last full capture) against the budget."""
        buffers = [b for c in self.slot.checkpoints for b in c.buffers()]
        if self._full_capture is not None:
            buffers.extend(self._full_capture[1].buffers())
        self.store.pin(self.slot, buffers)

    def _erased(self, checkpoint: Checkpoint, reason: str) -> None:
        self.counters.checkpoints_erased += 1
        self.hooks.on_checkpoint_erased(self.slot, checkpoint, reason)

    def clear_slot(self) -> None:
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
        if self.store.contains(entry):
            # A host that consults its cache itself (``Llama.load_state(cache[key])``) hits through here.
            self.counters.cache_hits += 1
            self.store.touch(entry)
            self._loaded_from_cache = self.slot.version
        self.last_restore_seconds = time.perf_counter() - started
        self.counters.restore_seconds += self.last_restore_seconds
        self.hooks.on_slot_restore(self.slot, checkpoint=None, entry=entry, n_tokens=self.slot.n_tokens)
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
            old = self.store.ram
            old.pin(self.slot, ())
            self.store.ram = cache
            for entry in old.clear():
                self.store.admit(entry, write_through=False)
            self._pin_slot()
        if disk is not None:
            self.store.disk = disk

    def admit(self, entry: CacheEntry, write_through: bool = True) -> bool:
        """Offer ``entry`` to the prompt cache through the ``on_cache_alloc`` veto and ``select_cache_victims``
        (evictions fire ``on_cache_evict``), and write it through to the disk tier; return whether a tier holds it.
        """
        return self.store.admit(entry, write_through)

    def clear_cache(self, namespace: str | None = None) -> Cleared:
        """Forget ``namespace``'s state (everyone's, for ``None``) in every tier the plugin owns: the RAM cache,
        the disk tier's files, the shared tier's partition of this model, and the live slot if it holds that state.

        Holds the manager's lock throughout (a request using the slot finishes first), so that no request of the
        tenant can restore from a tier between two of the deletions.

        :return: The entries deleted over every tier, an ``int`` (:class:`~ckpt_plugin.stats.Cleared`) whose
            ``tiers`` has the count per tier and whether the slot was emptied.
        """
        with self.lock:
            slot = self.slot
            emptied = 0
            if namespace is None or slot.namespace == namespace:
                self.reconcile()
                emptied = int(slot.n_tokens > 0 or bool(slot.checkpoints))
                self.clear_slot()
            tiers = self.store.forget(namespace, self.fingerprint)
        return Cleared({**tiers, "slot": emptied})

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
        self.store.resize(max_bytes)

    def current_namespace(self) -> str:
        """The namespace of the request being served (the manager's own outside a request scope)."""
        scope = current_request.get()
        return scope.namespace if scope is not None and scope.namespace else self.settings.namespace

    def enter_namespace(self, namespace: str) -> None:
        """Never let one tenant reuse another's live state: park it in its owner's partition first."""
        slot = self.slot
        if slot.namespace == namespace:
            return
        if slot.n_tokens >= self.settings.cache_min_tokens:
            self.save_to_cache()
        self.clear_slot()
        slot.namespace = namespace

    def plan(self, prompt: np.ndarray, max_keep: int | None = None) -> Plan[CacheEntry]:
        """How ``prompt`` would be served (see :func:`~ckpt_plugin.policy.plan_prompt`).

        Changes nothing but what the disk tier read of the candidates it fetched: counting, promotion and restores
        are :meth:`prepare`'s.
        """
        slot = self.slot
        live = LiveMemory(slot.lineage, slot.n_tokens, int(self.backend.pos_min()), slot.checkpoints)
        hits = self.store.lookup(slot.namespace, self.fingerprint, prompt, self.kind, max_keep)
        return plan_prompt(self.kind, prompt, live, hits, self.settings.cache_min_discard,
                           self.settings.cache_min_tokens, max_keep)

    def prepare(self, prompt: Sequence[int] | np.ndarray, max_keep: int | None = None) -> int:
        """Make the memory hold the longest prefix of ``prompt`` that can be served without evaluation.

        Looks at the live memory, the slot's checkpoints and every tier of the store; saves the live state into the
        cache first when the new prompt would discard enough of it. At least one prompt token is always left to
        evaluate.

        :param max_keep: Keep at most this many tokens (see :func:`~ckpt_plugin.policy.plan_prompt`).
        :return: ``n_keep``: the memory now holds ``prompt[:n_keep]``.
        """
        prompt = np.asarray(prompt, dtype=np.int32)
        slot = self.slot
        self.reconcile()
        self.enter_namespace(self.current_namespace())
        self.counters.prompts += 1
        just_loaded = self._loaded_from_cache == slot.version
        plan = self.plan(prompt, max_keep)
        self.branch_point = branch_point(self.kind, self.rules, plan)
        if plan.entry is not None and plan.tier != "ram":
            if plan.tier == "disk":
                self.counters.disk_hits += 1
            self.store.promote(plan.entry, plan.tier)
        if plan.park_live:
            self.save_to_cache()
        entry, n_keep = plan.entry, plan.n_keep
        try:
            self._apply(plan)
        except StateRestoreError as exc:
            # The slot was cleared: serve the request by evaluating its whole prompt, as the host alone would.
            log.warning("restore failed, evaluating the whole prompt: %s", exc)
            self.counters.restore_failures += 1
            entry, n_keep = None, 0
        live = plan.live
        if entry is None and n_keep < live.n_common:
            self.counters.forced_reprocess += 1
            self.counters.tokens_reprocessed += live.n_common - n_keep
            reason = (
                "recurrent state cannot be truncated" if self.kind.recurrent else "sliding window lost the prefix"
            )
            log.info("re-processing %d tokens the memory shared with the prompt: %s", live.n_common - n_keep, reason)
            self.hooks.on_full_reprocess(slot, n_common=live.n_common, reason=reason)
        if entry is None and live.n_keep < max(len(prompt) - 1, 0) and not just_loaded:
            self.counters.cache_misses += 1
        self.counters.tokens_reused += n_keep
        self._pin_slot()
        scope = current_request.get()
        if scope is not None:
            scope.prompt_tokens, scope.cached_tokens = len(prompt), n_keep
        return n_keep

    def _apply(self, plan: Plan[CacheEntry]) -> None:
        """Make the memory hold ``plan.n_keep`` tokens: truncate, or restore the entry and/or a checkpoint."""
        slot, entry, n_keep = self.slot, plan.entry, plan.n_keep
        if not plan.needs_restore:
            if n_keep < slot.n_tokens:
                self._cut(n_keep)
            return
        started = time.perf_counter()
        if entry is not None:
            self.counters.cache_hits += 1
            self.hooks.on_cache_hit(slot, entry, n_tokens=n_keep)
            if plan.restore_state:
                self._restore(entry.state)
            self.store.touch(entry)
        if plan.checkpoint is not None:
            self._restore(plan.checkpoint)
            self.counters.checkpoints_restored += 1
        self._cut(n_keep)
        if entry is not None:
            self._adopt(entry.tokens, entry.checkpoints, n_keep)
        self.last_restore_seconds = time.perf_counter() - started
        self.counters.restore_seconds += self.last_restore_seconds
        self.hooks.on_slot_restore(slot, checkpoint=plan.checkpoint, entry=entry, n_tokens=n_keep)

    def _cut(self, n_keep: int) -> None:
        """Truncate the memory to ``n_keep`` tokens."""
        self._full_capture = None
        if n_keep == 0:
            self.backend.clear()
        elif not self.backend.truncate(n_keep):
            self.clear_slot()
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
        branch = self.branch_point
        bounds = [start, *pause_points(self.kind, self.rules, start, end, prompt_end, last, branch), end]
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
            if b == branch and b < end and b < slot.n_lineage and slot.lineage[b] != tokens[b - start]:
                # The prompt leaves the lineage here: its checkpoints past this point go now rather than with the
                # next chunk, so that the branch checkpoint is the newest.
                self._invalidate_after(b)
            if a < prompt_end:
                self.hooks.on_prompt_processed(slot, start=a, end=b, prompt_end=prompt_end)
        if start < branch <= end:
            self.branch_point = 0  # one prompt's, spent by the evaluation that passed it
        self._pin_slot()

    # ---------------------------------------------------------------------------------------------------------------
    # views and slot files (their own modules)

    def stats(self) -> dict[str, Any]:
        """Counters plus memory figures (see :func:`ckpt_plugin.stats.manager_stats`); safe from any thread."""
        return manager_stats(self)

    def describe(self, namespace: str | None = None) -> dict[str, Any]:
        """The slot, its checkpoints and the cache entries (see :func:`ckpt_plugin.stats.describe`)."""
        return describe(self, namespace)

    def save_slot(self, path: str | os.PathLike[str], namespace: str | None = None) -> dict[str, Any]:
        """Write the slot to a slot file (see :func:`ckpt_plugin.slot_files.save_slot`)."""
        return save_slot(self, path, namespace)

    def restore_slot(self, path: str | os.PathLike[str], namespace: str | None = None) -> dict[str, Any]:
        """Restore the slot from a slot file (see :func:`ckpt_plugin.slot_files.restore_slot`)."""
        return restore_slot(self, path, namespace)

    def erase_slot(self, namespace: str | None = None) -> dict[str, Any]:
        """Empty the slot if it holds ``namespace``'s state (see :func:`ckpt_plugin.slot_files.erase_slot`)."""
        return erase_slot(self, namespace)

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
        self.hooks.on_detach()
