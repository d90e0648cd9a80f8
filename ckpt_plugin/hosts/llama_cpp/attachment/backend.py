"""Sequence 0 of a ``llama_cpp.Llama`` context as an engine slot's :class:`~ckpt_plugin.core.slot.Backend`, and the host's
logits rows it keeps for the generations that read them (:mod:`ckpt_plugin.hosts.llama_cpp.attachment.logits`)."""

from __future__ import annotations

from typing import Any, Callable

import llama_cpp
import numpy as np
from llama_cpp.llama import Llama, LlamaState

from ckpt_plugin.hosts.llama_cpp.seam import compat as host
from ckpt_plugin.hosts.llama_cpp.attachment.logits import EVERY_ROW, NO_ROWS, LogitsNeeds, max_keep
from ckpt_plugin.core.memory import common_prefix
from ckpt_plugin.core.request import RequestInterrupted, current_request
from ckpt_plugin.hosts.llama_cpp.seam.context import state_flags, U8_P, writable_start, fingerprint, memory_kind
from ckpt_plugin.hosts.llama_cpp.attachment.outside_writes import OUTSIDE_WRITES, engine_writes

__all__ = ["HostRows", "LlamaBackend"]


class HostRows:
    """A ``Llama``'s evaluation bookkeeping: ``input_ids``, ``n_tokens`` and the ``scores`` rows a generation reads.

    Evaluation computes only the logits the current generation reads (``needs``, see
    :mod:`ckpt_plugin.hosts.llama_cpp.attachment.logits`) and keeps the host's ``scores`` array small unless a
    generation reads its rows: the ``n_ctx x n_vocab`` array a ``logits_all=True`` host allocates (4.3 GB of address
    space for Gemma-3 at n_ctx 4096) is released on attach and allocated again only for a request that reads prompt
    or completion logprobs.

    Subclasses evaluate a chunk (:meth:`_decode_chunk`) and drop positions (:meth:`_forget_after`) on their sequence.
    """

    llama: Llama
    n_ctx: int

    def _use_host(self, llama: Llama) -> None:
        """Keep ``llama``'s bookkeeping from now on (its rows start empty)."""
        self.llama = llama
        self._n_vocab = int(llama.n_vocab())
        self.host_logits_all = host.wants_all_logits(llama)
        # Outside a generation, a direct ``eval`` gets what the host asked for.
        self.default_needs: LogitsNeeds = EVERY_ROW if self.host_logits_all else NO_ROWS
        self.needs = self.default_needs
        self._host_scores_shape = tuple(llama.scores.shape)
        self._full = False
        # The tokens whose logits rows [0, len) of the full array hold; a row depends only on the tokens before it.
        self._row_tokens = np.zeros(0, dtype=np.int32)

    def _decode_chunk(self, chunk: np.ndarray, n_past: int, first: int) -> np.ndarray:
        """Evaluate ``chunk`` at positions ``n_past...`` with logits for its tokens ``first..`` (the last always);
        return those rows (``len(chunk) - first`` of them), valid until the next evaluation."""
        raise NotImplementedError

    def _forget_after(self, n_past: int) -> None:
        """Drop the sequence's positions ``>= n_past`` (what the host's ``eval`` does first)."""
        raise NotImplementedError

    def decode(self, tokens: np.ndarray) -> None:
        """``Llama.eval`` with per-token logits flags: llama.cpp computes the logits of each batch's last token and
        of the positions ``needs`` names, not of every token.

        Before each batch, the request being served is asked whether it was interrupted (its client left, or its
        time is up): a long prompt then stops within one batch instead of holding the slot to its end.

        :raises RequestInterrupted: The request was interrupted; the memory and ``n_tokens`` hold the batches
            decoded before.
        """
        llama, needs = self.llama, self.needs
        self._forget_after(int(llama.n_tokens))
        n_batch = int(llama.n_batch)
        request = current_request.get()
        for start in range(0, len(tokens), n_batch):
            if request is not None and request.interrupted():
                raise RequestInterrupted(start)
            chunk = tokens[start : start + n_batch]
            n_past, n = int(llama.n_tokens), len(chunk)
            first = needs.first_output(n_past, n)
            outputs = self._decode_chunk(chunk, n_past, first)
            llama.input_ids[n_past : n_past + n] = chunk
            self._keep_rows(needs, n_past, chunk, first, outputs)
            llama.n_tokens += n

    def _one_row(self) -> np.ndarray:
        # Enough for ``scores[-1]`` (``Llama._scores[-1]``: what a stopping criterion reads).
        return np.zeros((1, self._n_vocab), dtype=np.single)

    def _full_scores(self) -> np.ndarray:
        if not self._full:
            # calloc'd: zero pages until written, so only the rows written become resident, and rows nobody wrote
            # read as zeros (the host computes logprobs over every row, even those it then drops).
            self.llama.scores = np.zeros((self.n_ctx, self._n_vocab), dtype=np.single)
            self._full = True
            self._row_tokens = self._row_tokens[:0]
        return self.llama.scores

    def exact_rows(self, prompt: np.ndarray) -> int:
        """How many leading rows of ``scores`` hold the logits ``prompt``'s tokens would get."""
        if not self._full:
            return 0
        return common_prefix(self._row_tokens, prompt)

    def _keep_rows(self, needs: LogitsNeeds, n_past: int, chunk: np.ndarray, first: int, outputs: np.ndarray) -> None:
        n = len(chunk)
        known = len(self._row_tokens)
        if needs.rows_from is not None:
            scores = self._full_scores()
            kept_from = max(0, needs.rows_from - n_past)
            if kept_from < n:
                scores[n_past + kept_from : n_past + n] = outputs[kept_from - first :]
            if needs.latest_row:
                # Row 0 now holds another position's logits: no leading row is known exact any more.
                scores[0] = outputs[-1]
                self._row_tokens = self._row_tokens[:0]
                return
            if kept_from == 0 and known >= n_past:
                self._row_tokens = np.concatenate((self._row_tokens[:n_past], chunk))
                return
        elif needs.latest_row:
            # Where ``scores[:n_tokens][0]`` and ``[-1]`` both land: a one-row array.
            scores = self.llama.scores
            scores[min(n_past + n, len(scores)) - 1] = outputs[-1]
        if known > n_past:
            self._row_tokens = self._row_tokens[:n_past]

    def take_over_scores(self) -> None:
        """Release the host's ``scores`` array (on attach): rows are kept only while a generation reads them."""
        self.llama.scores = self._one_row()
        self._full, self._row_tokens = False, self._row_tokens[:0]

    def begin_generation(self, needs: LogitsNeeds, prompt: np.ndarray) -> int | None:
        """Serve a generation that reads ``needs``; return the most prompt tokens a restore may keep for it."""
        if not needs.full_rows and len(self.llama.scores) > 1:
            # Nobody reads the rows now: give their memory back.
            self.llama.scores = self._one_row()
            self._full = False
            self._row_tokens = self._row_tokens[:0]
        self.needs = needs
        return max_keep(needs, self.exact_rows(prompt))

    def load_host_state(self, load: Callable[[LlamaState], None], state: LlamaState) -> None:
        """Run the host's own ``load_state`` for a plain ``LlamaState``: it copies the state's logits rows into a
        ``scores`` array of the host's own shape, which then holds the rows of the state's tokens."""
        self.llama.scores = np.zeros(self._host_scores_shape, dtype=np.single)
        self._full = self._host_scores_shape[0] >= self.n_ctx
        load(state)
        n_rows = min(int(state.n_tokens), len(state.scores)) if self._full and np.ndim(state.scores) == 2 else 0
        self._row_tokens = np.asarray(state.input_ids[:n_rows], dtype=np.int32)

    def end_generation(self) -> None:
        """Back to what the host asked for, for direct ``eval`` calls (the rows stay for readers)."""
        self.needs = self.default_needs

    def release(self) -> None:
        """Give the host its own ``scores`` array back (on detach)."""
        llama = self.llama
        if not (self._full and tuple(llama.scores.shape) == self._host_scores_shape):
            llama.scores = np.ndarray(self._host_scores_shape, dtype=np.single)
            self._full, self._row_tokens = False, self._row_tokens[:0]
        if self.host_logits_all and self.exact_rows(llama.input_ids[: llama.n_tokens]) < llama.n_tokens:
            # The host would reuse rows it believes exact: have it evaluate its next prompt in full.
            host.set_evaluated_prefix(llama, llama.input_ids, 0)


class LlamaBackend(HostRows):
    """Sequence 0 of a ``llama_cpp.Llama`` context, as the manager's :class:`~ckpt_plugin.core.slot.Backend`."""

    def __init__(self, llama: Llama) -> None:
        self.kind = memory_kind(llama)
        self.fingerprint = fingerprint(llama)
        self.n_ctx = int(llama.n_ctx())
        self._memory = llama_cpp.llama_get_memory(llama.ctx)
        self._use_host(llama)
        self.watched = OUTSIDE_WRITES.watch(llama.ctx, self._memory, 0)
        # What the memory held before the engine existed (a Llama attached again after detach, or after use alone):
        # the host's record is all there is to name it, as the host alone would trust it.
        held = min(int(llama.n_tokens), int(llama_cpp.llama_memory_seq_pos_max(self._memory, 0)) + 1)
        if held > 0:
            self.watched.named(0, np.asarray(llama.input_ids[:held], dtype=np.int64))

    def take_outside_write(self) -> int:
        """The first position written to the memory from outside the engine since the last call (a huge number
        if none), see :mod:`.outside_writes`."""
        return self.watched.take()

    def release(self) -> None:
        OUTSIDE_WRITES.unwatch(self.watched)
        super().release()

    def decode(self, tokens: np.ndarray) -> None:
        # The watched record follows the engine's writes too: what an outside write left is judged against it.
        start = int(self.llama.n_tokens)
        self.watched.unnamed(start)
        try:
            with engine_writes():
                super().decode(tokens)
        finally:
            end = int(self.llama.n_tokens)
            if end > start:
                self.watched.named(start, np.asarray(tokens[: end - start]))
                self.watched.decoded(end)  # every chunk's last row has logits

    def load_host_state(self, load: Callable[[LlamaState], None], state: LlamaState) -> None:
        self.watched.unnamed(0)
        with engine_writes():
            super().load_host_state(load, state)

    @property
    def _ctx(self) -> Any:
        return self.llama.ctx

    def state_size(self, partial: bool) -> int:
        return int(llama_cpp.llama_state_seq_get_size_ext(self._ctx, 0, state_flags(partial)))

    def read_state(self, buffer: np.ndarray, partial: bool) -> int:
        return int(
            llama_cpp.llama_state_seq_get_data_ext(self._ctx, writable_start(buffer), buffer.nbytes, 0, state_flags(partial))
        )

    def write_state(self, buffer: np.ndarray, partial: bool) -> int:
        # The read-only buffer is handed over by address: llama.cpp only reads it.
        self.watched.unnamed(0)
        with engine_writes():
            return int(
                llama_cpp.llama_state_seq_set_data_ext(
                    self._ctx, buffer.ctypes.data_as(U8_P), buffer.nbytes, 0, state_flags(partial)
                )
            )

    def pos_min(self) -> int:
        return int(llama_cpp.llama_memory_seq_pos_min(self._memory, 0))

    def pos_max(self) -> int:
        return int(llama_cpp.llama_memory_seq_pos_max(self._memory, 0))

    def truncate(self, n_keep: int) -> bool:
        with engine_writes():
            done = bool(llama_cpp.llama_memory_seq_rm(self._memory, 0, n_keep, -1))
        if done:
            self.watched.unnamed(n_keep)
        return done

    def clear(self) -> None:
        with engine_writes():
            llama_cpp.llama_memory_seq_rm(self._memory, 0, -1, -1)
        self.watched.unnamed(0)

    def _forget_after(self, n_past: int) -> None:
        ctx, _ = host.decode_handles(self.llama)
        ctx.kv_cache_seq_rm(-1, n_past, -1)

    def _decode_chunk(self, chunk: np.ndarray, n_past: int, first: int) -> np.ndarray:
        ctx, batch = host.decode_handles(self.llama)
        n = len(chunk)
        batch.set_batch(batch=chunk.tolist(), n_past=n_past, logits_all=False)
        flags = batch.batch.logits
        for j in range(first, n - 1):
            flags[j] = True
        ctx.decode(batch)
        # A view of llama.cpp's own output buffer: no copy.
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits(self._ctx), shape=(n - first, self._n_vocab))
