"""llama.cpp's sequence-state layout, parsed into what is stored per position and what is not (pure: no llama.cpp).

``llama_state_seq_get_data`` writes a magic number (u32) and the sequence id (i32), then each memory of the context
in turn: an attention KV cache as

- ``n_stream`` (u32), then per stream ``cell_count`` (u32) and, for the one stream that holds the sequence's cells,
- one metadata record per cell: ``pos`` (i32), ``n_seq_id`` (u32, 1 for one sequence), the cell's extension (12
  bytes, only where the model needs M-RoPE's 2D position or the token id) and the sequence id (i32);
- ``v_trans`` (u32) and ``n_layer`` (u32); per layer the K type (i32), the K row size (u64) and one K row per cell;
- per layer the V type (i32) and either its row size (u64) and one V row per cell, or (``v_trans``) its element size
  (u32), ``n_embd_v_gqa`` (u32) and, for each of those rows, one element per cell.

An iSWA model writes its base cache then its window cache (only the window with ``PARTIAL_ONLY``); a hybrid model
writes its attention cache then its recurrent state. The recurrent state has one cell per sequence, nothing is per
position there: it is the non-paged rest. This module finds the per-cell stripes of each attention cache; a layout it
does not recognise exactly (sizes that do not add up to the blob, two streams holding cells, positions that are not
one consecutive run) is refused with :class:`UnknownLayout`, and the caller keeps the state whole.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

__all__ = ["KvSection", "StateLayout", "Stripe", "UnknownLayout", "parse_state"]

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_I32 = struct.Struct("<i")
_MAGIC = 0xAF143CD8
"""What a sequence state starts with (llama.cpp writes no magic in older releases: then none is expected)."""
_CELL_EXT_BYTES = 12
"""``llama_kv_cell_ext``: x, y (i32) and the token id (i32)."""
_MAX_KV_SECTIONS = 2
"""Attention caches in one state at most: an iSWA model's base and window caches."""
_MAX_STREAMS = 1024
_MAX_LAYERS = 4096
_MAX_ROW_BYTES = 1 << 26
_MAX_TYPE = 1024


class UnknownLayout(ValueError):
    """The state is not laid out as this module reads llama.cpp's sequence states."""


@dataclass(frozen=True, slots=True)
class Stripe:
    """The bytes every cell has in one part of a cache: its metadata, a layer's K rows or V rows.

    :ivar literal: The bytes written before the cells' data (a layer's type and row size), kept as they were.
    :ivar offset: Where the cells' data starts in the state.
    :ivar per_cell: Bytes each cell takes in this stripe.
    :ivar rows: 1, or ``n_embd_v_gqa`` for a transposed V: that many rows, each holding ``per_cell // rows`` bytes of
        every cell one after the other.
    """

    literal: bytes
    offset: int
    per_cell: int
    rows: int = 1


@dataclass(frozen=True, slots=True)
class KvSection:
    """One attention cache of a sequence state.

    :ivar head: The bytes before the first cell's metadata: ``n_stream``, the cell counts of the streams before the
        one holding the cells, its ``cell_count``.
    :ivar tail: The cell counts (zeros) of the streams after it.
    :ivar positions: The cells' positions in the order the state holds them.
    :ivar stripes: The metadata stripe first (its record holds the sequence id in its last 4 bytes), then every
        layer's K and V stripes in state order.
    :ivar end: Where the section ends in the state.
    """

    head: bytes
    tail: bytes
    positions: np.ndarray
    stripes: tuple[Stripe, ...]
    end: int

    @property
    def n_cells(self) -> int:
        return len(self.positions)

    @property
    def per_cell(self) -> int:
        """Bytes each cell takes over all stripes."""
        return sum(stripe.per_cell for stripe in self.stripes)

    @property
    def signature(self) -> bytes:
        """What the layout of a cell's bytes depends on: every stripe's literal and sizes (not the cell count)."""
        return b"".join(struct.pack("<QQ", s.per_cell, s.rows) + s.literal for s in self.stripes)


@dataclass(frozen=True, slots=True)
class StateLayout:
    """A sequence state, parsed.

    :ivar prefix: The bytes before the first cache: the magic and the sequence id (empty in older formats).
    :ivar sections: Its attention caches, in state order.
    :ivar rest: Where the part that is not per position starts (a recurrent state); the state's length if none.
    :ivar n_bytes: The state's length.
    """

    prefix: bytes
    sections: tuple[KvSection, ...]
    rest: int
    n_bytes: int


def parse_state(state: np.ndarray, recurrent: bool) -> StateLayout:
    """The layout of ``state`` (a sequence state of a model with a recurrent part when ``recurrent``).

    :raises UnknownLayout: The bytes are not a layout this module knows, exactly.
    """
    data = memoryview(np.ascontiguousarray(state, dtype=np.uint8)).cast("B")
    offset, sections = 0, []
    if len(data) >= 8 and _U32.unpack_from(data, 0)[0] == _MAGIC:
        offset = 8
    prefix = bytes(data[:offset])
    while len(sections) < _MAX_KV_SECTIONS and offset < len(data):
        try:
            section = _parse_section(data, offset)
        except UnknownLayout:
            if not sections and not recurrent:
                raise
            break
        sections.append(section)
        offset = section.end
    if not recurrent and offset != len(data):
        raise UnknownLayout(f"{len(data) - offset} bytes follow the attention caches of a state without a recurrent "
                            f"part")
    if recurrent and offset == len(data):
        raise UnknownLayout("a hybrid state without its recurrent part")
    if not sections:
        raise UnknownLayout("no attention cache in the state")
    return StateLayout(prefix, tuple(sections), offset, len(data))


def _read(data: memoryview, offset: int, item: struct.Struct) -> int:
    if offset + item.size > len(data):
        raise UnknownLayout("the state ends inside a header")
    return item.unpack_from(data, offset)[0]


def _parse_section(data: memoryview, start: int) -> KvSection:
    n_stream = _read(data, start, _U32)
    if not 1 <= n_stream <= _MAX_STREAMS:
        raise UnknownLayout(f"{n_stream} streams")
    offset = start + 4
    head = b""
    parsed: tuple[np.ndarray, tuple[Stripe, ...]] | None = None
    for _ in range(n_stream):
        cell_count = _read(data, offset, _U32)
        offset += 4
        if cell_count == 0:
            continue
        if parsed is not None:
            raise UnknownLayout("two streams hold cells of one sequence")
        head = bytes(data[start:offset])
        parsed, offset = _parse_cells(data, offset, cell_count)
    if parsed is None:
        raise UnknownLayout("no stream holds a cell")
    positions, stripes = parsed
    tail_start = stripes[-1].offset + stripes[-1].per_cell * len(positions)
    return KvSection(head, bytes(data[tail_start:offset]), positions, stripes, offset)


def _parse_cells(data: memoryview, offset: int, cell_count: int) -> tuple[tuple[np.ndarray, tuple[Stripe, ...]], int]:
    """The cells of one stream at ``offset``: their positions and stripes, and where the stream ends. A cell
    extension is tried when the records without one do not add up."""
    failure = UnknownLayout("no cell record size fits")
    for ext in (0, _CELL_EXT_BYTES):
        record = 12 + ext
        size = cell_count * record
        if offset + size > len(data):
            continue
        records = np.frombuffer(data, dtype=np.uint8, count=size, offset=offset).reshape(cell_count, record)
        if not np.all(records[:, 4:8].copy().view("<u4") == 1):
            continue
        positions = records[:, 0:4].copy().view("<i4").ravel().astype(np.int64)
        try:
            stripes, end = _parse_data(data, offset + size, cell_count)
        except UnknownLayout as exc:
            failure = exc
            continue
        return (positions, (Stripe(b"", offset, record), *stripes)), end
    raise failure


def _parse_data(data: memoryview, offset: int, cell_count: int) -> tuple[list[Stripe], int]:
    literal_start = offset
    v_trans = _read(data, offset, _U32)
    n_layer = _read(data, offset + 4, _U32)
    if v_trans not in (0, 1) or not 1 <= n_layer <= _MAX_LAYERS:
        raise UnknownLayout(f"v_trans {v_trans}, {n_layer} layers")
    offset += 8
    stripes = []
    for layer in range(2 * n_layer):
        header_start = literal_start if layer == 0 else offset
        kind = _read(data, offset, _I32)
        if not 0 <= kind < _MAX_TYPE:
            raise UnknownLayout(f"tensor type {kind}")
        if layer < n_layer or not v_trans:
            row = _read(data, offset + 4, _U64)
            offset += 12
            rows, per_cell = 1, row
        else:
            element = _read(data, offset + 4, _U32)
            rows = _read(data, offset + 8, _U32)
            offset += 12
            per_cell = element * rows
            if not 1 <= element <= 64 or not 1 <= rows <= _MAX_ROW_BYTES:
                raise UnknownLayout(f"transposed V of {rows} rows of {element}-byte elements")
        if not 1 <= per_cell <= _MAX_ROW_BYTES:
            raise UnknownLayout(f"{per_cell} bytes a cell")
        stripes.append(Stripe(bytes(data[header_start:offset]), offset, per_cell, rows))
        offset += per_cell * cell_count
        if offset > len(data):
            raise UnknownLayout("the state ends inside a layer's cells")
    return stripes, offset
