"""The tiny vision projector (``write_tiny_mmproj``) through llama-cpp-python's real multimodal chat handlers.

libmtmd (bundled with llama-cpp-python) loads the projector next to each tiny text model; images go in as PNG
``data:`` URIs, exactly as a chat request carries them. Each image takes ``mmproj_positions_per_image()`` positions
(one per patch, ``n_pos == n_tokens``), its content changes the answer, and the same image gives the same answer.
"""

from __future__ import annotations

import ctypes
import pathlib
import struct
import zlib
from typing import Any, Callable

import llama_cpp
import llama_cpp.mtmd_cpp as mtmd_cpp
import numpy as np
import pytest
from llama_cpp.llama_chat_format import Llava15ChatHandler, MTMDChatHandler

from ckpt_plugin.testing.tiny_models import (
    MMPROJ_IMAGE_SIZE,
    image_data_uri,
    mmproj_positions_per_image,
    tiny_png,
    write_tiny_mmproj,
)

KINDS = ["llama", "gemma3", "mamba", "hybrid"]
N_IMAGE = mmproj_positions_per_image()
N_CTX = 512


@pytest.fixture
def vision_llama(make_llama: Callable[..., Any], mmproj: pathlib.Path) -> Callable[..., Any]:
    """``vision_llama(kind, handler_class=Llava15ChatHandler)``: a tiny ``Llama`` with a multimodal chat handler."""

    def make(kind: str, handler_class: type = Llava15ChatHandler) -> Any:
        handler = handler_class(clip_model_path=str(mmproj), verbose=False)
        return make_llama(kind, chat_handler=handler, n_ctx=N_CTX)

    return make


def ask(llama: Any, image_seeds: list[int], max_tokens: int = 1) -> tuple[dict[str, Any], np.ndarray]:
    """One greedy chat request with the images of ``image_seeds`` and a short question: the response and the
    logits of the last decode (with ``max_tokens=1``, those of the prompt's last position)."""
    content: list[dict[str, Any]] = [
        {"type": "image_url", "image_url": {"url": image_data_uri(tiny_png(seed))}} for seed in image_seeds
    ]
    content.append({"type": "text", "text": "what is this?"})
    response = llama.create_chat_completion(
        messages=[{"role": "user", "content": content}], temperature=0.0, repeat_penalty=1.0, max_tokens=max_tokens
    )
    logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llama.ctx, -1), shape=(llama.n_vocab(),)).copy()
    return response, logits


def last_position(llama: Any) -> int:
    """The highest position sequence 0 holds in the context's memory."""
    return int(llama_cpp.llama_memory_seq_pos_max(llama_cpp.llama_get_memory(llama.ctx), 0))


def decode_png(png: bytes) -> np.ndarray:
    """The pixels of an 8-bit RGB, unfiltered PNG as :func:`tiny_png` writes it (height, width, 3)."""
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    chunks: dict[bytes, bytes] = {}
    at = 8
    while at < len(png):
        (length,) = struct.unpack(">I", png[at : at + 4])
        kind, data = png[at + 4 : at + 8], png[at + 8 : at + 8 + length]
        assert struct.unpack(">I", png[at + 8 + length : at + 12 + length])[0] == zlib.crc32(kind + data)
        chunks[kind] = data
        at += 12 + length
    width, height, depth, color, _, _, _ = struct.unpack(">IIBBBBB", chunks[b"IHDR"])
    assert (depth, color) == (8, 2)
    rows = np.frombuffer(zlib.decompress(chunks[b"IDAT"]), dtype=np.uint8).reshape(height, 1 + 3 * width)
    assert not rows[:, 0].any()  # filter type 0 on every scanline
    return rows[:, 1:].reshape(height, width, 3)


def test_tiny_png_is_deterministic_and_valid() -> None:
    assert tiny_png(3) == tiny_png(3)
    assert tiny_png(3) != tiny_png(4)
    pixels = decode_png(tiny_png(3))
    assert pixels.shape == (MMPROJ_IMAGE_SIZE, MMPROJ_IMAGE_SIZE, 3)
    assert decode_png(tiny_png(3, 40, 20)).shape == (20, 40, 3)
    assert image_data_uri(b"\x89PNG").startswith("data:image/png;base64,")


def test_mmproj_is_deterministic_and_small(tmp_path: pathlib.Path, mmproj: pathlib.Path) -> None:
    again = write_tiny_mmproj(tmp_path / "again.gguf")
    assert again.read_bytes() == mmproj.read_bytes()
    assert write_tiny_mmproj(tmp_path / "other.gguf", seed=1).read_bytes() != mmproj.read_bytes()
    assert mmproj.stat().st_size < 256 * 1024
    assert N_IMAGE == 4
    with pytest.raises(ValueError, match="multiple of patch_size"):
        write_tiny_mmproj(tmp_path / "bad.gguf", image_size=30)


def tokenize_with_image(ctx: Any, png: bytes) -> list[tuple[int, int, int]]:
    """``(type, n_tokens, n_pos)`` of each chunk mtmd makes of a short text around one image."""
    buffer = (ctypes.c_uint8 * len(png)).from_buffer_copy(png)
    bitmap = mtmd_cpp.mtmd_helper_bitmap_init_from_buf(ctx, buffer, len(png), False)
    assert bitmap is not None
    chunks = mtmd_cpp.mtmd_input_chunks_init()
    try:
        text = b"hello " + mtmd_cpp.mtmd_default_marker() + b" world"
        input_text = mtmd_cpp.mtmd_input_text()
        input_text.text, input_text.text_len = text, len(text)
        input_text.add_special, input_text.parse_special = True, True
        bitmaps = (mtmd_cpp.mtmd_bitmap_p_ctypes * 1)(bitmap)
        assert mtmd_cpp.mtmd_tokenize(ctx, chunks, ctypes.byref(input_text), bitmaps, 1) == 0
        out = []
        for i in range(mtmd_cpp.mtmd_input_chunks_size(chunks)):
            chunk = mtmd_cpp.mtmd_input_chunks_get(chunks, i)
            out.append(
                (
                    mtmd_cpp.mtmd_input_chunk_get_type(chunk),
                    mtmd_cpp.mtmd_input_chunk_get_n_tokens(chunk),
                    mtmd_cpp.mtmd_input_chunk_get_n_pos(chunk),
                )
            )
        return out
    finally:
        mtmd_cpp.mtmd_input_chunks_free(chunks)
        mtmd_cpp.mtmd_bitmap_free(bitmap)


def test_mtmd_decodes_the_png_and_gives_one_position_per_patch(vision_llama: Callable[..., Any]) -> None:
    llama = vision_llama("llama")
    ask(llama, [1])  # the handler creates its mtmd context on the first request
    ctx = llama.chat_handler.mtmd_ctx
    assert ctx is not None and mtmd_cpp.mtmd_support_vision(ctx)
    assert not mtmd_cpp.mtmd_decode_use_mrope(ctx)
    assert not mtmd_cpp.mtmd_decode_use_non_causal(ctx, None)

    # stb_image in libmtmd reads back exactly the pixels written
    png = tiny_png(5)
    buffer = (ctypes.c_uint8 * len(png)).from_buffer_copy(png)
    bitmap = mtmd_cpp.mtmd_helper_bitmap_init_from_buf(ctx, buffer, len(png), False)
    assert bitmap is not None
    try:
        size = (mtmd_cpp.mtmd_bitmap_get_nx(bitmap), mtmd_cpp.mtmd_bitmap_get_ny(bitmap))
        assert size == (MMPROJ_IMAGE_SIZE, MMPROJ_IMAGE_SIZE)
        data = ctypes.string_at(mtmd_cpp.mtmd_bitmap_get_data(bitmap), mtmd_cpp.mtmd_bitmap_get_n_bytes(bitmap))
        assert np.array_equal(np.frombuffer(data, dtype=np.uint8).reshape(28, 28, 3), decode_png(png))
    finally:
        mtmd_cpp.mtmd_bitmap_free(bitmap)

    text, image = mtmd_cpp.MTMD_INPUT_CHUNK_TYPE_TEXT, mtmd_cpp.MTMD_INPUT_CHUNK_TYPE_IMAGE
    for png in (tiny_png(5), tiny_png(6, 40, 20)):  # any size is resized to the encoder's square
        chunks = tokenize_with_image(ctx, png)
        assert [kind for kind, _, _ in chunks] == [text, image, text]
        assert chunks[1][1:] == (N_IMAGE, N_IMAGE)  # n_tokens, n_pos


@pytest.mark.parametrize("kind", KINDS)
def test_images_take_their_positions_and_their_content_matters(kind: str, vision_llama: Callable[..., Any]) -> None:
    llama = vision_llama(kind)
    one, logits_a = ask(llama, [1])
    n_prompt = one["usage"]["prompt_tokens"]
    assert llama.n_tokens == n_prompt
    assert last_position(llama) == n_prompt - 1  # positions 0..n-1, the image's among them
    # the greedy token is the argmax of the logits read back
    assert llama.detokenize([int(np.argmax(logits_a))]).decode() == one["choices"][0]["message"]["content"]

    two, _ = ask(llama, [1, 2])
    assert two["usage"]["prompt_tokens"] == n_prompt + N_IMAGE
    assert last_position(llama) == n_prompt + N_IMAGE - 1

    _, logits_b = ask(llama, [2])
    assert not np.array_equal(logits_a, logits_b)
    assert np.abs(logits_a - logits_b).max() > 0.1

    _, logits_again = ask(llama, [1])
    assert np.array_equal(logits_a, logits_again)


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_same_image_same_answer(kind: str, vision_llama: Callable[..., Any]) -> None:
    llama = vision_llama(kind)
    first, _ = ask(llama, [7], max_tokens=8)
    ask(llama, [8], max_tokens=8)  # another image in between
    second, _ = ask(llama, [7], max_tokens=8)
    assert first["usage"]["completion_tokens"] == 8
    assert first["choices"][0]["message"]["content"] == second["choices"][0]["message"]["content"]


def test_generic_mtmd_handler(vision_llama: Callable[..., Any]) -> None:
    """``MTMDChatHandler`` renders the model's own chat template; the tiny models' prints a content list as
    Python text, with the media marker inside it (so the text around the images, not only the images, changes
    with their number)."""
    llama = vision_llama("llama", MTMDChatHandler)
    one, logits_a = ask(llama, [1])
    assert last_position(llama) == one["usage"]["prompt_tokens"] - 1
    _, logits_b = ask(llama, [2])
    _, logits_again = ask(llama, [1])
    assert not np.array_equal(logits_a, logits_b)
    assert np.array_equal(logits_a, logits_again)


def test_projector_must_match_the_text_width(tmp_path: pathlib.Path, make_llama: Callable[..., Any]) -> None:
    """mtmd refuses a projector whose output width is not the text model's ``n_embd``."""
    narrow = write_tiny_mmproj(tmp_path / "narrow.gguf", text_n_embd=32)
    llama = make_llama("llama", chat_handler=Llava15ChatHandler(clip_model_path=str(narrow), verbose=False))
    with pytest.raises(ValueError, match="Failed to load mtmd context"):
        ask(llama, [1])
