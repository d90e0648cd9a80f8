"""Model contexts through llama-cpp-python: memory kind, fingerprint, state-copy flags, logits, vocabulary.

Everything here reads a ``Llama`` (or a llama.cpp model) and changes nothing; the worker functions run in the
grammar guard's child process (:mod:`ckpt_plugin.http.grammar_guard`).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import time
import zlib
from typing import Any, Callable

import llama_cpp
import llama_cpp._logger as llama_logger
import numpy as np
from llama_cpp._internals import LlamaTokenDataArray
from llama_cpp.llama import Llama

from ckpt_plugin.core.memory import MemoryKind

__all__ = [
    "U8_P",
    "clear_memory",
    "end_of_generation_mask",
    "fingerprint",
    "fingerprint_of",
    "grammar_problem_in_worker",
    "last_logits",
    "memory_kind",
    "state_flags",
    "version_tuple",
    "vocab_digest",
    "vocab_facts_in_worker",
    "writable_start",
]

U8_P = ctypes.POINTER(ctypes.c_uint8)


def writable_start(buffer: np.ndarray) -> Any:
    """A ``uint8 *`` argument for ``buffer``'s first byte.

    ctypes' own view of the buffer: numpy's ``buffer.ctypes.data_as`` goes through Python-level helpers that cost
    tens of microseconds right after a state copy has left the CPU caches cold, on every capture.
    """
    if not buffer.nbytes:
        return None
    return ctypes.byref(ctypes.c_uint8.from_buffer(buffer))


def version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def state_flags(partial: bool) -> int:
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


def vocab_facts_in_worker(model_path: str) -> tuple[int, int]:
    """The number of tokens in the vocabulary of the model at ``model_path``, and the most bytes of text one token
    stands for (only the vocabulary is loaded).

    A token's text is at least as long as the input it covers: sentencepiece vocabularies spell a space as a 3-byte
    marker, byte-level BPE ones each byte as one or two, and a special token as its own text.
    """
    vocab = llama_cpp.llama_model_get_vocab(_worker_vocab_model(model_path))
    n_vocab = int(llama_cpp.llama_vocab_n_tokens(vocab))
    longest = max((len(llama_cpp.llama_vocab_get_text(vocab, token) or b"") for token in range(n_vocab)), default=1)
    return n_vocab, max(longest, 1)


def grammar_problem_in_worker(model_path: str, text: str, is_schema: bool, step_budget: float | None = None,
                              compiled: Callable[[], None] | None = None) -> str | None:
    """Why llama.cpp refuses a grammar (or a JSON schema the host turns into one) for the model at ``model_path``,
    or cannot sample with it.

    Meant for a child process (:mod:`ckpt_plugin.http.grammar_guard`): llama.cpp's grammar parser recurses once per
    nesting level and overflows the stack on a deeply nested grammar (about 30,000 levels: a 120 KB request body),
    which kills whatever process compiles it. Only the vocabulary is loaded. A grammar that compiles is then sampled
    with as the host's sampler will (:func:`_sampling_problem`): one that leaves no token to choose makes llama.cpp
    throw from inside the sampler, which aborts the process.

    :param step_budget: The most seconds one sampling step may take (``None``: no limit).
    :param compiled: Called once the grammar compiled, before sampling with it (the parent times the two apart).
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
    if compiled is not None:
        compiled()
    try:
        return _sampling_problem(model_path, vocab, sampler, step_budget, zlib.crc32(text.encode("utf-8")))
    finally:
        llama_cpp.llama_sampler_free(sampler)


GRAMMAR_WALKS = 4
"""Paths the grammar child samples with a grammar, each from its start (the sampler reset)."""

GRAMMAR_WALK_STEPS = 8
"""Sampling steps of each path, each over the whole vocabulary, a token chosen at random among those the grammar
allows (not an end of generation, while another is allowed)."""

_WALK_SECONDS = 1.0
"""The walk ends early (the grammar passes) once it has taken this long, every step within the budget: a longer walk
would delay the request, and a new grammar's first request pays for it."""

_SAMPLE_TOKENS = 4096
"""Tokens of the first, estimating step: a step's cost is proportional to the tokens it looks at."""

_WORKER_EOG: dict[str, np.ndarray] = {}


def end_of_generation_mask(vocab: Any) -> np.ndarray:
    """Which tokens of ``vocab`` end a generation (``llama_vocab_is_eog``), a mask over the vocabulary (a pass over
    it: a tenth of a second for 262,144 tokens)."""
    n_vocab = int(llama_cpp.llama_vocab_n_tokens(vocab))
    return np.fromiter((bool(llama_cpp.llama_vocab_is_eog(vocab, token)) for token in range(n_vocab)), dtype=bool,
                       count=n_vocab)


def _end_of_generation(model_path: str, vocab: Any) -> np.ndarray:
    """:func:`end_of_generation_mask`, once per model in the grammar child."""
    mask = _WORKER_EOG.get(model_path)
    if mask is None:
        mask = _WORKER_EOG[model_path] = end_of_generation_mask(vocab)
    return mask


def _allowed(sampler: Any, candidates: LlamaTokenDataArray, ids: np.ndarray) -> tuple[np.ndarray, float]:
    """Apply ``sampler`` to the tokens ``ids`` (equal logits), as ``llama_sampler_sample`` applies it to every token;
    return the ids it leaves a chance, and the seconds the step took."""
    n = len(ids)
    data = candidates.candidates_data
    data.id[:n] = ids
    data.logit[:n] = 0.0
    data.p[:n] = 0.0
    array = candidates.candidates
    array.data = data.ctypes.data_as(llama_cpp.llama_token_data_p)
    array.size, array.sorted, array.selected = n, False, -1
    started = time.perf_counter()
    llama_cpp.llama_sampler_apply(sampler, ctypes.byref(array))
    seconds = time.perf_counter() - started
    kept = data[: array.size]
    return kept.id[np.isfinite(kept.logit)].astype(np.int64), seconds


STEP_TOO_SLOW = ("one sampling step with it takes {about}{seconds:.2f} s over this model's {n_vocab} tokens, more than "
                 "the {budget:g} s allowed (grammar_max_step_seconds): it has too many alternatives")
NO_TOKEN = ("{where} no token of the model can follow it, which aborts llama.cpp's sampler: the grammar matches "
            "nothing there (an inverted range such as [z-a], or a character no token holds)")


def _sampling_problem(model_path: str, vocab: Any, sampler: Any, step_budget: float | None, seed: int) -> str | None:
    """Sample with a compiled grammar as the host will: each step over the whole vocabulary, then a token the grammar
    allows accepted (:data:`GRAMMAR_WALKS` paths of :data:`GRAMMAR_WALK_STEPS` steps at most); why the host cannot,
    or ``None``.

    llama.cpp's grammar sampler leaves every token at -inf where the grammar matches nothing; the host's chain then
    picks one anyway and accepting it throws ("Unexpected empty grammar stack"), a C++ exception that terminates the
    process. Here every step checks that some token is left before one is accepted, so the walk itself never
    accepts a token the grammar refuses. The paths are samples, not a proof: a point that matches nothing deeper
    than they go, or on a path none of them takes, is not found (control characters, the usual way a JSON schema
    gets there, are refused before: :func:`~ckpt_plugin.http.request_checks.check_no_control_characters`).

    A step's time is what the host pays for every token it generates: it grows with the grammar's alternatives times
    the tokens looked at (about 7 ns each here: 1,000 alternatives over Gemma-3's 262,144 tokens take 1.9 s). The
    first step looks at a sample of the vocabulary and refuses a grammar whose full step would clearly be over the
    budget without paying for it; a full step over the budget is measured again and the faster kept (the first may
    have waited for a core).
    """
    n_vocab = int(llama_cpp.llama_vocab_n_tokens(vocab))
    eog = _end_of_generation(model_path, vocab)
    candidates = LlamaTokenDataArray(n_vocab=n_vocab)
    rng = np.random.default_rng(seed)
    every = np.arange(n_vocab, dtype=np.intc)
    if step_budget is not None and n_vocab > 2 * _SAMPLE_TOKENS:
        sample = rng.choice(every, _SAMPLE_TOKENS, replace=False).astype(np.intc)
        _, seconds = _allowed(sampler, candidates, sample)
        estimate = seconds * n_vocab / _SAMPLE_TOKENS
        if estimate > 2 * step_budget:
            return STEP_TOO_SLOW.format(about="about ", seconds=estimate, n_vocab=n_vocab, budget=step_budget)
    started = time.perf_counter()
    for walk in range(GRAMMAR_WALKS):
        if walk:
            if time.perf_counter() - started > _WALK_SECONDS:
                return None  # every step so far was within the budget
            llama_cpp.llama_sampler_reset(sampler)
        for step in range(GRAMMAR_WALK_STEPS):
            allowed, seconds = _allowed(sampler, candidates, every)
            if step_budget is not None and seconds > step_budget:
                allowed, again = _allowed(sampler, candidates, every)
                seconds = min(seconds, again)
                if seconds > step_budget:
                    return STEP_TOO_SLOW.format(about="", seconds=seconds, n_vocab=n_vocab, budget=step_budget)
            if not len(allowed):
                where = "at its start," if step == 0 else f"after {step} sampled tokens,"
                return NO_TOKEN.format(where=where)
            going_on = allowed[~eog[allowed]]
            if not len(going_on):
                break  # only an end of generation is left: this path is complete
            if time.perf_counter() - started > _WALK_SECONDS:
                return None
            llama_cpp.llama_sampler_accept(sampler, int(rng.choice(going_on)))
    return None


def vocab_digest(llama: Llama) -> str:
    """A digest of ``llama``'s vocabulary (every token's text), to tell whether two models can share drafts."""
    vocab = llama_cpp.llama_model_get_vocab(llama.model)
    digest = hashlib.sha256()
    for token in range(llama.n_vocab()):
        digest.update(llama_cpp.llama_vocab_get_text(vocab, token) or b"")
        digest.update(b"\0")
    return digest.hexdigest()
