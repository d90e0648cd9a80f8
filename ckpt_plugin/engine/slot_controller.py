"""The request path of one slot of an engine: namespaces, plans, restores, evaluation with pauses for checkpoints.

The engine (:class:`~ckpt_plugin.engine.manager.CheckpointManager`) holds the parts every slot shares (settings, the store,
the counters, the hooks, the captures); a :class:`SlotController` applies plans to its own sequence through its
:class:`~ckpt_plugin.engine.slot_memory.SlotMemory`. Checkpoints and cache entries are immutable and shared by reference between slots
and the cache: an entry saved from one slot restores into any other of the same context.

Data flows one way: the host asks a slot to :meth:`~SlotController.prepare` a prompt and to
:meth:`~SlotController.process` the tokens that remain. The plan comes from :func:`~ckpt_plugin.policy.plan.plan_prompt`
over the store's candidates; the slot captures and restores through :class:`~ckpt_plugin.engine.captures.Captures`, fires the
hooks, counts, and keeps its checkpoints and the store's pins consistent.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from ckpt_plugin.core.checkpoint import Checkpoint
from ckpt_plugin.core.config import CheckpointSettings
from ckpt_plugin.core.entry import CacheEntry
from ckpt_plugin.core.slot import Backend, Slot
from ckpt_plugin.tiers.cost_probes import CostProbe, live_keep
from ckpt_plugin.policy.plan_record import PlanClock
from ckpt_plugin.core.errors import StateRestoreError
from ckpt_plugin.core.memory import MemoryKind
from ckpt_plugin.policy.plan import LiveMemory, Plan, keep_limit, plan_prompt
from ckpt_plugin.policy.schedule import CheckpointRules, branch_point, pause_points
from ckpt_plugin.core.counters import TIER_SOURCES
from ckpt_plugin.core.request import RequestInterrupted, current_request
from ckpt_plugin.engine.slot_memory import CellSource, SlotMemory
from ckpt_plugin.tiers.protocol import Tier

if TYPE_CHECKING:
    from ckpt_plugin.core.counters import Counters
    from ckpt_plugin.engine.captures import Captures
    from ckpt_plugin.plugins.engine_hooks import EngineHooks
    from ckpt_plugin.tiers.store import TieredStore

__all__ = ["SlotController"]

log = logging.getLogger("ckpt_plugin")

_WINDOW_ATTEMPTS = 3
"""Plans applied at most for one prompt when other slots' decodes keep taking the window's cells meanwhile."""


class SlotController:
    """One slot of an engine, as hosts and plugins use it (:class:`~ckpt_plugin.plugins.view.SlotView`): the request
    path (namespaces, plans, evaluation with its pauses for checkpoints) over the slot's :class:`SlotMemory`.

    :param slot_id: The slot's id (its sequence id).
    :param backend: The sequence.
    :param settings: The engine's settings.
    :param rules: Checkpoint spacing and count.
    :param store: The engine's tiers.
    :param counters: The engine's counters.
    :param hooks: The engine's hooks (plugins receive the engine and this slot's :class:`~ckpt_plugin.core.slot.Slot`).
    :param captures: The engine's state copies.
    :ivar memory: The sequence, its record and checkpoints.
    :ivar lock: Held by the host-facing layer while a request uses the slot, and by the slot file operations.
    :ivar branch_point: Where the prompt last prepared leaves the longest prefix it shares with a stored state, when
        a restore could not serve all of it: a checkpoint is taken there (``schedule.branch_point``; 0: none).
    :ivar peers: Set by a host whose sequences share one KV cache: the other live sequences of a namespace whose
        cells this slot may take over (:class:`~ckpt_plugin.engine.slot_memory.CellSource`); ``None``: none.
    """

    def __init__(self, *, slot_id: int, backend: Backend, settings: CheckpointSettings, rules: CheckpointRules,
                 store: TieredStore, counters: Counters, hooks: EngineHooks, captures: Captures) -> None:
        self.settings = settings
        self.rules = rules
        self.store = store
        self.counters = counters
        self.hooks = hooks
        # The engine's measured rates (one model in the engine's rules, switched on or off by the engine).
        self.costs = rules.costs
        self.memory = SlotMemory(slot_id=slot_id, backend=backend, settings=settings, store=store,
                                 counters=counters, hooks=hooks, captures=captures, costs=self.costs)
        # Reentrant: a slot changing hands keeps it from its prepare to its prompt's submission, across the host's
        # calls that take it again (see BatchScheduler.held_until_submitted).
        self.lock = threading.RLock()
        self._busy = False
        self.branch_point = 0
        self.plan_clock: PlanClock | None = None
        self.fetch_seconds = 0.0
        self.peers: Callable[[str], Sequence[CellSource]] | None = None

    # What plugins and hosts read and call on a slot (SlotView): the memory's, under the slot's name.
    @property
    def slot(self) -> Slot:
        """The slot's tokens, lineage and checkpoints."""
        return self.memory.slot

    @property
    def backend(self) -> Backend:
        """The sequence in the model context."""
        return self.memory.backend

    @property
    def kind(self) -> MemoryKind:
        """The memory kind of the engine's context."""
        return self.memory.kind

    @property
    def fingerprint(self) -> str:
        """The fingerprint of the engine's context."""
        return self.memory.fingerprint

    @property
    def last_restore_seconds(self) -> float:
        """What the slot's latest restore took."""
        return self.memory.last_restore_seconds

    def checkpoint(self) -> Checkpoint | None:
        """Take a partial checkpoint now and keep it (:meth:`SlotMemory.checkpoint`)."""
        return self.memory.checkpoint()

    def save(self) -> CacheEntry:
        """The slot's full state with its checkpoints (:meth:`SlotMemory.save`)."""
        return self.memory.save()

    def load(self, entry: CacheEntry) -> int:
        """Restore ``entry`` into the slot (:meth:`SlotMemory.load`)."""
        return self.memory.load(entry)

    @property
    def busy(self) -> bool:
        """Whether a generation holds the slot (across its tokens, not only its calls): set by the host-facing layer
        through :meth:`mark_busy` and :meth:`mark_idle`."""
        return self._busy

    def mark_busy(self) -> None:
        """A generation starts on the slot (the slot's lock held)."""
        self._busy = True

    def mark_idle(self) -> None:
        """The generation that held the slot ended."""
        self._busy = False

    @property
    def holds_outside_writes(self) -> bool:
        """Whether the memory holds positions written from outside that no token id names
        (:attr:`SlotMemory.opaque`)."""
        return self.memory.opaque

    def discard_outside_writes(self) -> None:
        """Cut the memory back to the tokens the slot names (:meth:`SlotMemory.discard_opaque`)."""
        self.memory.discard_opaque()

    def record_evaluated(self, chunk: np.ndarray) -> None:
        """``chunk`` was just evaluated after the slot's end, outside the engine: record it
        (:meth:`SlotMemory.append`)."""
        self.memory.append(chunk)

    def window_serves(self, n_keep: int) -> bool:
        """Whether the memory, cut to ``n_keep`` tokens, holds the window the token at ``n_keep`` sees
        (:meth:`SlotMemory.window_serves`)."""
        return self.memory.window_serves(n_keep)

    def save_to_cache(self) -> CacheEntry | None:
        """Put the slot's state into the prompt cache; the entry, or ``None`` if it was not admitted
        (:meth:`SlotMemory.save_to_cache`)."""
        return self.memory.save_to_cache()

    def adopt_memory(self, tokens: np.ndarray) -> None:
        """The memory was loaded outside the engine and holds ``tokens`` (:meth:`SlotMemory.adopt_memory`)."""
        self.memory.adopt_memory(tokens)

    def reconcile(self) -> None:
        """Bring the slot in line with the memory (:meth:`SlotMemory.reconcile`)."""
        self.memory.reconcile()

    def clear_slot(self) -> None:
        """Empty the memory and the slot (:meth:`SlotMemory.clear`)."""
        self.memory.clear()

    def current_namespace(self) -> str:
        """The namespace of the request being served (the manager's own outside a request scope)."""
        scope = current_request.get()
        return scope.namespace if scope is not None and scope.namespace else self.settings.namespace

    def enter_namespace(self, namespace: str) -> None:
        """Never let one tenant reuse another's live state: park it in its owner's partition first."""
        slot = self.slot
        if slot.namespace == namespace:
            return
        if slot.n_tokens >= self.settings.cache_min_tokens and not self.memory.opaque:
            self.memory.save_to_cache()
        self.memory.clear()
        slot.namespace = namespace

    def plan(self, prompt: np.ndarray, max_keep: int | None = None) -> Plan[CacheEntry]:
        """How ``prompt`` would be served (see :func:`~ckpt_plugin.policy.plan.plan_prompt`).

        Changes nothing but what the disk tier read of the candidates it fetched: counting, promotion and restores
        are :meth:`prepare`'s.
        """
        slot = self.slot
        live = LiveMemory(slot.lineage, slot.n_tokens, int(self.backend.pos_min()), slot.checkpoints)
        rates = self.costs.active_rates()
        probe = CostProbe(self.costs, rates, len(prompt), lambda: live_keep(self.kind, live, prompt, max_keep))
        hits = self.store.lookup(slot.namespace, self.fingerprint, prompt, self.kind, max_keep, probe)
        peers = self.peers(slot.namespace) if self.peers is not None else ()
        plan = plan_prompt(self.kind, prompt, live, hits, self.settings.cache_min_discard,
                           self.settings.cache_min_tokens, max_keep, rates, peers)
        self.fetch_seconds = probe.fetch_seconds
        return plan

    def prepare(self, prompt: Sequence[int] | np.ndarray, max_keep: int | None = None) -> int:
        """Make the memory hold the longest prefix of ``prompt`` that can be served without evaluation.

        Looks at the live memory, the slot's checkpoints and every tier of the store; saves the live state into the
        cache first when the new prompt would discard enough of it. At least one prompt token is always left to
        evaluate.

        :param max_keep: Keep at most this many tokens (see :func:`~ckpt_plugin.policy.plan.plan_prompt`).
        :return: ``n_keep``: the memory now holds ``prompt[:n_keep]``.
        """
        prompt = np.asarray(prompt, dtype=np.int32)
        just_loaded = self._take_for(prompt)
        plan, window = self._settle(prompt, max_keep)
        started = time.perf_counter()
        plan, entry, n_keep = self._restore_for(plan, window, prompt, max_keep)
        self._count_outcome(plan, entry, n_keep, prompt, just_loaded)
        self._time_plan(plan, prompt, n_keep, started)
        # A slot the host itself just loaded from its cache counts as a cache hit, as slot_memory counts it.
        source = TIER_SOURCES[str(plan.tier)] if entry is not None and plan.tier else "cache" if just_loaded else "slot"
        self._record_reuse(prompt, n_keep, source)
        return n_keep

    def _take_for(self, prompt: np.ndarray) -> bool:
        """Take the slot for a new prompt: in line with the memory, without positions written from outside (a prompt
        is served from what token ids name), in the caller's namespace; return whether the slot was just loaded
        from the cache by the host itself."""
        self.memory.reconcile()
        self.memory.discard_opaque()
        self.enter_namespace(self.current_namespace())
        self.counters.add(prompts=1)
        return self.memory.just_loaded_from_cache()

    def _restore_for(self, plan: Plan[CacheEntry], window: int, prompt: np.ndarray,
                     max_keep: int | None) -> tuple[Plan[CacheEntry], CacheEntry | None, int]:
        """Apply ``plan``; return the plan applied (made again if the window moved meanwhile), the entry restored
        from (``None``: the live memory) and the tokens kept. A failed restore clears the slot: the whole prompt is
        evaluated, as the host alone would."""
        try:
            applied = self._apply_checked(plan, window, prompt, max_keep)
            return applied, applied.entry, applied.n_keep
        except StateRestoreError as exc:
            log.warning("restore failed, evaluating the whole prompt: %s", exc)
            self.counters.add(restore_failures=1)
            return plan, None, 0

    def _count_outcome(self, plan: Plan[CacheEntry], entry: CacheEntry | None, n_keep: int, prompt: np.ndarray,
                       just_loaded: bool) -> None:
        """Forced re-processing (with its hook) and cache misses."""
        # Tokens the plan chose to evaluate although it could keep them are the cost model's, not forced.
        live, kept = plan.live, max(n_keep, plan.live.n_keep) if plan.by_cost and entry is None else n_keep
        if entry is None and kept < live.n_common:
            self.counters.add(forced_reprocess=1, tokens_reprocessed=live.n_common - kept)
            reason = (
                "recurrent state cannot be truncated" if self.kind.recurrent else "sliding window lost the prefix"
            )
            log.info("re-processing %d tokens the memory shared with the prompt: %s", live.n_common - kept, reason)
            self.hooks.call(self.hooks.hook.on_full_reprocess, slot=self.slot, n_common=live.n_common, reason=reason)
        if entry is None and live.n_keep < keep_limit(len(prompt)) and not just_loaded and not plan.by_cost \
                and plan.peer is None:
            self.memory.count_lookup(hit=False)

    def _time_plan(self, plan: Plan[CacheEntry], prompt: np.ndarray, n_keep: int, started: float) -> None:
        """Start timing the prompt against the plan's estimate (the cost model learns from the difference)."""
        if plan.estimated_seconds > 0 and self.costs.calibrated:
            self.plan_clock = PlanClock(estimated=plan.estimated_seconds, prompt_end=len(prompt), n_keep=n_keep,
                                        most_tokens=plan.most_tokens, tier=plan.tier, by_cost=plan.by_cost,
                                        fetches_skipped=plan.fetches_skipped,
                                        seconds=self.fetch_seconds + time.perf_counter() - started)

    def _record_reuse(self, prompt: np.ndarray, n_keep: int, source: str) -> None:
        """Count the prompt's tokens and those reused (in all and from ``source``, one of
        :data:`~ckpt_plugin.core.counters.REUSE_SOURCES`), pin what the slot now holds, and tell the request."""
        self.counters.add(prompt_tokens=len(prompt), tokens_reused=n_keep, **{f"tokens_reused_from_{source}": n_keep})
        self.memory.pin()
        scope = current_request.get()
        if scope is not None:
            scope.prompt_tokens, scope.cached_tokens = len(prompt), n_keep

    def _settle(self, prompt: np.ndarray, max_keep: int | None) -> tuple[Plan[CacheEntry], int]:
        """:meth:`plan`, with what it asks for before the restore: its branch point, the promotion of an entry of a
        lower tier, the live state parked; and where the sequence's window started when the plan looked."""
        window = int(self.backend.pos_min())
        plan = self.plan(prompt, max_keep)
        self.branch_point = branch_point(self.kind, self.rules, plan)
        if plan.entry is not None and plan.tier != Tier.RAM:
            if plan.tier == Tier.DISK:
                self.counters.add(disk_hits=1)
            self.store.promote(plan.entry, plan.tier)
        if plan.park_live:
            self.memory.save_to_cache()
        return plan, window

    def _apply_checked(self, plan: Plan[CacheEntry], window: int, prompt: np.ndarray,
                       max_keep: int | None) -> Plan[CacheEntry]:
        """:meth:`_apply` ``plan``, made when the window started at ``window``; return the plan applied.

        The sequences of a context share its KV cells: a decode of another slot may take cells of this sequence's
        sliding window that its own next token no longer sees (its end being further on), which moves ``pos_min``
        up (llama.cpp keeps a sequence's positions contiguous, and nothing else moves it while this slot prepares).
        A plan whose window moved since it looked is made again; after the restore or cut, the window must reach
        back as far as the token at ``n_keep`` sees, which nothing can take from it any more. Were it taken in the
        instant between the last look and the cut, the memory serves nothing of the prompt (its end no longer
        continues): the slot is cleared and planned again from the tiers. No lock is held against the other slots'
        decodes, which a batching host runs together.
        """
        for attempt in range(1, _WINDOW_ATTEMPTS + 1):
            if self.kind.swa and attempt < _WINDOW_ATTEMPTS and int(self.backend.pos_min()) != window:
                log.debug("slot %d: another sequence took cells of its window since the plan; planning again",
                          self.slot.id)
                plan, window = self._settle(prompt, max_keep)
                continue
            self.memory.apply(plan)
            if self.memory.window_serves(plan.n_keep):
                return plan
            log.info("slot %d: another sequence took cells of its window before the cut to %d tokens; clearing it",
                     self.slot.id, plan.n_keep)
            self.memory.clear()
            if attempt < _WINDOW_ATTEMPTS:
                plan, window = self._settle(prompt, max_keep)
        raise StateRestoreError(f"the window of slot {self.slot.id} kept moving under its plans; the slot was cleared")

    def process(self, tokens: Sequence[int] | np.ndarray, prompt_end: int | None = None) -> None:
        """Evaluate ``tokens`` after the slot's end, pausing where checkpoints may be taken.

        :param tokens: Tokens to evaluate.
        :param prompt_end: Length of the prompt these tokens belong to; tokens past it are generated tokens and get
            no checkpoints. Defaults to the end of ``tokens``.
        :raises RequestInterrupted: The request being served was interrupted between two batches (its client left,
            its time is up); the slot holds the tokens evaluated before.
        """
        tokens = np.asarray(tokens, dtype=np.int32)
        scope = current_request.get()
        if len(tokens) and scope is not None and scope.interrupted():
            raise RequestInterrupted(0)
        if len(tokens) and int(tokens.min()) < 0:
            raise ValueError("negative token ids stand for media positions, which only their media chunk evaluates")
        slot = self.slot
        self.memory.discard_opaque()
        start = slot.n_tokens
        end = start + len(tokens)
        if prompt_end is None:
            prompt_end = end
        # Checkpoints past ``start`` belong to a lineage these tokens may rewrite: space from the valid ones.
        last = max((c.n_tokens for c in slot.checkpoints if c.n_tokens <= start), default=0)
        branch = self.branch_point
        bounds = [start, *pause_points(self.kind, self.rules, start, end, prompt_end, last, branch), end]
        for a, b in zip(bounds, bounds[1:]):
            if a == b:
                continue
            chunk = tokens[a - start : b - start]
            decoding = time.perf_counter()
            try:
                self.backend.decode(chunk)
            except RequestInterrupted as exc:
                # The request stopped between two batches of the chunk: the slot records what the memory holds.
                if exc.evaluated:
                    self._evaluated(chunk[: exc.evaluated], time.perf_counter() - decoding, prompt_end)
                self.memory.pin()
                raise
            self._evaluated(chunk, time.perf_counter() - decoding, prompt_end,
                            next_token=(b, int(tokens[b - start])) if b == branch and b < end else None)
        if start < branch <= end:
            self.branch_point = 0  # one prompt's, spent by the evaluation that passed it
        self.memory.pin()

    def process_media(self, ids: np.ndarray, decode: Callable[[], None], prompt_end: int) -> None:
        """Evaluate one media chunk after the slot's end: ``decode`` fills its positions (llama.cpp's multimodal
        helper), and the slot records them under ``ids`` (:func:`~ckpt_plugin.core.media.media_token_ids`), so that the
        chunk is matched, cached and restored like tokens."""
        self.memory.discard_opaque()
        decoding = time.perf_counter()
        decode()
        # Prompts often part right after an image (another question about it), and a chunk costs far more to
        # encode than its positions suggest: its end is a branch point, where a checkpoint is wanted.
        saved, self.branch_point = self.branch_point, self.slot.n_tokens + len(ids)
        try:
            self._evaluated(np.asarray(ids, dtype=np.int32), time.perf_counter() - decoding, prompt_end)
        finally:
            self.branch_point = saved
        self.counters.add(media_chunks=1, media_positions=len(ids))
        self.memory.pin()

    def _evaluated(self, chunk: np.ndarray, seconds: float, prompt_end: int,
                   next_token: tuple[int, int] | None = None) -> None:
        """``chunk`` was just decoded after the slot's end in ``seconds``: the slot's record, counters and hooks.

        :param next_token: ``(position, token)`` of the prompt's next token where it may leave the lineage (the
            branch point).
        """
        slot = self.slot
        a = slot.n_tokens
        b = a + len(chunk)
        self._decoded(a, b, seconds)
        self.memory.append(chunk)
        self.counters.add(tokens_evaluated=len(chunk))
        if next_token is not None and next_token[0] < slot.n_lineage and slot.lineage[next_token[0]] != next_token[1]:
            # The prompt leaves the lineage here: its checkpoints past this point go now rather than with the
            # next chunk, so that the branch checkpoint is the newest.
            self.memory.invalidate_after(next_token[0])
        if a < prompt_end:
            self.hooks.call(self.hooks.hook.on_prompt_processed, slot=slot, start=a, end=b, prompt_end=prompt_end)

    def _decoded(self, start: int, end: int, seconds: float) -> None:
        """Tokens ``start:end`` were decoded in ``seconds``: an evaluation rate, and part of the prompt's plan."""
        self.costs.observe_eval(end - start, seconds)
        clock = self.plan_clock
        if clock is not None and start < clock.prompt_end:
            clock.seconds += seconds
            if end >= clock.prompt_end:
                self.plan_clock = None
                self.costs.plan_record.add(clock)
