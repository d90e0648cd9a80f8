"""A draft model for every slot of a :class:`~ckpt_plugin.hosts.llama_cpp.parallel.parallel_llama.ParallelLlama`.

One draft context over the draft model's weights holds a sequence per slot, as the target context does
(:class:`~ckpt_plugin.hosts.llama_cpp.parallel.sequences.SequenceContext`). Its steps are a lane of the target's
:class:`~ckpt_plugin.hosts.llama_cpp.parallel.scheduler.BatchScheduler`: one loop drafts for every speculating slot in
one batch per drafting step (each slot's drafting runs whole in the scheduler's thread), then verifies every slot's
drafts in one target step, and the two contexts never compute at once. Each draft sequence is kept in step with its
slot's tokens by an engine of its own (only new tokens are evaluated; rejected drafts are cut off), and its state rides
in every checkpoint and cache entry of the target slot (the named extra state ``draft``, :class:`SlotDraftStates`), so
that after a restore the draft evaluates only the tokens past it, whichever slot the state is restored into.

How many tokens a slot drafts adapts to how many of its drafts the target keeps (:class:`DraftLength`), as llama.cpp's
server shortens the drafts of a slot whose drafts fail.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import numpy as np
from llama_cpp.llama import Llama
from llama_cpp.llama_speculative import LlamaDraftModel

from ckpt_plugin.core.checkpoint import Checkpoint, ExtraState
from ckpt_plugin.core.entry import CacheEntry
from ckpt_plugin.engine.manager import CheckpointManager
from ckpt_plugin.engine.slot_controller import SlotController
from ckpt_plugin.hosts.llama_cpp.parallel.lanes import DecodeLane
from ckpt_plugin.hosts.llama_cpp.parallel.scheduler import BatchScheduler
from ckpt_plugin.hosts.llama_cpp.parallel.sequences import SequenceBackend, SequenceContext
from ckpt_plugin.hosts.llama_cpp.speculative.drafts import (
    DRAFT_ENGINE_SETTINGS,
    DraftStatePlugin,
    accepted_prefix,
    check_draft_pair,
)
from ckpt_plugin.plugins.hookspecs import hookimpl

__all__ = ["DraftLength", "SlotDrafts"]


class DraftSequence(SequenceBackend):
    """One sequence of the draft context, evaluated through the draft lane (in one batch with the other slots'
    drafting steps).

    :meth:`draft` evaluates the tokens the sequence lacks and drafts past them in one submission; the engine then
    records what that evaluated through :meth:`decode`, which evaluates nothing for tokens the drafting already put
    into the sequence (:attr:`ahead`).

    :param context: The draft context.
    :param seq_id: The sequence (the target slot's id).
    :param lane: The draft context's lane of the target's scheduler.
    """

    def __init__(self, context: SequenceContext, seq_id: int, lane: DecodeLane) -> None:
        super().__init__(context, seq_id)
        self.lane = lane
        # Tokens the last drafting evaluated past the engine's record, which the engine's next decode records.
        self.ahead = np.empty(0, dtype=np.int32)

    def draft(self, tokens: np.ndarray, n_draft: int) -> list[int]:
        """Evaluate ``tokens`` after the sequence's end and draft ``n_draft`` greedy tokens past them; the sequence
        then holds ``tokens`` and all drafted tokens but the last, which :attr:`ahead` holds for the engine."""
        tokens = np.asarray(tokens, dtype=np.int32)
        n_past = self.pos_max() + 1
        self.forget_ahead()
        try:
            drafted = self.lane.draft(self.seq_id, tokens, n_past, n_draft)
        except BaseException:
            self.evaluated(None)
            raise
        self.ahead = np.concatenate([tokens, np.asarray(drafted[:-1], dtype=np.int32)])
        self.evaluated(n_past + len(self.ahead), self.lane.pos_min_after.get(self.seq_id))
        return drafted

    def decode(self, tokens: np.ndarray) -> None:
        tokens = np.asarray(tokens, dtype=np.int32)
        if not len(tokens):
            return
        ahead = self.ahead
        if len(ahead) >= len(tokens) and np.array_equal(ahead[: len(tokens)], tokens):
            self.ahead = ahead[len(tokens):]  # evaluated by the drafting: recorded, not evaluated again
            return
        if len(ahead):  # not what the drafting evaluated: those positions go
            self.remove(self.pos_max() + 1 - len(ahead), -1)
        n_past = self.pos_max() + 1
        try:
            self.lane.decode(self.seq_id, tokens, n_past, len(tokens) - 1)
        except BaseException:
            self.evaluated(None)
            raise
        self.evaluated(n_past + len(tokens), self.lane.pos_min_after.get(self.seq_id))

    def forget_ahead(self) -> None:
        """Nothing the drafting evaluated is left for the engine to record (it was, or the memory changed)."""
        self.ahead = np.empty(0, dtype=np.int32)

    def remove(self, p0: int, p1: int) -> bool:
        self.forget_ahead()  # a cut: the engine's record is what counts again
        return super().remove(p0, p1)

    def write_state(self, buffer: np.ndarray, partial: bool) -> int:
        self.forget_ahead()
        return super().write_state(buffer, partial)


class DraftLength:
    """How many tokens a slot drafts: ``n_max`` while the target keeps its drafts, fewer after drafts it rejects.

    After each verified draft the length moves toward what was accepted plus one, never below ``n_min``, so a slot
    whose drafts fail stops paying for drafting steps and verification rows that buy nothing, and a slot whose drafts
    hold grows back to ``n_max``.
    """

    def __init__(self, n_max: int, n_min: int = 1) -> None:
        self.n_max = n_max
        self.n_min = min(n_min, n_max)
        self.current = n_max

    def update(self, drafted: int, accepted: int) -> None:
        """A draft of ``drafted`` tokens was verified, ``accepted`` of them kept."""
        if drafted <= 0:
            return
        if accepted >= drafted:
            self.current = min(self.n_max, self.current + 1)
        else:
            self.current = max(self.n_min, min(self.current, accepted + 1))

    def reset(self) -> None:
        self.current = self.n_max


class SlotDraft(LlamaDraftModel):
    """The draft model of one slot: greedy drafts from its sequence of the draft context.

    :param drafts: The drafts of every slot.
    :param slot_id: The slot.
    """

    def __init__(self, drafts: SlotDrafts, slot_id: int) -> None:
        self.drafts = drafts
        self.slot_id = slot_id
        self.length = DraftLength(drafts.n_draft)
        self._last: tuple[int, list[int]] | None = None

    @property
    def controller(self) -> SlotController:
        """The draft engine's slot of this target slot."""
        return self.drafts.engine.controllers[self.slot_id]

    def sync(self, tokens: np.ndarray) -> None:
        """Make the draft sequence hold ``tokens`` (evaluating only what it does not hold yet)."""
        controller = self.controller
        with controller.lock:
            n_keep = controller.prepare(tokens)
            controller.process(tokens[n_keep:])

    def __call__(self, input_ids: np.ndarray, /, **kwargs: Any) -> np.ndarray:
        tokens = np.asarray(input_ids, dtype=np.int32)
        if len(tokens) == 0:
            return np.empty(0, dtype=np.intc)
        self._score_last_draft(tokens)
        controller = self.controller
        backend = self.drafts.sequences[self.slot_id]
        with controller.lock:
            # At least the last token is evaluated: its logits give the first drafted token.
            n_keep = controller.prepare(tokens)
            drafted = backend.draft(tokens[n_keep:], self.length.current)
            # The engine records what the drafting evaluated (the backend evaluates none of it again).
            try:
                controller.process(np.concatenate([tokens[n_keep:], np.asarray(drafted[:-1], dtype=np.int32)]))
            finally:
                backend.forget_ahead()
        self.drafts.count(drafted=len(drafted))
        self._last = (len(tokens), drafted)
        return np.asarray(drafted, dtype=np.intc)

    def start_generation(self) -> None:
        """A new generation holds the slot: the last draft (another generation's) is not this one's to score."""
        self._last = None
        self.length.reset()

    def _score_last_draft(self, tokens: np.ndarray) -> None:
        """Count the tokens of the previous draft that the target accepted (``tokens`` holds them where it did), and
        adapt the draft length to them."""
        if self._last is None:
            return
        start, drafted = self._last
        accepted = accepted_prefix(tokens, start, drafted)
        self.length.update(len(drafted), accepted)
        self.drafts.count(scored=len(drafted), accepted=accepted)


class SlotDrafts:
    """A draft model per slot over one draft context of ``n_slots`` sequences.

    :param draft: The draft ``Llama`` (its weights are used; its own context is not).
    :param target: The target ``Llama``; its vocabulary must be the draft's.
    :param scheduler: The target context's scheduler: the draft context becomes a lane of it.
    :param n_slots: Slots of the target.
    :param n_ctx: Positions each slot's draft sequence can hold (the target's per slot).
    :param n_draft: The most tokens drafted per call (fewer for a slot whose drafts the target rejects).
    :ivar lane: The draft context's steps, in the target scheduler's loop.
    :ivar engine: The draft context's engine: one slot per target slot, no cache of its own (the target's checkpoints
        carry the draft state), no shared tier, no checkpoints.
    :ivar drafted: Tokens drafted so far.
    :ivar scored: Of those, the tokens whose fate is known (a slot's next drafting call sees which the target kept;
        the last draft of a generation is never seen).
    :ivar accepted: Of those, the tokens the target accepted.
    """

    def __init__(self, draft: Llama, target: Llama, scheduler: BatchScheduler, *, n_slots: int, n_ctx: int,
                 n_draft: int = 4) -> None:
        check_draft_pair(draft, target, n_draft)
        self.llama = draft
        self.n_draft = n_draft
        self.scheduler = scheduler
        self.context = SequenceContext(draft, n_slots, n_ctx=n_ctx * n_slots, unified=False)
        self.lane = scheduler.add_lane(self.context)
        self.sequences = [DraftSequence(self.context, i, self.lane) for i in range(n_slots)]
        self.engine = CheckpointManager(self.sequences[0], more_slots=self.sequences[1:], **DRAFT_ENGINE_SETTINGS)
        self.models = [SlotDraft(self, i) for i in range(n_slots)]
        self.drafted = 0
        self.scored = 0
        self.accepted = 0
        self._counting = threading.Lock()

    @property
    def acceptance(self) -> float:
        """Fraction of the scored drafted tokens that the target accepted."""
        return self.accepted / self.scored if self.scored else 0.0

    def count(self, drafted: int = 0, scored: int = 0, accepted: int = 0) -> None:
        """Add to the counts (slots draft from several threads)."""
        with self._counting:
            self.drafted += drafted
            self.scored += scored
            self.accepted += accepted

    @contextlib.contextmanager
    def drafting(self, slot_id: int) -> Iterator[SlotDraft]:
        """While a generation holds ``slot_id``: its draft model (the scheduler already waits for the slot's steps,
        on either context)."""
        model = self.models[slot_id]
        model.start_generation()
        yield model

    def state_plugin(self) -> SlotDraftStates:
        """The plugin that stores each slot's draft state with the target slot's checkpoints."""
        return SlotDraftStates(self)

    def close(self) -> None:
        """Close the draft engine and free the draft context (after the target's scheduler stopped: its thread
        decodes the draft lane)."""
        self.engine.close()
        self.context.close()


class SlotDraftStates:
    """Stores the draft sequence of a target slot with every checkpoint and cache entry of that slot, and puts it back
    into the draft sequence of whichever slot the target state is restored into.

    :param drafts: The drafts of every slot.
    """

    def __init__(self, drafts: SlotDrafts) -> None:
        self.drafts = drafts
        self.by_slot = [DraftStatePlugin(model) for model in drafts.models]

    @hookimpl
    def on_attach(self, manager: CheckpointManager) -> None:
        self.by_slot[0].on_attach(manager)

    @hookimpl
    def on_checkpoint_capture(self, manager: CheckpointManager, slot: Any, n_tokens: int,
                              partial: bool) -> ExtraState | None:
        return self.by_slot[slot.id].on_checkpoint_capture(manager, slot, n_tokens, partial)

    @hookimpl(tryfirst=True)
    def on_slot_restore(self, manager: CheckpointManager, slot: Any, checkpoint: Checkpoint | None,
                        entry: CacheEntry | None, n_tokens: int) -> None:
        self.by_slot[slot.id].on_slot_restore(manager, slot, checkpoint, entry, n_tokens)

    @property
    def restored(self) -> int:
        """Draft states put back so far."""
        return sum(plugin.restored for plugin in self.by_slot)

