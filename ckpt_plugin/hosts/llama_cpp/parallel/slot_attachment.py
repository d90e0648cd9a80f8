"""The attachment of one request's view of the parallel slots (:class:`SlotAttachment`): it leases a slot for each
generation, binds the view to it, and serves a multimodal handler's evaluations on the slot it leases first."""

from __future__ import annotations

import contextlib
import re
import weakref
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import numpy as np

from ckpt_plugin.core.errors import UnsupportedHostError
from ckpt_plugin.hosts.llama_cpp.attachment.logits import NO_ROWS
from ckpt_plugin.hosts.llama_cpp.attachment.multimodal import MediaChunkDecode
from ckpt_plugin.hosts.llama_cpp.attachment.outside_writes import same_handle
from ckpt_plugin.hosts.llama_cpp.attachment.patches import Attachment
from ckpt_plugin.hosts.llama_cpp.parallel.slot_media import MediaLease
from ckpt_plugin.hosts.llama_cpp.parallel.slot_views import SlotLlama

if TYPE_CHECKING:
    from ckpt_plugin.hosts.llama_cpp.parallel.parallel_llama import ParallelLlama

__all__ = ["SlotAttachment"]


class SlotAttachment(Attachment):
    """The attachment of one request's view: it leases a slot for each generation and binds the view to it.

    A multimodal chat handler evaluates its prompt before the completion starts: its first evaluation leases the
    slot (for the whole prompt, media positions included), the handler's text and media chunks are evaluated there,
    and the completion's generation takes that lease over (:mod:`ckpt_plugin.hosts.llama_cpp.parallel.slot_media`).
    """

    def __init__(self, view: SlotLlama, parallel: ParallelLlama) -> None:
        manager = parallel.manager
        # Slot 0 stands in until a generation leases a slot: nothing runs on it before.
        super().__init__(view, manager, parallel.backends[0], manager.controllers[0])
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
            self.controller = parallel.manager.controllers[slot_id]
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
