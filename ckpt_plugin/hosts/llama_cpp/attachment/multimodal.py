"""llama-cpp-python's multimodal chat handlers (the MTMD family: llava-1-5, llava-1-6, minicpm-v-2.6, moondream,
nanollava, llama-3-vision-alpha, mtmd, gemma4, ...) on an attached ``Llama``: images keyed by content, and reused.

Each such handler, for every request: tokenizes the prompt into text and media chunks (``mtmd_tokenize``), calls
``llama.reset()`` and clears the memory, evaluates each text chunk with ``llama.eval`` and each media chunk with
``mtmd_helper_eval_chunk_single`` (embeddings decoded straight into the context), sets ``llama.n_tokens`` past them
without writing ``input_ids`` there, then completes ``input_ids[:n_tokens]``.

:class:`MtmdRelay` stands in for the handler's ``mtmd_cpp`` module (an attribute of the handler instance; the
module itself is untouched) and changes three of its calls:

- ``mtmd_helper_bitmap_init_from_buf``: the bitmap gets an id, a digest of its decoded pixels (or samples) and of the
  projector file, as llama.cpp's server does (:func:`ckpt_plugin.core.media.media_digest`);
- ``mtmd_tokenize``: the chunks become one prompt of token ids in which each media chunk's positions are ids derived
  from its digest (:func:`ckpt_plugin.core.media.media_token_ids`), and the engine is told the request ahead
  (:meth:`~ckpt_plugin.hosts.llama_cpp.attachment.media_flow.MediaFlow.arm`): the clear that follows does nothing,
  and the handler's evaluations are served from the longest prefix of that prompt the memory, a checkpoint or the
  cache holds;
- ``mtmd_helper_eval_chunk_single``: a media chunk the memory already holds at that place is not decoded again; one
  that is decoded is recorded under its ids, so that checkpoints, cache entries, slot files and the shared tier
  carry it like any tokens.

Prompts this cannot represent exactly are left to the host (the relay passes every call through): positions that
are not one per token (M-RoPE models such as Qwen2-VL), chunks without an id, a prompt that ends with a media chunk,
media for a request that drafts with a draft model (which would be handed the media ids as tokens). The engine then
sees positions it did not evaluate, keeps them out of every store, and stands aside for the request
(:mod:`.outside_writes`, ``SlotMemory.reconcile``).

Parallel slots (:mod:`ckpt_plugin.hosts.llama_cpp.parallel`) give each request's view a copy of the handler with a
relay of its own (:func:`relay_for_view`): the view leases its slot at the handler's first evaluation, and a media
chunk is decoded into that slot's sequence of the shared context (:class:`MediaChunkDecode`), never where the handler
asks (sequence 0).
Nothing is left to the host there: a prompt whose media cannot be keyed is refused
(:attr:`~ckpt_plugin.hosts.llama_cpp.attachment.media_flow.MediaFlow.must_key`).
"""

from __future__ import annotations

import copy
import ctypes
import hashlib
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import numpy as np

from ckpt_plugin.core.errors import UnsupportedHostError
from ckpt_plugin.core.media import media_digest, media_token_ids
from ckpt_plugin.hosts.llama_cpp.seam.compat import serialize_bitmap_creation
from ckpt_plugin.hosts.llama_cpp.attachment.media_flow import MediaFlow

__all__ = [
    "MediaChunkDecode",
    "MediaDecodeError",
    "MtmdRelay",
    "install_relay",
    "is_mtmd_handler",
    "relay_for_view",
    "remove_relay",
]

log = logging.getLogger("ckpt_plugin")

_PROJECTOR_DIGESTS: dict[tuple[str, int, int], str] = {}
_DIGEST_LOCK = threading.Lock()


def projector_digest(path: str) -> str:
    """SHA-256 of the projector file (computed once per path, size and modification time)."""
    stat = os.stat(path)
    key = (os.path.abspath(path), stat.st_size, stat.st_mtime_ns)
    with _DIGEST_LOCK:
        known = _PROJECTOR_DIGESTS.get(key)
    if known is not None:
        return known
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    value = digest.hexdigest()
    with _DIGEST_LOCK:
        _PROJECTOR_DIGESTS[key] = value
    return value


class MediaDecodeError(ValueError):
    """libmtmd failed to evaluate a media chunk (the handler's own error, with llama.cpp's status).

    :ivar status: What ``mtmd_helper_eval_chunk_single`` returned (1: no room in the KV cache, as ``llama_decode``).
    """

    def __init__(self, status: int) -> None:
        super().__init__(f"Failed to evaluate chunk: error code {status}")
        self.status = status


@dataclass(frozen=True)
class MediaChunkDecode:
    """One media chunk of the handler, ready to decode: called with ``n_past``, it decodes the chunk where the
    handler asked (its context ``lctx``, its sequence ``seq_id``); :attr:`into` decodes it into any sequence of a
    context (a parallel slot's). Both return the position after the chunk.

    :raises MediaDecodeError: libmtmd failed (its status says why).
    """

    lctx: Any
    seq_id: int
    into: Callable[[Any, int, int], int]

    def __call__(self, n_past: int) -> int:
        return self.into(self.lctx, self.seq_id, n_past)


class MediaHost(Protocol):
    """What the relay needs of the attachment it serves."""

    media: MediaFlow

    def owns_context(self, lctx: Any) -> bool:
        """Whether ``lctx`` is the context the attachment evaluates in."""

    def serve_media(self, n_positions: int, decode: MediaChunkDecode) -> int | None:
        """:meth:`MediaFlow.eval_media` under the slot's lock, ``decode`` run where the slot's sequence is."""



def media_prompt(mtmd: Any, mtmd_ctx: Any, chunks: Any) -> tuple[np.ndarray, list[tuple[int, int]]] | None:
    """The prompt of ``chunks`` in token ids, media chunks as their ids, and where each media chunk is (``None``
    where that is not exact)."""
    if mtmd.mtmd_decode_use_mrope(mtmd_ctx):
        return None
    parts: list[np.ndarray] = []
    spans: list[tuple[int, int]] = []
    position = 0
    last_is_text = False
    for index in range(int(mtmd.mtmd_input_chunks_size(chunks))):
        chunk = mtmd.mtmd_input_chunks_get(chunks, index)
        if chunk is None:
            return None
        kind = mtmd.mtmd_input_chunk_get_type(chunk)
        if kind == mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT:
            count = ctypes.c_size_t()
            pointer = mtmd.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(count))
            n = int(count.value)
            if n:
                parts.append(np.ctypeslib.as_array(pointer, shape=(n,)).astype(np.int32))
                position += n
                last_is_text = True
            continue
        n_tokens = int(mtmd.mtmd_input_chunk_get_n_tokens(chunk))
        chunk_id = mtmd.mtmd_input_chunk_get_id(chunk)
        if not chunk_id or int(mtmd.mtmd_input_chunk_get_n_pos(chunk)) != n_tokens:
            return None
        parts.append(media_token_ids(chunk_id.decode("ascii", "replace"), n_tokens))
        spans.append((position, position + n_tokens))
        position += n_tokens
        last_is_text = False
    if not parts or not last_is_text:
        return None
    return np.concatenate(parts), spans


class MtmdRelay:
    """The handler's ``mtmd_cpp`` module with three calls changed (see the module docstring); every other attribute
    is the module's own."""

    def __init__(self, module: Any, host: MediaHost, projector_path: str) -> None:
        self._module = module
        self._host = host
        self._projector_path = projector_path

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)

    def mtmd_helper_bitmap_init_from_buf(self, mtmd_ctx: Any, buffer: Any, size: int, *rest: Any) -> Any:
        mtmd = self._module
        bitmap = mtmd.mtmd_helper_bitmap_init_from_buf(mtmd_ctx, buffer, size, *rest)
        if bitmap:
            n_bytes = int(mtmd.mtmd_bitmap_get_n_bytes(bitmap))
            data = mtmd.mtmd_bitmap_get_data(bitmap)
            content = ctypes.string_at(data, n_bytes) if data and n_bytes else b""
            kind = "audio" if mtmd.mtmd_bitmap_is_audio(bitmap) else "image"
            key = media_digest(kind, projector_digest(self._projector_path), int(mtmd.mtmd_bitmap_get_nx(bitmap)),
                               int(mtmd.mtmd_bitmap_get_ny(bitmap)), content)
            mtmd.mtmd_bitmap_set_id(bitmap, key.encode("ascii"))
        return bitmap

    def mtmd_tokenize(self, mtmd_ctx: Any, chunks: Any, *rest: Any) -> int:
        result = int(self._module.mtmd_tokenize(mtmd_ctx, chunks, *rest))
        flow = self._host.media
        if result != 0:
            flow.disarm()
            return result
        prompt = media_prompt(self._module, mtmd_ctx, chunks)
        # A draft model would be handed media positions' ids as tokens (a prompt of text only is served as any).
        drafted = prompt is not None and bool(prompt[1]) and not flow.serves_media
        if prompt is None or drafted:
            flow.disarm()
            reason = ("a draft model would be handed the media positions' ids as tokens" if drafted else
                      "its media positions cannot be keyed one per token (M-RoPE positions, as Qwen2-VL's, a chunk "
                      "without an id, or a prompt that ends with a media chunk)")
            if flow.must_key:
                raise UnsupportedHostError(f"parallel slots cannot serve this multimodal prompt: {reason}; serve it "
                                           "with one slot (--parallel 1)")
            log.info("multimodal prompt left to the host: %s", reason)
        else:
            flow.arm(*prompt)
        return result

    def mtmd_helper_eval_chunk_single(self, mtmd_ctx: Any, lctx: Any, chunk: Any, n_past: Any, seq_id: Any,
                                      n_batch: int, logits_last: bool, new_n_past: Any) -> int:
        mtmd = self._module
        if not self._host.owns_context(lctx):
            raise ValueError("this multimodal handler evaluates into a context that is not the one its model is "
                             "attached to")

        def into(target: Any, sequence: int, start: int) -> int:
            out = ctypes.c_int32(0)
            status = int(mtmd.mtmd_helper_eval_chunk_single(mtmd_ctx, target, chunk, start, sequence, n_batch,
                                                            logits_last, ctypes.byref(out)))
            if status != 0:
                raise MediaDecodeError(status)
            return int(out.value)

        decode = MediaChunkDecode(lctx, int(getattr(seq_id, "value", seq_id)), into)
        end = self._host.serve_media(int(mtmd.mtmd_input_chunk_get_n_tokens(chunk)), decode)
        if end is None:
            return int(mtmd.mtmd_helper_eval_chunk_single(mtmd_ctx, lctx, chunk, n_past, seq_id, n_batch,
                                                          logits_last, new_n_past))
        _set_out(new_n_past, end)
        return 0


def _set_out(reference: Any, value: int) -> None:
    """Write ``value`` where a ``ctypes.byref(c_int32)`` argument points."""
    target = getattr(reference, "_obj", None)
    if target is not None:
        target.value = value
    else:
        ctypes.cast(reference, ctypes.POINTER(ctypes.c_int32))[0] = value


def is_mtmd_handler(handler: Any) -> bool:
    """Whether ``handler`` is one of llama-cpp-python's MTMD chat handlers (libmtmd module and projector file)."""
    return getattr(handler, "_mtmd_cpp", None) is not None and isinstance(getattr(handler, "clip_model_path", None),
                                                                          str)


def install_relay(handler: Any, host: MediaHost) -> MtmdRelay | None:
    """Give a multimodal chat ``handler`` a relay to ``host`` (``None``: not an MTMD handler, left as it is)."""
    if not is_mtmd_handler(handler):
        return None
    module = handler._mtmd_cpp
    if isinstance(module, MtmdRelay):
        module = module._module
    relay = MtmdRelay(module, host, handler.clip_model_path)
    handler._mtmd_cpp = relay
    return relay


def relay_for_view(handler: Any, host: MediaHost) -> Any:
    """A copy of an MTMD chat ``handler`` whose relay serves ``host`` (a parallel slot's view), or ``handler``
    itself when it is not one.

    The handler object is shared by every view of the ``Llama`` (and every request thread); the relay is per
    request, so each view gets a shallow copy: the same libmtmd context (loaded once, freed with the ``Llama``: see
    :func:`~ckpt_plugin.hosts.llama_cpp.seam.compat.init_mtmd_context`), its own relay.
    """
    if not is_mtmd_handler(handler):
        return handler
    view_handler = copy.copy(handler)
    install_relay(view_handler, host)
    serialize_bitmap_creation(view_handler)  # its stdout/stderr redirection is not safe across threads
    return view_handler


def remove_relay(handler: Any) -> None:
    """Undo :func:`install_relay`."""
    module = getattr(handler, "_mtmd_cpp", None)
    if isinstance(module, MtmdRelay):
        handler._mtmd_cpp = module._module
