"""One sequence of the parallel slots' shared context as an engine slot's backend (:class:`ViewBackend`): the
bookkeeping of whichever request's view holds the slot, and evaluation through the batch scheduler."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
from llama_cpp._internals import LlamaTokenDataArray
from llama_cpp.llama import Llama

from ckpt_plugin.core.errors import PoolFullError
from ckpt_plugin.core.request import current_request
from ckpt_plugin.hosts.llama_cpp.attachment.backend import HostRows
from ckpt_plugin.hosts.llama_cpp.parallel.scheduler import BatchScheduler
from ckpt_plugin.hosts.llama_cpp.parallel.sequences import SequenceBackend, SequenceContext
from ckpt_plugin.hosts.llama_cpp.parallel.slot_views import SlotLlama

__all__ = ["ViewBackend"]


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
