"""Writes to an attached context's memory that do not go through the engine, noticed as they happen.

The engine names what the memory holds by token ids. Host code can change the memory without it: a multimodal chat
handler decodes image embeddings with ``mtmd_helper_eval_chunk_single``, clears the memory with
``Llama._ctx.kv_cache_clear()``, a guidance-style library calls ``llama_decode`` itself, code restores a raw state.
Most of these show as a memory shorter or longer than the engine's record, but not all: a memory cleared and then
filled again to the same length (an image spanning exactly the positions of the previous request) looks unchanged,
and the engine would label the image's state with the previous request's token ids.

:class:`OutsideWrites` wraps llama.cpp's writing functions in the ``llama_cpp`` namespaces that Python code calls
them through (``llama_cpp.llama_decode`` and ``llama_cpp.llama_cpp.llama_decode``, which ``Llama`` and its context
wrapper use). A call on the context or memory of an attached ``Llama`` that the engine did not make itself records
the first position it may have changed; the engine reads that record (:meth:`Watched.take`) before it trusts the
memory again. Calls on any other context pass straight through, at the cost of one dictionary lookup. The engine's
own calls are made inside :func:`engine_writes`.

Each :class:`Watched` also keeps, from every write it sees (the engine's included), which token id each position
holds (:meth:`Watched.names`: none for embeddings, copies, state loads, removed positions) and whose logits the
context holds (:attr:`Watched.logits_end`): what lets the completion that follows outside writes be served from the
logits the host's writes left, and never by evaluating ids that do not name what a position holds.

What Python cannot see: a C library calling ``llama_decode`` itself (libmtmd's helpers do). Such a write still makes
the memory longer than the engine's record, which the engine notices by itself; the multimodal handlers' memory
clears, which would hide it, go through ``llama_cpp`` and are seen here.
"""

from __future__ import annotations

import ctypes
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator, NamedTuple

import llama_cpp
import llama_cpp.llama_cpp as llama_cpp_module
import numpy as np

__all__ = ["OUTSIDE_WRITES", "UNNAMED", "Watched", "engine_writes", "same_handle"]

NOTHING_CHANGED = 1 << 62
"""What :meth:`Watched.take` returns when no outside write touched the sequence."""

UNNAMED = -1
"""What :meth:`Watched.names` gives for a position no token id is known to name."""

_engine = threading.local()


@contextmanager
def engine_writes() -> Iterator[None]:
    """Mark the calls made inside as the engine's own (not outside writes)."""
    depth = getattr(_engine, "depth", 0)
    _engine.depth = depth + 1
    try:
        yield
    finally:
        _engine.depth = depth


def _address(handle: Any) -> int | None:
    if handle is None or isinstance(handle, int):
        return handle
    if isinstance(handle, ctypes.c_void_p):
        return handle.value
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return None


def same_handle(a: Any, b: Any) -> bool:
    """Whether two llama.cpp handles (ints, ``c_void_p`` or other ctypes pointers) point to the same object."""
    address = _address(a)
    return address is not None and address == _address(b)


class Watched:
    """One sequence of one context: the first position an outside write may have changed since the last look."""

    def __init__(self, seq_id: int) -> None:
        self.seq_id = seq_id
        self._from = NOTHING_CHANGED
        self._skip_clears = False
        self._lock = threading.Lock()
        # Per position, the token id the latest write there decoded (UNNAMED: embeddings, a copy, a state load, a
        # removal, or never written as far as anything seen tells), by the engine or from outside.
        self._names = np.full(0, UNNAMED, dtype=np.int64)
        self._logits_end: int | None = None

    def wrote(self, position: int) -> None:
        with self._lock:
            self._from = min(self._from, max(0, position))

    def take(self) -> int:
        """The first position written from outside since the last call (:data:`NOTHING_CHANGED` if none)."""
        with self._lock:
            position, self._from = self._from, NOTHING_CHANGED
        return position

    def skip_clears(self) -> None:
        """Let full clears of the memory from outside do nothing until :meth:`cancel_skip`: the engine serves what
        follows them as a new prompt (used for the clears a multimodal handler makes before every request: its
        ``Llama.reset()`` clears a recurrent memory, then it clears the memory itself)."""
        with self._lock:
            self._skip_clears = True

    def cancel_skip(self) -> None:
        with self._lock:
            self._skip_clears = False

    def _skips_clear(self) -> bool:
        with self._lock:
            return self._skip_clears

    def touches(self, seq_id: int) -> bool:
        return seq_id < 0 or seq_id == self.seq_id

    # -- what the positions hold, and the context's logits ------------------------------------------------------------

    def named(self, start: int, ids: np.ndarray) -> None:
        """Positions ``start...`` now hold the tokens ``ids``."""
        end = start + len(ids)
        with self._lock:
            if end > len(self._names):
                grown = np.full(max(end, 2 * len(self._names)), UNNAMED, dtype=np.int64)
                grown[: len(self._names)] = self._names
                self._names = grown
            self._names[start:end] = ids

    def unnamed(self, start: int, end: int | None = None) -> None:
        """Positions ``[start, end)`` (to the end of the sequence: ``None``) hold nothing a token id is known to name
        (removed, or filled with embeddings or copied state); the context's logits are no longer theirs."""
        start = max(0, start)
        with self._lock:
            self._names[start:end] = UNNAMED
            if self._logits_end is not None and start < self._logits_end and (end is None or self._logits_end <= end):
                self._logits_end = None

    def names(self, start: int, end: int) -> np.ndarray:
        """The token id each position of ``[start, end)`` holds as far as the writes seen tell (:data:`UNNAMED`:
        unknown)."""
        out = np.full(max(0, end - start), UNNAMED, dtype=np.int64)
        with self._lock:
            known = self._names[start:end]
            out[: len(known)] = known
        return out

    def decoded(self, logits_end: int | None) -> None:
        """A decode just ran on the context: the logits it holds now are those of position ``logits_end - 1`` of the
        sequence (``None``: of no position of it)."""
        with self._lock:
            self._logits_end = logits_end

    @property
    def logits_end(self) -> int | None:
        """One past the position of the sequence whose logits the context holds (``None``: none known)."""
        with self._lock:
            return self._logits_end


class OutsideWrites:
    """The registry of watched contexts and the wrappers around llama.cpp's writing functions (installed once)."""

    def __init__(self) -> None:
        self._by_ctx: dict[int, Watched] = {}
        self._by_memory: dict[int, Watched] = {}
        self._installed = False
        self._lock = threading.Lock()

    def watch(self, ctx: Any, memory: Any, seq_id: int = 0) -> Watched:
        """Start watching sequence ``seq_id`` of ``ctx`` (whose memory is ``memory``)."""
        watched = Watched(seq_id)
        with self._lock:
            self._install()
            ctx_address, memory_address = _address(ctx), _address(memory)
            if ctx_address is not None:
                self._by_ctx[ctx_address] = watched
            if memory_address is not None:
                self._by_memory[memory_address] = watched
        return watched

    def unwatch(self, watched: Watched) -> None:
        with self._lock:
            for table in (self._by_ctx, self._by_memory):
                for key in [key for key, value in table.items() if value is watched]:
                    del table[key]

    def _watched(self, table: dict[int, Watched], handle: Any) -> Watched | None:
        if not table or getattr(_engine, "depth", 0):
            return None
        return table.get(_address(handle))  # type: ignore[arg-type]

    def _install(self) -> None:
        if self._installed:
            return
        self._installed = True
        wrappers: dict[str, Callable[[Callable[..., Any]], Callable[..., Any]]] = {
            "llama_decode": self._batch_write,
            "llama_encode": self._encoder_write,
            "llama_memory_clear": self._clear,
            "llama_memory_seq_rm": self._seq_write(1, 2, removes=True),
            "llama_memory_seq_cp": self._seq_write(2, 3),
            "llama_memory_seq_keep": self._keep,
            "llama_memory_seq_add": self._seq_write(1, 2),
            "llama_memory_seq_div": self._seq_write(1, 2),
            "llama_state_set_data": self._context_write,
            "llama_state_load_file": self._context_write,
            "llama_state_seq_set_data": self._seq_state_write,
            "llama_state_seq_set_data_ext": self._seq_state_write,
            "llama_state_seq_load_file": self._seq_state_write,
        }
        for name, wrap in wrappers.items():
            original = getattr(llama_cpp_module, name, None)
            if original is None:
                continue
            wrapped = wrap(original)
            wrapped.__wrapped__ = original  # type: ignore[attr-defined]
            for namespace in (llama_cpp_module, llama_cpp):
                if getattr(namespace, name, None) is original:
                    setattr(namespace, name, wrapped)

    # -- wrappers ----------------------------------------------------------------------------------------------------

    def _encoder_write(self, original: Callable[..., Any]) -> Callable[..., Any]:
        return self._batch_write(original, encoder=True)

    def _batch_write(self, original: Callable[..., Any], encoder: bool = False) -> Callable[..., Any]:
        def write(ctx: Any, batch: Any, *rest: Any) -> Any:
            watched = self._watched(self._by_ctx, ctx)
            if watched is None:
                return original(ctx, batch, *rest)
            first = _first_position(batch, watched)
            if first is None:
                memory = llama_cpp_module.llama_get_memory(ctx)
                first = int(llama_cpp_module.llama_memory_seq_pos_max(memory, watched.seq_id)) + 1
                contents = _contents(batch, watched, first)
            else:
                contents = _contents(batch, watched, None)
            result = original(ctx, batch, *rest)
            watched.wrote(first)
            # An encoder's output is no token of the sequence's and leaves no logits to sample from.
            _record(watched, contents, int(result) == 0 and not encoder)
            return result

        return write

    def _clear(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def clear(memory: Any, *rest: Any) -> Any:
            watched = self._watched(self._by_memory, memory)
            if watched is None:
                return original(memory, *rest)
            if watched._skips_clear():
                return None
            result = original(memory, *rest)
            watched.wrote(0)
            watched.unnamed(0)
            return result

        return clear

    def _seq_write(self, seq_index: int, p0_index: int, removes: bool = False
                   ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
            def write(memory: Any, *args: Any) -> Any:
                watched = self._watched(self._by_memory, memory)
                result = original(memory, *args)
                if watched is not None:
                    seq_id = int(args[seq_index - 1])
                    if watched.touches(seq_id):
                        p0 = int(args[p0_index - 1])  # p0 < 0 means from the start
                        watched.wrote(p0)
                        if not removes:
                            watched.unnamed(p0)  # copied or shifted: nothing there is named any more
                        elif result:  # a recurrent memory refuses a partial removal and keeps everything
                            p1 = int(args[p0_index])
                            watched.unnamed(p0, p1 if p1 >= 0 else None)
                return result

            return write

        return wrap

    def _keep(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def keep(memory: Any, seq_id: Any, *rest: Any) -> Any:
            watched = self._watched(self._by_memory, memory)
            result = original(memory, seq_id, *rest)
            if watched is not None and int(seq_id) != watched.seq_id:
                watched.wrote(0)
                watched.unnamed(0)
            return result

        return keep

    def _context_write(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def write(ctx: Any, *args: Any) -> Any:
            watched = self._watched(self._by_ctx, ctx)
            result = original(ctx, *args)
            if watched is not None:
                watched.wrote(0)
                watched.unnamed(0)
            return result

        return write

    def _seq_state_write(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def write(ctx: Any, *args: Any) -> Any:
            watched = self._watched(self._by_ctx, ctx)
            result = original(ctx, *args)
            if watched is not None:
                # The destination sequence follows the source: a path, or a buffer and its size.
                seq_id = args[1] if isinstance(args[0], (bytes, str)) else args[2]
                try:
                    touched = watched.touches(int(seq_id))
                except (TypeError, ValueError):
                    touched = True
                if touched:
                    watched.wrote(0)
                    watched.unnamed(0)
            return result

        return write


def _first_position(batch: Any, watched: Watched) -> int | None:
    """The smallest position ``batch`` writes to the watched sequence (``None``: positions left to llama.cpp; a
    batch that does not touch the sequence gives :data:`NOTHING_CHANGED`)."""
    n = int(batch.n_tokens)
    if not batch.pos:
        return None
    first = NOTHING_CHANGED
    for i in range(n):
        if batch.seq_id and batch.n_seq_id:
            seqs = [batch.seq_id[i][j] for j in range(batch.n_seq_id[i])]
        else:
            seqs = [0]
        if any(watched.touches(s) for s in seqs):
            first = min(first, int(batch.pos[i]))
    return first


class _Contents(NamedTuple):
    """What a batch writes to the watched sequence."""

    positions: np.ndarray
    ids: np.ndarray | None  # None: embeddings
    logits_end: int | None  # one past the position whose logits the context holds after it


def _contents(batch: Any, watched: Watched, next_position: int | None) -> _Contents:
    """What ``batch`` writes to the watched sequence: its positions there, the token ids it decodes at them
    (``None``: embeddings), and one past the position whose logits the context holds after it (``None``: the
    batch's last row, the one a sampler reads, is not the sequence's or has none). ``next_position``: where
    llama.cpp puts the batch when it left the positions to it."""
    n = int(batch.n_tokens)
    if next_position is not None:
        positions = next_position + np.arange(n, dtype=np.int64)
    else:
        positions = np.array([int(batch.pos[i]) for i in range(n)], dtype=np.int64)
    if batch.seq_id and batch.n_seq_id:
        touched = np.array([any(watched.touches(batch.seq_id[i][j]) for j in range(batch.n_seq_id[i]))
                            for i in range(n)], dtype=bool)
    else:
        touched = np.ones(n, dtype=bool)
    ids = None if batch.embd or not batch.token else np.array([int(batch.token[i]) for i in range(n)], dtype=np.int64)
    # Without per-token flags llama.cpp outputs the last token's logits only.
    last_has_logits = n > 0 and (not batch.logits or bool(batch.logits[n - 1]))
    logits_end = int(positions[-1]) + 1 if last_has_logits and touched[-1] else None
    return _Contents(positions[touched], None if ids is None else ids[touched], logits_end)


def _record(watched: Watched, contents: _Contents, decoded: bool) -> None:
    """Note what a batch decoded from outside left in the sequence (if it failed: that nothing there is known)."""
    positions, ids = contents.positions, contents.ids
    if len(positions):
        start, end = int(positions.min()), int(positions.max()) + 1
        if decoded and ids is not None and end - start == len(positions) and bool((np.diff(positions) == 1).all()):
            watched.named(start, ids)
        else:
            watched.unnamed(start, end)
    watched.decoded(contents.logits_end if decoded else None)


OUTSIDE_WRITES = OutsideWrites()
"""The process's one registry (the wrappers are installed when the first context is watched)."""
