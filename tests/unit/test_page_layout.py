"""The state-layout parser, the pager and the page-map codec on states built by hand in llama.cpp's layout (no model):
streams, cell extensions, transposed V, cells out of position order, a recurrent rest; malformed input refused."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from ckpt_plugin.core.errors import CorruptFileError
from ckpt_plugin.core.pages import PagedState, PageStore, TokenChain, page_state
from ckpt_plugin.core.state_layout import UnknownLayout, parse_state
from ckpt_plugin.persist.page_map import decode_page_map, encode_page_map, open_page, seal_page

MAGIC = struct.pack("<Ii", 0xAF143CD8, 0)


def kv_section(positions: list[int], *, n_layer: int = 2, row: int = 6, v_trans: bool = False, ext: bool = False,
               streams: int = 1, stream: int = 0, seq_id: int = 0, seed: int = 0) -> bytes:
    """One attention cache's bytes as llama_kv_cache::state_write lays them out; each cell's data derived from its
    position, so that equal positions hold equal bytes."""
    out = [struct.pack("<I", streams)]
    n = len(positions)
    for s in range(streams):
        out.append(struct.pack("<I", n if s == stream else 0))
        if s != stream:
            continue
        for pos in positions:
            out.append(struct.pack("<iI", pos, 1) + (struct.pack("<iii", pos, 0, pos + 7) if ext else b"")
                       + struct.pack("<i", seq_id))
        out.append(struct.pack("<II", int(v_trans), n_layer))

        def cell_bytes(layer: int, part: int, pos: int, size: int) -> bytes:
            rng = np.random.default_rng([seed, layer, part, pos])
            return rng.integers(0, 256, size, dtype=np.uint8).tobytes()

        for layer in range(n_layer):
            out.append(struct.pack("<iQ", 1, row))
            out += [cell_bytes(layer, 0, pos, row) for pos in positions]
        for layer in range(n_layer):
            if not v_trans:
                out.append(struct.pack("<iQ", 1, row))
                out += [cell_bytes(layer, 1, pos, row) for pos in positions]
            else:
                element, embd = 2, row // 2
                out.append(struct.pack("<iII", 1, element, embd))
                per_cell = {pos: cell_bytes(layer, 1, pos, row) for pos in positions}
                for j in range(embd):
                    out += [per_cell[pos][j * element:(j + 1) * element] for pos in positions]
    return b"".join(out)


def as_state(data: bytes) -> np.ndarray:
    state = np.frombuffer(data, dtype=np.uint8)
    return state


def paged(data: bytes, tokens: np.ndarray, recurrent: bool = False, store: PageStore | None = None,
          page_positions: int = 4) -> PagedState:
    state = as_state(data)
    result = page_state(state, parse_state(state, recurrent), TokenChain(b"seed", tokens, page_positions),
                        store if store is not None else PageStore(), page_positions)
    assert result is not None
    return result


TOKENS = np.arange(100, 164, dtype=np.int32)


@pytest.mark.parametrize("v_trans", [False, True])
@pytest.mark.parametrize("ext", [False, True])
@pytest.mark.parametrize("streams", [1, 3])
def test_assembly_gives_the_state_back(v_trans: bool, ext: bool, streams: int) -> None:
    data = MAGIC + kv_section(list(range(5, 30)), v_trans=v_trans, ext=ext, streams=streams, stream=streams - 1)
    result = paged(data, TOKENS)
    assert result.nbytes == len(data)
    assert result.materialize().tobytes() == data


def test_two_caches_and_a_recurrent_rest() -> None:
    rest = bytes(range(200)) * 3
    data = MAGIC + kv_section(list(range(0, 40)), n_layer=1) + kv_section(list(range(20, 40)), n_layer=3) + rest
    layout = parse_state(as_state(data), recurrent=True)
    assert [s.n_cells for s in layout.sections] == [40, 20] and layout.n_bytes - layout.rest == len(rest)
    result = paged(data, TOKENS, recurrent=True)
    assert result.materialize().tobytes() == data
    with pytest.raises(UnknownLayout):
        parse_state(as_state(data), recurrent=False)


def test_cells_out_of_order_are_assembled_in_position_order() -> None:
    ordered = MAGIC + kv_section(list(range(8, 24)))
    shuffled = MAGIC + kv_section([*range(16, 24), *range(8, 16)])
    assert paged(shuffled, TOKENS).materialize().tobytes() == ordered


def test_the_sequence_id_does_not_enter_a_page() -> None:
    store = PageStore()
    mine = paged(MAGIC + kv_section(list(range(0, 16)), seq_id=0), TOKENS, store=store)
    theirs = paged(struct.pack("<Ii", 0xAF143CD8, 3) + kv_section(list(range(0, 16)), seq_id=3), TOKENS, store=store)
    assert mine.page_ids == theirs.page_ids
    assert all(a is b for a, b in zip(mine.parts(), theirs.parts()))  # stored once
    assert store.tally.stored == 4 and store.tally.shared == 4


def test_pages_are_named_by_tokens_and_position() -> None:
    store = PageStore()
    window = paged(MAGIC + kv_section(list(range(8, 24))), TOKENS, store=store)
    later = paged(MAGIC + kv_section(list(range(12, 28))), TOKENS, store=store)
    assert set(window.page_ids[1:]) & set(later.page_ids)  # whole pages in both windows: one id, one buffer
    other = TOKENS.copy()
    other[3] += 1  # a token before the window: every later cell is another state
    assert not set(paged(MAGIC + kv_section(list(range(8, 24))), other).page_ids) & set(window.page_ids)


@pytest.mark.parametrize("cut", [0, 5, 9, 13, 20, 40])
def test_truncated_or_garbled_states_are_refused(cut: int) -> None:
    data = bytearray(MAGIC + kv_section(list(range(0, 12))))
    with pytest.raises(UnknownLayout):
        parse_state(as_state(bytes(data[: len(data) - 1 - cut])), recurrent=False)
    data[8 + cut] ^= 0xFF
    try:
        layout = parse_state(as_state(bytes(data)), recurrent=False)
    except UnknownLayout:
        return
    assert layout.n_bytes == len(data)  # a flipped data byte is still a state; a flipped header is not


def test_cells_outside_the_tokens_keep_the_state_whole() -> None:
    state = as_state(MAGIC + kv_section(list(range(60, 70))))
    assert page_state(state, parse_state(state, False), TokenChain(b"s", TOKENS, 4), PageStore(), 4) is None
    gapped = as_state(MAGIC + kv_section([1, 2, 4, 5]))
    assert page_state(gapped, parse_state(gapped, False), TokenChain(b"s", TOKENS, 4), PageStore(), 4) is None


def test_page_maps_round_trip_and_refuse_garbage() -> None:
    data = MAGIC + kv_section(list(range(0, 40)), v_trans=True) + kv_section(list(range(20, 40))) + b"rest" * 10
    state = paged(data, TOKENS, recurrent=True)
    encoded = encode_page_map(state)
    page_map = decode_page_map(encoded, "test")
    pages = state.pages_by_id()
    assert page_map.page_sizes == {i: p.nbytes for i, p in pages.items()}
    assert page_map.bind(pages).materialize().tobytes() == data
    for cut in (1, 9, len(encoded) // 2):
        with pytest.raises(CorruptFileError):
            decode_page_map(encoded[:-cut], "test")
    with pytest.raises(CorruptFileError):
        decode_page_map(encoded + b"x", "test")
    page_id, page = next(iter(pages.items()))
    sealed = seal_page(page)
    store = PageStore()
    assert open_page(sealed, page_id, page.nbytes, store, "k").tobytes() == page.tobytes()
    with pytest.raises(CorruptFileError):
        open_page(sealed[:-1] + bytes([sealed[-1] ^ 1]), b"x" * 16, page.nbytes, store, "k")
    with pytest.raises(CorruptFileError):
        open_page(sealed, b"y" * 16, page.nbytes + 1, store, "k")


@settings(max_examples=60, deadline=None)
@given(start=st.integers(0, 30), length=st.integers(1, 34), page_positions=st.sampled_from([1, 3, 4, 8, 64]),
       v_trans=st.booleans(), shuffle=st.randoms(use_true_random=False))
def test_any_window_pages_and_assembles(start: int, length: int, page_positions: int, v_trans: bool,
                                        shuffle: object) -> None:
    positions = list(range(start, start + length))
    ordered = MAGIC + kv_section(positions, v_trans=v_trans)
    shuffle.shuffle(positions)  # type: ignore[attr-defined]
    result = paged(MAGIC + kv_section(positions, v_trans=v_trans), TOKENS, page_positions=page_positions)
    assert result.materialize().tobytes() == ordered
    assert all(0 < n <= page_positions for s in result.sections for n in s.page_cells)
