"""Where the tiers' costs are measured: a plan's lookups and fetches, timed into the engine's
:class:`~ckpt_plugin.policy.costs.CostModel`.

The store asks each tier through :meth:`CostProbe.find` when a probe is given (``TieredStore.lookup``): a shared-tier
lookup is a round trip or two to the server, which prices the fixed cost of a fetch before any fetch is made; each
hit of a slower tier gets a ``fetch`` that times itself and reports the bytes it moved. RAM hits are handed through
untouched (their fetch is a reference).

With rates, the shared tier is not even asked when the lookup's own round trips would cost more than
:data:`~ckpt_plugin.policy.costs.LOOKUP_SHARE` of evaluating what the live memory and the local tiers leave (an answer that
turns out useless must not make the request noticeably slower than it is without the tier), nor when its best
possible answer (every prompt token but one, in one fetch, after those round trips) would be clearly slower than that
evaluation: on a far server the round trips alone cost more than a short suffix's evaluation.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from ckpt_plugin.policy.costs import LOCAL_TIERS, LOOKUP_SHARE, MIN_SAVING, RAM, SHARED, CostModel, Rates, clearly_cheaper
from ckpt_plugin.core.memory import MemoryKind
from ckpt_plugin.policy.plan import LiveMemory, best_reuse, keep_limit

if TYPE_CHECKING:
    from ckpt_plugin.policy.plan import Hit
    from ckpt_plugin.tiers.protocol import CacheTier, Query

__all__ = ["CostProbe", "live_keep"]

LOOKUP_ROUND_TRIPS = 2
"""Round trips of a shared-tier lookup that finds something: the index keys, then the manifests."""


def live_keep(kind: MemoryKind, live: LiveMemory, prompt: np.ndarray, max_keep: int | None) -> int:
    """Prompt tokens the live memory alone can keep (as the planner rates it)."""
    limit = keep_limit(len(prompt), max_keep)
    return best_reuse(kind, live.lineage, live.n_tokens, live.pos_min, live.checkpoints, prompt, limit).n_keep


def _trips_and_bytes(tier: Any) -> tuple[int, int] | None:
    """A tier's request-path round trips and bytes read so far, if it counts them (the shared tier does)."""
    counters = getattr(tier, "counters", None)
    trips, read = getattr(counters, "round_trips", None), getattr(counters, "bytes_read", None)
    return (trips, read) if isinstance(trips, int) and isinstance(read, int) else None


class CostProbe:
    """Times one plan's tier lookups and fetches.

    :param costs: Where the measurements go.
    :param rates: The plan's rates (``None``: every tier is asked, as without rates).
    :param n_prompt: The prompt's length.
    :param local_keep: Returns the tokens the live memory can keep (asked only when a slow tier may be skipped).
    :ivar fetch_seconds: Seconds the plan's fetches took (part of what the plan's time is compared with).
    """

    def __init__(self, costs: CostModel, rates: Rates | None = None, n_prompt: int = 0,
                 local_keep: Callable[[], int] = lambda: 0) -> None:
        self.costs = costs
        self.rates = rates
        self.n_prompt = n_prompt
        self.local_keep = local_keep
        self.fetch_seconds = 0.0

    def lookup_pays(self, query: Query) -> bool:
        """Whether the shared tier's best answer to ``query`` could be worth its round trips (see the module)."""
        rates = self.rates
        if rates is None:
            return True
        local = max(query.floor, self.local_keep())
        without = rates.eval_seconds(self.n_prompt - local)
        if rates.transfer_seconds(SHARED, 0, operations=LOOKUP_ROUND_TRIPS) > max(MIN_SAVING, LOOKUP_SHARE * without):
            return False
        size = rates.state_bytes(query.limit)
        best = (rates.eval_seconds(self.n_prompt - query.limit) + rates.transfer_seconds(RAM, size)
                + rates.transfer_seconds(SHARED, size, operations=LOOKUP_ROUND_TRIPS + 1))
        return not clearly_cheaper(best, without)

    def find(self, name: str, tier: CacheTier, query: Query) -> list[Hit[Any]]:
        """``tier.find(query)``, its round trips measured, its hits' fetches timed (``name``: the tier's name)."""
        if name in LOCAL_TIERS:
            return tier.find(query)
        if name == SHARED and not self.lookup_pays(query):
            self.costs.skipped_lookup()
            return []
        before = _trips_and_bytes(tier)
        started = time.perf_counter()
        hits = tier.find(query)
        seconds = time.perf_counter() - started
        after = _trips_and_bytes(tier)
        if name == SHARED and before is not None and after is not None and after[0] > before[0]:
            # Index keys and manifests are small: the lookup's time per round trip is the server's fixed cost.
            self.costs.observe_transfer(name, 0, seconds, after[0] - before[0])
        return [replace(hit, fetch=self._timed(name, tier, hit.fetch)) for hit in hits]

    def _timed(self, name: str, tier: CacheTier, fetch: Callable[[], Any]) -> Callable[[], Any]:
        def timed() -> Any:
            before = _trips_and_bytes(tier)
            started = time.perf_counter()
            candidate = fetch()
            seconds = time.perf_counter() - started
            self.fetch_seconds += seconds
            if candidate is None:
                return None
            after = _trips_and_bytes(tier)
            if before is not None and after is not None:
                trips, n_bytes = after[0] - before[0], after[1] - before[1]
                if trips > 0:  # none when every blob was already held here: nothing was moved
                    self.costs.observe_transfer(name, n_bytes, seconds, trips)
            else:
                self.costs.observe_transfer(name, int(getattr(candidate, "nbytes", 0)), seconds)
            return candidate

        return timed
