"""Paged, content-addressed states: every run of cells stored once, shared by every state that holds it.

A sequence state is split (:func:`page_state`) into **pages** of at most ``page_positions`` consecutive positions
of one attention cache (each page holds its cells' bytes from every stripe: metadata, each layer's K and V), plus
the small literal headers and the part that is not per position (a recurrent state). A :class:`PagedState` is the
manifest: the literals, the pages by reference and that rest. :meth:`PagedState.assemble` writes the bytes llama.cpp
reads back, cells in position order.

A page's id is a chained hash of everything that decides its bytes: the model and context fingerprint, the tenant's
namespace, every token id from position 0 to the page's end, which cache it belongs to (counted from the last
attention cache, so a window cache is the same in a full state and in a partial one), the cells' layout and the
positions it covers. Equal ids mean equal bytes, so a page is stored once: a :class:`PageStore` maps ids to the live
pages, and a new capture takes a page that exists from there instead of copying its bytes. A page is an ordinary
read-only state buffer: whatever holds a paged state holds its pages by reference, and the budgets, which count
unique buffers, count each page once. A page lives as long as one state references it.

A :class:`PageListener` on the store hears of each page as it is first stored (with the tokens and positions it
holds), as it goes (its last holder dropped it), as another tier writes it by id, and as the cache is cleared: the
KV events (:mod:`ckpt_plugin.services.kv_events`) listen there. Without a listener nothing of this is computed.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import struct
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Callable, Iterator, Protocol, Sequence

import numpy as np

from ckpt_plugin.core.state_layout import KvSection, StateLayout, Stripe

__all__ = [
    "DEFAULT_PAGE_POSITIONS",
    "PAGES",
    "PageInfo",
    "PageListener",
    "PageTally",
    "PagedSection",
    "PagedState",
    "PageStore",
    "TokenChain",
    "page_state",
]

DEFAULT_PAGE_POSITIONS = 32
"""Positions a page covers: see "Pages" in docs/design.md for the measurement behind it."""
_SEQ_ID_BYTES = 4


class TokenChain:
    """Chained hashes of a token sequence, one per ``block`` tokens, seeded by what else decides a state's bytes.

    ``at(end)`` names tokens ``[0, end)``: the hash of the block before ``end``'s block and the tokens after it.
    ``namespace`` is the tenant namespace folded into ``seed``, kept for a :class:`PageListener`.
    """

    def __init__(self, seed: bytes, tokens: np.ndarray, block: int, namespace: str = "") -> None:
        self.tokens = np.ascontiguousarray(tokens, dtype=np.int32)
        self.block = block
        self.namespace = namespace
        self._blocks = [hashlib.blake2b(seed, digest_size=16).digest()]

    def at(self, end: int) -> bytes:
        """The chained hash of tokens ``[0, end)``."""
        whole = end // self.block
        while len(self._blocks) <= whole:
            k = len(self._blocks) - 1
            self._blocks.append(self._hash(self._blocks[-1], k * self.block, (k + 1) * self.block))
        if whole * self.block == end:
            return self._blocks[whole]
        return self._hash(self._blocks[whole], whole * self.block, end)

    def _hash(self, parent: bytes, start: int, end: int) -> bytes:
        digest = hashlib.blake2b(parent, digest_size=16)
        digest.update(self.tokens[start:end].tobytes())
        return digest.digest()


@dataclass(slots=True)
class PageTally:
    """What paging one state did: pages (and their bytes) copied out of it, and pages found live and referenced."""

    stored: int = 0
    shared: int = 0
    bytes_stored: int = 0
    bytes_shared: int = 0

    def count(self, stored: bool, n_bytes: int) -> None:
        """Count one page: copied (``stored``) or referenced."""
        if stored:
            self.stored += 1
            self.bytes_stored += n_bytes
        else:
            self.shared += 1
            self.bytes_shared += n_bytes


@dataclass(frozen=True, slots=True)
class PageInfo:
    """What one page holds, for a :class:`PageListener`.

    :ivar page_id: The page's id.
    :ivar parent_id: The id of the whole page before it in the same cache (positions ``start - page_positions`` to
        ``start``), whether or not a state holds that one now; ``None`` for a page at position 0 or one that does not
        start on a page boundary.
    :ivar tokens: The token ids at the page's positions.
    :ivar start: Its first position.
    :ivar depth: Which attention cache, counted from the last (0: the only cache of most models; an iSWA model's
        window cache, whose full cache is 1).
    :ivar page_positions: The page size of the states it was cut from.
    :ivar namespace: The tenant namespace folded into its id.
    """

    page_id: bytes
    parent_id: bytes | None
    tokens: np.ndarray
    start: int
    depth: int
    page_positions: int
    namespace: str

    @property
    def whole(self) -> bool:
        """Whether the page covers one whole block of ``page_positions`` positions, as a cache block does."""
        return self.start % self.page_positions == 0 and len(self.tokens) == self.page_positions


class PageListener(Protocol):
    """Hears what happens to pages. Called on the threads that capture and drop states, sometimes while a lock of
    the caller is held: an implementation only records (appends to a queue) and returns."""

    def page_stored(self, info: PageInfo, token: int) -> None:
        """A page is live in this process and was not announced yet; ``token`` names this announcement."""

    def page_gone(self, page_id: bytes, token: int) -> None:
        """The page of announcement ``token`` was freed (its last holder dropped it). A page of the same id may have
        been announced again meanwhile (under another token): only the latest announcement counts."""

    def tier_stored(self, tier: str, page_ids: Sequence[bytes]) -> None:
        """Tier ``tier`` (``"shared"``, ``"disk"``) wrote the live pages ``page_ids``."""

    def cleared(self, namespace: str | None) -> None:
        """Every tier forgot ``namespace``'s state (everyone's, for ``None``)."""


class PageStore:
    """The live pages by id (weakly: a page goes when the last state holding it does).

    :ivar tally: Every page interned here: copied out of a capture, or found live and referenced instead.
    :ivar listener: Hears of pages stored and gone (see :meth:`listen`); ``None`` for none.
    :ivar announce_seconds: Time the capturing threads spent announcing pages to the listener (describing them,
        calling it, watching them go).
    """

    def __init__(self) -> None:
        self._pages: weakref.WeakValueDictionary[bytes, np.ndarray] = weakref.WeakValueDictionary()
        self._lock = threading.Lock()
        self.tally = PageTally()
        self.listener: PageListener | None = None
        # The page object each id was last announced for: a page found live is announced once, a new page of an id
        # whose last one went is announced again.
        self._announced: weakref.WeakValueDictionary[bytes, np.ndarray] = weakref.WeakValueDictionary()
        self._tokens = itertools.count(1)
        self.announce_seconds = 0.0

    def listen(self, listener: PageListener | None) -> None:
        """Tell ``listener`` of the pages stored from now on (``None``: stop telling). Pages already live are
        announced when a capture next references them."""
        with self._lock:
            self.listener = listener
            self._announced.clear()

    def tier_stored(self, tier: str, page_ids: Sequence[bytes]) -> None:
        """Tier ``tier`` wrote the live pages ``page_ids`` (told to the listener, if any)."""
        listener = self.listener
        if listener is not None and page_ids:
            listener.tier_stored(tier, page_ids)

    def cleared(self, namespace: str | None) -> None:
        """Every tier forgot ``namespace``'s state (everyone's, for ``None``): told to the listener, and after a whole
        clear every live page is announced again when a capture next references it."""
        listener = self.listener
        if listener is None:
            return
        with self._lock:
            if namespace is None:
                self._announced.clear()
            listener.cleared(namespace)

    def __len__(self) -> int:
        return len(self._pages)

    def get(self, page_id: bytes) -> np.ndarray | None:
        """The live page ``page_id`` names, if any."""
        with self._lock:
            return self._pages.get(page_id)

    def intern(self, page_id: bytes, make: Callable[[], np.ndarray], tally: PageTally | None = None,
               describe: Callable[[], PageInfo] | None = None) -> np.ndarray:
        """The live page ``page_id`` names, or the one ``make`` builds, stored under that id (``tally`` counts
        which). With a listener, a page not announced yet is announced with what ``describe`` says of it (a page
        without one, read from a tier by id, is announced once a capture describes it)."""
        with self._lock:
            page = self._pages.get(page_id)
        stored = page is None
        if stored:
            made = make()
            made.flags.writeable = False
            with self._lock:
                page = self._pages.setdefault(page_id, made)  # another thread may have stored it meanwhile
            stored = page is made
        with self._lock:
            self.tally.count(stored, page.nbytes)
        if tally is not None:
            tally.count(stored, page.nbytes)
        listener = self.listener
        if listener is not None and describe is not None:
            self._announce(listener, page_id, page, describe)
        return page

    def _announce(self, listener: PageListener, page_id: bytes, page: np.ndarray,
                  describe: Callable[[], PageInfo]) -> None:
        started = time.perf_counter()
        with self._lock:
            announced = self._announced.get(page_id) is page
            if not announced:
                self._announced[page_id] = page
                token = next(self._tokens)
        if not announced:
            # Stored before the finalizer exists, so the listener hears of a page's going only after its storing.
            listener.page_stored(describe(), token)
            weakref.finalize(page, listener.page_gone, page_id, token).atexit = False
        self.announce_seconds += time.perf_counter() - started

    @property
    def unique_bytes(self) -> int:
        """Bytes of the live pages."""
        with self._lock:
            return sum(page.nbytes for page in self._pages.values())


@dataclass(frozen=True, slots=True)
class PagedSection:
    """One attention cache of a paged state.

    :ivar head: Literal bytes before the cells (see :class:`~ckpt_plugin.core.state_layout.KvSection`).
    :ivar tail: Literal bytes after them.
    :ivar stripes: The stripes' literals and sizes (their offsets are those of the state the section was taken
        from, unused here).
    :ivar page_ids: Each page's id, in position order.
    :ivar pages: Each page's bytes: for each stripe, its rows of the page's cells.
    :ivar page_cells: Cells each page holds.
    """

    head: bytes
    tail: bytes
    stripes: tuple[Stripe, ...]
    page_ids: tuple[bytes, ...]
    pages: tuple[np.ndarray, ...]
    page_cells: tuple[int, ...]

    @property
    def n_cells(self) -> int:
        return sum(self.page_cells)

    @property
    def nbytes(self) -> int:
        """Bytes this section takes in the assembled state."""
        return (len(self.head) + len(self.tail) + sum(len(s.literal) for s in self.stripes)
                + self.n_cells * sum(s.per_cell for s in self.stripes))


@dataclass(frozen=True, slots=True, eq=False, weakref_slot=True)
class PagedState:
    """A sequence state as pages: what :func:`page_state` gives, what :meth:`assemble` turns back into bytes.

    :ivar prefix: The literal bytes before the first cache (the magic; the sequence id zeroed: a restore ignores it).
    :ivar sections: The attention caches, in state order.
    :ivar rest: The bytes that are not per position (a recurrent state), read-only; empty if none.
    :ivar nbytes: Bytes of the assembled state.
    """

    prefix: bytes
    sections: tuple[PagedSection, ...]
    rest: np.ndarray
    nbytes: int

    def parts(self) -> Iterator[np.ndarray]:
        """Every buffer this state references: its pages, then the rest (if any)."""
        for section in self.sections:
            yield from section.pages
        if self.rest.nbytes:
            yield self.rest

    @property
    def page_ids(self) -> list[bytes]:
        return [page_id for section in self.sections for page_id in section.page_ids]

    def pages_by_id(self) -> dict[bytes, np.ndarray]:
        """Every page of this state by its id."""
        return {page_id: page for section in self.sections for page_id, page in zip(section.page_ids, section.pages)}

    def assemble(self, out: np.ndarray) -> np.ndarray:
        """Write the state's bytes into ``out`` (at least :attr:`nbytes` long); return the written view."""
        if out.nbytes < self.nbytes:
            raise ValueError(f"a {out.nbytes}-byte buffer cannot hold a {self.nbytes}-byte state")
        view = out[: self.nbytes]
        offset = _put(view, 0, self.prefix)
        for section in self.sections:
            offset = _put(view, offset, section.head)
            n_cells = section.n_cells
            page_offset = 0
            for stripe in section.stripes:
                offset = _put(view, offset, stripe.literal)
                width = stripe.per_cell // stripe.rows
                target = view[offset: offset + n_cells * stripe.per_cell].reshape(stripe.rows, n_cells * width)
                column = 0
                for page, cells in zip(section.pages, section.page_cells):
                    size = cells * stripe.per_cell
                    source = page[page_offset * cells: page_offset * cells + size]
                    target[:, column: column + cells * width] = source.reshape(stripe.rows, cells * width)
                    column += cells * width
                offset += n_cells * stripe.per_cell
                page_offset += stripe.per_cell
            offset = _put(view, offset, section.tail)
        view[offset:] = self.rest
        return view

    def materialize(self) -> np.ndarray:
        """The state's bytes in a new read-only buffer."""
        buffer = self.assemble(np.empty(self.nbytes, dtype=np.uint8))
        buffer.flags.writeable = False
        return buffer


def _put(view: np.ndarray, offset: int, literal: bytes) -> int:
    if literal:
        view[offset: offset + len(literal)] = np.frombuffer(literal, dtype=np.uint8)
    return offset + len(literal)


def page_state(state: np.ndarray, layout: StateLayout, chain: TokenChain, store: PageStore,
               page_positions: int, tally: PageTally | None = None) -> PagedState | None:
    """``state`` (laid out as ``layout``) as pages, each taken from ``store`` where it lives already, else copied.

    ``chain`` names the tokens at positions ``0..``; ``None`` when a section's positions are not one consecutive
    run inside them (the caller keeps the state whole).
    """
    sections = []
    for depth, section in enumerate(reversed(layout.sections)):
        paged = _page_section(state, section, depth, chain, store, page_positions, tally)
        if paged is None:
            return None
        sections.append(paged)
    sections.reverse()
    rest = state[layout.rest:]
    if rest.nbytes:
        rest = rest.copy()
        rest.flags.writeable = False
    else:
        rest = np.empty(0, dtype=np.uint8)
    prefix = layout.prefix[:4] + bytes(len(layout.prefix) - 4) if layout.prefix else b""
    return PagedState(prefix, tuple(sections), rest, layout.n_bytes)


def _page_section(state: np.ndarray, section: KvSection, depth: int, chain: TokenChain, store: PageStore,
                  page_positions: int, tally: PageTally | None) -> PagedSection | None:
    positions = section.positions
    order = np.argsort(positions, kind="stable")
    first = int(positions[order[0]])
    n_cells = len(positions)
    if first < 0 or first + n_cells > len(chain.tokens):
        return None
    in_order = bool(np.all(order == np.arange(n_cells)))
    if not np.array_equal(positions[order], np.arange(first, first + n_cells)):
        return None
    signature = hashlib.blake2b(section.signature, digest_size=16).digest()
    per_cell = section.per_cell
    ids, pages, counts = [], [], []
    start = first
    while start < first + n_cells:
        end = min((start // page_positions + 1) * page_positions, first + n_cells)
        page_id = _page_id(chain, signature, depth, start, end)
        begin = start - first
        rows = slice(begin, begin + end - start) if in_order else order[begin: begin + end - start]
        describe = None
        if store.listener is not None:
            describe = functools.partial(_describe, chain, signature, depth, start, end, page_id,
                                         ids[-1] if ids and counts[-1] == page_positions else None)
        pages.append(store.intern(page_id, lambda rows=rows, cells=end - start: _cut(state, section, rows, cells,
                                                                                        per_cell), tally, describe))
        ids.append(page_id)
        counts.append(end - start)
        start = end
    return PagedSection(section.head, section.tail, section.stripes, tuple(ids), tuple(pages), tuple(counts))


def _page_id(chain: TokenChain, signature: bytes, depth: int, start: int, end: int) -> bytes:
    return hashlib.blake2b(chain.at(end) + signature + struct.pack("<III", depth, start, end), digest_size=16).digest()


def _describe(chain: TokenChain, signature: bytes, depth: int, start: int, end: int, page_id: bytes,
              previous: bytes | None) -> PageInfo:
    """What the page of positions ``[start, end)`` holds; ``previous`` is the whole page before it, where the state
    holds that one (else its id is computed: a window cache starts inside a page, or past the whole one before)."""
    block = chain.block
    parent = None
    if start % block == 0 and start >= block:
        parent = previous if previous is not None else _page_id(chain, signature, depth, start - block, start)
    return PageInfo(page_id, parent, chain.tokens[start:end].copy(), start, depth, block, chain.namespace)


def _cut(state: np.ndarray, section: KvSection, rows: slice | np.ndarray, cells: int, per_cell: int) -> np.ndarray:
    """The bytes of ``cells`` cells (``rows``: their indices in the state) from every stripe of ``section``."""
    page = np.empty(cells * per_cell, dtype=np.uint8)
    offset = 0
    n_total = section.n_cells
    for index, stripe in enumerate(section.stripes):
        width = stripe.per_cell // stripe.rows
        source = state[stripe.offset: stripe.offset + n_total * stripe.per_cell].reshape(stripe.rows, n_total, width)
        target = page[offset: offset + cells * stripe.per_cell].reshape(stripe.rows, cells, width)
        target[...] = source[:, rows, :]
        if index == 0:  # the sequence id the cells were captured from: a restore discards it, a page is any slot's
            target[:, :, width - _SEQ_ID_BYTES:] = 0
        offset += cells * stripe.per_cell
    return page


PAGES = PageStore()
"""The pages of every state of this process: captures, the prompt cache, the disk and shared tiers' reads."""
