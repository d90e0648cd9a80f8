"""What plugins and services see of an engine and its slots: protocols, so that nothing below the engine imports it.

:class:`~ckpt_plugin.engine.manager.CheckpointManager` and :class:`~ckpt_plugin.engine.slot_controller.SlotController` implement them.
Hook implementations receive an :class:`EngineView` as ``manager``; the services (stats, slot files, publishing to
the shared tier) take an engine or one of its slots through these protocols only.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Protocol, Sequence

if TYPE_CHECKING:
    from ckpt_plugin.core.entry import CacheEntry
    from ckpt_plugin.tiers.ram import PromptCache
    from ckpt_plugin.core.checkpoint import Checkpoint
    from ckpt_plugin.core.config import CheckpointSettings
    from ckpt_plugin.core.counters import Counters
    from ckpt_plugin.tiers.disk import DiskTier
    from ckpt_plugin.core.memory import MemoryKind
    from ckpt_plugin.policy.schedule import CheckpointRules
    from ckpt_plugin.core.slot import Backend, Slot
    from ckpt_plugin.tiers.store import TieredStore

__all__ = ["EngineView", "SlotView"]


class SlotView(Protocol):
    """One slot's controller, as plugins and services see it: the slot's record, its sequence and what may be done
    to them.

    :ivar slot: Tokens, lineage and checkpoints (read-only for plugins).
    :ivar backend: The sequence in the model context.
    :ivar lock: Held while a request or a service uses the slot.
    :ivar branch_point: Where the prompt being served leaves the longest stored prefix it shares (0: none).
    :ivar last_restore_seconds: What the slot's latest restore took.
    """

    slot: Slot
    backend: Backend
    lock: threading.Lock
    branch_point: int
    last_restore_seconds: float
    settings: CheckpointSettings
    store: TieredStore
    counters: Counters

    @property
    def fingerprint(self) -> str: ...

    def checkpoint(self) -> Checkpoint | None: ...

    def save(self) -> CacheEntry: ...

    def load(self, entry: CacheEntry) -> int: ...

    def reconcile(self) -> None: ...

    def clear_slot(self) -> None: ...

    def enter_namespace(self, namespace: str) -> None: ...


class EngineView(Protocol):
    """An engine: slots over one store, with settings, rules, counters and plugins they share.

    :ivar controllers: The slots' controllers, by slot id (``slot.id`` indexes it).
    :ivar hooks: Calls the plugins' hooks with ``manager`` bound (:class:`~ckpt_plugin.plugins.engine_hooks.EngineHooks`).
    """

    settings: CheckpointSettings
    kind: MemoryKind
    rules: CheckpointRules
    counters: Counters
    store: TieredStore
    plugins: Any
    hooks: Any
    controllers: Sequence[SlotView]

    @property
    def fingerprint(self) -> str: ...

    @property
    def cache(self) -> PromptCache: ...

    @property
    def disk(self) -> DiskTier | None: ...
