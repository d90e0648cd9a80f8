"""A llama.cpp context with several sequences over the weights of a ``Llama``: one engine slot per sequence id.

llama-cpp-python's ``Llama`` creates its context with one sequence. :class:`SequenceContext` creates a second context
on the same model (no second copy of the weights) with ``n_seq`` sequences, in one KV cache they share or in a KV
stream each (as llama.cpp's server does with ``--parallel``); each :class:`SequenceBackend` is one
sequence, the :class:`~ckpt_plugin.core.slot.Backend` of one engine slot. A state captured from one sequence restores into
any other of the same context (the fingerprint covers the context's parameters and its number of sequences).
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import llama_cpp
import numpy as np
from llama_cpp.llama import Llama

from ckpt_plugin.core.errors import PoolFullError, StateRestoreError
from ckpt_plugin.hosts.llama_cpp.attachment.multimodal import MediaDecodeError
from ckpt_plugin.hosts.llama_cpp.seam.context import state_flags, U8_P, writable_start, fingerprint_of, memory_kind
from ckpt_plugin.core.memory import MemoryKind
from ckpt_plugin.core.renamed import Renamed

__all__ = ["SequenceBackend", "SequenceContext"]


class SequenceContext:
    """``n_seq`` sequences in one llama.cpp context over ``llama``'s model.

    :param llama: Gives the model and the context parameters (threads, flash attention, cache types, window).
    :param n_seq: Sequences (slots).
    :param n_ctx: Cells of the KV cache (default: ``llama``'s ``n_ctx``).
    :param unified: One KV cache the sequences share (``True``), or one stream of ``n_ctx / n_seq`` cells per
        sequence (``False``, llama.cpp's server's default with ``--parallel``): attention then spans a sequence's
        own cells only, where in a shared cache every token attends over the whole range of used cells, every
        sequence's (masked), which grows with the slots' turnover.
    :ivar unified: Whether the sequences share one KV cache (else each has a stream of its own).
    :ivar seq_n_ctx: The most positions one sequence can hold: every cell, or its stream's.
    :ivar lock: Held around every llama.cpp call on the context (llama.cpp contexts are not thread-safe).
    :ivar kind: The memory kind.
    :ivar fingerprint: What a state of this context must carry to be restored here.
    """

    def __init__(
        self, llama: Llama, n_seq: int, n_ctx: int | None = None, unified: bool = True
    ) -> None:
        if n_seq < 1:
            raise ValueError("a context needs at least one sequence")
        self.llama = llama  # keeps the model alive as long as this context
        # A copy: the Llama's own parameters stay as they are.
        params = type(llama.context_params).from_buffer_copy(llama.context_params)
        params.n_ctx = int(n_ctx or llama.n_ctx())
        params.n_seq_max = n_seq
        params.kv_unified = unified
        self.ctx = llama_cpp.llama_init_from_model(llama.model, params)
        if not self.ctx:
            raise MemoryError(f"llama.cpp could not create a context of {params.n_ctx} cells for {n_seq} sequences")
        self.memory = llama_cpp.llama_get_memory(self.ctx)
        self.n_seq = n_seq
        self.n_ctx = int(llama_cpp.llama_n_ctx(self.ctx))
        self.unified = unified
        self.seq_n_ctx = self.n_ctx if unified else self.n_ctx // n_seq
        self.n_batch = int(llama_cpp.llama_n_batch(self.ctx))
        self.n_vocab = int(llama.n_vocab())
        self.kind: MemoryKind = memory_kind(llama)
        self.fingerprint = fingerprint_of(llama, params, self.n_ctx, n_seq)
        self._batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)
        self._logits = np.zeros((n_seq, self.n_vocab), dtype=np.single)
        self.lock = threading.RLock()
        # Set where the sequences share one pool of cells: called, the context held, when a decode or a restore
        # finds no room; frees the cells of a slot no generation holds and returns True, or False if none is left.
        self.make_room: Callable[[], bool] | None = None
        self._closed = False

    def sequence(self, seq_id: int) -> SequenceBackend:
        """The :class:`~ckpt_plugin.core.slot.Backend` of sequence ``seq_id``."""
        if not 0 <= seq_id < self.n_seq:
            raise ValueError(f"sequence {seq_id} is not one of this context's {self.n_seq}")
        return SequenceBackend(self, seq_id)

    def decode(self, seq_id: int, tokens: np.ndarray) -> None:
        """Evaluate ``tokens`` after sequence ``seq_id``'s last position, in batches of ``n_batch``; the logits of
        the last token are kept (:meth:`logits`)."""
        batch = self._batch
        with self.lock:
            position = int(llama_cpp.llama_memory_seq_pos_max(self.memory, seq_id)) + 1
            for start in range(0, len(tokens), self.n_batch):
                chunk = tokens[start : start + self.n_batch]
                n = len(chunk)
                for i, token in enumerate(chunk.tolist()):
                    batch.token[i] = token
                    batch.pos[i] = position + i
                    batch.n_seq_id[i] = 1
                    batch.seq_id[i][0] = seq_id
                    batch.logits[i] = i == n - 1
                batch.n_tokens = n
                status = int(llama_cpp.llama_decode(self.ctx, batch))
                if status != 0:
                    raise StateRestoreError(f"llama_decode failed with {status} on sequence {seq_id}")
                position += n
            if len(tokens):
                row = llama_cpp.llama_get_logits_ith(self.ctx, -1)
                self._logits[seq_id] = np.ctypeslib.as_array(row, shape=(self.n_vocab,))

    def logits(self, seq_id: int) -> np.ndarray:
        """A read-only view of the logits of the last token decoded for sequence ``seq_id``."""
        view = self._logits[seq_id]
        view.flags.writeable = False
        return view

    def close(self) -> None:
        """Free the context (its sequences are unusable afterwards)."""
        if not self._closed:
            self._closed = True
            llama_cpp.llama_batch_free(self._batch)
            llama_cpp.llama_free(self.ctx)

    def __enter__(self) -> SequenceContext:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class SequenceBackend:
    """One sequence of a :class:`SequenceContext`: an engine slot's :class:`~ckpt_plugin.core.slot.Backend`.

    :param context: The context.
    :param seq_id: The sequence.
    """

    def __init__(self, context: SequenceContext, seq_id: int) -> None:
        self.context = context
        self.seq_id = seq_id
        self.kind = context.kind
        self.fingerprint = context.fingerprint
        self.n_ctx = context.seq_n_ctx
        # Kept by this backend's own calls, so that the slot's questions and cuts between two tokens need no call on
        # the context (each would wait for the other slots' step in flight); None: unknown, asked under the lock.
        # end_bound: no position at or past it is in the sequence; a cut past it has nothing to remove. Not used
        # for a recurrent memory, which keeps per-token snapshots past its last position that a cut clears.
        self.end_bound: int | None = None
        # _pos_max: what llama.cpp answers for the sequence's largest position (a sliding-window memory answers for
        # its window, so this is not end_bound - 1 after a partial restore).
        self._pos_max: int | None = None
        # _pos_min: llama.cpp's answer for the smallest position, as the batched step that last evaluated the
        # sequence read it. Only trusted where the sequence has a KV stream of its own: in a pool another
        # sequence's step may take a masked window cell of this one.
        self._pos_min: int | None = None
        # (namespace, tokens) the cells hold from position 0, for other sequences of a unified cache to share
        # (share_prefix). Set by the slot's own thread where its record and memory agree (offer_cells); cut back under
        # the context lock by every call that removes or replaces cells, before it does: a reader holding the lock
        # never sees tokens the cells no longer hold. Appends leave it alone (it stays a prefix of the truth).
        self.offered: tuple[str, np.ndarray] | None = None
        # Set where other sequences may share this one's cells: called after each offer.
        self.on_offer: Callable[[], None] | None = None

    def evaluated(self, end: int | None, pos_min: int | None = None) -> None:
        """The sequence, cut to some ``n_past`` first, got positions ``n_past..end - 1`` from a caller other than
        this backend (a batched step); ``None``: an evaluation that failed part-way, its end is unknown.
        ``pos_min``: the sequence's smallest position after the step, if the step read it."""
        bound = self.end_bound
        self.end_bound = None if end is None or bound is None else max(bound, end)
        self._pos_max = None if end is None else end - 1
        self._pos_min = pos_min if end is not None and not self.context.unified else None

    def remove(self, p0: int, p1: int) -> bool:
        """Remove positions ``[p0, p1)`` (negative: from the start, to the end), as ``llama_memory_seq_rm``."""
        start = max(p0, 0)
        if p1 < 0 and not self.kind.recurrent and self.end_bound is not None and self.end_bound <= start:
            return True  # nothing there to remove
        with self.context.lock:
            self._withdraw_from(start)
            removed = bool(llama_cpp.llama_memory_seq_rm(self.context.memory, self.seq_id, p0, p1))
            self._ask_pos_max()
        if removed and p1 < 0:
            self.end_bound = start if self.end_bound is None else min(self.end_bound, start)
        return removed

    def _ask_pos_max(self) -> int:
        # The lock is held. Whatever changed the largest position may have changed the smallest.
        self._pos_min = None
        self._pos_max = int(llama_cpp.llama_memory_seq_pos_max(self.context.memory, self.seq_id))
        return self._pos_max

    @property
    def memory_lock(self) -> threading.RLock:
        """Held, it keeps every other llama.cpp call on the context out (the captures' one look at the cells)."""
        return self.context.lock

    def state_size(self, partial: bool) -> int:
        with self.context.lock:
            return int(llama_cpp.llama_state_seq_get_size_ext(self.context.ctx, self.seq_id, state_flags(partial)))

    def read_state(self, buffer: np.ndarray, partial: bool) -> int:
        with self.context.lock:
            return int(llama_cpp.llama_state_seq_get_data_ext(
                self.context.ctx, writable_start(buffer), buffer.nbytes, self.seq_id, state_flags(partial)))

    def write_state(self, buffer: np.ndarray, partial: bool) -> int:
        # The read-only buffer is handed over by address: llama.cpp only reads it.
        with self.context.lock:
            # Unknown, not pos_max: a partial state restores the window only, and a sliding-window memory reports
            # the window's positions while its full-attention cells may hold more.
            self.end_bound = None
            self.offered = None
            read = self._set_state(buffer, partial)
            make_room = self.context.make_room
            while read == 0 and make_room is not None and make_room():
                read = self._set_state(buffer, partial)  # a full pool had no cells for it
            self._ask_pos_max()
            return read

    def _set_state(self, buffer: np.ndarray, partial: bool) -> int:
        # The lock is held.
        return int(llama_cpp.llama_state_seq_set_data_ext(
            self.context.ctx, buffer.ctypes.data_as(U8_P), buffer.nbytes, self.seq_id, state_flags(partial)))

    def _withdraw_from(self, start: int) -> None:
        # The lock is held: the cells from ``start`` on are about to go.
        offered = self.offered
        if offered is not None and len(offered[1]) > start:
            self.offered = (offered[0], offered[1][:start]) if start > 0 else None

    def offer_cells(self, namespace: str, tokens: np.ndarray) -> None:
        """The cells hold ``tokens`` from position 0: offer them to the other sequences (the slot's record, which
        its own thread keeps; no lock: only this thread changes the sequence, and a reader holds the lock, which
        every change of cells takes)."""
        if self.on_offer is None:
            return  # no sequence shares this one's cells (a KV stream each, or a kind that keeps them apart)
        copied = np.array(tokens, dtype=np.int32)
        copied.flags.writeable = False
        self.offered = (namespace, copied) if len(copied) else None
        self.on_offer()

    # Deprecated: "publish" is the shared tier's word (docs/design.md, "Words").
    publish = Renamed("offer_cells")
    published = Renamed("offered")

    def share_prefix(self, source: SequenceBackend, tokens: np.ndarray, n_keep: int) -> bool:
        """Hold ``source``'s first ``n_keep`` cells, shared (``llama_memory_seq_cp`` within one KV cache: no copy),
        in place of this sequence's; ``False`` (nothing changed) unless ``source`` still holds ``tokens[:n_keep]``."""
        context = self.context
        with context.lock:
            offered = source.offered
            if (offered is None or len(offered[1]) < n_keep
                    or not np.array_equal(offered[1][:n_keep], tokens[:n_keep])):
                return False
            self._withdraw_from(0)
            llama_cpp.llama_memory_seq_rm(context.memory, self.seq_id, -1, -1)
            llama_cpp.llama_memory_seq_cp(context.memory, source.seq_id, self.seq_id, 0, n_keep)
            held = self._ask_pos_max() + 1
            self.end_bound = held
            if held != n_keep:
                return False
            self.offered = (offered[0], offered[1][:n_keep])
        if self.on_offer is not None:
            self.on_offer()
        return True

    def decode_media(self, into: Callable[[Any, int, int], int], n_past: int) -> int:
        """Evaluate one media chunk into this sequence at positions ``n_past...`` with libmtmd: ``into(ctx, seq_id,
        n_past)`` encodes the chunk and decodes its embeddings there, and returns the position after it
        (:class:`~ckpt_plugin.hosts.llama_cpp.attachment.multimodal.MediaChunkDecode`); return that position.

        The context is held throughout, its encoding included: no batched step runs meanwhile (libmtmd decodes with a
        batch of its own, may switch the context to non-causal attention for the chunk, and leaves the context's
        output buffer without rows; the scheduler reads a step's rows under the same hold as its decode, so none of
        this is mistaken for a step's), and one chunk is encoded at a time (libmtmd keeps its output embeddings in
        one buffer per projector), as llama.cpp's server, whose loop encodes a chunk between two decodes.

        In a pool of cells the slots share, a chunk that finds no room gets an idle slot's cells
        (:attr:`SequenceContext.make_room`) and is evaluated again from its start.

        :raises PoolFullError: No room in the shared pool with every idle slot's cells freed.
        :raises MediaDecodeError: libmtmd failed otherwise; what the chunk had filled is removed where the memory
            allows it (the slot reconciles with the memory before trusting it again).
        """
        context = self.context
        self.remove(n_past, -1)  # as the host's eval cuts to its n_tokens first; normally nothing is there
        with context.lock:
            self._withdraw_from(n_past)
            self.end_bound = self._pos_max = self._pos_min = None
            while True:
                try:
                    end = int(into(context.ctx, self.seq_id, n_past))
                    break
                except MediaDecodeError as exc:
                    # The chunk is whole or absent: what its first batches filled goes.
                    llama_cpp.llama_memory_seq_rm(context.memory, self.seq_id, n_past, -1)
                    make_room = context.make_room
                    if exc.status != 1 or make_room is None:
                        raise
                    if not make_room():
                        raise PoolFullError(
                            f"the {context.n_ctx} cells the slots share are all held by busy slots: no room for the "
                            f"media chunk at position {n_past} of sequence {self.seq_id}; retry when a request has "
                            "finished, or raise --n_ctx") from exc
                except BaseException:
                    llama_cpp.llama_memory_seq_rm(context.memory, self.seq_id, n_past, -1)
                    raise
            self._ask_pos_max()
            if not context.unified:  # read now, as a batched step does, so that the slot need not ask later
                self._pos_min = int(llama_cpp.llama_memory_seq_pos_min(context.memory, self.seq_id))
            self.end_bound = end
        return end

    def pos_min(self) -> int:
        known = self._pos_min
        if known is not None:
            return known  # without waiting for the other slots' step in flight
        with self.context.lock:
            return int(llama_cpp.llama_memory_seq_pos_min(self.context.memory, self.seq_id))

    def pos_max(self) -> int:
        known = self._pos_max
        if known is not None:
            return known
        with self.context.lock:
            return self._ask_pos_max()

    def truncate(self, n_keep: int) -> bool:
        return self.remove(n_keep, -1)

    def clear(self) -> None:
        self.remove(-1, -1)

    def decode(self, tokens: np.ndarray) -> None:
        # The context's decode appends after whatever the sequence holds.
        self.end_bound = self._pos_max = self._pos_min = None
        self.context.decode(self.seq_id, tokens)

    def logits(self) -> np.ndarray:
        """The logits of the last token this sequence decoded."""
        return self.context.logits(self.seq_id)
