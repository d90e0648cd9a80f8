"""The prompt cache's tiers behind one interface: RAM in front of disk (and of a shared tier, when there is one).

The store is where entries are found, admitted, promoted and evicted, and where their bytes are counted; the
manager decides what to ask for (see :func:`ckpt_plugin.policy.plan.plan_prompt`) and the store's events tell the
engine what happened. Several managers may share the tiers (one host cache object, several Llamas); each has its own store
object over them, with its own events.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

import numpy as np

from ckpt_plugin.core.entry import CacheEntry
from ckpt_plugin.tiers.ram import PromptCache
from ckpt_plugin.core.checkpoint import StateBuffer
from ckpt_plugin.tiers.disk import DiskTier
from ckpt_plugin.core.memory import MemoryKind
from ckpt_plugin.policy.plan import Hit, keep_limit
from ckpt_plugin.tiers.protocol import CacheTier, Query, Tier

if TYPE_CHECKING:
    from ckpt_plugin.tiers.cost_probes import CostProbe
    from ckpt_plugin.tiers.shared.tier import SharedTier

__all__ = ["StoreEvents", "TieredStore"]


class StoreEvents(Protocol):
    """What the store asks of, and tells, the engine that owns it: its hooks and counters
    (:class:`~ckpt_plugin.engine.store_events.EngineStoreEvents`), never the manager itself."""

    def allow(self, entry: CacheEntry, n_bytes: int) -> bool:
        """Whether ``entry`` may enter RAM, adding ``n_bytes`` to its entries (``on_cache_alloc``)."""

    def select_victims(self, entries: Sequence[Any], n_bytes: int, tier: str = Tier.RAM) -> Sequence[Any]:
        """Victims among LRU-ordered ``entries`` of ``tier`` for a shortfall of ``n_bytes``
        (``select_cache_victims``)."""

    def evicted(self, entry: CacheEntry, reason: str) -> None:
        """``entry`` left RAM: ``"budget"``, ``"replaced"`` or ``"cleared"`` (``on_cache_evict``)."""

    def admitted(self, entry: CacheEntry) -> None:
        """``entry`` entered RAM."""


class TieredStore:
    """RAM (a :class:`~ckpt_plugin.tiers.ram.PromptCache`), an optional :class:`~ckpt_plugin.tiers.disk.DiskTier` and an
    optional :class:`~ckpt_plugin.tiers.shared.tier.SharedTier`.

    :param ram: The RAM tier, which holds the byte budget of every state byte (see ``PromptCache.pin``).
    :param disk: The disk tier, written through on admission and read back into buffers of the RAM tier's pool.
    :param events: The owner's admission, victim selection and eviction callbacks.
    :param shared: The shared tier (Redis), written behind on admission and on :meth:`publish`.

    Every tier admits through one signature (:meth:`~ckpt_plugin.tiers.protocol.CacheTier.admit`), with the store as the
    :class:`~ckpt_plugin.tiers.protocol.Admission`: the owner's veto and victim selection, evictions reported, buffers held
    while a tier writes them later.
    """

    def __init__(self, ram: PromptCache, disk: DiskTier | None, events: StoreEvents,
                 shared: SharedTier | None = None) -> None:
        self.ram = ram
        self.disk = disk
        self.events = events
        self.shared = shared

    def lookup(self, namespace: str, fingerprint: str, prompt: np.ndarray, kind: MemoryKind | None = None,
               max_keep: int | None = None, probe: CostProbe | None = None) -> list[Hit[CacheEntry]]:
        """Candidates for ``prompt`` in every tier, RAM first; nothing is fetched (read) until a hit's ``fetch``.

        The shared tier is asked only with the memory ``kind`` (its fetch brings only what a plan of that kind
        restores), and only for prefixes longer than the local tiers hold (``max_keep`` as for the planner).
        With a ``probe``, the tiers are asked through it (their round trips and fetches are timed).
        """
        limit = keep_limit(len(prompt), max_keep)
        query = Query(namespace, fingerprint, prompt, kind, limit, self.ram.pool)
        hits: list[Hit[CacheEntry]] = []
        for tier in self.tiers():
            offered = min(max((hit.n_common for hit in hits), default=0), limit)
            asked = query.offering(offered)
            hits += tier.find(asked) if probe is None else probe.find(self.tier_name(tier), tier, asked)
        return hits

    @property
    def in_memory(self) -> bool:
        """Whether every tier is this process's memory: no lookup, read or write waits on a disk or the network."""
        return self.disk is None and self.shared is None

    def tier_name(self, tier: CacheTier) -> Tier:
        """The name of one of the store's tiers."""
        return Tier.RAM if tier is self.ram else Tier.DISK if tier is self.disk else Tier.SHARED

    def tiers(self) -> list[CacheTier]:
        """The tiers present, fastest first: RAM, disk, shared."""
        return [tier for tier in (self.ram, self.disk, self.shared) if tier is not None]

    def admit(self, entry: CacheEntry, write_through: bool = True) -> bool:
        """Offer ``entry`` to RAM (through the owner's admission and victim selection; evictions are reported), and
        write it through to the disk tier; return whether a tier holds it."""
        admitted = self.ram.admit(entry, self)
        if admitted:
            self.events.admitted(entry)
        if self.disk is not None and write_through:
            admitted = self.disk.admit(entry, self) or admitted
        if write_through:
            self.publish(entry)
        return admitted

    def promote(self, entry: CacheEntry, tier: str = Tier.DISK) -> bool:
        """Bring an entry fetched from a lower tier into RAM, through the same admission as any entry (the buffers
        it was read or fetched into are its buffers: nothing is copied again)."""
        if tier == Tier.SHARED and self.shared is not None:
            self.shared.count_hit()
        return self.admit(entry, write_through=False)

    def publish(self, entry: CacheEntry) -> bool:
        """Queue ``entry`` for the shared tier; its buffers count against the budget until written (pinned)."""
        return self.shared is not None and self.shared.admit(entry, self)

    # the Admission every tier admits through (see ckpt_plugin.tiers.protocol.Admission)

    def allow(self, entry: CacheEntry, n_bytes: int) -> bool:
        return self.events.allow(entry, n_bytes)

    def select_victims(self, candidates: Sequence[Any], n_bytes: int, tier: str) -> Sequence[Any]:
        return self.events.select_victims(candidates, n_bytes, tier)

    def evicted(self, entry: CacheEntry, reason: str) -> None:
        self.events.evicted(entry, reason)

    def hold(self, entry: CacheEntry) -> Callable[[], None]:
        ticket = _Queued()
        # The pin is released where it was made, even if the store moves to another RAM tier meanwhile.
        ram = self.ram
        self._report(ram.pin(ticket, list(entry.buffers()), self.events.select_victims))
        return lambda: ram.pin(ticket, ())

    def touch(self, entry: CacheEntry) -> None:
        """Mark ``entry`` as just used."""
        self.ram.touch(entry)

    def contains(self, entry: CacheEntry) -> bool:
        """Whether RAM holds ``entry`` (this very object)."""
        return self.ram.contains(entry)

    def pin(self, holder: object, buffers: Sequence[StateBuffer]) -> None:
        """Count ``holder``'s buffers against the budget (see ``PromptCache.pin``); evictions are reported."""
        self._report(self.ram.pin(holder, buffers, self.events.select_victims))

    def pin_changes(self, holder: object, added: Sequence[StateBuffer], released: Sequence[StateBuffer]) -> None:
        """Pin ``added`` and release ``released`` for ``holder`` (see ``PromptCache.pin_changes``)."""
        self._report(self.ram.pin_changes(holder, added, released, self.events.select_victims))

    def resize(self, max_bytes: int) -> None:
        """Change the RAM budget, evicting through the owner's victim selection."""
        for entry in self.ram.resize(max_bytes, self.events.select_victims):
            self.events.evicted(entry, "budget")

    def clear(self, namespace: str | None = None) -> int:
        """Drop every RAM entry (of ``namespace`` only, if given); return how many there were."""
        entries = self.ram.clear(namespace)
        for entry in entries:
            self.events.evicted(entry, "cleared")
        return len(entries)

    def forget(self, namespace: str | None, fingerprint: str) -> dict[str, int | None]:
        """Delete ``namespace``'s entries (every entry, for ``None``) from every tier: RAM, the disk tier's files of
        that namespace, and the shared tier's partition of that namespace and model ``fingerprint``; return the
        count per tier (``{"ram": n, "disk": n, "shared": n}``, tiers present only; ``None`` for a shared tier
        whose server could not be cleared)."""
        tiers: dict[str, int | None] = {Tier.RAM.value: self.clear(namespace)}
        if self.disk is not None:
            tiers[Tier.DISK.value] = self.disk.clear(namespace)
        if self.shared is not None:
            tiers[Tier.SHARED.value] = self.shared.forget(namespace, fingerprint)
        return tiers

    def _report(self, removed: list[tuple[CacheEntry, str]]) -> None:
        for entry, reason in removed:
            self.events.evicted(entry, reason)


class _Queued:
    """Holds the pin of an entry waiting for the shared tier's write-behind thread."""
