"""The tiers a cache entry can live in: their names, and the one way every tier is asked for candidates and offered
entries.

RAM (:class:`~ckpt_plugin.tiers.ram.PromptCache`), disk (:class:`~ckpt_plugin.tiers.disk.DiskTier`) and Redis
(:class:`~ckpt_plugin.tiers.shared.tier.SharedTier`) implement :class:`CacheTier`: ``find(query)`` returns
:class:`~ckpt_plugin.policy.plan.Hit` objects whose ``fetch()`` reads the entry only if the planner picks it (``None`` if
it is gone); ``admit(entry, admission)`` offers an entry, with the owner's veto, victim selection and accounting
behind one :class:`Admission`. The store asks them in order, each with what the faster ones already offer
(``floor``), and offers an entry to each.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

if TYPE_CHECKING:
    import numpy as np

    from ckpt_plugin.core.checkpoint import StateBufferPool
    from ckpt_plugin.core.memory import MemoryKind
    from ckpt_plugin.policy.plan import Hit

__all__ = ["Admission", "CacheTier", "Query", "Tier"]


class Tier(str, enum.Enum):
    """Where an entry lives: a string enum, so ``Tier.RAM == "ram"`` (plans, hooks and JSON views use the names)."""

    RAM = "ram"
    DISK = "disk"
    SHARED = "shared"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Query:
    """What a tier is asked for a prompt.

    :ivar namespace: The cache partition of the request.
    :ivar fingerprint: The model and context states must belong to.
    :ivar prompt: The prompt's tokens.
    :ivar kind: The memory kind (a tier may fetch only what a plan of that kind restores); ``None`` when unknown.
    :ivar limit: Tokens a plan may keep at most (one prompt token is always evaluated).
    :ivar pool: Where a slower tier reads an entry's buffers (the RAM tier's pool: the entry is promoted there).
    :ivar floor: Tokens the faster tiers already offer: a tier may skip what cannot beat it.
    """

    namespace: str
    fingerprint: str
    prompt: np.ndarray
    kind: MemoryKind | None
    limit: int
    pool: StateBufferPool | None = None
    floor: int = 0

    def offering(self, floor: int) -> Query:
        """The same query for a slower tier, with what the faster ones offer."""
        return replace(self, floor=floor)


class Admission(Protocol):
    """What a tier asks of the store that offers it an entry (the owner's hooks and counters stand behind it)."""

    def allow(self, entry: Any, n_bytes: int) -> bool:
        """Whether ``entry`` may add ``n_bytes`` to the tier's entries (``on_cache_alloc``)."""

    def select_victims(self, candidates: Sequence[Any], n_bytes: int, tier: str) -> Sequence[Any]:
        """Victims among ``tier``'s LRU-ordered ``candidates`` for a shortfall of ``n_bytes``
        (``select_cache_victims``)."""

    def evicted(self, entry: Any, reason: str) -> None:
        """``entry`` left the RAM tier: ``"budget"`` or ``"replaced"`` (``on_cache_evict``)."""

    def hold(self, entry: Any) -> Callable[[], None]:
        """Keep ``entry``'s buffers counted against the state budget until the returned release is called (by a tier
        that writes the entry later)."""


class CacheTier(Protocol):
    """A tier the store asks for candidates and offers entries to."""

    def find(self, query: Query) -> list[Hit[Any]]:
        """Candidates for ``query.prompt`` in ``query``'s partition (hits of cache entries), nothing fetched until a
        hit's ``fetch``."""

    def admit(self, entry: Any, admission: Admission) -> bool:
        """Offer ``entry`` (a :class:`~ckpt_plugin.core.entry.CacheEntry`) to the tier, within its budget and through
        ``admission``; return whether the tier holds it now (or will: the shared tier writes behind the response)."""
