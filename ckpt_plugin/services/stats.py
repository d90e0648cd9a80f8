"""Read-only views of an engine's state: ``stats()`` and ``describe()``.

Both are safe to call from any thread while the model runs: they read snapshots (lists copied) of the slots and the
cache, never the context.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ckpt_plugin.core.pages import PAGES

if TYPE_CHECKING:
    from ckpt_plugin.core.entry import CacheEntry
    from ckpt_plugin.core.checkpoint import Checkpoint
    from ckpt_plugin.plugins.view import EngineView

__all__ = ["describe", "manager_stats", "plugin_names"]


def manager_stats(manager: EngineView) -> dict[str, Any]:
    """Counters plus memory figures.

    ``resident_bytes`` counts each state buffer held by a slot or the cache once; ``referenced_bytes`` counts it
    once per holder (what a copying cache would hold): their ratio, ``sharing_ratio``, is 1.0 when nothing is shared.
    ``live_pages`` and ``live_page_bytes`` count the pages of every paged state of the process (all engines).
    ``state_bytes`` is what the budget (``state_budget_bytes``) bounds: entries, slot pins and recycled mappings.
    ``corrupt_files`` counts the files that failed validation: slot files this manager was asked to restore
    (``corrupt_slot_files``) plus the disk tier's (at its start-up scan and when read); a disk tier shared by
    several managers shows its count under each, as it does ``disk_entries``.
    ``costs`` holds the measured rates (seconds per evaluated token by batch size, each tier's fixed cost and
    bandwidth) and the plans' estimated and actual times (:meth:`ckpt_plugin.policy.costs.CostModel.snapshot`).
    ``plugins`` names the plugins registered (:func:`plugin_names`). docs/server.md, "Stats fields", describes every
    field.
    """
    cache = manager.cache
    slots = [controller.slot for controller in manager.controllers]
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
    out: dict[str, Any] = manager.counters.snapshot()  # one instant: slots count from their own threads
    out.update(
        bytes_copied=out["bytes_captured"] + out["bytes_restored"],
        resident_bytes=sum(unique.values()),
        referenced_bytes=referenced,
        sharing_ratio=round(referenced / max(1, sum(unique.values())), 3),
        live_pages=len(PAGES),
        live_page_bytes=PAGES.unique_bytes,
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
        corrupt_files=out["corrupt_slot_files"] + (manager.disk.corrupt_files if manager.disk is not None else 0),
        shared=manager.store.shared.stats() if manager.store.shared is not None else None,
        costs=manager.rules.costs.snapshot(),
        plugins=plugin_names(manager.plugins),
    )
    return out


def plugin_names(plugins: Any) -> list[str]:
    """The plugins registered with a pluggy plugin manager, sorted: each by the name it was registered under, or by
    its class (``module.Class``) where it was registered without one (pluggy then names it by its ``id()``)."""
    names = []
    for name, plugin in plugins.list_name_plugin():
        if plugin is None:  # blocked names
            continue
        if name == str(id(plugin)):
            name = f"{type(plugin).__module__}.{type(plugin).__qualname__}"
        names.append(name)
    return sorted(names)


def describe(manager: EngineView, namespace: str | None = None) -> dict[str, Any]:
    """A JSON-able view of the slots, their checkpoints and the cache entries; of ``namespace`` only, if given (a
    slot is shown only while it holds that namespace's state)."""

    def checkpoint_view(c: Checkpoint) -> dict[str, Any]:
        return {"n_tokens": c.n_tokens, "pos_min": c.pos_min, "pos_max": c.pos_max, "partial": c.partial,
                "bytes": c.nbytes}

    slots = [
        {"id": slot.id, "n_tokens": slot.n_tokens, "namespace": slot.namespace,
         "checkpoints": [checkpoint_view(c) for c in list(slot.checkpoints)]}
        for slot in (controller.slot for controller in manager.controllers)
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


