"""Immutable checkpoints and the state buffers they own.

A state buffer is a one-dimensional ``uint8`` numpy array allocated uninitialized (no zero-fill; recycled from
buffers nobody holds any more, see :class:`StateBufferPool`), written once by the backend and then frozen
read-only. Everything that holds a checkpoint (a slot, the prompt cache,
a saved state) holds a reference to the same buffer; nothing copies it. Restores hand the buffer's address to
llama.cpp directly.
"""

from __future__ import annotations

import collections
import mmap
import re
import threading
import weakref
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Iterator, Mapping

import numpy as np

from ckpt_plugin.core.buffers import SPARE_MAPPER
from ckpt_plugin.core.pages import PagedState

__all__ = [
    "Checkpoint",
    "DEFAULT_POOL",
    "DRAFT",
    "EXTRA_NAME",
    "ExtraState",
    "SPECULATIVE",
    "StateBuffer",
    "StateBufferPool",
    "TARGET",
    "allocate_state_buffer",
    "as_state_buffer",
    "check_extra_name",
    "freeze",
]

StateBuffer = np.ndarray
"""A read-only, C-contiguous ``uint8`` array holding serialized llama.cpp state."""


_PAGE = 64 << 10
# Populating a new mapping in one go costs about half of faulting its pages in one by one during the state copy.
_MAP_FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)


class StateBufferPool:
    """Hands out state buffers, recycling the memory of buffers nobody references any more.

    A fresh anonymous mapping costs a page fault per 4 KiB page on first write, which on a 12 MB state costs several
    times the state copy itself. Each buffer here is a view of a private anonymous ``mmap``; when the last array
    derived from it is gone, the mapping goes back to a free list and the next capture of a similar size writes into
    pages that are already mapped. Memory is never shared between live buffers: a mapping is reused only after every
    view of it died. Unused mappings are kept up to ``max_free_bytes``.

    When a buffer needs a new mapping, a spare a little larger is mapped and populated at idle priority
    (:mod:`ckpt_plugin.core.buffers`), within the same ``max_free_bytes``, so that a growing cache does not pay the
    kernel's page faults on the request path each time (``spares=False``: never).

    :ivar reused: Buffers served from recycled mappings (spares included).
    :ivar mapped: Buffers that needed a new mapping on the caller's thread.
    :ivar spares_mapped: Spares mapped ahead of time.
    """

    def __init__(self, max_free_bytes: int = 256 << 20, spares: bool = True) -> None:
        self.max_free_bytes = max_free_bytes
        self.spares = spares
        self._free: list[mmap.mmap] = []
        self._free_bytes = 0
        # id(weak reference to a live buffer's memoryview) -> (that reference, the buffer's mapping)
        self._watched: dict[int, tuple[weakref.ref, mmap.mmap]] = {}
        self._returned: collections.deque[mmap.mmap] = collections.deque()  # freed, not yet in the free list
        self._pending_bytes = 0
        self._lock = threading.Lock()
        self.reused = 0
        self.mapped = 0
        self.spares_mapped = 0

    def allocate(self, n_bytes: int) -> StateBuffer:
        """An uninitialized, writable buffer of ``n_bytes`` bytes (``MemoryError`` when memory is refused)."""
        if n_bytes < 0:
            raise ValueError(f"negative state size {n_bytes}")
        if n_bytes == 0:
            return np.empty(0, dtype=np.uint8)
        backing = self._take(n_bytes)
        if backing is None:
            try:
                backing = _map(n_bytes)
            except OSError as exc:
                raise MemoryError(f"cannot map {n_bytes} bytes for a state buffer: {exc}") from exc
            with self._lock:  # slots of one engine allocate from several threads: no count lost
                self.mapped += 1
            self._want_spare(n_bytes + n_bytes // 8)  # the next capture of this kind is usually a little larger
        buffer = np.frombuffer(backing, dtype=np.uint8, count=n_bytes)
        # buffer.base is the memoryview (numpy's) every derived array keeps alive: when it dies, nothing can see the
        # memory. A plain weak reference rather than weakref.finalize: a third of the cost on the capture path, and
        # it never fires at exit while the buffer is still alive.
        watch = weakref.ref(buffer.base, self._released)
        self._watched[id(watch)] = (watch, backing)
        return buffer

    def _take(self, n_bytes: int) -> mmap.mmap | None:
        """The smallest free mapping that fits ``n_bytes`` without wasting more than a quarter, taken out."""
        largest = n_bytes + n_bytes // 4 + _PAGE
        with self._lock:
            self._take_in_returned()
            best_index, best_size = -1, largest + 1
            for index, mapping in enumerate(self._free):
                if n_bytes <= len(mapping) < best_size:
                    best_index, best_size = index, len(mapping)
            if best_index < 0:
                return None
            best = self._free.pop(best_index)
            self._free_bytes -= best_size
            self.reused += 1
            return best

    def _want_spare(self, n_bytes: int) -> None:
        if not self.spares:
            return
        size = _mapped_size(n_bytes)
        with self._lock:
            if self._free_bytes + self._pending_bytes + size > self.max_free_bytes:
                return
            self._pending_bytes += size
        SPARE_MAPPER.request(_map, self._add_spare, size)

    def _add_spare(self, backing: mmap.mmap | None, n_bytes: int) -> None:
        with self._lock:
            self._pending_bytes -= n_bytes
            if backing is None:
                return
            if self._free_bytes + len(backing) > self.max_free_bytes:
                backing.close()
                return
            self._free.append(backing)
            self._free_bytes += len(backing)
            self.spares_mapped += 1

    def _released(self, watch: weakref.ref) -> None:
        # Runs wherever a buffer's last view dies: on any thread, or in a garbage collection that an allocation
        # inside this pool's own locked code set off. So it never waits for the lock: the mapping is queued
        # (deque.append is atomic) and taken in now if the lock is free, else by the next call that holds it.
        self._returned.append(self._watched.pop(id(watch))[1])
        if self._lock.acquire(blocking=False):
            try:
                self._take_in_returned()
            finally:
                self._lock.release()

    def _take_in_returned(self) -> None:
        """Move returned mappings into the free list (called under the lock)."""
        while self._returned:
            backing = self._returned.popleft()
            self._free.append(backing)
            self._free_bytes += len(backing)
        self._trim_locked()

    def trim(self, max_free_bytes: int | None = None) -> None:
        """Unmap recycled mappings beyond ``max_free_bytes`` (and keep that limit from now on), oldest first."""
        with self._lock:
            if max_free_bytes is not None:
                self.max_free_bytes = max(0, max_free_bytes)
            self._take_in_returned()
            self._trim_locked()

    def _trim_locked(self) -> None:
        while self._free_bytes > self.max_free_bytes and self._free:
            oldest = self._free.pop(0)
            self._free_bytes -= len(oldest)
            try:
                oldest.close()
            except BufferError:  # still exported somewhere: the mapping goes when its last view does
                pass

    @property
    def free_bytes(self) -> int:
        """Bytes of mappings kept for reuse."""
        with self._lock:
            self._take_in_returned()
            return self._free_bytes


def _mapped_size(n_bytes: int) -> int:
    """``n_bytes`` rounded up to whole mapping pages."""
    return -(-n_bytes // _PAGE) * _PAGE


def _map(n_bytes: int) -> mmap.mmap:
    # 4 KiB pages on purpose: see "Decisions" in docs/design.md for what transparent huge pages cost and gave.
    return mmap.mmap(-1, _mapped_size(n_bytes), flags=_MAP_FLAGS)


DEFAULT_POOL = StateBufferPool(64 << 20)
"""The pool of buffers allocated outside any prompt cache (each cache has its own, within its budget)."""


def allocate_state_buffer(n_bytes: int, pool: StateBufferPool | None = None) -> StateBuffer:
    """Allocate an uninitialized buffer of ``n_bytes`` bytes (raises ``MemoryError`` when memory is refused)."""
    return (pool or DEFAULT_POOL).allocate(n_bytes)


def freeze(buffer: StateBuffer) -> StateBuffer:
    """Make ``buffer`` read-only in place and return it."""
    buffer.setflags(write=False)
    return buffer


def as_state_buffer(data: bytes | bytearray | memoryview | np.ndarray) -> StateBuffer:
    """View ``data`` as a read-only state buffer without copying it."""
    if isinstance(data, np.ndarray):
        if data.dtype != np.uint8 or data.ndim != 1 or not data.flags.c_contiguous:
            raise ValueError("state buffers are one-dimensional contiguous uint8 arrays")
        if data.flags.writeable:
            data = data.view()
            data.flags.writeable = False
        return data
    return np.frombuffer(data, dtype=np.uint8)


EXTRA_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:-]{0,47}")
"""What an extra state's name may be: 1 to 48 ASCII characters of ``[A-Za-z0-9_.:-]``, not starting with ``.``,
``:`` or ``-`` (it is stored with the blob in files and manifests, see ``docs/persistence-format.md``)."""
TARGET = "target"
"""The name of a checkpoint's target state (reserved: no extra state takes it)."""
DRAFT = "draft"
"""The extra state of a draft model's context
(:class:`~ckpt_plugin.hosts.llama_cpp.speculative.drafts.DraftStatePlugin`)."""
SPECULATIVE = "speculative"
"""The extra state of a speculative decoder
(:class:`~ckpt_plugin.hosts.llama_cpp.speculative.drafts.NgramStatePlugin`)."""


def check_extra_name(name: str) -> str:
    """``name`` if an extra state may take it.

    :raises ValueError: It may not (not a string, empty, too long, other characters, or ``"target"``).
    """
    if not isinstance(name, str) or not EXTRA_NAME.fullmatch(name) or name == TARGET:
        raise ValueError(f"extra state name {name!r} is not 1 to 48 characters of [A-Za-z0-9_.:-] starting with a "
                         f"letter, digit or '_', or is the reserved name {TARGET!r}")
    return name


@dataclass(frozen=True, slots=True)
class ExtraState:
    """Companion state contributed to a checkpoint by a plugin (see ``on_checkpoint_capture``), stored with the
    checkpoint under ``name`` in every tier.

    :ivar name: Whose state it is: :data:`DRAFT` for a draft model's context, :data:`SPECULATIVE` for a speculative
        decoder's, or a plugin's own name (see :data:`EXTRA_NAME`). One name per checkpoint.
    :ivar data: Read-only bytes.
    """

    name: str
    data: StateBuffer

    def __post_init__(self) -> None:
        check_extra_name(self.name)
        object.__setattr__(self, "data", as_state_buffer(self.data))


_NO_EXTRA: Mapping[str, StateBuffer] = MappingProxyType({})


@dataclass(frozen=True, slots=True, eq=False, init=False)
class Checkpoint:
    """An immutable capture of one sequence at one position (docs/design.md, "Words").

    ``partial`` says what it holds: only the part a truncation cannot rebuild (the sliding window, the recurrent
    state), as the checkpoints a slot keeps along its lineage; or the whole sequence state (a *full state*), as every
    cache entry's ``state``. Both are this one type, restored the same way.

    Two checkpoints are equal only if they are the same object: identity is what sharing is about.

    :ivar n_tokens: Tokens in the sequence when the snapshot was taken.
    :ivar pos_min: Smallest position the snapshot's memory still held (the sliding window's start), -1 if empty.
    :ivar pos_max: Largest position held (``n_tokens - 1``).
    :ivar partial: ``True`` if only the part that cannot be truncated was captured (``PARTIAL_ONLY``: the sliding
        window or the recurrent state); ``False`` for the whole sequence state (a full state).
    :ivar target: The target context's state: its bytes, or the pages holding them (a :class:`PagedState`, see
        :mod:`ckpt_plugin.core.pages`; :meth:`target_bytes` gives the bytes either way).
    :ivar fingerprint: The model/context fingerprint the state belongs to.
    :ivar extra: Companion states by name (a read-only mapping, in name order): what plugins contributed through
        ``on_checkpoint_capture`` (:data:`DRAFT`, :data:`SPECULATIVE`, a plugin's own name).
    """

    n_tokens: int
    pos_min: int
    pos_max: int
    partial: bool
    target: StateBuffer | PagedState = field(repr=False)
    fingerprint: str = field(repr=False)
    extra: Mapping[str, StateBuffer] = field(repr=False)

    def __init__(self, *, n_tokens: int, pos_min: int, pos_max: int, partial: bool,
                 target: StateBuffer | PagedState,
                 fingerprint: str, extra: Mapping[str, StateBuffer] | None = None,
                 draft: StateBuffer | None = None, speculative: StateBuffer | None = None) -> None:
        """``draft`` and ``speculative`` are shorthands for those names of ``extra`` (and win over them)."""
        setter = object.__setattr__
        setter(self, "n_tokens", n_tokens)
        setter(self, "pos_min", pos_min)
        setter(self, "pos_max", pos_max)
        setter(self, "partial", partial)
        setter(self, "target", target)
        setter(self, "fingerprint", fingerprint)
        if isinstance(target, np.ndarray) and target.flags.writeable:
            raise ValueError("checkpoint target buffer must be frozen read-only before it is shared")
        if not extra and draft is None and speculative is None:
            setter(self, "extra", _NO_EXTRA)  # the usual capture: no mapping built
            return
        named = dict(extra or {})
        for name, buffer in ((DRAFT, draft), (SPECULATIVE, speculative)):
            if buffer is not None:
                named[name] = buffer
        for name, buffer in named.items():
            check_extra_name(name)
            if not isinstance(buffer, np.ndarray) or buffer.flags.writeable:
                raise ValueError(f"checkpoint {name} buffer must be frozen read-only before it is shared")
        setter(self, "extra", MappingProxyType(dict(sorted(named.items()))))

    @property
    def draft(self) -> StateBuffer | None:
        """The draft model's state bytes (``extra["draft"]``), if a draft plugin contributed them."""
        return self.extra.get(DRAFT)

    @property
    def speculative(self) -> StateBuffer | None:
        """The speculative decoder's state bytes (``extra["speculative"]``), if a plugin contributed them."""
        return self.extra.get(SPECULATIVE)

    @property
    def paged(self) -> bool:
        """Whether the target state is held as pages."""
        return isinstance(self.target, PagedState)

    def target_bytes(self) -> StateBuffer:
        """The target state's bytes: the buffer itself, or the pages assembled into a new read-only buffer."""
        target = self.target
        return target.materialize() if isinstance(target, PagedState) else target

    def buffers(self) -> Iterator[StateBuffer]:
        """Yield every state buffer of this checkpoint: the target (each of its pages, if paged), then the extra
        states in name order."""
        target = self.target
        if isinstance(target, PagedState):
            yield from target.parts()
        else:
            yield target
        yield from self.extra.values()

    @property
    def nbytes(self) -> int:
        """Bytes of this checkpoint's states as llama.cpp reads them (pages other states hold too counted in full:
        :meth:`buffers` gives what is held once)."""
        return int(self.target.nbytes + sum(buffer.nbytes for buffer in self.extra.values()))
