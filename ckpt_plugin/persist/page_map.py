"""A paged state's manifest as bytes (a **page map**), and a page's bytes as a stored value.

A page map names the pages of one :class:`~ckpt_plugin.core.pages.PagedState` by id and carries what is not paged
(the literal headers, the recurrent rest), so a tier stores each page once, under its id, and a state as its small
map. Layout (little-endian)::

    "CKPTPGM1"                                   magic (no llama.cpp state starts with it)
    u64 n_bytes                                  the assembled state's length
    u32 len, prefix | u32 len, rest              literal prefix; the part that is not per position
    u32 n_sections
      per section: u32 len, head | u32 len, tail
                   u32 n_stripes, per stripe: u32 len, literal | u64 per_cell | u32 rows
                   u32 n_pages,   per page:   16-byte id | u32 cells

A stored page is its bytes followed by their XXH3-128 digest (:func:`seal_page`): the id names what the bytes are
(tokens, model, tenant), the digest checks that they arrived whole.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from ckpt_plugin.core.errors import CorruptFileError
from ckpt_plugin.core.pages import PagedSection, PagedState, PageStore
from ckpt_plugin.core.state_layout import Stripe

try:
    import xxhash
except ImportError:  # pragma: no cover - the redis extra is missing: the shared tier refuses to start without it
    xxhash = None

__all__ = ["PAGE_MAP_MAGIC", "PageMap", "decode_page_map", "encode_page_map", "is_page_map", "open_page",
           "seal_page"]

PAGE_MAP_MAGIC = b"CKPTPGM1"
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_PAGE = struct.Struct("<16sI")
_STRIPE = struct.Struct("<QI")
_DIGEST = 16
_MAX_ITEMS = 1 << 20
_MAX_BYTES = 1 << 40


def is_page_map(data: bytes | memoryview | np.ndarray) -> bool:
    """Whether ``data`` is a page map (rather than a state's bytes)."""
    return bytes(memoryview(data)[: len(PAGE_MAP_MAGIC)]) == PAGE_MAP_MAGIC


def encode_page_map(state: PagedState) -> bytes:
    """The page map of ``state``."""
    out = [PAGE_MAP_MAGIC, _U64.pack(state.nbytes), _blob(state.prefix), _blob(state.rest.tobytes()),
           _U32.pack(len(state.sections))]
    for section in state.sections:
        out += [_blob(section.head), _blob(section.tail), _U32.pack(len(section.stripes))]
        for stripe in section.stripes:
            out += [_blob(stripe.literal), _STRIPE.pack(stripe.per_cell, stripe.rows)]
        out.append(_U32.pack(len(section.page_ids)))
        out += [_PAGE.pack(page_id, cells) for page_id, cells in zip(section.page_ids, section.page_cells)]
    return b"".join(out)


def _blob(data: bytes) -> bytes:
    return _U32.pack(len(data)) + data


@dataclass(frozen=True)
class PageMap:
    """A decoded page map: a paged state without its pages' bytes.

    :ivar sections: Each section as a :class:`PagedSection` whose ``pages`` are empty.
    :ivar page_sizes: Every page's length in bytes, by id.
    """

    prefix: bytes
    rest: bytes
    sections: tuple[PagedSection, ...]
    n_bytes: int
    page_sizes: dict[bytes, int]

    def bind(self, pages: dict[bytes, np.ndarray]) -> PagedState:
        """The paged state, its pages taken from ``pages`` (every id of :attr:`page_sizes` must be there)."""
        sections = tuple(PagedSection(s.head, s.tail, s.stripes, s.page_ids, tuple(pages[i] for i in s.page_ids),
                                      s.page_cells) for s in self.sections)
        rest = np.frombuffer(self.rest, dtype=np.uint8)
        return PagedState(self.prefix, sections, rest, self.n_bytes)


class _Reader:
    def __init__(self, data: bytes, where: str) -> None:
        self.data, self.where, self.offset = data, where, 0

    def take(self, item: struct.Struct) -> tuple:
        if self.offset + item.size > len(self.data):
            raise CorruptFileError(f"{self.where}: the page map ends early")
        value = item.unpack_from(self.data, self.offset)
        self.offset += item.size
        return value

    def count(self) -> int:
        (value,) = self.take(_U32)
        if value > _MAX_ITEMS:
            raise CorruptFileError(f"{self.where}: the page map names {value} items")
        return value

    def blob(self) -> bytes:
        (length,) = self.take(_U32)
        if self.offset + length > len(self.data):
            raise CorruptFileError(f"{self.where}: the page map ends inside a literal")
        self.offset += length
        return self.data[self.offset - length: self.offset]


def decode_page_map(data: bytes | memoryview | np.ndarray, where: str) -> PageMap:
    """The page map in ``data``.

    :raises CorruptFileError: It is not one, or its sizes do not add up.
    """
    raw = bytes(memoryview(data))
    if not raw.startswith(PAGE_MAP_MAGIC):
        raise CorruptFileError(f"{where}: not a page map")
    reader = _Reader(raw, where)
    reader.offset = len(PAGE_MAP_MAGIC)
    (n_bytes,) = reader.take(_U64)
    prefix, rest = reader.blob(), reader.blob()
    sections, sizes = [], {}
    total = len(prefix) + len(rest)
    for _ in range(reader.count()):
        head, tail = reader.blob(), reader.blob()
        stripes = []
        for _ in range(reader.count()):
            literal = reader.blob()
            per_cell, rows = reader.take(_STRIPE)
            if not 1 <= rows <= per_cell or per_cell % rows or per_cell > _MAX_BYTES:
                raise CorruptFileError(f"{where}: a stripe of {rows} rows and {per_cell} bytes a cell")
            stripes.append(Stripe(literal, 0, per_cell, rows))
        ids, cells = [], []
        per_cell = sum(s.per_cell for s in stripes)
        for _ in range(reader.count()):
            page_id, n = reader.take(_PAGE)
            ids.append(page_id)
            cells.append(n)
            sizes[page_id] = n * per_cell
        if not stripes or any(n == 0 for n in cells):
            raise CorruptFileError(f"{where}: a section without stripes or with an empty page")
        total += len(head) + len(tail) + sum(len(s.literal) for s in stripes) + sum(cells) * per_cell
        sections.append(PagedSection(head, tail, tuple(stripes), tuple(ids), (), tuple(cells)))
    if reader.offset != len(raw):
        raise CorruptFileError(f"{where}: {len(raw) - reader.offset} bytes follow the page map")
    if total != n_bytes or not sections:
        raise CorruptFileError(f"{where}: the page map's parts add up to {total} bytes, not {n_bytes}")
    return PageMap(prefix, rest, tuple(sections), n_bytes, sizes)


def seal_page(page: np.ndarray) -> bytes:
    """A page's bytes as stored: the bytes, then their XXH3-128 digest."""
    return page.tobytes() + xxhash.xxh3_128_digest(page)


def open_page(value: bytes, page_id: bytes, size: int, store: PageStore, where: str) -> np.ndarray:
    """The page a stored ``value`` holds (``size`` bytes; checked against its digest), taken from ``store``
    where a live page has that id already, else put there.

    :raises CorruptFileError: The value is not a whole page of that size.
    """
    if len(value) != size + _DIGEST:
        raise CorruptFileError(f"{where}: {len(value)} bytes where a page of {size} bytes was expected")
    data = memoryview(value)[:size]
    if xxhash.xxh3_128_digest(data) != value[size:]:
        raise CorruptFileError(f"{where}: the page's digest does not match (the value is corrupted)")
    return store.intern(page_id, lambda: np.frombuffer(value, dtype=np.uint8, count=size))
