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
"""

from __future__ import annotations

import hashlib
import struct
import threading
import weakref
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import numpy as np

from ckpt_plugin.core.state_layout import KvSection, StateLayout, Stripe

__all__ = [
    "DEFAULT_PAGE_POSITIONS",
    "PAGES",
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
    """

    def __init__(self, seed: bytes, tokens: np.ndarray, block: int) -> None:
        self.tokens = np.ascontiguousarray(tokens, dtype=np.int32)
        self.block = block
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


class PageStore:
    """The live pages by id (weakly: a page goes when the last state holding it does).

    :ivar tally: Every page interned here: copied out of a capture, or found live and referenced instead.
    """

    def __init__(self) -> None:
        self._pages: weakref.WeakValueDictionary[bytes, np.ndarray] = weakref.WeakValueDictionary()
        self._lock = threading.Lock()
        self.tally = PageTally()

    def __len__(self) -> int:
        return len(self._pages)

    def get(self, page_id: bytes) -> np.ndarray | None:
        """The live page ``page_id`` names, if any."""
        with self._lock:
            return self._pages.get(page_id)

    def intern(self, page_id: bytes, make: Callable[[], np.ndarray], tally: PageTally | None = None) -> np.ndarray:
        """The live page ``page_id`` names, or the one ``make`` builds, stored under that id (``tally`` counts
        which)."""
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
        return page

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
        page_id = hashlib.blake2b(chain.at(end) + signature + struct.pack("<III", depth, start, end),
                                  digest_size=16).digest()
        begin = start - first
        rows = slice(begin, begin + end - start) if in_order else order[begin: begin + end - start]
        pages.append(store.intern(page_id, lambda rows=rows, cells=end - start: _cut(state, section, rows, cells,
                                                                                        per_cell), tally))
        ids.append(page_id)
        counts.append(end - start)
        start = end
    return PagedSection(section.head, section.tail, section.stripes, tuple(ids), tuple(pages), tuple(counts))


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


def page_ids_of(states: Sequence[PagedState]) -> set[bytes]:
    """Every page id the paged ``states`` reference."""
    return {page_id for state in states for page_id in state.page_ids}
