"""Parallel slots: N conversations at once over one ``Llama``'s weights, batched, with checkpoints per slot.

:class:`ParallelLlama` builds, for a host's ``Llama``:

- a :class:`~ckpt_plugin.hosts.llama_cpp.sequences.SequenceContext` with N sequences, each in a KV stream of its
  own of ``n_ctx`` cells (llama.cpp's server's layout with ``--parallel``): every slot holds a whole ``n_ctx``
  conversation (a request that fits one slot fits any, as with one), and a token attends over its own slot's cells
  only; or, with ``unified=True``, one pool of ``n_ctx`` cells the slots share, where a slot takes a prefix another
  live slot holds without evaluating it (:mod:`ckpt_plugin.hosts.llama_cpp.kv_sharing`);
- a :class:`~ckpt_plugin.hosts.llama_cpp.scheduler.BatchScheduler` decoding every busy slot's tokens together;
- one engine (:class:`~ckpt_plugin.engine.manager.CheckpointManager`) with one slot per sequence: checkpoints and cache
  entries are shared by reference between the slots and the tiers, so a conversation that moves to another slot
  restores from them;
- :meth:`ParallelLlama.view`: per request, a :class:`~ckpt_plugin.hosts.llama_cpp.slot_views.SlotLlama` on which the
  host runs its own completion and chat code. The view is bound to a slot when its generation starts, the point
  where the prompt's tokens are known: the idle slot sharing the longest prefix with them
  (:mod:`ckpt_plugin.hosts.llama_cpp.slot_choice`), leased until the generation ends.

Speculative decoding: with a draft model (``draft=``), a draft context of N sequences whose drafting steps run in the
target scheduler's loop, every speculating slot's drafts in one batch per step, its state stored with the slot's
checkpoints
(:mod:`ckpt_plugin.hosts.llama_cpp.slot_drafts`); llama-cpp-python's prompt lookup decoding
(``LlamaPromptLookupDecoding`` as the host's ``draft_model``) gets an instance per slot.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import re
import weakref
from typing import Any, Iterator, Sequence

import llama_cpp
import numpy as np
from llama_cpp._internals import LlamaTokenDataArray
from llama_cpp.llama import Llama
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

from ckpt_plugin.tiers.ram import PromptCache
from ckpt_plugin.core.config import CheckpointSettings
from ckpt_plugin.tiers.disk import DiskTier
from ckpt_plugin.core.errors import UnsupportedHostError
from ckpt_plugin.engine.manager import CheckpointManager
from ckpt_plugin.hosts.llama_cpp.slot_choice import SlotLeases
from ckpt_plugin.hosts.llama_cpp.kv_sharing import PrefixSharing
from ckpt_plugin.policy.plan import shares_cells
from ckpt_plugin.hosts.llama_cpp.slot_drafts import SlotDrafts
from ckpt_plugin.hosts.llama_cpp.attach import Attachment
from ckpt_plugin.hosts.llama_cpp.backend import HostRows
from ckpt_plugin.hosts.llama_cpp.scheduler import BatchScheduler
from ckpt_plugin.hosts.llama_cpp.sequences import SequenceBackend, SequenceContext
from ckpt_plugin.hosts.llama_cpp.slot_views import SlotLlama, view_of

log = logging.getLogger("ckpt_plugin")


class ViewBackend(HostRows, SequenceBackend):
    """One sequence of the shared context as an engine slot's backend, keeping the bookkeeping of whichever view
    (request) holds the slot, and evaluating through the batch scheduler."""

    def __init__(self, context: SequenceContext, seq_id: int, scheduler: BatchScheduler, llama: Llama) -> None:
        SequenceBackend.__init__(self, context, seq_id)
        self.scheduler = scheduler
        self._use_host(llama)  # until a view binds the slot: only shapes are read from it
        # The logits rows of the slot's last evaluated chunk (its flagged tokens, in order): what its view samples.
        self.last_outputs = np.zeros((0, context.n_vocab), dtype=np.single)
        self._candidates: LlamaTokenDataArray | None = None

    def bind(self, view: SlotLlama) -> None:
        """Keep ``view``'s bookkeeping from now on (its request holds the slot)."""
        self._use_host(view)
        self.take_over_scores()
        view.sequence.bind(self)
        view.slot_rows = lambda: self.last_outputs
        view.candidates = self.candidates

    def candidates(self) -> LlamaTokenDataArray:
        """The slot's reusable sampling candidates (one vocabulary-sized array per slot, not per request)."""
        if self._candidates is None:
            self._candidates = LlamaTokenDataArray(n_vocab=self.context.n_vocab)
        return self._candidates

    def _forget_after(self, n_past: int) -> None:
        self.truncate(n_past)

    def _decode_chunk(self, chunk: np.ndarray, n_past: int, first: int) -> np.ndarray:
        try:
            self.last_outputs = self.scheduler.decode(self.seq_id, chunk, n_past, first)
        except BaseException:
            self.evaluated(None)
            raise
        self.evaluated(n_past + len(chunk), self.scheduler.pos_min_after.get(self.seq_id))
        return self.last_outputs


class SlotAttachment(Attachment):
    """The attachment of one request's view: it leases a slot for each generation and binds the view to it."""

    def __init__(self, view: SlotLlama, parallel: ParallelLlama) -> None:
        manager = parallel.manager
        # Slot 0 stands in until a generation leases a slot: nothing runs on it before.
        super().__init__(view, manager, parallel.backends[0], manager.slots[0])
        self.parallel = parallel
        self._open: weakref.WeakSet[Iterator[int]] = weakref.WeakSet()

    def generate(self, tokens: Sequence[int], *args: Any, **kwargs: Any) -> Iterator[int]:
        generation = super().generate(tokens, *args, **kwargs)
        self._open.add(generation)
        return generation

    def create_completion(self, *args: Any, **kwargs: Any) -> Iterator[Any]:
        return _slot_context_errors(super().create_completion(*args, **kwargs), int(self.llama.n_ctx()))

    def eval(self, tokens: Sequence[int]) -> None:
        if self.prompt_end is None:
            # Slot 0 only stands in before a lease: evaluating on it would write into another request's slot. Only
            # multimodal chat handlers evaluate before their completion starts.
            raise UnsupportedHostError("parallel slots evaluate tokens only within a completion: multimodal chat "
                                       "handlers are served with --parallel 1")
        super().eval(tokens)

    def end(self) -> None:
        """End the generations the request left suspended (a client that left mid-stream): their slots are free
        now, not whenever the garbage collector reaches a generator that a reference cycle keeps alive."""
        for generation in list(self._open):
            try:
                generation.close()  # type: ignore[attr-defined]
            except ValueError:
                pass  # running in another thread: it ends, and frees its slot, when its step returns

    @contextlib.contextmanager
    def generation_slot(self, tokens: list[int]) -> Iterator[None]:
        """Lease a slot for the generation (queued first come, first served) and bind this view to it."""
        parallel = self.parallel
        slot_id = parallel.leases.lease(np.asarray(tokens, dtype=np.int32), self.controller.current_namespace())
        try:
            self.controller = parallel.manager.slots[slot_id]
            self.backend = parallel.backends[slot_id]
            self.backend.bind(self.llama)
            # With a store all in memory, the prepare holds the slot and the context until the prompt is queued
            # (BatchScheduler.held_until_submitted); a disk or shared tier may wait on a read or the network.
            held = parallel.scheduler.held_until_submitted(self.controller.lock) if parallel.manager.store.in_memory \
                else contextlib.nullcontext()
            with contextlib.ExitStack() as stack:
                if parallel.sharing is not None:  # before the hold: a wait for a prefix in flight holds nothing
                    stack.enter_context(parallel.sharing.flight(slot_id, self.controller.current_namespace(),
                                                                np.asarray(tokens, dtype=np.int32)))
                stack.enter_context(parallel.scheduler.generating(slot_id))
                if parallel.drafts is not None:
                    self.llama.draft_model = stack.enter_context(parallel.drafts.drafting(slot_id))
                elif parallel.lookups is not None:
                    self.llama.draft_model = parallel.lookups[slot_id]
                stack.enter_context(held)
                yield
        finally:
            parallel.leases.release(slot_id)


_CONTEXT_WINDOW = re.compile(r"(exceed context window of )\d+")


def _slot_context_errors(completion: Iterator[Any], n_ctx: int) -> Iterator[Any]:
    """``completion``, its "exceed context window" error naming the slot's ``n_ctx``.

    The host checks a prompt against the view's own ``n_ctx`` (a slot's) but names the size of the context it
    reads through ``llama_n_ctx``: the shared one, N slots' worth, which no request can use.
    """
    try:
        yield from completion
    except ValueError as exc:
        message = str(exc)
        fixed = _CONTEXT_WINDOW.sub(lambda match: f"{match.group(1)}{n_ctx}", message)
        if fixed == message:
            raise
        raise ValueError(fixed) from None


class ParallelLlama:
    """``n_slots`` slots over ``llama``'s weights (see the module docstring).

    :param llama: The host's ``Llama``; it stays usable on its own context, which the slots do not use.
    :param n_slots: Slots (sequences), at least 1.
    :param settings: Checkpoint settings of the engine.
    :param cache: A prompt cache to share; :param disk: a disk tier to share.
    :param draft: A draft model for speculative decoding (same vocabulary): each slot drafts from its own sequence
        of a draft context (the slots compute the logits rows a verification samples, whatever ``logits_all``).
    :param n_draft: Tokens drafted per step with ``draft``.
    :param unified: One pool of ``n_ctx`` cells for all the slots (llama.cpp's ``kv_unified``, llama-server's
        ``--kv-unified``), each slot able to grow to the whole context, instead of a stream of ``n_ctx`` cells per
        slot; with plain attention, a prompt sharing a prefix with another slot's live memory takes over its cells
        (:mod:`ckpt_plugin.hosts.llama_cpp.kv_sharing`), and a prefix in flight is evaluated once.
    :ivar manager: The engine, one slot per sequence.
    :ivar leases: Which slot each generation holds.
    :ivar drafts: The slots' draft models (``None`` without ``draft``).
    :ivar lookups: A prompt lookup decoder per slot, where the host's ``draft_model`` is one.
    :ivar sharing: The prompts in flight, and the cells the slots share where they can (``unified`` and plain
        attention); ``None`` for a recurrent memory.
    :raises UnsupportedHostError: ``llama`` serves embeddings, or has a draft model other than prompt lookup.
    """

    def __init__(
        self,
        llama: Llama,
        n_slots: int,
        settings: CheckpointSettings | None = None,
        *,
        cache: PromptCache | None = None,
        disk: DiskTier | None = None,
        draft: Llama | None = None,
        n_draft: int = 4,
        unified: bool = False,
        **overrides: Any,
    ) -> None:
        host_draft = llama.draft_model
        if host_draft is not None and not isinstance(host_draft, LlamaPromptLookupDecoding):
            raise UnsupportedHostError("parallel slots take a draft model as ParallelLlama(draft=...), which gives "
                                       "each slot a sequence of its own; a Llama's draft_model has one")
        if draft is not None and host_draft is not None:
            raise UnsupportedHostError("a draft model and prompt lookup decoding cannot both draft")
        if llama.context_params.embeddings:
            raise UnsupportedHostError("embedding contexts have no generation state to checkpoint")
        self.llama = llama
        n_ctx = int(llama.n_ctx())
        self.context = SequenceContext(llama, n_slots, n_ctx=n_ctx if unified else n_ctx * n_slots, unified=unified)
        self.scheduler = BatchScheduler(self.context)
        self.backends = [ViewBackend(self.context, i, self.scheduler, llama) for i in range(n_slots)]
        self.manager = CheckpointManager(self.backends[0], settings, cache=cache, disk=disk,
                                         more_slots=self.backends[1:], **overrides)
        self.leases = SlotLeases(n_slots, self._describe)
        self.sharing: PrefixSharing | None = None
        cells = unified and shares_cells(self.context.kind)
        if not self.context.kind.recurrent:  # a recurrent state at a prompt's end serves no shorter prefix
            self.sharing = PrefixSharing(self.backends, self.manager.counters, self.manager.settings.cache_min_tokens,
                                         park=None if cells else self._park)
        if cells and self.sharing is not None:
            for controller in self.manager.slots:
                controller.peers = self.sharing.peers(controller.slot.id)
        if unified:
            self.context.make_room = self._make_room
        self.lookups = [copy.copy(host_draft) for _ in range(n_slots)] if host_draft is not None else None
        self.drafts: SlotDrafts | None = None
        if draft is not None:
            self.drafts = SlotDrafts(draft, llama, self.scheduler, n_slots=n_slots, n_ctx=n_ctx, n_draft=n_draft)
            states = self.drafts.state_plugin()
            try:
                states.on_attach(self.manager)
            except BaseException:
                self.close()
                raise
            self.manager.plugins.register(states, name="ckpt_plugin.draft")
        self.manager.hooks.call(self.manager.hooks.hook.on_attach)

    @property
    def n_slots(self) -> int:
        return len(self.backends)

    def _describe(self, slot_id: int) -> tuple[str, np.ndarray]:
        slot = self.manager.slots[slot_id].slot
        return slot.namespace, slot.tokens

    def _park(self, slot_id: int) -> None:
        """Put slot ``slot_id``'s state into the cache for the generations waiting for its prefix (on its thread)."""
        controller = self.manager.slots[slot_id]
        try:
            if not controller.memory.opaque:
                controller.memory.save_to_cache()
        except Exception:  # the waiters evaluate the prefix themselves
            log.exception("slot %d: its state could not be parked for the prompts waiting for it", slot_id)

    def _make_room(self) -> bool:
        """Park one idle slot's conversation in the cache and free its cells (the least recently used slot whose
        lock is free); ``False`` if none could be. Called for a full pool (:attr:`SequenceContext.make_room`) on the
        scheduler's thread or a restoring slot's, the context held: a slot's lock is only tried, never waited for
        (its owner may be waiting for this very step)."""
        for slot_id in self.leases.idle_oldest_first():
            controller = self.manager.slots[slot_id]
            # A slot without tokens may still hold cells: the chunks of a prompt whose evaluation failed.
            empty = llama_cpp.llama_memory_seq_pos_max(self.context.memory, slot_id) < 0
            if empty or not controller.lock.acquire(blocking=False):
                continue
            try:
                if self.leases.busy(slot_id) or controller.busy:
                    continue
                log.info("slot %d: the pool of KV cells is full; its conversation goes to the cache", slot_id)
                if controller.slot.n_tokens >= self.manager.settings.cache_min_tokens and not controller.memory.opaque:
                    try:
                        controller.memory.save_to_cache()
                    except Exception:  # the conversation is lost to the cache, not the step to the other slots
                        log.exception("slot %d: its state could not be parked", slot_id)
                controller.clear_slot()
                return True
            finally:
                controller.lock.release()
        return False

    def view(self) -> SlotLlama:
        """A view of the ``Llama`` for one request: the host's completion methods, on a slot leased per
        generation. Close the view when the request ends: a generation it left suspended frees its slot then."""
        view = view_of(self.llama, self.context)
        attachment = SlotAttachment(view, self)
        attachment.patch_methods()
        view.end_generations = attachment.end
        return view

    def busy(self, slot_id: int) -> bool:
        """Whether a generation holds ``slot_id`` now."""
        return self.leases.busy(slot_id)

    def close(self) -> None:
        """Close the engine, stop the scheduler and free the shared context."""
        self.manager.close()
        self.scheduler.close()
        self.context.close()
        if self.drafts is not None:
            self.drafts.close()
