"""One slot of an engine: a sequence id of the model context, its live memory, lineage and checkpoints.

The engine (:class:`~ckpt_plugin.manager.CheckpointManager`) holds the parts every slot shares (settings, the store,
the counters, the hooks, the captures); a :class:`SlotController` applies plans to its own sequence through its own
:class:`~ckpt_plugin.slot.Backend`. Checkpoints and cache entries are immutable and shared by reference between slots
and the cache: an entry saved from one slot restores into any other of the same context.

Data flows one way: the host asks a slot to :meth:`~SlotController.prepare` a prompt and to
:meth:`~SlotController.process` the tokens that remain. The plan comes from :func:`~ckpt_plugin.policy.plan_prompt`
over the store's candidates; the slot captures and restores through :class:`~ckpt_plugin.captures.Captures`, fires the
hooks, counts, and keeps its checkpoints and the store's pins consistent.
"""

from __future__ import annotations

import logging
import time
from typing import Sequence

import numpy as np

from .cache import CacheEntry
from .errors import StateRestoreError
from .policy import LiveMemory, Plan, plan_prompt
from .schedule import branch_point, pause_points
from .request import current_request
from .slot_memory import SlotMemory
from .tiers import Tier

log = logging.getLogger("ckpt_plugin")


class SlotController(SlotMemory):
    """One slot of an engine: :class:`SlotMemory` plus the request path (namespaces, plans, evaluation)."""

    def current_namespace(self) -> str:
        """The namespace of the request being served (the manager's own outside a request scope)."""
        scope = current_request.get()
        return scope.namespace if scope is not None and scope.namespace else self.settings.namespace

    def enter_namespace(self, namespace: str) -> None:
        """Never let one tenant reuse another's live state: park it in its owner's partition first."""
        slot = self.slot
        if slot.namespace == namespace:
            return
        if slot.n_tokens >= self.settings.cache_min_tokens:
            self.save_to_cache()
        self.clear_slot()
        slot.namespace = namespace

    def plan(self, prompt: np.ndarray, max_keep: int | None = None) -> Plan[CacheEntry]:
        """How ``prompt`` would be served (see :func:`~ckpt_plugin.policy.plan_prompt`).

        Changes nothing but what the disk tier read of the candidates it fetched: counting, promotion and restores
        are :meth:`prepare`'s.
        """
        slot = self.slot
        live = LiveMemory(slot.lineage, slot.n_tokens, int(self.backend.pos_min()), slot.checkpoints)
        hits = self.store.lookup(slot.namespace, self.fingerprint, prompt, self.kind, max_keep)
        return plan_prompt(self.kind, prompt, live, hits, self.settings.cache_min_discard,
                           self.settings.cache_min_tokens, max_keep)

    def prepare(self, prompt: Sequence[int] | np.ndarray, max_keep: int | None = None) -> int:
        """Make the memory hold the longest prefix of ``prompt`` that can be served without evaluation.

        Looks at the live memory, the slot's checkpoints and every tier of the store; saves the live state into the
        cache first when the new prompt would discard enough of it. At least one prompt token is always left to
        evaluate.

        :param max_keep: Keep at most this many tokens (see :func:`~ckpt_plugin.policy.plan_prompt`).
        :return: ``n_keep``: the memory now holds ``prompt[:n_keep]``.
        """
        prompt = np.asarray(prompt, dtype=np.int32)
        slot = self.slot
        self.reconcile()
        self.enter_namespace(self.current_namespace())
        self.counters.prompts += 1
        just_loaded = self._loaded_from_cache == slot.version
        plan = self.plan(prompt, max_keep)
        self.branch_point = branch_point(self.kind, self.rules, plan)
        if plan.entry is not None and plan.tier != Tier.RAM:
            if plan.tier == Tier.DISK:
                self.counters.disk_hits += 1
            self.store.promote(plan.entry, plan.tier)
        if plan.park_live:
            self.save_to_cache()
        entry, n_keep = plan.entry, plan.n_keep
        try:
            self._apply(plan)
        except StateRestoreError as exc:
            # The slot was cleared: serve the request by evaluating its whole prompt, as the host alone would.
            log.warning("restore failed, evaluating the whole prompt: %s", exc)
            self.counters.restore_failures += 1
            entry, n_keep = None, 0
        live = plan.live
        if entry is None and n_keep < live.n_common:
            self.counters.forced_reprocess += 1
            self.counters.tokens_reprocessed += live.n_common - n_keep
            reason = (
                "recurrent state cannot be truncated" if self.kind.recurrent else "sliding window lost the prefix"
            )
            log.info("re-processing %d tokens the memory shared with the prompt: %s", live.n_common - n_keep, reason)
            self.hooks.call(self.hooks.hook.on_full_reprocess, slot=slot, n_common=live.n_common, reason=reason)
        if entry is None and live.n_keep < max(len(prompt) - 1, 0) and not just_loaded:
            self.counters.cache_misses += 1
        self.counters.tokens_reused += n_keep
        self.pin_slot()
        scope = current_request.get()
        if scope is not None:
            scope.prompt_tokens, scope.cached_tokens = len(prompt), n_keep
        return n_keep

    def _apply(self, plan: Plan[CacheEntry]) -> None:
        """Make the memory hold ``plan.n_keep`` tokens: truncate, or restore the entry and/or a checkpoint."""
        slot, entry, n_keep = self.slot, plan.entry, plan.n_keep
        if not plan.needs_restore:
            if n_keep < slot.n_tokens:
                self._cut(n_keep)
            return
        started = time.perf_counter()
        if entry is not None:
            self.counters.cache_hits += 1
            self.hooks.call(self.hooks.hook.on_cache_hit, slot=slot, entry=entry, n_tokens=n_keep)
            if plan.restore_state:
                self._restore(entry.state)
            self.store.touch(entry)
        if plan.checkpoint is not None:
            self._restore(plan.checkpoint)
            self.counters.checkpoints_restored += 1
        self._cut(n_keep)
        if entry is not None:
            self._adopt(entry.tokens, entry.checkpoints, n_keep)
        self.last_restore_seconds = time.perf_counter() - started
        self.counters.restore_seconds += self.last_restore_seconds
        self.hooks.call(self.hooks.hook.on_slot_restore, slot=slot, checkpoint=plan.checkpoint, entry=entry,
                        n_tokens=n_keep)

    def process(self, tokens: Sequence[int] | np.ndarray, prompt_end: int | None = None) -> None:
        """Evaluate ``tokens`` after the slot's end, pausing where checkpoints may be taken.

        :param tokens: Tokens to evaluate.
        :param prompt_end: Length of the prompt these tokens belong to; tokens past it are generated tokens and get
            no checkpoints. Defaults to the end of ``tokens``.
        """
        tokens = np.asarray(tokens, dtype=np.int32)
        slot = self.slot
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
            self.backend.decode(chunk)
            rewritten_from = slot._append(chunk)
            if rewritten_from is not None:
                self._invalidate_after(rewritten_from)
            self.counters.tokens_evaluated += len(chunk)
            # The last full capture describes the old memory: do not keep its bytes alive for nothing.
            self._full_capture = None
            if b == branch and b < end and b < slot.n_lineage and slot.lineage[b] != tokens[b - start]:
                # The prompt leaves the lineage here: its checkpoints past this point go now rather than with the
                # next chunk, so that the branch checkpoint is the newest.
                self._invalidate_after(b)
            if a < prompt_end:
                self.hooks.call(self.hooks.hook.on_prompt_processed, slot=slot, start=a, end=b, prompt_end=prompt_end)
        if start < branch <= end:
            self.branch_point = 0  # one prompt's, spent by the evaluation that passed it
        self.pin_slot()
