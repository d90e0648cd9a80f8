"""What the prompt cache's store tells the engine, and asks of it: answered by the engine's hooks and counted in its
counters.

The store (:class:`~ckpt_plugin.tiers.store.TieredStore`) gets this object, not the manager: it reaches the plugins'
admission veto and victim selection, and reports admissions and evictions, without a way back up to the engine's
other parts.
"""

from __future__ import annotations

from typing import Any, Sequence

from ckpt_plugin.core.counters import Counters
from ckpt_plugin.core.entry import CacheEntry
from ckpt_plugin.plugins.engine_hooks import EngineHooks
from ckpt_plugin.tiers.protocol import Tier

__all__ = ["EngineStoreEvents"]


class EngineStoreEvents:
    """The engine's answers to a store's :class:`~ckpt_plugin.tiers.store.StoreEvents`.

    :param hooks: The engine's hook caller (``on_cache_alloc``, ``select_cache_victims``, ``on_cache_evict``).
    :param counters: The engine's counters (``cache_saves``, ``cache_evictions``).
    """

    def __init__(self, hooks: EngineHooks, counters: Counters) -> None:
        self.hooks = hooks
        self.counters = counters

    def allow(self, entry: CacheEntry, n_bytes: int) -> bool:
        # A None from every plugin admits the entry.
        return self.hooks.call(self.hooks.hook.on_cache_alloc, namespace=entry.namespace, n_tokens=entry.n_tokens,
                               n_bytes=n_bytes) is not False

    def select_victims(self, entries: Sequence[Any], n_bytes: int, tier: str = Tier.RAM) -> Sequence[Any]:
        return self.hooks.call(self.hooks.hook.select_cache_victims, entries=entries, n_bytes=n_bytes, tier=tier) or []

    def evicted(self, entry: CacheEntry, reason: str) -> None:
        if reason == "budget":
            self.counters.add(cache_evictions=1)
        self.hooks.call(self.hooks.hook.on_cache_evict, entry=entry, reason=reason)

    def admitted(self, entry: CacheEntry) -> None:
        self.counters.add(cache_saves=1)
