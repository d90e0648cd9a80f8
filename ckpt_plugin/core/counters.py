"""An engine's counters, and what a forget cleared: plain data, shared by the engine and its services."""

from __future__ import annotations

import threading
from dataclasses import dataclass, fields
from typing import Any, Iterable, Mapping

__all__ = ["Cleared", "Counters", "REUSE_SOURCES", "TIER_SOURCES"]


@dataclass
class Counters:
    """Monotonic counters of a manager (see :func:`manager_stats`).

    Every slot of an engine counts here from its own thread: ``counters.x += n`` reads and writes in two steps and
    loses counts when two threads interleave, so updates go through :meth:`add` (one lock for all the fields), and
    :meth:`snapshot` reads every field under the same lock (a view in which related counters agree). Reading one
    field alone needs no lock.
    """

    prompts: int = 0
    prompt_tokens: int = 0
    tokens_evaluated: int = 0
    tokens_reused: int = 0
    # tokens_reused by where they came from (REUSE_SOURCES): they add up to it.
    tokens_reused_from_slot: int = 0
    tokens_reused_from_cache: int = 0
    tokens_reused_from_disk: int = 0
    tokens_reused_from_shared: int = 0
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
    stood_aside: int = 0
    outside_writes_dropped: int = 0
    # Prefixes a slot took over from another live sequence's cells (llama_memory_seq_cp in a unified KV cache), and
    # their tokens: cells held once for both (tokens_reused counts them too, from the source "slot").
    kv_shares: int = 0
    tokens_shared: int = 0
    # Generations that waited for another slot to evaluate the new prefix they share, instead of evaluating it too.
    prefix_waits: int = 0
    # Media chunks (an image, an audio clip) a multimodal projector encoded and the model decoded, and their
    # positions (in tokens_evaluated too): a follow-up about an image the memory or a store holds adds none.
    media_chunks: int = 0
    media_positions: int = 0
    # Pages of captured states: copied out of a capture (a run of cells no stored state held yet), or referenced
    # where a live state held them already; captures kept whole (a layout the pager does not know, or no cells).
    pages_stored: int = 0
    pages_shared: int = 0
    page_bytes_stored: int = 0
    page_bytes_shared: int = 0
    states_kept_whole: int = 0

    def __post_init__(self) -> None:
        # An attribute, not a field: fields(), asdict() and == see only the counts.
        self._lock = threading.Lock()

    def add(self, **amounts: float) -> None:
        """Add each amount to the counter of that name, atomically with respect to every other :meth:`add`.

        :raises AttributeError: A name is not a counter (nothing is added).
        """
        with self._lock:
            updated = [(name, getattr(self, name) + amount) for name, amount in amounts.items()]
            for name, value in updated:
                setattr(self, name, value)

    def snapshot(self) -> dict[str, Any]:
        """Every counter, read at one instant (no :meth:`add` half-way)."""
        with self._lock:
            return {counter.name: getattr(self, counter.name) for counter in fields(self)}


REUSE_SOURCES = ("slot", "cache", "disk", "shared")
"""Where reused prompt tokens come from: the slot's own memory and checkpoints, the RAM prompt cache (entries of
conversations that left the slot, the host's own cache included), the disk tier and the shared tier; each has a
``tokens_reused_from_<source>`` counter."""

TIER_SOURCES = {"ram": "cache", "disk": "disk", "shared": "shared"}
"""The reuse source of an entry by the tier a plan found it in."""


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
