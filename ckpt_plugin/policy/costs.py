"""What evaluating tokens and copying states cost on this machine: the rates plans and captures are weighed by.

Two parts, both without llama.cpp or a clock:

- :class:`Rates`: an immutable table of estimates (seconds per evaluated token by batch size, and per tier a fixed
  cost per operation plus bytes per second). The planner (:func:`ckpt_plugin.policy.plan.plan_prompt`) and the checkpoint
  schedule (:mod:`ckpt_plugin.policy.schedule`) are pure functions of a prompt, its candidates and a ``Rates``.
- :class:`CostModel`: an engine's learner. The engine reports what it measured (a decode, a restore, a capture, a
  tier's round trip or fetch); the model keeps the rates as exponentially weighted moving averages and hands out a
  ``Rates`` snapshot. Its record of plans, estimated against actual time, is
  :class:`~ckpt_plugin.policy.plan_record.PlanRecord`.

Calibration. An engine starts from :data:`DEFAULT_RATES`, which are CPU-like (evaluation far dearer than copying,
so a fresh engine plans exactly as one that keeps the most tokens), and the first observation of each rate replaces
its default (a fixed cost, once measured :data:`LATENCY_SAMPLES` times). No calibration runs at attach: a decode
there would write into the host's context and cost a decode call, while every engine's first prompt evaluates tokens
before any plan can restore what it evaluated. The shared tier's round trip is measured by every lookup, which comes
before the fetch it prices. So calibrating costs nothing.

Robustness. A stall of the machine (another process, a page fault storm) only ever makes an operation slower, so:
fixed costs are the smallest of the recent measurements, not an average; bandwidths are learned only from transfers
of at least :data:`MIN_RATE_BYTES` (below that, call overheads dominate and the ratio says nothing about the link);
and a plan gives up tokens for time only when the saving is clear (:func:`clearly_cheaper`).
"""

from __future__ import annotations

import bisect
import threading
from collections import deque
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Mapping

from ckpt_plugin.policy.plan_record import PlanRecord

__all__ = [
    "CostModel",
    "DEFAULT_RATES",
    "EVAL_BUCKETS",
    "LOCAL_TIERS",
    "LOOKUP_SHARE",
    "MIN_RATE_BYTES",
    "MIN_SAVING",
    "RAM",
    "Rates",
    "SHARED",
    "TransferRate",
    "clearly_cheaper",
    "option_seconds",
    "with_transfer",
]

RAM = "ram"
"""Restoring a state into the context from host memory (every restore pays it: live or RAM checkpoints, entries)."""
DISK = "disk"
"""Reading an entry from the disk tier into host memory (then restored like a RAM entry)."""
SHARED = "shared"
"""Fetching an entry from the shared tier (Redis) into host memory (then restored like a RAM entry)."""
CAPTURE = "capture"
"""Copying a state out of the context into host memory (a checkpoint, a full capture)."""
LOCAL_TIERS = (RAM,)
"""Tiers whose candidates cost nothing to fetch (their entries are held in memory)."""

EVAL_BUCKETS: tuple[int, ...] = (1, 2, 8, 32, 128, 512)
"""Lower bounds of the batch sizes whose per-token evaluation time is learned apart: a lone token pays a whole decode
call's overhead, a 512-token batch shares it. Each measured bucket is a point (its average batch size, its seconds
per token) of :attr:`Rates.eval_points`; between points the time is interpolated, so a bucket never measured is
priced from its measured neighbours' times, never from one's per-token rate multiplied out."""
MIN_SAVING = 0.002
"""Seconds a plan must save before it keeps fewer tokens than it could (estimates are noisy; below this nobody waits
noticeably)."""
MARGIN = 0.05
"""Fraction of the most-tokens plan's time a cheaper plan must save as well (plans within 5% of each other are
alike: the one keeping the most tokens is kept)."""
LOOKUP_SHARE = 0.05
"""Fraction of a request's time (evaluating what the live memory and the local tiers leave) a lookup of the shared
tier may cost, or :data:`MIN_SAVING`: a lookup that finds nothing usable then makes the request at most that much
slower than it would be without the tier."""
ALPHA = 0.25
"""Weight of a new observation in the moving averages (the last ~4 observations dominate)."""
LATENCY_WINDOW = 32
"""Recent fixed-cost measurements whose smallest is the fixed cost."""
LATENCY_SAMPLES = 3
"""Measurements a fixed cost needs before it replaces its default: a connection's first command pays its handshake
(a new Redis connection's first lookup took three round trips through a far link), and a single stalled measurement
is no fixed cost either."""
MIN_RATE_BYTES = 1 << 20
"""Smallest transfer a bandwidth is learned from."""


def clearly_cheaper(most_tokens_seconds: float, cheaper_seconds: float) -> bool:
    """Whether a plan estimated at ``cheaper_seconds`` is worth choosing over the plan that keeps the most tokens,
    estimated at ``most_tokens_seconds``: it must save :data:`MIN_SAVING` and :data:`MARGIN` of that time."""
    return most_tokens_seconds - cheaper_seconds > max(MIN_SAVING, MARGIN * most_tokens_seconds)


@dataclass(frozen=True, slots=True)
class TransferRate:
    """The cost of moving state bytes one way: ``latency`` seconds per operation plus ``bandwidth`` bytes a second.

    :ivar latency: Seconds of one operation whatever its size (a call into llama.cpp, a round trip to Redis).
    :ivar bandwidth: Bytes per second once moving.
    """

    latency: float
    bandwidth: float

    def seconds(self, n_bytes: int, operations: int = 1) -> float:
        """Estimated seconds to move ``n_bytes`` in ``operations`` operations."""
        return operations * self.latency + max(n_bytes, 0) / max(self.bandwidth, 1.0)


DEFAULT_EVAL_SECONDS = 1e-3
"""Seconds per token before anything is measured: a small model on a few CPU cores (Gemma-3-270M: 1.7 ms)."""
DEFAULT_TRANSFERS: Mapping[str, TransferRate] = MappingProxyType({
    RAM: TransferRate(20e-6, 5e9),
    DISK: TransferRate(100e-6, 2e9),
    SHARED: TransferRate(0.5e-3, 100e6),
    CAPTURE: TransferRate(20e-6, 5e9),
})
"""Transfer rates before anything is measured: host memory, a page-cached file, a server on a shared 1 Gb/s network
(a pessimistic bandwidth: a fetch is made anyway when it saves many tokens, and measured then; an optimistic one
would make the first fetch of a short prefix slower than evaluating it)."""


@dataclass(frozen=True)
class Rates:
    """What evaluating and copying cost, as the planner and the schedule see them (immutable).

    :ivar eval_points: ``(batch size, seconds per token at that size)`` by increasing size (see
        :meth:`eval_seconds`).
    :ivar transfers: Per tier name (:data:`RAM`, :data:`DISK`, :data:`SHARED`, :data:`CAPTURE`).
    :ivar full_bytes_per_token: Bytes per token of a full state (0: unknown), to price a candidate not yet fetched.
    :ivar partial_bytes: Bytes of a partial checkpoint (0: unknown), to price a capture before it is taken.
    """

    eval_points: tuple[tuple[float, float], ...] = ((1.0, DEFAULT_EVAL_SECONDS),)
    transfers: Mapping[str, TransferRate] = field(default_factory=lambda: DEFAULT_TRANSFERS)
    full_bytes_per_token: float = 0.0
    partial_bytes: int = 0

    @classmethod
    def flat(cls, seconds_per_token: float, latency: float, bandwidth: float, *, full_bytes_per_token: float = 0.0,
             partial_bytes: int = 0) -> Rates:
        """The same evaluation rate at every batch size and the same transfer rate for every tier."""
        transfer = TransferRate(latency, bandwidth)
        return cls(((1.0, seconds_per_token),),
                   MappingProxyType({name: transfer for name in (RAM, DISK, SHARED, CAPTURE)}),
                   full_bytes_per_token, partial_bytes)

    def eval_seconds(self, n_tokens: int) -> float:
        """Estimated seconds to evaluate ``n_tokens`` tokens.

        Each point prices a batch of its size; between points the time is interpolated (from nothing for nothing),
        past the largest it grows at that point's rate. Never less than for fewer tokens: where a bigger batch's time
        comes out below a smaller one's (a lone token pays a decode call's whole overhead), the smaller one's holds.
        """
        if n_tokens <= 0:
            return 0.0
        previous_size, previous_time = 0.0, 0.0
        for size, per_token in self.eval_points:
            seconds = max(size * per_token, previous_time)
            if n_tokens <= size:
                return previous_time + (seconds - previous_time) * (n_tokens - previous_size) / (size - previous_size)
            previous_size, previous_time = size, seconds
        return previous_time + (n_tokens - previous_size) * self.eval_points[-1][1]

    def transfer_seconds(self, tier: str, n_bytes: int, operations: int = 1) -> float:
        """Estimated seconds to move ``n_bytes`` through ``tier`` (:data:`DEFAULT_TRANSFERS` for an unknown name)."""
        rate = self.transfers.get(tier) or DEFAULT_TRANSFERS.get(tier) or DEFAULT_TRANSFERS[SHARED]
        return rate.seconds(n_bytes, operations)

    def state_bytes(self, n_tokens: int) -> int:
        """Estimated bytes of a full state of ``n_tokens`` tokens (0 while unknown: a candidate is then priced by
        its fixed costs only, so it is fetched, and its size is known from then on)."""
        return int(self.full_bytes_per_token * max(n_tokens, 0))

    def capture_pays(self, n_saved: int) -> bool:
        """Whether a checkpoint is worth its copy: taking it and restoring it once costs less than evaluating the
        ``n_saved`` tokens it saves the prompt that restores it (against the restore point below it), unless the
        difference is below :data:`MIN_SAVING`."""
        size = self.partial_bytes
        cost = self.transfer_seconds(CAPTURE, size) + self.transfer_seconds(RAM, size)
        return cost - self.eval_seconds(n_saved) <= MIN_SAVING


DEFAULT_RATES = Rates()
"""CPU-like rates: evaluating a token costs more than copying a whole state, so plans keep the most tokens."""


class _Average:
    """An exponentially weighted moving average whose first observation replaces the seed."""

    __slots__ = ("value", "count")

    def __init__(self, seed: float) -> None:
        self.value = seed
        self.count = 0

    def observe(self, value: float) -> None:
        self.value = value if self.count == 0 else self.value + ALPHA * (value - self.value)
        self.count += 1


class _Transfer:
    """A tier's learned rate: the smallest recent fixed cost, the moving average of the bandwidth."""

    __slots__ = ("latencies", "seed", "bandwidth")

    def __init__(self, seed: TransferRate) -> None:
        self.seed = seed
        self.latencies: deque[float] = deque(maxlen=LATENCY_WINDOW)
        self.bandwidth = _Average(seed.bandwidth)

    @property
    def latency(self) -> float:
        return min(self.latencies) if len(self.latencies) >= LATENCY_SAMPLES else self.seed.latency

    def rate(self) -> TransferRate:
        return TransferRate(self.latency, self.bandwidth.value)

    def observe(self, n_bytes: int, seconds: float, operations: int) -> None:
        operations = max(operations, 1)
        if n_bytes < MIN_RATE_BYTES:
            self.latencies.append(seconds / operations)
            return
        moving = seconds - operations * self.latency
        if moving > 0:
            self.bandwidth.observe(n_bytes / moving)


class CostModel:
    """An engine's measured rates and its record of plans; thread-safe (slots report from their own threads).

    :param seed: The rates before anything is measured.
    :param learn: Update the rates from observations (``False``: fixed rates, e.g. in tests).
    :ivar enabled: Plans and captures are weighed by the rates (the ``plan_by_cost`` setting); otherwise they keep the
        most tokens and take every checkpoint, and the rates are still learned and shown.
    :ivar plan_record: The plans carried out, each estimate against what it took (the rates' own check).
    """

    def __init__(self, seed: Rates = DEFAULT_RATES, *, learn: bool = True) -> None:
        self.enabled = True
        self.learn = learn
        self._seed = seed
        self._lock = threading.Lock()
        self._eval = [_Average(0.0) for _ in EVAL_BUCKETS]  # seconds per token, by bucket
        self._eval_size = [_Average(float(size)) for size in EVAL_BUCKETS]  # batch size, by bucket
        self._transfers = {name: _Transfer(rate) for name, rate in {**DEFAULT_TRANSFERS, **seed.transfers}.items()}
        self._full_bytes_per_token = _Average(seed.full_bytes_per_token)
        self._partial_bytes = _Average(float(seed.partial_bytes))
        self._rates: Rates | None = seed if not learn else None
        self.lookups_skipped = 0
        self.plan_record = PlanRecord()

    # -- estimates ----------------------------------------------------------------------------------------------

    def rates(self) -> Rates:
        """The current rates (a snapshot, rebuilt only after an observation)."""
        with self._lock:
            if self._rates is None:
                self._rates = self._build()
            return self._rates

    def fix(self, rates: Rates) -> None:
        """Use ``rates`` from now on and learn nothing more (rates measured elsewhere, benchmarks, tests)."""
        with self._lock:
            self.learn = False
            self._rates = rates

    @property
    def calibrated(self) -> bool:
        """Whether an evaluation was measured (before that, estimates are the CPU-like defaults: a plan's record
        would compare a measurement with a guess)."""
        return not self.learn or any(average.count for average in self._eval)

    def active_rates(self) -> Rates | None:
        """The rates if plans and captures are weighed by them, else ``None``."""
        return self.rates() if self.enabled else None

    def _build(self) -> Rates:
        points = tuple((size.value, rate.value) for size, rate in zip(self._eval_size, self._eval) if rate.count)
        return Rates(points or self._seed.eval_points,
                     MappingProxyType({name: transfer.rate() for name, transfer in self._transfers.items()}),
                     self._full_bytes_per_token.value, int(self._partial_bytes.value))

    # -- observations -------------------------------------------------------------------------------------------

    def observe_eval(self, n_tokens: int, seconds: float) -> None:
        """A decode of ``n_tokens`` tokens took ``seconds``."""
        if not self.learn or n_tokens <= 0 or seconds <= 0:
            return
        index = bisect.bisect_right(EVAL_BUCKETS, n_tokens) - 1
        with self._lock:
            self._eval[index].observe(seconds / n_tokens)
            self._eval_size[index].observe(float(n_tokens))
            self._rates = None

    def observe_transfer(self, tier: str, n_bytes: int, seconds: float, operations: int = 1) -> None:
        """Moving ``n_bytes`` through ``tier`` in ``operations`` operations took ``seconds``."""
        if not self.learn or seconds <= 0 or operations <= 0:
            return
        with self._lock:
            transfer = self._transfers.get(tier)
            if transfer is None:
                transfer = self._transfers[tier] = _Transfer(DEFAULT_TRANSFERS[SHARED])
            transfer.observe(n_bytes, seconds, operations)
            self._rates = None

    def observe_capture(self, n_bytes: int, seconds: float, partial: bool, n_tokens: int) -> None:
        """A capture of ``n_bytes`` (a partial one, or a full state of ``n_tokens`` tokens) took ``seconds``."""
        if not self.learn or n_bytes <= 0:
            return
        self.observe_transfer(CAPTURE, n_bytes, seconds)
        with self._lock:
            if partial:
                self._partial_bytes.observe(float(n_bytes))
            elif n_tokens > 0:
                self._full_bytes_per_token.observe(n_bytes / n_tokens)
            self._rates = None

    # -- lookups ------------------------------------------------------------------------------------------------

    def skipped_lookup(self) -> None:
        """A slow tier was not asked: even its best answer could not have been faster."""
        with self._lock:
            self.lookups_skipped += 1

    def _transfer_view(self, name: str, rate: TransferRate) -> dict[str, Any]:
        transfer = self._transfers.get(name)
        return {"latency_seconds": rate.latency, "bytes_per_second": rate.bandwidth,
                "latency_observations": len(transfer.latencies) if transfer is not None else 0,
                "bandwidth_observations": transfer.bandwidth.count if transfer is not None else 0}

    def snapshot(self) -> dict[str, Any]:
        """A JSON-able view: the rates, how many observations each rests on, and the plans' estimates and outcomes
        (:meth:`~ckpt_plugin.policy.plan_record.PlanRecord.snapshot`)."""
        rates = self.rates()
        with self._lock:
            view: dict[str, Any] = {
                "enabled": self.enabled,
                "eval_seconds_per_token": {str(bound): average.value if average.count else None
                                           for bound, average in zip(EVAL_BUCKETS, self._eval)},
                "eval_observations": {str(bound): average.count for bound, average in zip(EVAL_BUCKETS, self._eval)},
                "eval_points": [list(point) for point in rates.eval_points],
                "transfers": {name: self._transfer_view(name, rate) for name, rate in rates.transfers.items()},
                "full_state_bytes_per_token": rates.full_bytes_per_token,
                "partial_state_bytes": rates.partial_bytes,
                "lookups_skipped_by_cost": self.lookups_skipped,
            }
        view.update(self.plan_record.snapshot())
        return view


def with_transfer(rates: Rates, tier: str, rate: TransferRate) -> Rates:
    """``rates`` with ``tier``'s transfer rate replaced (tests, benchmarks)."""
    return replace(rates, transfers=MappingProxyType({**rates.transfers, tier: rate}))


def option_seconds(rates: Rates, n_evaluated: int, restored_bytes: int, tier: str | None = None,
                   fetched_bytes: int = 0) -> float:
    """Expected seconds of one way of serving a prompt: fetch ``fetched_bytes`` from ``tier`` (``None`` or a local
    tier: nothing to fetch), restore ``restored_bytes`` into the context, evaluate ``n_evaluated`` tokens."""
    seconds = rates.eval_seconds(n_evaluated)
    if restored_bytes > 0:
        seconds += rates.transfer_seconds(RAM, restored_bytes)
    if tier is not None and tier not in LOCAL_TIERS:
        seconds += rates.transfer_seconds(tier, fetched_bytes)
    return seconds
