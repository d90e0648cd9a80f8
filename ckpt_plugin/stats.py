"""A manager's counters and the read-only views of its state: ``stats()`` and ``describe()``; what a forget cleared.

Both are safe to call from any thread while the model runs: they read snapshots (lists copied) of the slot and the
cache, never the context.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Iterable, Mapping

if TYPE_CHECKING:
    from .cache import CacheEntry
    from .checkpoint import Checkpoint
    from .manager import CheckpointManager


@dataclass
class Counters:
    """Monotonic counters of a manager (see :func:`manager_stats`)."""

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
    state_size_queries: int = 0
    bytes_captured: int = 0
    bytes_restored: int = 0
    restore_seconds: float = 0.0
    disk_hits: int = 0
    restore_failures: int = 0
    draft_dropped: int = 0
    corrupt_slot_files: int = 0


def manager_stats(manager: CheckpointManager) -> dict[str, Any]:
    """Counters plus memory figures.

    ``resident_bytes`` counts each state buffer held by a slot or the cache once; ``referenced_bytes`` counts it
    once per holder (what a copying cache would hold): their ratio is 1.0 when nothing is duplicated.
    ``state_bytes`` is what the budget (``state_budget_bytes``) bounds: entries, slot pins and recycled mappings.
    ``corrupt_files`` counts the files that failed validation: slot files this manager was asked to restore
    (``corrupt_slot_files``) plus the disk tier's (at its start-up scan and when read); a disk tier shared by
    several managers shows its count under each, as it does ``disk_entries``.
    """
    cache = manager.cache
    slots = [controller.slot for controller in manager.slots]
    checkpoints = [c for slot in slots for c in list(slot.checkpoints)]
    entries = cache.entries()
    unique: dict[int, int] = {}
    referenced = 0
    holders: list[Checkpoint | CacheEntry] = [*checkpoints, *entries]
    for holder in holders:
        for buffer in holder.buffers():
            unique[id(buffer)] = int(buffer.nbytes)
            referenced += int(buffer.nbytes)
    slot_only = cache.pinned_only_bytes()
    out: dict[str, Any] = asdict(manager.counters)
    out.update(
        bytes_copied=manager.counters.bytes_captured + manager.counters.bytes_restored,
        resident_bytes=sum(unique.values()),
        referenced_bytes=referenced,
        slot_only_bytes=slot_only,
        pool_free_bytes=cache.pool.free_bytes,
        state_bytes=cache.state_bytes,
        state_budget_bytes=cache.max_bytes,
        cache_entries=len(entries),
        cache_bytes=cache.resident_bytes - slot_only,
        cache_tokens=cache.n_tokens,
        slot_tokens=sum(slot.n_tokens for slot in slots),
        lineage_tokens=sum(slot.n_lineage for slot in slots),
        slot_checkpoints=len(checkpoints),
        slots=len(slots),
        memory_kind=manager.kind.name,
        disk_entries=len(manager.disk) if manager.disk is not None else 0,
        disk_bytes=manager.disk.resident_bytes if manager.disk is not None else 0,
        corrupt_files=manager.counters.corrupt_slot_files + (manager.disk.corrupt_files if manager.disk is not None
                                                              else 0),
        shared=manager.store.shared.stats() if manager.store.shared is not None else None,
    )
    return out


def describe(manager: CheckpointManager, namespace: str | None = None) -> dict[str, Any]:
    """A JSON-able view of the slots, their checkpoints and the cache entries; of ``namespace`` only, if given (a
    slot is shown only while it holds that namespace's state)."""

    def checkpoint_view(c: Checkpoint) -> dict[str, Any]:
        return {"n_tokens": c.n_tokens, "pos_min": c.pos_min, "pos_max": c.pos_max, "partial": c.partial,
                "bytes": c.nbytes}

    slots = [
        {"id": slot.id, "n_tokens": slot.n_tokens, "namespace": slot.namespace,
         "checkpoints": [checkpoint_view(c) for c in list(slot.checkpoints)]}
        for slot in (controller.slot for controller in manager.slots)
        if namespace is None or slot.namespace == namespace
    ]
    return {
        "fingerprint": manager.fingerprint,
        "memory_kind": manager.kind.name,
        "swa_full": manager.kind.swa_full,
        "slots": slots,
        "cache": [{"namespace": e.namespace, "n_tokens": e.n_tokens, "bytes": e.nbytes, "hits": e.hits,
                   "checkpoints": len(e.checkpoints)} for e in manager.cache.entries(namespace)],
    }


ENTRY_TIERS = ("ram", "disk", "shared")
"""The tiers whose counts of forgotten entries :class:`Cleared` adds up (the slot is not an entry)."""


class Cleared(int):
    """What :meth:`CheckpointManager.clear_cache` forgot: an ``int``, the entries deleted over every tier (an entry
    held in RAM and on disk counts once in each), with the counts per tier in :attr:`tiers`.

    :ivar tiers: ``{"ram": n, "disk": n, "shared": n, "slot": 0 or 1}``: entries of the RAM cache, entry files of the
        disk tier, manifests of the shared tier (``None``: the server could not be cleared, see the log), and
        whether the live slot held that state and was emptied. A tier the manager does not have is left out.
    """

    tiers: dict[str, int | None]

    def __new__(cls, tiers: Mapping[str, int | None]) -> Cleared:
        made = super().__new__(cls, sum(tiers.get(name) or 0 for name in ENTRY_TIERS))
        made.tiers = dict(tiers)
        return made

    @classmethod
    def combine(cls, parts: Iterable[int]) -> Cleared:
        """The sum of several managers' results, tier by tier (``None`` wins: one server not cleared is news).
        Plain ``int`` parts count as RAM entries."""
        tiers: dict[str, int | None] = {}
        for part in parts:
            for name, count in getattr(part, "tiers", {"ram": int(part)}).items():
                if count is None or (name in tiers and tiers[name] is None):
                    tiers[name] = None
                else:
                    tiers[name] = (tiers.get(name) or 0) + count
        return cls(tiers)

    def as_json(self) -> dict[str, Any]:
        """The body of ``DELETE /checkpoints``: ``{"cleared": n, "tiers": {...}}``."""
        return {"cleared": int(self), "tiers": dict(self.tiers)}

    def __repr__(self) -> str:
        return f"Cleared({int(self)}, tiers={self.tiers})"
