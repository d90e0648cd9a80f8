"""The patches installed on one ``llama_cpp.Llama`` (:class:`Attachment`), which
:mod:`~ckpt_plugin.hosts.llama_cpp.attachment.attach` installs and removes.

:func:`~ckpt_plugin.hosts.llama_cpp.attachment.attach.attach` patches seven methods on one ``llama_cpp.Llama``
instance (never the class):

- ``generate``: before the host's own prefix matching runs, the manager restores the best state for the prompt
  (live memory, checkpoint or prompt-cache entry) and sets the host's ``n_tokens`` to what the memory holds, so the
  host's ``kv_cache_seq_rm`` is a no-op and its destructive fallbacks (clearing a recurrent memory, truncating a
  sliding window that lost the prefix) never run;
- ``eval``: evaluates through the manager, which pauses where checkpoints are taken;
- ``save_state`` / ``load_state``: return and accept a :class:`SharedLlamaState` that references the slot's full
  state (an immutable :class:`~ckpt_plugin.core.checkpoint.Checkpoint`) and its checkpoints instead of copying the
  state and the logits array;
- ``set_cache``: installs :class:`HostPromptCache`, a ``BaseLlamaCache`` view of the manager's prefix-indexed cache;
- ``_init_sampler``: a request's sampler chain with a grammar, or a request asking for ``ignore_eos``, becomes a
  :class:`~ckpt_plugin.hosts.llama_cpp.attachment.guarded_sampling.GuardedSampler`: a grammar that matches nothing where
  the generation went ends it with :class:`~ckpt_plugin.core.errors.GrammarDeadEnd` instead of aborting the process;
- ``_create_completion``: notes whether the request reads logprobs (and of the prompt, with ``echo``), so that
  evaluation computes and keeps only the logits someone reads (:mod:`ckpt_plugin.hosts.llama_cpp.attachment.logits`;
  :mod:`ckpt_plugin.hosts.llama_cpp.attachment.host_logprobs`).
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, ContextManager, Iterator, Sequence

import llama_cpp
import numpy as np
from llama_cpp.llama import Llama, LlamaState
from llama_cpp.llama_cache import BaseLlamaCache

from ckpt_plugin.core.errors import GrammarDeadEnd, OpaqueMemoryError
from ckpt_plugin.core.request import Refused, RequestInterrupted, current_request
from ckpt_plugin.engine.manager import CheckpointManager
from ckpt_plugin.engine.slot_controller import SlotController
from ckpt_plugin.hosts.llama_cpp.attachment.backend import HostRows
from ckpt_plugin.hosts.llama_cpp.attachment.guarded_sampling import guarded_chain
from ckpt_plugin.hosts.llama_cpp.attachment.host_cache import (
    HostPromptCache,
    SharedLlamaState,
    host_only_known,
    mark_host_only,
    tiers_for_host_cache,
)
from ckpt_plugin.hosts.llama_cpp.attachment.host_logprobs import completion_noting_reads
from ckpt_plugin.hosts.llama_cpp.attachment.logits import generation_needs
from ckpt_plugin.hosts.llama_cpp.attachment.media_flow import MediaFlow
from ckpt_plugin.hosts.llama_cpp.attachment.multimodal import MediaChunkDecode, install_relay, remove_relay
from ckpt_plugin.hosts.llama_cpp.attachment.outside_prompts import serve_outside_writes
from ckpt_plugin.hosts.llama_cpp.attachment.outside_writes import same_handle
from ckpt_plugin.hosts.llama_cpp.seam import compat as host

__all__ = ["Attachment", "attachment_of"]

_PATCHED = ("eval", "generate", "save_state", "load_state", "set_cache", "_init_sampler", host.COMPLETION_METHOD)
_ATTACHMENT_ATTR = "_ckpt_plugin_attachment"


class _Generation:
    """One call of the host's ``generate``: the prompt boundary its evaluations need.

    Only the generation itself writes to this object, so an abandoned generation that the garbage collector closes
    later, from whatever thread, changes nothing anybody else reads.
    """

    __slots__ = ("prompt_end", "finished")

    def __init__(self) -> None:
        self.prompt_end: int | None = None
        self.finished = False


class Attachment:
    """The patches installed on one ``Llama`` and what they replaced.

    Ownership (``docs/design.md``, "Who owns the slot"): the manager's lock is held only inside the synchronous
    calls below (prepare, one ``eval``, ``save_state``, ``load_state``), never across a ``yield`` to the host. The
    latest generation owns the slot; one the host stopped iterating (a dropped client, an interrupted stream) owns
    nothing once a newer one starts, and the memory itself tells the next request what is in it.
    """

    def __init__(self, llama: Llama, manager: CheckpointManager, backend: HostRows, controller: SlotController) -> None:
        self.llama = llama
        self.manager = manager
        self.backend = backend
        self.controller = controller
        self.saved = {name: llama.__dict__[name] for name in _PATCHED if name in llama.__dict__}
        self.saved_cache = llama.cache
        self.current: _Generation | None = None
        # (logprobs, echo) of the completion whose generation starts next.
        self.pending_reads: tuple[bool, bool] | None = None
        self._generate = type(llama).generate.__get__(llama)
        self._load_state = type(llama).load_state.__get__(llama)
        self._init_sampler = type(llama)._init_sampler.__get__(llama)
        self._generate_signature = inspect.signature(type(llama).generate)
        completion = getattr(type(llama), host.COMPLETION_METHOD)
        self._create_completion = completion.__get__(llama)
        self._completion_signature = inspect.signature(completion)
        # Generations started so far, and how many had started when the memory was first seen holding positions
        # written from outside (``None``: it holds none). Such positions serve only the generation that follows
        # them directly (the host code that wrote them is about to complete them); a later one drops them.
        self.generations = 0
        self.opaque_since: int | None = None
        self.media = MediaFlow(getattr(backend, "watched", None), llama, self._prepare_media, self._memory_end,
                               self._process, self._process_media)

    @property
    def prompt_end(self) -> int | None:
        """Prompt length of the generation that owns the slot, ``None`` outside a generation."""
        current = self.current
        return current.prompt_end if current is not None and not current.finished else None

    def patch_methods(self) -> None:
        """Install the patched methods on the instance."""
        llama = self.llama
        llama.eval = self.eval
        llama.generate = self.generate
        llama.save_state = self.save_state
        llama.load_state = self.load_state
        llama.set_cache = self.set_cache
        llama._init_sampler = self.init_sampler
        setattr(llama, host.COMPLETION_METHOD, self.create_completion)

    def install(self) -> None:
        self.patch_methods()
        llama = self.llama
        self.backend.take_over_scores()
        if llama.cache is not None:
            self.set_cache(llama.cache)
        install_relay(getattr(llama, "chat_handler", None), self)
        setattr(llama, _ATTACHMENT_ATTR, self)

    def uninstall(self) -> None:
        llama = self.llama
        for name in _PATCHED:
            llama.__dict__.pop(name, None)
        llama.__dict__.update(self.saved)
        llama.cache = self.saved_cache
        llama.__dict__.pop(_ATTACHMENT_ATTR, None)
        remove_relay(getattr(llama, "chat_handler", None))
        self.media.disarm()
        self.backend.release()

    # -- outside writes and media ------------------------------------------------------------------------------------

    def owns_context(self, lctx: Any) -> bool:
        return same_handle(lctx, self.llama.ctx)

    def serve_media(self, n_positions: int, decode: MediaChunkDecode) -> int | None:
        with self.controller.lock:
            self._reconcile()
            return self.media.eval_media(n_positions, decode)  # where the handler asked: the Llama's sequence 0

    # The controller is looked up at each call: a parallel view's changes with each lease.
    def _memory_end(self) -> int:
        return self.controller.slot.n_tokens

    def _process(self, tokens: np.ndarray, prompt_end: int) -> None:
        self.controller.process(tokens, prompt_end)

    def _process_media(self, ids: np.ndarray, fill: Callable[[], None], prompt_end: int) -> None:
        self.controller.process_media(ids, fill, prompt_end)

    def _prepare_media(self, prompt: np.ndarray, max_keep: int | None) -> int:
        n_keep = self.controller.prepare(prompt, max_keep=max_keep)
        self._sync_host(n_keep, prompt)
        return n_keep

    def _reconcile(self) -> None:
        """The controller's reconcile, noting when the memory started holding positions written from outside."""
        controller = self.controller
        controller.reconcile()
        if not controller.holds_outside_writes:
            self.opaque_since = None
        elif self.opaque_since is None:
            self.opaque_since = self.generations

    def _stands_aside(self) -> bool:
        """Whether the generation starting now is served as the host alone would: the memory holds positions
        written from outside since the last generation, by this tenant (see ``opaque_since``)."""
        controller = self.controller
        if not controller.holds_outside_writes:
            return False
        if self.opaque_since == self.generations and controller.slot.namespace == controller.current_namespace():
            return True
        controller.discard_outside_writes()
        self.opaque_since = None
        return False


    def _continuation(self, tokens: list[int], args: tuple, kwargs: dict) -> tuple[list[int], tuple, dict]:
        """The host's ``generate`` arguments to evaluate ``tokens`` after what it holds (without its reset)."""
        bound = self._generate_signature.bind(self.llama, tokens, *args, **kwargs)
        bound.arguments["reset"] = False
        return list(bound.args[1]), tuple(bound.args[2:]), dict(bound.kwargs)

    def _sync_host(self, n_keep: int, tokens: np.ndarray) -> None:
        host.set_evaluated_prefix(self.llama, tokens, n_keep)

    # -- patched methods --------------------------------------------------------------------------------------------

    def eval(self, tokens: Sequence[int]) -> None:
        with self.controller.lock:
            self._eval(tokens)

    def _eval(self, tokens: Sequence[int]) -> None:
        llama, controller = self.llama, self.controller
        new = np.asarray(tokens, dtype=np.int32).reshape(-1)
        self._reconcile()
        if self.media.armed and self.media.eval_text(new):
            return
        n_host = llama.n_tokens
        slot = controller.slot
        if controller.holds_outside_writes:
            if n_host > slot.n_tokens:
                # Host code evaluates after positions it wrote itself: as the host alone, nothing recorded.
                try:
                    self.backend.decode(new)
                except RuntimeError as exc:
                    # llama.cpp refused the batch (nothing changed): the host's record and the memory disagree.
                    raise OpaqueMemoryError(
                        f"the host evaluates after positions written outside the engine where its record does not "
                        f"match the memory ({exc}); nothing was evaluated") from exc
                controller.counters.add(tokens_evaluated=len(new))
                return
            controller.discard_outside_writes()
        if n_host != slot.n_tokens or (len(new) > 1 and not np.array_equal(llama.input_ids[:n_host], slot.tokens)):
            wanted = np.concatenate((llama.input_ids[:n_host].astype(np.int32), new))
            n_keep = controller.prepare(wanted)
            self._sync_host(n_keep, wanted)
            new = wanted[n_keep:]
        prompt_end = self.prompt_end
        if prompt_end is None:
            prompt_end = llama.n_tokens + len(new)
        controller.process(new, prompt_end)

    def init_sampler(self, *args: Any, **kwargs: Any) -> Any:
        """The host's sampler chain, guarded where the request needs it
        (:func:`~ckpt_plugin.hosts.llama_cpp.attachment.guarded_sampling.guarded_chain`)."""
        return guarded_chain(self.llama, self._init_sampler, args, kwargs)

    def create_completion(self, *args: Any, **kwargs: Any) -> Iterator[Any]:
        """The host's ``_create_completion``, noting the logits the request reads
        (:func:`~ckpt_plugin.hosts.llama_cpp.attachment.host_logprobs.completion_noting_reads`)."""
        return completion_noting_reads(self.llama, self._create_completion, self._completion_signature, args, kwargs,
                                       self._note_reads)

    def _note_reads(self, reads: tuple[bool, bool]) -> None:
        # The host's body runs on the completion's first next(): it calls generate() within that very call, which
        # takes the reads (so the rows are kept even though the host itself is not asked for logprobs).
        self.pending_reads = reads

    def generate(self, tokens: Sequence[int], *args: Any, **kwargs: Any) -> Iterator[int]:
        bound = self._generate_signature.bind(self.llama, tokens, *args, **kwargs)
        reset = bound.arguments.get("reset", True)
        stopping = bound.arguments.get("stopping_criteria") is not None
        return self._generation(list(tokens), reset, stopping, args, kwargs)

    def generation_slot(self, tokens: list[int]) -> ContextManager[None]:
        """The slot a generation of ``tokens`` runs on, held while it runs (:attr:`controller` and :attr:`backend`
        name it): this attachment's one slot. An attachment of a view of parallel slots leases one here."""
        return contextlib.nullcontext()

    def _generation(
        self, tokens: list[int], reset: bool, stopping: bool, args: tuple, kwargs: dict
    ) -> Iterator[int]:
        """The host's generation of ``tokens`` on the slot it holds while it runs (:meth:`generation_slot`), the slot
        prepared for the prompt first, and ended at the request's limits."""
        with self.generation_slot(tokens):
            generation = _Generation()
            reads, self.pending_reads = self.pending_reads, None
            with self.controller.lock:
                # The newest generation owns the slot: an older one the host abandoned mid-stream is superseded.
                self.current = generation
                self.controller.mark_busy()
                try:
                    skip = self._begin(generation, tokens, reset, stopping, reads or (False, False))
                except BaseException:  # a refused or failed prepare leaves the slot free, not busy for ever
                    self._end(generation)
                    raise
            if skip:
                tokens, args, kwargs = self._continuation(tokens[skip:], args, kwargs)
            request = current_request.get()
            try:
                if request is None:
                    yield from self._generate(tokens, *args, **kwargs)
                    return
                # The server's limits and its client's disconnect end the generation at the next token: the host
                # then finishes the response as if max_tokens was reached, and the model is free for the next one.
                vocab = llama_cpp.llama_model_get_vocab(self.llama.model)
                if request.completion_tokens is None:
                    request.completion_tokens = 0
                try:
                    for generated, token in enumerate(self._generate(tokens, *args, **kwargs)):
                        if request.should_stop(generated):
                            return
                        if not llama_cpp.llama_vocab_is_eog(vocab, token):  # the host's usage counts it
                            request.completion_tokens += 1
                        yield token
                except RequestInterrupted:
                    return  # between two batches of the prompt: the same end, before the first token
                except GrammarDeadEnd as exc:
                    request.refused = Refused(422, "invalid_grammar", str(exc))
                    raise
            finally:
                self._end(generation)

    def _end(self, generation: _Generation) -> None:
        """``generation`` is over: the slot is free unless a newer generation owns it."""
        generation.finished = True
        if self.current is generation:
            self.backend.end_generation()
            self.controller.mark_idle()

    def _begin(self, generation: _Generation, tokens: list[int], reset: bool, stopping: bool,
               reads: tuple[bool, bool]) -> int | None:
        """Prepare the slot for a generation of ``tokens`` (the controller's lock held); how many prompt tokens the
        host skips while standing aside (``None``: the engine serves the prompt)."""
        logprobs, echo = reads
        prompt = np.asarray(tokens, dtype=np.int32)
        generation.prompt_end = len(tokens) if reset else self.llama.n_tokens + len(tokens)
        needs = generation_needs(generation.prompt_end, logprobs=logprobs, echo=echo, stopping_criteria=stopping,
                                 draft=self.llama.draft_model is not None)
        limit = self.backend.begin_generation(needs, prompt if reset else prompt[:0])
        self._reconcile()
        media_done = reset and self.media.completed(prompt)
        self.media.disarm()
        skip: int | None = None
        if self._stands_aside():
            try:
                skip = (serve_outside_writes(self.llama, self.controller, self.backend, prompt)
                        if reset and tokens else 0)
            except OpaqueMemoryError:
                self.generations += 1  # refused: the positions serve no later generation either
                raise
        if skip is not None:
            self.controller.counters.add(stood_aside=1)
        elif media_done and self.controller.slot.n_tokens == len(prompt) - 1 and (limit is None or
                                                                                  limit >= len(prompt) - 1):
            # The handler's chunks were served from the memory and the stores already, all but the last token.
            self._sync_host(len(prompt) - 1, prompt)
        elif reset and tokens:
            n_keep = self.controller.prepare(prompt, max_keep=limit)
            self._sync_host(n_keep, prompt)
        self.generations += 1
        return skip

    def save_state(self) -> LlamaState:
        with self.controller.lock:
            self._reconcile()
            if self.controller.holds_outside_writes:
                # Positions no token id names: the host's own copy of the whole state, kept out of every store.
                state = type(self.llama).save_state(self.llama)
                return mark_host_only(state, self.controller.slot.n_tokens)
            return SharedLlamaState(self.controller.save(), host.seed(self.llama))

    def load_state(self, state: LlamaState) -> None:
        with self.controller.lock:
            if isinstance(state, SharedLlamaState):
                n_keep = self.controller.load(state.entry)
                self._sync_host(n_keep, state.entry.tokens)
                host.set_seed(self.llama, state.seed)
                return
            self.backend.load_host_state(self._load_state, state)
            tokens = np.asarray(state.input_ids[: state.n_tokens], dtype=np.int32)
            known = host_only_known(state)
            self.controller.adopt_memory(tokens if known is None else tokens[:known])
            self._reconcile()

    def set_cache(self, cache: BaseLlamaCache | None) -> None:
        if cache is None or isinstance(cache, HostPromptCache):
            self.llama.cache = cache
            return
        with self.controller.lock:
            self.manager.use_shared_tiers(*tiers_for_host_cache(cache, self.manager.settings))
        self.llama.cache = HostPromptCache(self.manager, self.llama)


def attachment_of(llama: Llama) -> Attachment | None:
    """The attachment installed on ``llama``, or ``None``."""
    return getattr(llama, _ATTACHMENT_ATTR, None)
