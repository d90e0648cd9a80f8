"""When to take, erase and restore checkpoints: pure functions over token arrays and checkpoint metadata.

Nothing here touches llama.cpp. The rules follow llama.cpp's server (``tools/server``) and improve on it where noted:

- Plain attention memory can be truncated anywhere: no checkpoint is needed for prefix reuse.
- A sliding-window (SWA) memory can be truncated to ``p`` only while it still holds the window the token at ``p``
  attends to: llama.cpp masks the positions ``<= p - n_swa``, so ``pos_min <= max(0, p - n_swa + 1)`` (llama.cpp's
  server asks one position more, ``p - n_swa``; this is what lets a checkpoint taken at the prompt's end serve a
  regeneration, one token earlier). A checkpoint serves ``p`` under the same condition on its own ``pos_min``; unlike
  llama.cpp, which only restores checkpoints ending before ``p``, we also restore one ending after ``p`` and then
  truncate it, because attention cells are per position and the window before ``p`` is exact in it. That removes the
  re-evaluation between the checkpoint and the divergence point.
- A recurrent state exists only at its end: a checkpoint serves a prefix only if taken exactly at its length.

:func:`plan_prompt` keeps the most tokens it can, or, given measured rates (:mod:`ckpt_plugin.policy.costs`), the plan with
the least expected time when that is clearly faster.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Generic, Iterable, Protocol, Sequence, TypeVar

import numpy as np

from ckpt_plugin.core.checkpoint import Checkpoint
from ckpt_plugin.core.memory import MemoryKind, common_prefix
from ckpt_plugin.core.renamed import Renamed
from ckpt_plugin.policy.costs import LOCAL_TIERS, Rates, clearly_cheaper, option_seconds

__all__ = [
    "Candidate",
    "Hit",
    "LiveMemory",
    "Plan",
    "Reuse",
    "best_reuse",
    "can_truncate",
    "checkpoint_serves",
    "keep_limit",
    "plan_prompt",
    "shares_cells",
    "swa_threshold",
]


def keep_limit(n_prompt: int, max_keep: int | None = None) -> int:
    """The most tokens of an ``n_prompt``-token prompt that a plan may keep: all but the last (one token is always
    evaluated, so that fresh logits exist), and at most ``max_keep``."""
    limit = max(n_prompt - 1, 0)
    return limit if max_keep is None else max(0, min(limit, max_keep))


def swa_threshold(kind: MemoryKind, n_keep: int) -> int:
    """The largest ``pos_min`` a sliding-window memory may have to be truncated to ``n_keep`` tokens.

    The next token, at position ``n_keep``, attends to the positions above ``n_keep - n_swa`` (llama.cpp's
    ``is_masked_swa``: masked when ``p1 - p0 >= n_swa``).
    """
    return max(0, n_keep - kind.n_swa + 1)


def shares_cells(kind: MemoryKind) -> bool:
    """Whether sequences of one KV cache may share a prefix's cells (``llama_memory_seq_cp`` in a unified cache):
    plain attention only. A sliding window's cells are dropped per sequence as each one moves on, and a recurrent
    state exists only at its end, so for those kinds a sequence's state stays its own (checkpoints and entries)."""
    return kind.attention and not kind.swa and not kind.recurrent


def can_truncate(kind: MemoryKind, n_memory: int, pos_min: int, n_keep: int) -> bool:
    """Whether a memory holding ``n_memory`` tokens can be cut back to ``n_keep`` without a checkpoint.

    :param kind: The memory kind.
    :param n_memory: Tokens the memory holds.
    :param pos_min: Smallest position it holds (its sliding window's start).
    :param n_keep: Tokens to keep.
    """
    if n_keep > n_memory:
        return False
    if n_keep == n_memory or n_keep == 0:
        return True
    if kind.recurrent:
        return False
    if kind.swa:
        return pos_min <= swa_threshold(kind, n_keep)
    return True


def checkpoint_serves(kind: MemoryKind, checkpoint: Checkpoint, n_common: int) -> int | None:
    """How many tokens ``checkpoint`` can restore for a prompt sharing ``n_common`` tokens with its lineage.

    The checkpoint's tokens are a prefix of the lineage, so it is consistent with the prompt up to
    ``min(checkpoint.n_tokens, n_common)``.

    :return: Tokens in memory after restoring it (and truncating), or ``None`` if it cannot serve the prompt.
    """
    if not checkpoint.partial:
        return None
    if kind.recurrent:
        return checkpoint.n_tokens if checkpoint.n_tokens <= n_common else None
    if kind.swa:
        n_keep = min(checkpoint.n_tokens, n_common)
        return n_keep if checkpoint.pos_min <= swa_threshold(kind, n_keep) else None
    return None


@dataclass(frozen=True, slots=True)
class Reuse:
    """How a base (the live memory or a cache entry) can serve a prompt.

    :ivar n_keep: Prompt tokens served without evaluation.
    :ivar checkpoint: The partial checkpoint to restore on top of the base, or ``None``.
    :ivar n_common: Tokens the base shares with the prompt (what an ideal memory would serve).
    """

    n_keep: int
    checkpoint: Checkpoint | None
    n_common: int


def reuse_options(
    kind: MemoryKind,
    lineage: np.ndarray,
    n_memory: int,
    pos_min: int,
    checkpoints: Sequence[Checkpoint],
    prompt: np.ndarray,
    limit: int,
) -> list[Reuse]:
    """Every way a base can serve a prefix of ``prompt``, in the order :func:`best_reuse` weighs them: nothing
    (``n_keep`` 0), the memory truncated (when it can be), then each checkpoint that serves the prompt, newest first.
    No checkpoint is listed once the truncated memory serves all the base shares (none could keep more).

    Parameters as for :func:`best_reuse`.
    """
    n_common = min(common_prefix(lineage, prompt), limit)
    n_direct = min(n_common, n_memory)
    options = [Reuse(0, None, n_common)]
    if can_truncate(kind, n_memory, pos_min, n_direct):
        options.append(Reuse(n_direct, None, n_common))
        if n_direct == n_common:
            return options
    for checkpoint in reversed(checkpoints):
        n_keep = checkpoint_serves(kind, checkpoint, n_common)
        if n_keep is None or (kind.attention and n_keep > n_memory):
            # Attention layers are not in a partial checkpoint: the memory must still hold them.
            continue
        options.append(Reuse(n_keep, checkpoint, n_common))
    return options


def best_reuse(
    kind: MemoryKind,
    lineage: np.ndarray,
    n_memory: int,
    pos_min: int,
    checkpoints: Sequence[Checkpoint],
    prompt: np.ndarray,
    limit: int,
) -> Reuse:
    """The longest prefix of ``prompt`` a base can serve, directly or through one of its checkpoints (the first of
    :func:`reuse_options` keeping the most tokens).

    :param kind: The memory kind.
    :param lineage: The tokens the base's checkpoints were taken on; the memory holds ``lineage[:n_memory]``.
    :param n_memory: Tokens the memory holds.
    :param pos_min: The memory's smallest held position.
    :param checkpoints: Checkpoints of the lineage, oldest first.
    :param prompt: The prompt.
    :param limit: The most tokens that may be kept (``len(prompt) - 1``: one token is always evaluated so that
        fresh logits exist).
    """
    options = reuse_options(kind, lineage, n_memory, pos_min, checkpoints, prompt, limit)
    best = options[0]
    for option in options[1:]:
        if option.n_keep > best.n_keep:
            best = option
    return best


class Candidate(Protocol):
    """A stored state a prompt may start from (a cache entry of any tier)."""

    @property
    def tokens(self) -> np.ndarray: ...

    @property
    def n_tokens(self) -> int: ...

    @property
    def pos_min(self) -> int: ...

    @property
    def checkpoints(self) -> Sequence[Checkpoint]: ...


C = TypeVar("C", bound=Candidate)


@dataclass(frozen=True, slots=True)
class Hit(Generic[C]):
    """A candidate found by a store's lookup, not fetched yet.

    :ivar tier: The tier it lives in (a :class:`~ckpt_plugin.tiers.protocol.Tier`).
    :ivar n_common: Tokens it shares with the prompt at most (what the index matched).
    :ivar fetch: Returns the candidate (mapping a file, fetching from a remote tier), or ``None`` if it is gone.
    """

    tier: str
    n_common: int
    fetch: Callable[[], C | None]


@dataclass(frozen=True, slots=True)
class LiveMemory:
    """The slot as the planner sees it: its lineage, how much of it the memory holds, its checkpoints."""

    lineage: np.ndarray
    n_tokens: int
    pos_min: int
    checkpoints: Sequence[Checkpoint]


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan(Generic[C]):
    """How a prompt will be served: what to restore, where to truncate, what to evaluate.

    :ivar n_keep: Prompt tokens the memory will hold without evaluation; ``prompt[n_keep:]`` is evaluated.
    :ivar entry: The stored candidate to restore, or ``None`` to start from the live memory.
    :ivar tier: The tier ``entry`` came from (``None`` for the live memory).
    :ivar checkpoint: The partial checkpoint to restore (the entry's or the slot's), or ``None``.
    :ivar restore_state: Restore ``entry``'s full state first (not when a checkpoint holds the whole state).
    :ivar park_live: Put the live state into the cache first: the plan discards enough of it to be worth keeping.
    :ivar live: What the live memory alone offered (for the forced-reprocess and miss counters).
    :ivar n_shared: The longest prefix the prompt shares with the live memory's lineage or any candidate (within the
        limit), whether or not a restore can serve all of it.
    :ivar estimated_seconds: The plan's expected time (fetch, restore, evaluation of the rest), 0 without rates.
    :ivar most_tokens: What the plan keeping the most tokens keeps (``n_keep`` unless ``by_cost``; for a candidate
        not fetched, what its index matched).
    :ivar by_cost: The plan keeps fewer tokens than it could (``most_tokens``), because that is clearly faster.
    :ivar fetches_skipped: Candidates of slower tiers not fetched, because even at best they could not be faster.
    :ivar peer: Another live sequence whose first ``n_keep`` cells the slot takes over, shared (``entry`` and
        ``checkpoint`` are then ``None``, and the slot's own memory is discarded).
    """

    n_keep: int
    entry: C | None
    tier: str | None
    checkpoint: Checkpoint | None
    restore_state: bool
    park_live: bool
    live: Reuse
    n_shared: int = 0
    estimated_seconds: float = 0.0
    most_tokens: int = 0
    by_cost: bool = False
    fetches_skipped: int = 0
    peer: C | None = None

    # Deprecated names (docs/hooks.md): one letter told a count from a sequence.
    shared = Renamed("n_shared")
    share = Renamed("peer")

    @property
    def needs_restore(self) -> bool:
        """Whether anything is restored (otherwise the memory is only truncated, or left as it is)."""
        return self.entry is not None or self.checkpoint is not None or self.peer is not None


class _Pricer(Generic[C]):
    """Expected times of the ways a plan can serve one prompt, and the cheapest so far (the first on a tie)."""

    def __init__(self, rates: Rates, kind: MemoryKind, n_prompt: int) -> None:
        self.rates, self.kind, self.n_prompt = rates, kind, n_prompt
        self.cheapest: tuple[float, Reuse, C | None, str | None] | None = None

    def live(self, reuse: Reuse) -> float:
        restored = reuse.checkpoint.nbytes if reuse.checkpoint is not None else 0
        return option_seconds(self.rates, self.n_prompt - reuse.n_keep, restored)

    def entry(self, tier: str, candidate: C, reuse: Reuse) -> float:
        restored = reuse.checkpoint.nbytes if reuse.checkpoint is not None else 0
        if reuse.checkpoint is None or not self.kind.partial_is_complete:
            state = getattr(candidate, "state", None)
            restored += state.nbytes if state is not None else self.rates.state_bytes(candidate.n_tokens)
        fetched = 0 if tier in LOCAL_TIERS else int(getattr(candidate, "nbytes", restored))
        return option_seconds(self.rates, self.n_prompt - reuse.n_keep, restored, tier, fetched)

    def offer(self, seconds: float, reuse: Reuse, entry: C | None, tier: str | None) -> None:
        if self.cheapest is None or seconds < self.cheapest[0]:
            self.cheapest = (seconds, reuse, entry, tier)

    def not_worth_fetching(self, tier: str, bound: int) -> bool:
        """Whether a candidate of ``tier`` sharing ``bound`` tokens, at best (all of them kept, a state of that
        length), would still be clearly slower than the cheapest way found so far."""
        if tier in LOCAL_TIERS or self.cheapest is None:
            return False
        size = self.rates.state_bytes(bound)
        best_case = option_seconds(self.rates, self.n_prompt - bound, size, tier, size)
        return clearly_cheaper(best_case, self.cheapest[0])


def plan_prompt(
    kind: MemoryKind,
    prompt: np.ndarray,
    live: LiveMemory,
    hits: Iterable[Hit[C]],
    min_discard: int,
    min_tokens: int,
    max_keep: int | None = None,
    rates: Rates | None = None,
    peers: Iterable[C] = (),
) -> Plan[C]:
    """Choose how to serve ``prompt``: from the live memory (truncated, or through one of its checkpoints) or from
    a stored candidate.

    Without ``rates``, the way that keeps the most tokens. Ties go to the live memory, then to the earlier hit.
    With ``rates``, every way is priced (fetch, restore, evaluation of the rest of the prompt) and the cheapest is
    chosen when it is clearly cheaper than the one keeping the most tokens (:func:`~ckpt_plugin.policy.costs.clearly_cheaper`;
    otherwise the latter, so that rates where evaluation is far dearer than copying give exactly the plans made
    without them). At least one prompt token is always left to evaluate, so that fresh logits exist.

    Pure but for the ``fetch`` of the hits, which is called only for a hit that could beat the most tokens kept so
    far (its ``n_common``, capped at the limit, exceeds them), in the order given, and with ``rates`` only if that
    hit, kept whole, could be clearly cheaper than the cheapest way so far (a fetch from a slow tier is what a plan
    saves by not restoring from it).

    :param kind: The memory kind.
    :param prompt: The prompt's tokens.
    :param live: The slot.
    :param hits: Candidates from the store, best tiers first.
    :param min_discard: Park the live state when the plan discards at least this many of its tokens ...
    :param min_tokens: ... and it holds at least this many.
    :param max_keep: Keep at most this many tokens (a request that reads prompt logits keeps only the prefix whose
        logits are known).
    :param rates: What evaluating and copying cost (:class:`~ckpt_plugin.policy.costs.Rates`), or ``None``.
    :param peers: The live memories of other sequences of the same cache whose cells can be shared (only for a kind
        that :func:`shares_cells`): nothing is copied, so one that keeps more tokens than the slot's own memory is
        chosen over it and over every stored candidate keeping no more (no fetch, no restore).
    """
    limit = keep_limit(len(prompt), max_keep)
    options = reuse_options(kind, live.lineage, live.n_tokens, live.pos_min, live.checkpoints, prompt, limit)
    live_reuse = max(options, key=lambda option: option.n_keep)  # the first of the longest: best_reuse's choice
    best, entry, tier = live_reuse, None, None
    n_shared = live_reuse.n_common
    pricer: _Pricer[C] | None = None
    most_seconds = 0.0
    if rates is not None:
        pricer = _Pricer(rates, kind, len(prompt))
        for option in options:
            pricer.offer(pricer.live(option), option, None, None)
        most_seconds = pricer.live(live_reuse)
    chosen_peer: C | None = None
    for peer in peers if shares_cells(kind) else ():
        n_keep = min(common_prefix(peer.tokens, prompt), peer.n_tokens, limit)
        if n_keep > best.n_keep:
            best, chosen_peer = Reuse(n_keep, None, n_keep), peer
            n_shared = max(n_shared, n_keep)
            most_seconds = option_seconds(rates, len(prompt) - n_keep, 0) if rates is not None else 0.0
    skipped, most_tokens = 0, 0
    for hit in hits:
        bound = min(hit.n_common, limit)
        n_shared = max(n_shared, bound)
        if bound <= best.n_keep:
            continue
        if pricer is not None and pricer.not_worth_fetching(hit.tier, bound):
            skipped, most_tokens = skipped + 1, max(most_tokens, bound)
            continue
        candidate = hit.fetch()
        if candidate is None:
            continue
        entry_options = reuse_options(kind, candidate.tokens, candidate.n_tokens, candidate.pos_min,
                                      candidate.checkpoints, prompt, limit)[1:]
        reuse = max(entry_options, key=lambda option: option.n_keep, default=Reuse(0, None, 0))
        if reuse.n_keep > best.n_keep:
            best, entry, tier, chosen_peer = reuse, candidate, hit.tier, None
            if pricer is not None:
                most_seconds = pricer.entry(hit.tier, candidate, reuse)
        if pricer is not None:
            for option in entry_options:
                if option.n_keep > 0:
                    pricer.offer(pricer.entry(hit.tier, candidate, option), option, candidate, hit.tier)
    chosen, estimate, by_cost = (best, entry, tier), most_seconds, False
    cheapest = pricer.cheapest if pricer is not None else None
    # A peer's cells cost no copy: no way keeping fewer tokens is cheaper (and the pricer does not price peers).
    if chosen_peer is None and cheapest is not None and clearly_cheaper(most_seconds, cheapest[0]) and (
            cheapest[2] is not entry or cheapest[1] != best):
        chosen, estimate, by_cost = cheapest[1:], cheapest[0], True
    reuse, entry, tier = chosen
    most_tokens = max(most_tokens, best.n_keep)
    by_cost = by_cost or most_tokens > reuse.n_keep
    kept_live = reuse.n_keep if entry is None and chosen_peer is None else 0
    park = live.n_tokens - kept_live >= min_discard and live.n_tokens >= min_tokens
    restore_state = entry is not None and not (kind.partial_is_complete and reuse.checkpoint is not None)
    return Plan(n_keep=reuse.n_keep, entry=entry, tier=tier, checkpoint=reuse.checkpoint, restore_state=restore_state,
                park_live=park, live=live_reuse, n_shared=n_shared, estimated_seconds=estimate,
                most_tokens=most_tokens, by_cost=by_cost, fetches_skipped=skipped, peer=chosen_peer)
