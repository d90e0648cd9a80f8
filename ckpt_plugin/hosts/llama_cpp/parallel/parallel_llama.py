"""Parallel slots: N conversations at once over one ``Llama``'s weights, batched, with checkpoints per slot.

:class:`ParallelLlama` builds, for a host's ``Llama``:

- a :class:`~ckpt_plugin.hosts.llama_cpp.parallel.sequences.SequenceContext` with N sequences, each in a KV stream of
  its own of ``n_ctx`` cells (llama.cpp's server's layout with ``--parallel``): every slot holds a whole ``n_ctx``
  conversation (a request that fits one slot fits any, as with one), and a token attends over its own slot's cells
  only; or, with ``unified=True``, one pool of ``n_ctx`` cells the slots share, where a slot takes a prefix another
  live slot holds without evaluating it (:mod:`ckpt_plugin.hosts.llama_cpp.parallel.kv_sharing`);
- a :class:`~ckpt_plugin.hosts.llama_cpp.parallel.scheduler.BatchScheduler` decoding every busy slot's tokens together;
- one engine (:class:`~ckpt_plugin.engine.manager.CheckpointManager`) with one slot per sequence: checkpoints and cache
  entries are shared by reference between the slots and the tiers, so a conversation that moves to another slot
  restores from them;
- :meth:`ParallelLlama.view`: per request, a :class:`~ckpt_plugin.hosts.llama_cpp.parallel.slot_views.SlotLlama` on
  which the host runs its own completion and chat code. The view is bound to a slot when its generation starts, the
  point where the prompt's tokens are known: the idle slot sharing the longest prefix with them
  (:mod:`ckpt_plugin.hosts.llama_cpp.parallel.slot_choice`), leased until the generation ends. A multimodal chat handler
  (llava-1-5, mtmd, ...), which evaluates its prompt before the completion, leases the slot at its first evaluation
  instead: its text and media chunks go to that slot (an image decoded into the slot's sequence, keyed by its
  content as with one slot), and the generation takes the lease over
  (:mod:`ckpt_plugin.hosts.llama_cpp.parallel.slot_media`).

Speculative decoding: with a draft model (``draft=``), a draft context of N sequences whose drafting steps run in the
target scheduler's loop, every speculating slot's drafts in one batch per step, its state stored with the slot's
checkpoints
(:mod:`ckpt_plugin.hosts.llama_cpp.parallel.slot_drafts`); llama-cpp-python's prompt lookup decoding
(``LlamaPromptLookupDecoding`` as the host's ``draft_model``) gets an instance per slot.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import re
import weakref
from typing import Any, Callable, Iterator, Sequence

import llama_cpp
import numpy as np
from llama_cpp._internals import LlamaTokenDataArray
from llama_cpp.llama import Llama
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

from ckpt_plugin.tiers.ram import PromptCache
from ckpt_plugin.core.config import CheckpointSettings
from ckpt_plugin.tiers.disk import DiskTier
from ckpt_plugin.core.errors import PoolFullError, UnsupportedHostError
from ckpt_plugin.core.request import current_request
from ckpt_plugin.engine.manager import CheckpointManager
from ckpt_plugin.hosts.llama_cpp.parallel.slot_choice import SlotLeases
from ckpt_plugin.hosts.llama_cpp.parallel.kv_sharing import PrefixSharing
from ckpt_plugin.policy.plan import shares_cells
from ckpt_plugin.hosts.llama_cpp.parallel.slot_drafts import SlotDrafts
from ckpt_plugin.hosts.llama_cpp.attachment.patches import Attachment
from ckpt_plugin.hosts.llama_cpp.attachment.backend import HostRows
from ckpt_plugin.hosts.llama_cpp.attachment.logits import NO_ROWS
from ckpt_plugin.hosts.llama_cpp.seam import compat as host
from ckpt_plugin.hosts.llama_cpp.attachment.multimodal import MediaChunkDecode, is_mtmd_handler, relay_for_view
from ckpt_plugin.hosts.llama_cpp.attachment.outside_writes import same_handle
from ckpt_plugin.hosts.llama_cpp.parallel.slot_media import MediaLease
from ckpt_plugin.hosts.llama_cpp.parallel.scheduler import BatchScheduler
from ckpt_plugin.hosts.llama_cpp.parallel.sequences import SequenceBackend, SequenceContext
from ckpt_plugin.hosts.llama_cpp.parallel.slot_views import SlotLlama, view_of

__all__ = ["ParallelLlama"]

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

    def decode_media(self, into: Callable[[Any, int, int], int], n_past: int) -> int:
        """:meth:`SequenceBackend.decode_media`, the slot's logits rows dropped: a media chunk leaves none, and those
        of the chunk before it are no longer the sequence's last (the completion evaluates the prompt's last token,
        text, before anything samples). A full pool of cells is the request's 503, as for a step."""
        self.last_outputs = self.last_outputs[:0]
        try:
            return super().decode_media(into, n_past)
        except PoolFullError as exc:
            scope = current_request.get()
            if scope is not None:
                scope.unavailable = str(exc)
            raise


class SlotAttachment(Attachment):
    """The attachment of one request's view: it leases a slot for each generation and binds the view to it.

    A multimodal chat handler evaluates its prompt before the completion starts: its first evaluation leases the
    slot (for the whole prompt, media positions included), the handler's text and media chunks are evaluated there,
    and the completion's generation takes that lease over (:mod:`ckpt_plugin.hosts.llama_cpp.parallel.slot_media`).
    """

    def __init__(self, view: SlotLlama, parallel: ParallelLlama) -> None:
        manager = parallel.manager
        # Slot 0 stands in until a generation leases a slot: nothing runs on it before.
        super().__init__(view, manager, parallel.backends[0], manager.slots[0])
        self.parallel = parallel
        self._open: weakref.WeakSet[Iterator[int]] = weakref.WeakSet()
        self.media_lease = MediaLease()
        # Nothing of a multimodal prompt can be left to the host here: its handler decodes into sequence 0, another
        # request's slot. Drafts (a draft model or prompt lookup, per slot) would be handed media positions as tokens.
        self.media.must_key = True
        self.media.drafting = lambda: parallel.drafts is not None or parallel.lookups is not None
        self._ended = False

    def patch_methods(self) -> None:
        super().patch_methods()
        self.llama.create_chat_completion = self.create_chat_completion

    def generate(self, tokens: Sequence[int], *args: Any, **kwargs: Any) -> Iterator[int]:
        generation = super().generate(tokens, *args, **kwargs)
        self._open.add(generation)
        return generation

    def create_completion(self, *args: Any, **kwargs: Any) -> Iterator[Any]:
        return _slot_context_errors(super().create_completion(*args, **kwargs), int(self.llama.n_ctx()))

    def create_chat_completion(self, *args: Any, **kwargs: Any) -> Any:
        """The host's ``create_chat_completion`` on the view. A slot its multimodal handler leased is released if no
        generation took it over: when the call fails (the handler's own checks, a prompt too long), or returns a
        whole response without one. A stream's generation takes it over when the stream is read (or the view's
        close releases it)."""
        try:
            response = type(self.llama).create_chat_completion(self.llama, *args, **kwargs)
        except BaseException:
            self._drop_media_lease()
            raise
        if isinstance(response, dict):
            self._drop_media_lease()
        return response

    def _drop_media_lease(self) -> None:
        if self.media_lease.release():
            self.media.disarm()

    # -- a multimodal handler's evaluations, before the completion -------------------------------------------------

    def owns_context(self, lctx: Any) -> bool:
        # The handler decodes into the view's context: the shared one, whichever sequence it names.
        return same_handle(lctx, self.parallel.context.ctx)

    def _lease_for_media(self) -> None:
        """Lease a slot for the multimodal prompt the handler is evaluating, unless one is held already."""
        if self.media_lease.held:
            return
        if self._ended:
            raise RuntimeError("this view's request has ended: its multimodal handler evaluates on no slot")
        tokens = self.media.tokens
        assert tokens is not None
        stack = contextlib.ExitStack()
        stack.enter_context(self._leased(tokens))
        # A chat reads no prompt row (it has no echo): only the last row of each chunk, until the generation says.
        self.backend.needs = NO_ROWS
        self.media_lease.hold(stack)

    def eval(self, tokens: Sequence[int]) -> None:
        if self.prompt_end is not None:  # within a generation, on its slot
            super().eval(tokens)
            return
        if self.media.armed:
            self._lease_for_media()
        elif not self.media_lease.held:
            # Slot 0 only stands in before a lease: evaluating on it would write into another request's slot.
            raise UnsupportedHostError("parallel slots evaluate tokens only within a completion, or as the prompt a "
                                       "multimodal chat handler tokenized; evaluate on the Llama itself, or serve "
                                       "such host code with one slot (--parallel 1)")
        with self.media_lease.evaluating():
            super().eval(tokens)

    def serve_media(self, n_positions: int, decode: MediaChunkDecode) -> int | None:
        """Evaluate the handler's media chunk into this request's slot (leased now if the prompt starts with it),
        whichever sequence the handler names."""
        if not self.media.armed:
            raise UnsupportedHostError("parallel slots evaluate a media chunk only as part of the prompt its "
                                       "multimodal chat handler tokenized")
        self._lease_for_media()
        with self.media_lease.evaluating(), self.controller.lock:
            self._reconcile()
            backend = self.backend
            end = self.media.eval_media(n_positions, lambda start: backend.decode_media(decode.into, start))
        if end is None:
            raise UnsupportedHostError("the multimodal chat handler evaluated a media chunk out of the order it "
                                       "tokenized its prompt in; parallel slots serve such a handler with one slot "
                                       "(--parallel 1)")
        return end

    # -- leases ----------------------------------------------------------------------------------------------------

    def end(self) -> None:
        """End the generations the request left suspended (a client that left mid-stream): their slots are free
        now, not whenever the garbage collector reaches a generator that a reference cycle keeps alive. A slot a
        multimodal handler leased and no generation took over is released too."""
        self._ended = True
        for generation in list(self._open):
            try:
                generation.close()  # type: ignore[attr-defined]
            except ValueError:
                pass  # running in another thread: it ends, and frees its slot, when its step returns
        self.media_lease.release()  # once the handler's evaluation in flight, if any, returns

    @contextlib.contextmanager
    def _leased(self, tokens: np.ndarray) -> Iterator[int]:
        """Lease a slot for a prompt of ``tokens`` (queued first come, first served), bind this view to it, and
        register the prompt in flight; yield the slot's id. At the end the view is unbound (its handle acts on no
        sequence: host code that clears it afterwards, a multimodal handler's reset before its next prompt, clears
        nothing of another request's) and the slot released."""
        parallel = self.parallel
        namespace = self.controller.current_namespace()
        slot_id = parallel.leases.lease(tokens, namespace)
        try:
            self.controller = parallel.manager.slots[slot_id]
            self.backend = parallel.backends[slot_id]
            self.backend.bind(self.llama)
            with contextlib.ExitStack() as stack:
                if parallel.sharing is not None:  # before any hold: a wait for a prefix in flight holds nothing
                    stack.enter_context(parallel.sharing.flight(slot_id, namespace, tokens))
                yield slot_id
        finally:
            self.llama.sequence.bind(None)
            parallel.leases.release(slot_id)

    @contextlib.contextmanager
    def generation_slot(self, tokens: list[int]) -> Iterator[None]:
        """Lease a slot for the generation (queued first come, first served) and bind this view to it; or take over
        the slot the request's multimodal handler evaluated the prompt on."""
        parallel = self.parallel
        with contextlib.ExitStack() as stack:
            evaluated = self.media_lease.take()
            if evaluated is not None:
                stack.enter_context(evaluated)
                slot_id = self.backend.seq_id
            else:
                slot_id = stack.enter_context(self._leased(np.asarray(tokens, dtype=np.int32)))
            # With a store all in memory, the prepare holds the slot and the context until the prompt is queued
            # (BatchScheduler.held_until_submitted); a disk or shared tier may wait on a read or the network.
            held = parallel.scheduler.held_until_submitted(self.controller.lock) if parallel.manager.store.in_memory \
                else contextlib.nullcontext()
            stack.enter_context(parallel.scheduler.generating(slot_id))
            if parallel.drafts is not None:
                self.llama.draft_model = stack.enter_context(parallel.drafts.drafting(slot_id))
            elif parallel.lookups is not None:
                self.llama.draft_model = parallel.lookups[slot_id]
            stack.enter_context(held)
            yield


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
        (:mod:`ckpt_plugin.hosts.llama_cpp.parallel.kv_sharing`), and a prefix in flight is evaluated once.
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
        if is_mtmd_handler(llama.chat_handler):
            # Loaded once, with the model, before any request: the views share it (each with a relay of its own).
            host.init_mtmd_context(llama.chat_handler, llama)
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
            if not controller.holds_outside_writes:
                controller.save_to_cache()
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
                if (controller.slot.n_tokens >= self.manager.settings.cache_min_tokens
                        and not controller.holds_outside_writes):
                    try:
                        controller.save_to_cache()
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
        # A multimodal chat handler evaluates through this view's attachment (its own copy of the handler).
        view.chat_handler = relay_for_view(view.chat_handler, attachment)
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
