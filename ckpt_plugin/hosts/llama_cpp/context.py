"""Model contexts through llama-cpp-python: memory kind, fingerprint, state-copy flags, logits, vocabulary.

Everything here reads a ``Llama`` (or a llama.cpp model) and changes nothing; the worker functions run in the
grammar guard's child process (:mod:`ckpt_plugin.grammar_guard`).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
from typing import Any

import llama_cpp
import llama_cpp._logger as llama_logger
import numpy as np
from llama_cpp.llama import Llama
from llama_cpp.llama_speculative import LlamaDraftModel  # noqa: F401  (the base class speculative.py subclasses)

from ...policy import MemoryKind

_u8_p = ctypes.POINTER(ctypes.c_uint8)


def _writable_start(buffer: np.ndarray) -> Any:
    """A ``uint8 *`` argument for ``buffer``'s first byte.

    ctypes' own view of the buffer: numpy's ``buffer.ctypes.data_as`` goes through Python-level helpers that cost
    tens of microseconds right after a state copy has left the CPU caches cold, on every capture.
    """
    if not buffer.nbytes:
        return None
    return ctypes.byref(ctypes.c_uint8.from_buffer(buffer))


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def _flags(partial: bool) -> int:
    return llama_cpp.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY if partial else llama_cpp.LLAMA_STATE_SEQ_FLAGS_NONE


def memory_kind(llama: Llama) -> MemoryKind:
    """What kind of memory ``llama``'s context has."""
    model = llama.model
    recurrent = bool(llama_cpp.llama_model_is_recurrent(model))
    hybrid = bool(llama_cpp.llama_model_is_hybrid(model))
    return MemoryKind(
        n_swa=int(llama_cpp.llama_model_n_swa(model)),
        swa_full=bool(llama.context_params.swa_full),
        recurrent=recurrent or hybrid,
        attention=hybrid or not recurrent,
    )


def fingerprint(llama: Llama) -> str:
    """A digest of what makes a state restorable: model file identity, context and cache settings, LoRAs."""
    return fingerprint_of(llama, llama.context_params, int(llama.n_ctx()), 1)


def fingerprint_of(llama: Llama, params: Any, n_ctx: int, n_seq: int) -> str:
    """The fingerprint of a context of ``llama``'s model made with ``params`` (``n_ctx`` cells, ``n_seq``
    sequences)."""
    try:
        stat = os.stat(llama.model_path)
        file_id = (os.path.realpath(llama.model_path), stat.st_size, stat.st_mtime_ns)
    except OSError:
        file_id = (str(llama.model_path), -1, -1)
    desc = ctypes.create_string_buffer(256)
    llama_cpp.llama_model_desc(llama.model, desc, ctypes.sizeof(desc))
    parts = (
        file_id,
        desc.value,
        int(llama_cpp.llama_model_n_params(llama.model)),
        int(n_ctx),
        int(params.type_k),
        int(params.type_v),
        bool(params.swa_full),
        int(params.flash_attn_type),
        bool(params.embeddings),
        str(getattr(llama, "lora_path", None)),
        float(getattr(llama, "lora_scale", 1.0) or 1.0),
    )
    if n_seq > 1:  # a one-sequence context keeps the digest it always had (disk tiers and slot files stay valid)
        parts = (*parts, n_seq, bool(params.kv_unified))
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:32]


def last_logits(llama: Llama) -> np.ndarray:
    """A read-only view of the logits of the last token ``llama`` decoded."""
    view = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llama.ctx, -1), shape=(llama.n_vocab(),))
    view.flags.writeable = False
    return view


def clear_memory(llama: Llama) -> None:
    """Empty ``llama``'s memory (all sequences), e.g. to evaluate a reference from scratch."""
    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(llama.ctx), True)


_WORKER_VOCABS: dict[str, Any] = {}


def _worker_vocab_model(model_path: str) -> Any:
    model = _WORKER_VOCABS.get(model_path)
    if model is None:
        # The server's log gets llama.cpp's errors (a grammar it cannot parse says where), not the loader's chatter.
        llama_logger.set_verbose(False)
        llama_cpp.llama_backend_init()
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        model = llama_cpp.llama_model_load_from_file(model_path.encode("utf-8"), params)
        if not model:
            raise OSError(f"could not load the vocabulary of {model_path}")
        _WORKER_VOCABS[model_path] = model
    return model


def vocab_size_in_worker(model_path: str) -> int:
    """The number of tokens in the vocabulary of the model at ``model_path`` (only the vocabulary is loaded)."""
    return int(llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(_worker_vocab_model(model_path))))


def grammar_problem_in_worker(model_path: str, text: str, is_schema: bool) -> str | None:
    """Why llama.cpp refuses a grammar (or a JSON schema the host turns into one) for the model at ``model_path``.

    Meant for a child process (:mod:`ckpt_plugin.grammar_guard`): llama.cpp's grammar parser recurses once per
    nesting level and overflows the stack on a deeply nested grammar (about 30,000 levels: a 120 KB request body),
    which kills whatever process compiles it. Only the vocabulary is loaded.
    """
    model = _worker_vocab_model(model_path)
    if is_schema:
        from llama_cpp.llama_grammar import json_schema_to_gbnf

        try:
            text = json_schema_to_gbnf(text)
        except Exception:
            return None  # the host falls back to its generic JSON grammar, which compiles
    vocab = llama_cpp.llama_model_get_vocab(model)
    sampler = llama_cpp.llama_sampler_init_grammar(vocab, text.encode("utf-8"), b"root")
    if not sampler:
        return "llama.cpp could not parse the grammar"
    llama_cpp.llama_sampler_free(sampler)
    return None


def vocab_digest(llama: Llama) -> str:
    """A digest of ``llama``'s vocabulary (every token's text), to tell whether two models can share drafts."""
    vocab = llama_cpp.llama_model_get_vocab(llama.model)
    digest = hashlib.sha256()
    for token in range(llama.n_vocab()):
        digest.update(llama_cpp.llama_vocab_get_text(vocab, token) or b"")
        digest.update(b"\0")
    return digest.hexdigest()
