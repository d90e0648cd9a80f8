"""The engine: the slots of one model context over one store, with the hooks, counters and settings they share.

A :class:`CheckpointManager` holds one :class:`~ckpt_plugin.engine.slot_controller.SlotController` per sequence id of its
context (``controllers``, indexed by slot id; a host's single ``Llama`` has one), the :class:`~ckpt_plugin.tiers.store.TieredStore` every slot shares,
the plugin manager and the counters. Each slot prepares prompts and evaluates tokens on its own sequence; checkpoints
and cache entries are immutable and shared by reference between the slots and the tiers. The one-slot API is
:attr:`~CheckpointManager.primary` (``manager.primary.prepare``, ``.process``, ``.save``, ``.load``, ...): slot 0,
the slot of an attached ``Llama``; the manager's old names for those verbs are deprecated.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import warnings
from typing import Any, Sequence

from ckpt_plugin.plugins import hookspecs as hooks
from ckpt_plugin.core.entry import CacheEntry
from ckpt_plugin.tiers.ram import PromptCache
from ckpt_plugin.engine.captures import Captures
from ckpt_plugin.core.config import CheckpointSettings
from ckpt_plugin.plugins.default import DEFAULT_PLUGIN_NAME, DefaultPlugin
from ckpt_plugin.tiers.disk import DiskTier
from ckpt_plugin.core.errors import SlotBusyError
from ckpt_plugin.plugins.engine_hooks import EngineHooks, ProjectPlugins
from ckpt_plugin.plugins.hookspecs import PROJECT_NAME
from ckpt_plugin.policy.schedule import CheckpointRules, default_min_step
from ckpt_plugin.tiers.shared.tier import SharedTier
from ckpt_plugin.core.renamed import Renamed
from ckpt_plugin.core.slot import Backend
from ckpt_plugin.engine.slot_controller import SlotController
from ckpt_plugin.engine.store_events import EngineStoreEvents
from ckpt_plugin.services.slot_files import erase_slot, restore_slot, save_slot
from ckpt_plugin.core.counters import Cleared, Counters
from ckpt_plugin.services.stats import describe, manager_stats
from ckpt_plugin.tiers.store import TieredStore
from ckpt_plugin.tiers.registry import TIERS

__all__ = ["CheckpointManager"]

log = logging.getLogger("ckpt_plugin")

_IDLE_POLL_SECONDS = 0.02
"""How often a deletion waiting for a busy slot looks again (a generation marks no event when it ends)."""


class _OnPrimary:
    """A deprecated name of the manager (kept one release): warns, then gives ``manager.primary``'s attribute of the
    same name (slot 0's value, or its bound verb)."""

    name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, manager: CheckpointManager | None, owner: type | None = None) -> Any:
        if manager is None:
            return self
        warnings.warn(f"CheckpointManager.{self.name} is deprecated: use manager.primary.{self.name} "
                      f"(or manager.controllers[i].{self.name})", DeprecationWarning, stacklevel=2)
        return getattr(manager.primary, self.name)


class CheckpointManager:
    """Checkpoints and prompt cache for one model context, with one slot per sequence id.

    Usually made by :func:`ckpt_plugin.attach`; can be built on any :class:`Backend`.

    :param backend: Slot 0's sequence.
    :param settings: Settings; keyword overrides are applied on top.
    :param cache: A prompt cache to share with other managers of the same model; a private one by default.
    :param disk: A disk tier to share likewise; by default one in ``settings.disk_dir`` if that is set.
    :param shared: A shared tier (Redis); by default the process's one for ``settings.redis_url`` if that is set.
    :param more_slots: The sequences of slots 1, 2, ... of the same context (same model fingerprint).
    :ivar controllers: The slots' controllers, by slot id (``controllers[slot.id]`` serves ``slot``).
    """

    def __init__(
        self,
        backend: Backend,
        settings: CheckpointSettings | None = None,
        cache: PromptCache | None = None,
        disk: DiskTier | None = None,
        shared: SharedTier | None = None,
        *,
        more_slots: Sequence[Backend] = (),
        **overrides: Any,
    ) -> None:
        base = settings.model_dump() if settings is not None else {}
        self.settings = CheckpointSettings(**{**base, **overrides})
        self.kind = backend.kind
        for other in more_slots:
            if other.fingerprint != backend.fingerprint:
                raise ValueError("every slot of an engine must be a sequence of the same model context")
        min_step = self.settings.checkpoint_min_step or default_min_step(self.kind)
        self.rules = CheckpointRules(self.settings.max_checkpoints, min_step)
        # The engine's one cost model: whether its rates decide plans and captures is the engine's setting.
        self.rules.costs.enabled = self.settings.plan_by_cost
        settings = self.settings
        if cache is None:
            cache = TIERS.ram(None, settings.cache_max_bytes, settings.cache_max_tokens)
        if disk is None and settings.disk_dir is not None:
            disk = TIERS.disk(settings.disk_dir, settings.disk_max_bytes)
        self.counters = Counters()
        self.plugins = ProjectPlugins(PROJECT_NAME)
        self.plugins.add_hookspecs(hooks)
        self.plugins.register(DefaultPlugin(), name=DEFAULT_PLUGIN_NAME)
        self.hooks = EngineHooks(self.plugins, self)
        # The store reports to the hooks and counters, never to the manager itself.
        self.store = TieredStore(cache, disk, EngineStoreEvents(self.hooks, self.counters),
                                 shared or TIERS.shared(settings))
        self.captures = Captures(self.kind, backend.fingerprint, self.store, self.counters, self.hooks,
                                 self.settings.page_positions)
        self._clearing = threading.Lock()  # one clear_cache at a time (see there)
        self.controllers = [
            SlotController(slot_id=slot_id, backend=slot_backend, settings=self.settings, rules=self.rules,
                           store=self.store, counters=self.counters, hooks=self.hooks, captures=self.captures)
            for slot_id, slot_backend in enumerate((backend, *more_slots))
        ]
        if self.settings.load_entrypoints:
            self.plugins.load_setuptools_entrypoints(PROJECT_NAME)
            # A misspelled hook implementation in an installed plugin fails here, not silently.
            self.plugins.check_pending()

    @property
    def fingerprint(self) -> str:
        """The fingerprint of the context (every state the engine captures carries it)."""
        return self.captures.fingerprint

    # ---------------------------------------------------------------------------------------------------------------
    # hooks

    @property
    def cache(self) -> PromptCache:
        """The RAM tier (the budget of every state byte)."""
        return self.store.ram

    @property
    def disk(self) -> DiskTier | None:
        """The disk tier, if any."""
        return self.store.disk

    # ---------------------------------------------------------------------------------------------------------------
    # slot 0: the slot of an attached Llama

    @property
    def primary(self) -> SlotController:
        """Slot 0's controller, the slot of an attached ``Llama`` (``controllers[0]``): its verbs are the one-slot
        API."""
        return self.controllers[0]

    # Deprecated for one release: the controllers' list under the records' name ("slot" is the Slot record).
    slots = Renamed("controllers")

    # Deprecated for one release: slot 0's verbs under the manager's name, now ``manager.primary.<name>``.
    slot = _OnPrimary()
    backend = _OnPrimary()
    lock = _OnPrimary()
    prepare = _OnPrimary()
    process = _OnPrimary()
    plan = _OnPrimary()
    checkpoint = _OnPrimary()
    save = _OnPrimary()
    load = _OnPrimary()
    save_to_cache = _OnPrimary()
    clear_slot = _OnPrimary()
    reconcile = _OnPrimary()
    adopt_memory = _OnPrimary()
    current_namespace = _OnPrimary()
    enter_namespace = _OnPrimary()

    # ---------------------------------------------------------------------------------------------------------------
    # the store

    def use_shared_tiers(self, cache: PromptCache, disk: DiskTier | None = None) -> None:
        """Serve from ``cache`` (and ``disk``) from now on, e.g. a cache shared with other managers; the entries of
        the cache used so far move over (within the new budget)."""
        if cache is not self.cache:
            old = self.store.ram
            for controller in self.controllers:
                old.pin(controller.slot, ())
            self.store.ram = cache
            for entry in old.clear():
                self.store.admit(entry, write_through=False)
            for controller in self.controllers:
                controller.memory.pin()
        if disk is not None:
            self.store.disk = disk

    def admit(self, entry: CacheEntry, write_through: bool = True) -> bool:
        """Offer ``entry`` to the prompt cache through the ``on_cache_alloc`` veto and ``select_cache_victims``
        (evictions fire ``on_cache_evict``), and write it through to the disk tier; return whether a tier holds it.
        """
        return self.store.admit(entry, write_through)

    def clear_cache(self, namespace: str | None = None, wait: float | None = None) -> Cleared:
        """Forget ``namespace``'s state (everyone's, for ``None``) in every tier the plugin owns: the RAM cache,
        the disk tier's files, the shared tier's partition of this model, and the live slots that hold that state.

        A generation using one of those slots finishes first: emptied under a live stream, a slot would make the
        stream evaluate its whole context again at its next token (and reply from another evaluation). While it
        waits, the slots already found idle are held, so that no generation starts on them, nor restores what is
        about to be deleted, and a busy server cannot keep the deletion waiting for ever. Then every slot's lock is
        held throughout the deletions, so that no request of the tenant can restore from a tier between two of them.

        :param wait: The most seconds to wait for those generations (``None``: as long as they take).
        :return: The entries deleted over every tier, an ``int`` (:class:`~ckpt_plugin.core.counters.Cleared`) whose
            ``tiers`` has the count per tier and how many slots were emptied.
        :raises SlotBusyError: A generation still used one of the slots after ``wait`` seconds; nothing was deleted.
        """
        deadline = None if wait is None else time.monotonic() + wait

        def in_scope(controller: SlotController) -> bool:
            return namespace is None or controller.slot.namespace == namespace

        with self._clearing:
            while True:
                with contextlib.ExitStack() as held:
                    # The slots to empty first, each once idle, then the others (only this method holds several
                    # slots' locks at once, one call at a time: no other order to deadlock with).
                    mine = [c for c in self.controllers if in_scope(c)]
                    for controller in mine:
                        self._hold_when_idle(controller, namespace, deadline, held)
                    for controller in self.controllers:
                        if controller not in mine:
                            held.enter_context(controller.lock)
                    if any(c.busy and in_scope(c) for c in self.controllers):
                        continue  # a generation of the tenant started on another slot meanwhile: wait for it too
                    emptied = 0
                    for controller in self.controllers:
                        if in_scope(controller):
                            controller.reconcile()
                            emptied += int(controller.slot.n_tokens > 0 or bool(controller.slot.checkpoints))
                            controller.clear_slot()
                    tiers = self.store.forget(namespace, self.fingerprint)
                    return Cleared({**tiers, "slot": emptied})

    @staticmethod
    def _hold_when_idle(controller: SlotController, namespace: str | None, deadline: float | None,
                        held: contextlib.ExitStack) -> None:
        """Hold ``controller``'s lock once no generation of ``namespace`` uses the slot (any, for ``None``).

        A generation takes the slot's lock only between its tokens, and marks the slot busy from its prepare to its
        end: the lock held with the slot not busy (or busy for another tenant) means no generation of the tenant
        is under way there, and none can start.

        :raises SlotBusyError: Still in use at ``deadline``.
        """
        while True:
            controller.lock.acquire()
            slot = controller.slot
            if not (controller.busy and (namespace is None or slot.namespace == namespace)):
                held.callback(controller.lock.release)
                return
            controller.lock.release()
            if deadline is not None and time.monotonic() >= deadline:
                raise SlotBusyError(f"slot {slot.id} was still generating when the deletion had waited as long as it "
                                    "may; nothing was deleted: retry")
            time.sleep(_IDLE_POLL_SECONDS)

    def resize_cache(self, max_bytes: int) -> None:
        """Change the prompt cache's byte budget (validated like ``cache_max_bytes``), evicting to fit."""
        self.settings.cache_max_bytes = max_bytes
        self.store.resize(max_bytes)

    # ---------------------------------------------------------------------------------------------------------------
    # views and slot files (their own modules)

    def stats(self) -> dict[str, Any]:
        """Counters plus memory figures (see :func:`ckpt_plugin.services.stats.manager_stats`); safe from any thread."""
        return manager_stats(self)

    def describe(self, namespace: str | None = None) -> dict[str, Any]:
        """The slot, its checkpoints and the cache entries (see :func:`ckpt_plugin.services.stats.describe`)."""
        return describe(self, namespace)

    def save_slot(self, path: str | os.PathLike[str], namespace: str | None = None, slot_id: int = 0) -> dict[str, Any]:
        """Write slot ``slot_id`` to a slot file (see :func:`ckpt_plugin.services.slot_files.save_slot`)."""
        return save_slot(self.controllers[slot_id], path, namespace)

    def restore_slot(
        self, path: str | os.PathLike[str], namespace: str | None = None, slot_id: int = 0
    ) -> dict[str, Any]:
        """Restore slot ``slot_id`` from a slot file (see :func:`ckpt_plugin.services.slot_files.restore_slot`)."""
        return restore_slot(self.controllers[slot_id], path, namespace)

    def erase_slot(self, namespace: str | None = None, slot_id: int = 0) -> dict[str, Any]:
        """Empty slot ``slot_id`` if it holds ``namespace``'s state (see :func:`ckpt_plugin.services.slot_files.erase_slot`)."""
        return erase_slot(self.controllers[slot_id], namespace)

    def flush(self) -> None:
        """Put every live slot into the cache (and so into the disk tier), e.g. before the process exits."""
        for controller in self.controllers:
            with controller.lock:
                controller.reconcile()
                if controller.slot.n_tokens >= self.settings.cache_min_tokens:
                    controller.memory.save_to_cache()

    def close(self) -> None:
        """Drop the slots' checkpoints and tell the plugins the manager is going away."""
        for controller in self.controllers:
            controller.memory.close()
        self.hooks.call(self.hooks.hook.on_detach)
