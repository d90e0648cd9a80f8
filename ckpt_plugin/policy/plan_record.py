"""The record of plans carried out: each plan's estimated time against what it took (:class:`PlanRecord`), the check
of the rates an engine plans by (:class:`~ckpt_plugin.policy.costs.CostModel`).

A slot times its prompt against its plan's estimate (:class:`PlanClock`), from the lookup's fetches to the decode
call that finishes the prompt, then adds it here: counts, the histogram of actual / estimated time, the latest plans.
"""

from __future__ import annotations

import bisect
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

__all__ = ["PlanClock", "PlanRecord", "RATIO_BUCKETS", "RECENT_PLANS"]

RATIO_BUCKETS: tuple[float, ...] = (0.25, 0.5, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0)
"""Upper bounds of the histogram of actual / estimated plan time."""
RECENT_PLANS = 16
"""Plans whose estimate and outcome :meth:`PlanRecord.snapshot` lists."""


@dataclass(kw_only=True)
class PlanClock:
    """One prompt's plan while it is carried out: its estimate and the time it has taken so far.

    :ivar estimated: The plan's estimated seconds (fetch, restore, evaluation of the rest of the prompt).
    :ivar prompt_end: The prompt's length: the plan is done once the slot holds that many tokens.
    :ivar n_keep: Prompt tokens the plan kept.
    :ivar most_tokens: Prompt tokens the plan keeping the most would have kept.
    :ivar tier: Where its entry came from (``None``: the live memory).
    :ivar by_cost: It keeps fewer tokens than it could because that is clearly faster.
    :ivar fetches_skipped: Candidates of slower tiers it did not fetch (they could not be faster).
    :ivar seconds: Measured so far: the lookup's fetches, the restore, the prompt's decode calls.
    """

    estimated: float
    prompt_end: int
    n_keep: int
    most_tokens: int
    tier: str | None
    by_cost: bool
    fetches_skipped: int = 0
    seconds: float = 0.0

    def outcome(self) -> dict[str, Any]:
        """A JSON-able record of the plan and what it took."""
        ratio = self.seconds / self.estimated if self.estimated > 0 else None
        return {"estimated_seconds": self.estimated, "actual_seconds": self.seconds, "ratio": ratio,
                "n_keep": self.n_keep, "most_tokens": self.most_tokens, "evaluated": self.prompt_end - self.n_keep,
                "tier": None if self.tier is None else str(self.tier), "by_cost": self.by_cost}


class PlanRecord:
    """The plans an engine carried out, each estimate against what it took; thread-safe (slots add from their own
    threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.plans = 0
        self.plans_by_cost = 0
        self.tokens_recomputed = 0
        self.fetches_skipped = 0
        self.estimated_seconds = 0.0
        self.actual_seconds = 0.0
        self._ratio_counts = [0] * (len(RATIO_BUCKETS) + 1)
        self._ratio_sum = 0.0
        self._recent: deque[dict[str, Any]] = deque(maxlen=RECENT_PLANS)

    def add(self, clock: PlanClock) -> None:
        """A plan was carried out (``clock`` holds its estimate and what it took)."""
        with self._lock:
            self.plans += 1
            self.fetches_skipped += clock.fetches_skipped
            if clock.by_cost:
                self.plans_by_cost += 1
                self.tokens_recomputed += max(0, clock.most_tokens - clock.n_keep)
            self.estimated_seconds += clock.estimated
            self.actual_seconds += clock.seconds
            if clock.estimated > 0:
                ratio = clock.seconds / clock.estimated
                self._ratio_counts[bisect.bisect_left(RATIO_BUCKETS, ratio)] += 1
                self._ratio_sum += ratio
            self._recent.append(clock.outcome())

    def ratio_histogram(self) -> tuple[list[tuple[float, int]], int, float]:
        """``([(upper bound, cumulative count), ...], count, sum)`` of actual / estimated plan time (the last bound
        is ``inf``)."""
        with self._lock:
            counts, total = list(self._ratio_counts), self._ratio_sum
        cumulative, running = [], 0
        for bound, count in zip((*RATIO_BUCKETS, float("inf")), counts):
            running += count
            cumulative.append((bound, running))
        return cumulative, running, total

    def snapshot(self) -> dict[str, Any]:
        """A JSON-able view: the plans' counts and totals, the histogram of actual / estimated time and the latest
        plans."""
        with self._lock:
            view: dict[str, Any] = {
                "plans": self.plans,
                "plans_by_cost": self.plans_by_cost,
                "tokens_recomputed_by_cost": self.tokens_recomputed,
                "fetches_skipped_by_cost": self.fetches_skipped,
                "estimated_seconds": self.estimated_seconds,
                "actual_seconds": self.actual_seconds,
                "recent_plans": list(self._recent),
            }
        buckets, count, total = self.ratio_histogram()
        view["time_ratio"] = {"buckets": [["+Inf" if b == float("inf") else b, c] for b, c in buckets],
                              "count": count, "sum": total}
        return view
