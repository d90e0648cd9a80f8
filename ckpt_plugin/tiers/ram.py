"""The prompt cache: states of prompts no longer live in a slot, found by longest common token prefix.

Entries are indexed by a compressed radix tree over token ids (:mod:`ckpt_plugin.tiers.radix`) per (namespace,
fingerprint) partition. Budgets are
in bytes and tokens; bytes are counted once per unique buffer, so entries sharing checkpoints with each other pay for
them once. The byte budget bounds every state byte of the managers that use the cache: its entries, the buffers
slots hold outside it (pinned, see :meth:`PromptCache.pin`) and the recycled mappings of its buffer pool. Eviction is
least-recently-used unless a plugin picks other victims. Entries are immutable: a restore never consumes one, it
stays valid for the next request.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from typing import Any, Callable, Sequence, TypeVar

import numpy as np

from ckpt_plugin.core.checkpoint import StateBuffer, StateBufferPool
from ckpt_plugin.core.entry import DEFAULT_MAX_BYTES, CacheEntry
from ckpt_plugin.policy.eviction import Chooser, evict_until
from ckpt_plugin.policy.plan import Hit
from ckpt_plugin.tiers.radix import RadixIndex
from ckpt_plugin.tiers.protocol import Admission, Query, Tier

__all__ = ["PromptCache", "locked"]

MAX_RECYCLE_BYTES = 64 << 20


def recycle_allowance(max_bytes: int) -> int:
    """Bytes of a budget set aside for freed mappings kept warm for the next capture: 1/16, at most 64 MiB.

    A capture into a recycled mapping costs no page faults; a few buffers' worth is all the steady state needs (each
    eviction frees about what the next capture takes).
    """
    return min(MAX_RECYCLE_BYTES, max_bytes // 16)

Victims = Chooser["CacheEntry"]
"""Picks victims among LRU-ordered entries for a byte shortfall (``select_cache_victims``)."""


_F = TypeVar("_F", bound=Callable[..., Any])


def locked(method: _F) -> _F:
    """Run ``method`` under ``self._lock``: several managers (threads) may share one cache or tier."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


class PromptCache:
    """A RAM prompt cache with byte and token budgets, shared-buffer accounting and LRU eviction.

    Safe to share between threads: every public method runs under the cache's own (reentrant) lock, held only for
    the bookkeeping, never while a model evaluates.

    :param max_bytes: Byte budget for the unique buffers held.
    :param max_tokens: Token budget (sum of entry lengths), ``None`` for none.
    """

    def __init__(
        self, max_bytes: int = DEFAULT_MAX_BYTES, max_tokens: int | None = None, pool: StateBufferPool | None = None
    ) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        if max_tokens is not None and max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0 or None, got {max_tokens}")
        self.max_bytes = max_bytes
        self.max_tokens = max_tokens
        self._owns_pool = pool is None
        self.pool = pool if pool is not None else StateBufferPool(recycle_allowance(max_bytes))
        self._indexes: dict[tuple[str, str], RadixIndex[CacheEntry]] = {}
        self._lru: OrderedDict[int, CacheEntry] = OrderedDict()
        # id(buffer) -> [entry references, pin references, buffer]; holding the buffer keeps its id unique.
        self._buffers: dict[int, list] = {}
        # id(holder) -> (holder, {id(buffer): [buffer, references]})
        self._pins: dict[int, tuple[object, dict[int, list[Any]]]] = {}
        self.resident_bytes = 0
        self.n_tokens = 0
        self._lock = threading.RLock()

    @property
    def entry_budget(self) -> int:
        """Bytes entries and pinned buffers may take: the budget less the pool's allowance for recycled mappings."""
        return max(0, self.max_bytes - self.pool.max_free_bytes)

    @property
    def state_bytes(self) -> int:
        """Every state byte the budget covers now: unique buffers of entries and pins, plus recycled mappings."""
        return self.resident_bytes + self.pool.free_bytes

    def __len__(self) -> int:
        return len(self._lru)

    @locked
    def entries(self, namespace: str | None = None) -> list[CacheEntry]:
        """All entries (of ``namespace`` only, if given), least recently used first."""
        entries = list(self._lru.values())
        return entries if namespace is None else [e for e in entries if e.namespace == namespace]

    def _index(self, namespace: str, fingerprint: str) -> RadixIndex[CacheEntry]:
        key = (namespace, fingerprint)
        index = self._indexes.get(key)
        if index is None:
            index = self._indexes[key] = RadixIndex()
        return index

    @locked
    def new_bytes(self, entry: CacheEntry) -> int:
        """Bytes ``entry`` would add to the budget: its buffers neither an entry nor a pin holds yet."""
        unique = {id(b): b for b in entry.buffers()}
        return sum(int(b.nbytes) for key, b in unique.items() if key not in self._buffers)

    @locked
    def unshared_bytes(self, entry: CacheEntry) -> int:
        """Bytes of ``entry``'s buffers no entry references yet: what the cache takes on by admitting it (a slot
        may hold them already)."""
        unique = {id(b): b for b in entry.buffers()}
        return sum(int(b.nbytes) for key, b in unique.items() if key not in self._buffers or not self._buffers[key][0])

    @locked
    def lookup(
        self, namespace: str, fingerprint: str, prompt: np.ndarray | Sequence[int], max_candidates: int = 8
    ) -> list[tuple[CacheEntry, int]]:
        """Candidate entries for ``prompt`` in one partition (see :meth:`RadixIndex.lookup`)."""
        index = self._indexes.get((namespace, fingerprint))
        if index is None or index.size == 0:
            return []
        return index.lookup(prompt, max_candidates)

    def find(self, query: Query) -> list[Hit[CacheEntry]]:
        """:class:`~ckpt_plugin.tiers.protocol.CacheTier`: the entries :meth:`lookup` finds, as hits."""
        return [Hit(Tier.RAM, n_common, _held(entry))
                for entry, n_common in self.lookup(query.namespace, query.fingerprint, query.prompt)]

    @locked
    def pinned_only_bytes(self) -> int:
        """Bytes of pinned buffers no entry references (what slots hold beyond the cache's entries)."""
        return sum(int(slot[2].nbytes) for slot in self._buffers.values() if slot[0] == 0)

    @locked
    def pin(self, holder: object, buffers: Sequence[StateBuffer],
            select_victims: Victims | None = None) -> list[tuple[CacheEntry, str]]:
        """Count ``buffers`` (replacing what ``holder`` pinned before) against the budget, evicting entries to fit.

        A slot pins the buffers it holds outside the cache (its checkpoints, its last full capture), so the budget
        bounds them too. Pinned buffers are never evicted: if they alone exceed the budget, every entry goes and the
        holder is expected to hold less. Pinning nothing releases the holder. A buffer listed several times is
        counted once and stays pinned until :meth:`pin_changes` has released it as many times.

        :return: The evicted entries, as ``[(entry, "budget"), ...]``.
        """
        held = self._pins.pop(id(holder), (holder, {}))[1]
        fresh: dict[int, list[Any]] = {}
        for buffer in buffers:
            fresh.setdefault(id(buffer), [buffer, 0])[1] += 1
        # A slot re-pins after every change: count only what changed, not every buffer it holds.
        self._count([ref[0] for key, ref in fresh.items() if key not in held], 0, +1, pin=True)
        self._count([ref[0] for key, ref in held.items() if key not in fresh], 0, -1, pin=True)
        if fresh:
            self._pins[id(holder)] = (holder, fresh)
        return self._evict_to_fit(None, select_victims)[1]

    @locked
    def pin_changes(self, holder: object, added: Sequence[StateBuffer], released: Sequence[StateBuffer],
                    select_victims: Victims | None = None) -> list[tuple[CacheEntry, str]]:
        """Pin ``added`` and release ``released`` (one reference each) for ``holder``, evicting entries to fit.

        The same as :meth:`pin` with the holder's whole new list, without walking what did not change: a slot that
        takes a checkpoint and erases one passes those two, not its dozens of others. A released buffer the holder
        does not pin is skipped (a hook may take a checkpoint before the slot re-pinned what it adopted; the next
        :meth:`pin` counts it all again).
        """
        held = self._pins.setdefault(id(holder), (holder, {}))[1]
        pinned = []
        for buffer in added:
            ref = held.get(id(buffer))
            if ref is None:
                held[id(buffer)] = [buffer, 1]
                pinned.append(buffer)
            else:
                ref[1] += 1
        unpinned = []
        for buffer in released:
            ref = held.get(id(buffer))
            if ref is None:
                continue
            ref[1] -= 1
            if ref[1] == 0:
                del held[id(buffer)]
                unpinned.append(buffer)
        if not held:
            del self._pins[id(holder)]
        self._count(pinned, 0, +1, pin=True)
        self._count(unpinned, 0, -1, pin=True)
        return self._evict_to_fit(None, select_victims)[1]

    @locked
    def contains(self, entry: CacheEntry) -> bool:
        """Whether ``entry`` (this very object) is in the cache."""
        return id(entry) in self._lru

    @locked
    def touch(self, entry: CacheEntry) -> None:
        """Mark ``entry`` as just used."""
        if id(entry) in self._lru:
            self._lru.move_to_end(id(entry))
            entry.hits += 1

    @locked
    def insert(
        self,
        entry: CacheEntry,
        admit: Callable[[int], bool] = lambda n_bytes: True,
        select_victims: Victims | None = None,
    ) -> tuple[bool, list[tuple[CacheEntry, str]]]:
        """Add ``entry``, evicting what the budget requires.

        An entry with the same tokens is replaced; entries of the same lineage that are strict prefixes of the new
        one (all their checkpoints are in it) are dropped, since the new entry serves every prompt they serve; so are
        entries it supersedes (:meth:`CacheEntry.superseded_by`: the conversation went on from their last checkpoint
        with other tokens than theirs).

        :param admit: Called with :meth:`unshared_bytes`; ``False`` keeps the entry out.
        :param select_victims: Picks victims among LRU-ordered entries for a byte shortfall (default: LRU order).
        :return: ``(admitted, [(removed entry, reason), ...])``.
        """
        n_bytes = self.unshared_bytes(entry)
        if n_bytes > self.entry_budget or (self.max_tokens is not None and entry.n_tokens > self.max_tokens):
            return False, []
        if not admit(n_bytes):
            return False, []
        fits, removed = self._evict_to_fit(entry, select_victims)
        if not fits:
            return False, removed
        index = self._index(entry.namespace, entry.fingerprint)
        replaced = index.insert(entry)
        if replaced is not None:
            self._forget(replaced)
            removed.append((replaced, "replaced"))
        self._lru[id(entry)] = entry
        self._account(entry, +1)
        mine = {id(c) for c in entry.checkpoints}
        for ancestor in list(index.ancestors(entry)):
            if all(id(c) in mine for c in ancestor.checkpoints):
                self.remove(ancestor)
                removed.append((ancestor, "replaced"))
        for older in [e for e in self._lru.values() if e is not entry and e.superseded_by(entry)]:
            self.remove(older)
            removed.append((older, "replaced"))
        return True, removed

    def admit(self, entry: CacheEntry, admission: Admission) -> bool:
        """:class:`~ckpt_plugin.tiers.protocol.CacheTier`: :meth:`insert` through ``admission``'s veto and victim selection;
        the entries it removed are reported to ``admission.evicted`` (outside the cache's lock)."""
        admitted, removed = self.insert(
            entry, admit=lambda n_bytes: admission.allow(entry, n_bytes),
            select_victims=lambda candidates, n_bytes: admission.select_victims(candidates, n_bytes, Tier.RAM),
        )
        for gone, reason in removed:
            admission.evicted(gone, reason)
        return admitted

    def _evict_to_fit(
        self, entry: CacheEntry | None, select_victims: Victims | None
    ) -> tuple[bool, list[tuple[CacheEntry, str]]]:
        """Evict until ``entry`` (or nothing, for ``None``) fits the budgets; return whether it does and the victims.

        Insertions, pins and budget changes all come here, and through :func:`~ckpt_plugin.policy.eviction.evict_until`
        (the ``select_cache_victims`` selector when one is given).
        """
        n_tokens = entry.n_tokens if entry is not None else 0

        def shortfall() -> int:
            return self.resident_bytes + (self.new_bytes(entry) if entry is not None else 0) - self.entry_budget

        def fits() -> bool:
            return shortfall() <= 0 and not (self.max_tokens is not None and self.n_tokens + n_tokens > self.max_tokens)

        fitted, victims = evict_until(fits, shortfall, lambda: list(self._lru.values()), self.remove, select_victims)
        return fitted, [(victim, "budget") for victim in victims]

    @locked
    def remove(self, entry: CacheEntry) -> None:
        """Drop ``entry`` from the cache (its buffers stay alive for other holders)."""
        if id(entry) not in self._lru:
            return
        self._index(entry.namespace, entry.fingerprint).remove(entry)
        self._forget(entry)

    def _forget(self, entry: CacheEntry) -> None:
        if self._lru.pop(id(entry), None) is not None:
            self._account(entry, -1)

    def _account(self, entry: CacheEntry, sign: int) -> None:
        self._count(list({id(b): b for b in entry.buffers()}.values()), entry.n_tokens, sign, pin=False)

    def _count(self, buffers: Sequence[StateBuffer], n_tokens: int, sign: int, pin: bool) -> None:
        """Add (``sign`` +1) or drop (-1) one holder's references to unique ``buffers``."""
        self.n_tokens += sign * n_tokens
        column = 1 if pin else 0
        for buffer in buffers:
            key = id(buffer)
            slot = self._buffers.get(key)
            if slot is None:
                slot = self._buffers[key] = [0, 0, buffer]
                self.resident_bytes += int(buffer.nbytes)
            slot[column] += sign
            if slot[0] == 0 and slot[1] == 0:
                del self._buffers[key]
                self.resident_bytes -= int(buffer.nbytes)

    @locked
    def clear(self, namespace: str | None = None) -> list[CacheEntry]:
        """Drop every entry (of ``namespace`` only, if given); return them."""
        entries = self.entries(namespace)
        for entry in entries:
            self.remove(entry)
        return entries

    @locked
    def resize(self, max_bytes: int, select_victims: Victims | None = None) -> list[CacheEntry]:
        """Change the byte budget, evicting to fit (through ``select_victims`` if given); return the evicted entries."""
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        if self._owns_pool:
            self.pool.trim(recycle_allowance(max_bytes))
        return [entry for entry, _ in self._evict_to_fit(None, select_victims)[1]]


def _held(entry: CacheEntry) -> Callable[[], CacheEntry]:
    return lambda: entry
