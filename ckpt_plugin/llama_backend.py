"""The only module that touches ``llama_cpp``: state get/set, memory kind, fingerprint, attach and detach.

:func:`attach` patches five methods on one ``llama_cpp.Llama`` instance (never the class):

- ``generate``: before the host's own prefix matching runs, the manager restores the best state for the prompt
  (live memory, checkpoint or prompt-cache entry) and sets the host's ``n_tokens`` to what the memory holds, so the
  host's ``kv_cache_seq_rm`` is a no-op and its destructive fallbacks (clearing a recurrent memory, truncating a
  sliding window that lost the prefix) never run;
- ``eval``: evaluates through the manager, which pauses where checkpoints are taken;
- ``save_state`` / ``load_state``: return and accept a :class:`SharedLlamaState` that references an immutable
  full-state capture and the slot's checkpoints instead of copying the state and the logits array;
- ``set_cache``: installs :class:`HostPromptCache`, a ``BaseLlamaCache`` view of the manager's prefix-indexed cache;
- ``_create_completion``: notes whether the request reads logprobs (and of the prompt, with ``echo``), so that
  evaluation computes and keeps only the logits someone reads (:mod:`ckpt_plugin.logits`).
"""

from __future__ import annotations

import ctypes
import hashlib
import inspect
import os
import threading
import weakref
from typing import Any, Callable, Iterator, Sequence

import llama_cpp
import numpy as np
from llama_cpp.llama import Llama, LlamaState
from llama_cpp.llama_cache import BaseLlamaCache, LlamaDiskCache
from llama_cpp.llama_speculative import LlamaDraftModel  # noqa: F401  (the base class speculative.py subclasses)

from . import host_compat as host
from .cache import CacheEntry, PromptCache
from .checkpoint import freeze
from .config import CheckpointSettings
from .disk_tier import DiskTier
from .errors import UnsupportedHostError
from .host_logprobs import CompletionTrace, LogprobsRequest, stop_sequences
from .logits import EVERY_ROW, NO_ROWS, LogitsNeeds, generation_needs, max_keep
from .manager import CheckpointManager
from .policy import MemoryKind, common_prefix
from .request import current_request

TESTED_VERSIONS = ((0, 3, 36), (0, 4, 0))
"""llama-cpp-python versions attach accepts: from the first (inclusive) to the second (exclusive)."""

_PATCHED = ("eval", "generate", "save_state", "load_state", "set_cache", host.COMPLETION_METHOD)
_MANAGER_ATTR = "_ckpt_plugin_attachment"
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


class LlamaBackend:
    """Sequence 0 of a ``llama_cpp.Llama`` context, as the manager's :class:`~ckpt_plugin.manager.Backend`.

    Evaluation computes only the logits the current generation reads (``needs``, see :mod:`ckpt_plugin.logits`) and
    keeps the host's ``scores`` array small unless a generation reads its rows: the ``n_ctx x n_vocab`` array a
    ``logits_all=True`` host allocates (4.3 GB of address space for Gemma-3 at n_ctx 4096) is released on attach
    and allocated again only for a request that reads prompt or completion logprobs.
    """

    def __init__(self, llama: Llama) -> None:
        self.llama = llama
        self.kind = memory_kind(llama)
        self.fingerprint = fingerprint(llama)
        self.n_ctx = int(llama.n_ctx())
        self._memory = llama_cpp.llama_get_memory(llama.ctx)
        self._n_vocab = int(llama.n_vocab())
        self.host_logits_all = host.wants_all_logits(llama)
        # Outside a generation, a direct ``eval`` gets what the host asked for.
        self.default_needs: LogitsNeeds = EVERY_ROW if self.host_logits_all else NO_ROWS
        self.needs = self.default_needs
        self._host_scores_shape = tuple(llama.scores.shape)
        self._full = False
        # The tokens whose logits rows [0, len) of the full array hold; a row depends only on the tokens before it.
        self._row_tokens = np.zeros(0, dtype=np.int32)

    @property
    def _ctx(self) -> Any:
        return self.llama.ctx

    def state_size(self, partial: bool) -> int:
        return int(llama_cpp.llama_state_seq_get_size_ext(self._ctx, 0, _flags(partial)))

    def read_state(self, buffer: np.ndarray, partial: bool) -> int:
        return int(
            llama_cpp.llama_state_seq_get_data_ext(self._ctx, _writable_start(buffer), buffer.nbytes, 0, _flags(partial))
        )

    def write_state(self, buffer: np.ndarray, partial: bool) -> int:
        # The read-only buffer is handed over by address: llama.cpp only reads it.
        return int(
            llama_cpp.llama_state_seq_set_data_ext(
                self._ctx, buffer.ctypes.data_as(_u8_p), buffer.nbytes, 0, _flags(partial)
            )
        )

    def pos_min(self) -> int:
        return int(llama_cpp.llama_memory_seq_pos_min(self._memory, 0))

    def pos_max(self) -> int:
        return int(llama_cpp.llama_memory_seq_pos_max(self._memory, 0))

    def truncate(self, n_keep: int) -> bool:
        return bool(llama_cpp.llama_memory_seq_rm(self._memory, 0, n_keep, -1))

    def clear(self) -> None:
        llama_cpp.llama_memory_seq_rm(self._memory, 0, -1, -1)

    def decode(self, tokens: np.ndarray) -> None:
        """``Llama.eval`` with per-token logits flags: llama.cpp computes the logits of each batch's last token and
        of the positions ``needs`` names, not of every token."""
        llama, needs = self.llama, self.needs
        ctx, batch = host.decode_handles(llama)
        ctx.kv_cache_seq_rm(-1, llama.n_tokens, -1)
        n_batch = int(llama.n_batch)
        for start in range(0, len(tokens), n_batch):
            chunk = tokens[start : start + n_batch]
            n_past, n = int(llama.n_tokens), len(chunk)
            first = needs.first_output(n_past, n)
            batch.set_batch(batch=chunk.tolist(), n_past=n_past, logits_all=False)
            flags = batch.batch.logits
            for j in range(first, n - 1):
                flags[j] = True
            ctx.decode(batch)
            llama.input_ids[n_past : n_past + n] = chunk
            self._keep_rows(needs, n_past, chunk, first)
            llama.n_tokens += n

    # -- the host's logits rows ------------------------------------------------------------------------------------

    def _one_row(self) -> np.ndarray:
        # Enough for ``scores[-1]`` (``Llama._scores[-1]``: what a stopping criterion reads).
        return np.zeros((1, self._n_vocab), dtype=np.single)

    def _full_scores(self) -> np.ndarray:
        if not self._full:
            # calloc'd: zero pages until written, so only the rows written become resident, and rows nobody wrote
            # read as zeros (the host computes logprobs over every row, even those it then drops).
            self.llama.scores = np.zeros((self.n_ctx, self._n_vocab), dtype=np.single)
            self._full = True
            self._row_tokens = self._row_tokens[:0]
        return self.llama.scores

    def exact_rows(self, prompt: np.ndarray) -> int:
        """How many leading rows of ``scores`` hold the logits ``prompt``'s tokens would get."""
        if not self._full:
            return 0
        return common_prefix(self._row_tokens, prompt)

    def _keep_rows(self, needs: LogitsNeeds, n_past: int, chunk: np.ndarray, first: int) -> None:
        n = len(chunk)
        known = len(self._row_tokens)
        if needs.rows_from is not None:
            scores = self._full_scores()
            kept_from = max(0, needs.rows_from - n_past)
            if kept_from < n:
                outputs = np.ctypeslib.as_array(llama_cpp.llama_get_logits(self._ctx), shape=(n - first, self._n_vocab))
                scores[n_past + kept_from : n_past + n] = outputs[kept_from - first :]
            if needs.latest_row:
                # Row 0 now holds another position's logits: no leading row is known exact any more.
                scores[0] = last_logits(self.llama)
                self._row_tokens = self._row_tokens[:0]
                return
            if kept_from == 0 and known >= n_past:
                self._row_tokens = np.concatenate((self._row_tokens[:n_past], chunk))
                return
        elif needs.latest_row:
            # Where ``scores[:n_tokens][0]`` and ``[-1]`` both land: a one-row array.
            scores = self.llama.scores
            scores[min(n_past + n, len(scores)) - 1] = last_logits(self.llama)
        if known > n_past:
            self._row_tokens = self._row_tokens[:n_past]

    def take_over_scores(self) -> None:
        """Release the host's ``scores`` array (on attach): rows are kept only while a generation reads them."""
        self.llama.scores = self._one_row()
        self._full, self._row_tokens = False, self._row_tokens[:0]

    def begin_generation(self, needs: LogitsNeeds, prompt: np.ndarray) -> int | None:
        """Serve a generation that reads ``needs``; return the most prompt tokens a restore may keep for it."""
        if not needs.full_rows and len(self.llama.scores) > 1:
            # Nobody reads the rows now: give their memory back.
            self.llama.scores = self._one_row()
            self._full = False
            self._row_tokens = self._row_tokens[:0]
        self.needs = needs
        return max_keep(needs, self.exact_rows(prompt))

    def load_host_state(self, load: Callable[[LlamaState], None], state: LlamaState) -> None:
        """Run the host's own ``load_state`` for a plain ``LlamaState``: it copies the state's logits rows into a
        ``scores`` array of the host's own shape, which then holds the rows of the state's tokens."""
        self.llama.scores = np.zeros(self._host_scores_shape, dtype=np.single)
        self._full = self._host_scores_shape[0] >= self.n_ctx
        load(state)
        n_rows = min(int(state.n_tokens), len(state.scores)) if self._full and np.ndim(state.scores) == 2 else 0
        self._row_tokens = np.asarray(state.input_ids[:n_rows], dtype=np.int32)

    def end_generation(self) -> None:
        """Back to what the host asked for, for direct ``eval`` calls (the rows stay for readers)."""
        self.needs = self.default_needs

    def release(self) -> None:
        """Give the host its own ``scores`` array back (on detach)."""
        llama = self.llama
        if not (self._full and tuple(llama.scores.shape) == self._host_scores_shape):
            llama.scores = np.ndarray(self._host_scores_shape, dtype=np.single)
            self._full, self._row_tokens = False, self._row_tokens[:0]
        if self.host_logits_all and self.exact_rows(llama.input_ids[: llama.n_tokens]) < llama.n_tokens:
            # The host would reuse rows it believes exact: have it evaluate its next prompt in full.
            host.set_evaluated_prefix(llama, llama.input_ids, 0)


_NO_SCORES = freeze(np.empty((0, 0), dtype=np.single))


class SharedLlamaState(LlamaState):
    """A ``LlamaState`` that references an immutable prompt-cache entry instead of copying the state.

    ``llama_state`` is a read-only ``memoryview`` of the captured bytes; ``scores`` is empty because restoring
    always re-evaluates the last prompt token (fresh logits). Pickling it produces a plain ``LlamaState`` copy.
    """

    def __init__(self, entry: CacheEntry, seed: int) -> None:
        self.entry = entry
        self.input_ids = entry.tokens
        self.scores = _NO_SCORES
        self.n_tokens = entry.n_tokens
        self.llama_state = memoryview(entry.state.target)
        self.llama_state_size = int(entry.state.target.nbytes)
        self.seed = seed

    def __reduce__(self) -> tuple:
        raise TypeError(
            "SharedLlamaState references a live sequence-state capture and cannot be pickled; "
            "use the manager's persistence API to store it"
        )


class HostPromptCache(BaseLlamaCache):
    """``BaseLlamaCache`` interface over a manager's prompt cache, installed by the patched ``set_cache``."""

    def __init__(self, manager: CheckpointManager, llama: Llama) -> None:
        super().__init__(manager.cache.max_bytes)
        self.manager = manager
        self._llama = llama

    def __bool__(self) -> bool:
        return True

    @property
    def cache_size(self) -> int:
        return self.manager.cache.resident_bytes

    def _best(self, key: Sequence[int]) -> CacheEntry | None:
        # The host takes one state: the entries below the point where the prompt leaves the tree all share the same
        # prefix with it, so one of them is as good as any (no walk through the others' subtrees).
        candidates = self.manager.cache.lookup(self.manager.current_namespace(), self.manager.fingerprint, key,
                                               max_candidates=1)
        best = max(candidates, key=lambda pair: pair[1], default=None)
        return best[0] if best is not None and best[1] > 0 else None

    def __getitem__(self, key: Sequence[int]) -> LlamaState:
        entry = self._best(key)
        if entry is None:
            raise KeyError("no cached prompt shares a prefix with this key")
        return SharedLlamaState(entry, host.seed(self._llama))

    def __contains__(self, key: Sequence[int]) -> bool:
        return self._best(key) is not None

    def __setitem__(self, key: Sequence[int], value: LlamaState) -> None:
        if not isinstance(value, SharedLlamaState):
            raise TypeError("only states from an attached Llama's save_state() can be cached here")
        with self.manager.lock:
            self.manager.admit(value.entry)


_HOST_CACHE_TIERS: "weakref.WeakKeyDictionary[BaseLlamaCache, tuple[PromptCache, DiskTier | None]]" = (
    weakref.WeakKeyDictionary()
)
_HOST_CACHE_TIERS_LOCK = threading.Lock()


def _tiers_for_host_cache(
    cache: BaseLlamaCache, settings: CheckpointSettings
) -> tuple[PromptCache, DiskTier | None]:
    """The prompt cache (and disk tier) standing for one host cache object, shared by every ``Llama`` given it.

    ``LlamaRAMCache(capacity_bytes)`` becomes a RAM prompt cache of that budget; ``LlamaDiskCache(cache_dir,
    capacity_bytes)`` a disk tier in ``cache_dir`` of that budget, in front of a RAM cache of the manager's budget.
    Entries of different models stay apart through their fingerprints, as in the host's own cache.
    """
    with _HOST_CACHE_TIERS_LOCK:
        tiers = _HOST_CACHE_TIERS.get(cache)
        if tiers is None:
            capacity = int(getattr(cache, "capacity_bytes", settings.cache_max_bytes))
            if isinstance(cache, LlamaDiskCache):
                directory = os.path.join(cache.cache.directory, "ckpt_plugin")
                tiers = (PromptCache(settings.cache_max_bytes, settings.cache_max_tokens),
                         DiskTier(directory, capacity))
            else:
                tiers = (PromptCache(capacity, settings.cache_max_tokens), None)
            _HOST_CACHE_TIERS[cache] = tiers
        return tiers


class _Generation:
    """One call of the host's ``generate``: the prompt boundary its evaluations need.

    Only the generation itself writes to this object, so an abandoned generation that the garbage collector closes
    later, from whatever thread, changes nothing anybody else reads.
    """

    __slots__ = ("prompt_end", "finished")

    def __init__(self) -> None:
        self.prompt_end: int | None = None
        self.finished = False


class _Attachment:
    """The patches installed on one ``Llama`` and what they replaced.

    Ownership (``docs/design.md``, "Who owns the slot"): the manager's lock is held only inside the synchronous
    calls below (prepare, one ``eval``, ``save_state``, ``load_state``), never across a ``yield`` to the host. The
    latest generation owns the slot; one the host stopped iterating (a dropped client, an interrupted stream) owns
    nothing once a newer one starts, and the memory itself tells the next request what is in it.
    """

    def __init__(self, llama: Llama, manager: CheckpointManager, backend: LlamaBackend) -> None:
        self.llama = llama
        self.manager = manager
        self.backend = backend
        self.saved = {name: llama.__dict__[name] for name in _PATCHED if name in llama.__dict__}
        self.saved_cache = llama.cache
        self.current: _Generation | None = None
        # (logprobs, echo) of the completion whose generation starts next.
        self.pending_reads: tuple[bool, bool] | None = None
        self._generate = type(llama).generate.__get__(llama)
        self._load_state = type(llama).load_state.__get__(llama)
        self._generate_signature = inspect.signature(type(llama).generate)
        completion = getattr(type(llama), host.COMPLETION_METHOD)
        self._create_completion = completion.__get__(llama)
        self._completion_signature = inspect.signature(completion)

    @property
    def prompt_end(self) -> int | None:
        """Prompt length of the generation that owns the slot, ``None`` outside a generation."""
        current = self.current
        return current.prompt_end if current is not None and not current.finished else None

    def install(self) -> None:
        llama = self.llama
        llama.eval = self.eval
        llama.generate = self.generate
        llama.save_state = self.save_state
        llama.load_state = self.load_state
        llama.set_cache = self.set_cache
        setattr(llama, host.COMPLETION_METHOD, self.create_completion)
        self.backend.take_over_scores()
        if llama.cache is not None:
            self.set_cache(llama.cache)
        setattr(llama, _MANAGER_ATTR, self)

    def uninstall(self) -> None:
        llama = self.llama
        for name in _PATCHED:
            llama.__dict__.pop(name, None)
        llama.__dict__.update(self.saved)
        llama.cache = self.saved_cache
        llama.__dict__.pop(_MANAGER_ATTR, None)
        self.backend.release()

    def _sync_host(self, n_keep: int, tokens: np.ndarray) -> None:
        host.set_evaluated_prefix(self.llama, tokens, n_keep)

    # -- patched methods --------------------------------------------------------------------------------------------

    def eval(self, tokens: Sequence[int]) -> None:
        with self.manager.lock:
            self._eval(tokens)

    def _eval(self, tokens: Sequence[int]) -> None:
        llama, manager = self.llama, self.manager
        new = np.asarray(tokens, dtype=np.int32).reshape(-1)
        manager.reconcile()
        n_host = llama.n_tokens
        slot = manager.slot
        if n_host != slot.n_tokens or (len(new) > 1 and not np.array_equal(llama.input_ids[:n_host], slot.tokens)):
            wanted = np.concatenate((llama.input_ids[:n_host].astype(np.int32), new))
            n_keep = manager.prepare(wanted)
            self._sync_host(n_keep, wanted)
            new = wanted[n_keep:]
        prompt_end = self.prompt_end
        if prompt_end is None:
            prompt_end = llama.n_tokens + len(new)
        manager.process(new, prompt_end)

    def create_completion(self, *args: Any, **kwargs: Any) -> Iterator[Any]:
        """The host's ``_create_completion``, noting the logits the request reads; a request for logprobs runs the
        host without them and gets them from :mod:`ckpt_plugin.host_logprobs` (the same values, vectorized)."""
        bound = self._completion_signature.bind(self.llama, *args, **kwargs)
        logprobs = bound.arguments.get("logprobs")
        reads = (logprobs is not None, bool(bound.arguments.get("echo", False)))
        if logprobs is None or not host.wants_all_logits(self.llama):
            # Without logits_all the host refuses logprobs itself, after its other checks: left to it.
            return self._completion_with_reads(self._create_completion(*args, **kwargs), reads)
        defaults = self._completion_signature.parameters

        def argument(name: str) -> Any:
            return bound.arguments.get(name, defaults[name].default)

        request = LogprobsRequest(prompt=argument("prompt"), logprobs=logprobs, echo=bool(argument("echo")),
                                  stream=bool(argument("stream")), stop=stop_sequences(argument("stop")))
        bound.arguments["logprobs"] = None
        return self._completion_with_reads(self._create_completion(*bound.args[1:], **bound.kwargs), reads, request)

    def _completion_with_reads(
        self, completion: Iterator[Any], reads: tuple[bool, bool], logprobs: LogprobsRequest | None = None
    ) -> Iterator[Any]:
        """Iterate the host's ``completion`` for a request reading ``reads`` (``(logprobs, echo)``); with
        ``logprobs``, the host runs without them and they are filled in (:meth:`_completion_with_host_logprobs`)."""
        # The host's body runs on the first next(): it calls generate() within this very call, which takes the reads
        # (so the rows are kept even though the host itself is not asked for logprobs).
        self.pending_reads = reads
        if logprobs is None:
            yield from completion
        else:
            yield from self._completion_with_host_logprobs(completion, logprobs)

    def _completion_with_host_logprobs(self, completion: Iterator[Any], request: LogprobsRequest) -> Iterator[Any]:
        """The host's response to a logprobs request, with the logprobs it would have computed.

        The host's ``completion`` runs with ``logprobs=None``. Its ``generate`` call is watched (a wrapper installed
        on the instance for its first ``next()`` only, the call in which the host calls ``generate``) by a
        :class:`~ckpt_plugin.host_logprobs.CompletionTrace`, which learns the prompt and completion tokens.
        Non-streamed: the single response gets ``logprobs`` computed from the rows after the generation, where the
        host computes them. Streamed: without logprobs the host groups tokens into chunks differently, so its chunks
        are dropped and the trace's replay of the logprobs loop (one chunk per token, computed as each token arrived)
        is yielded in their place, then its tail, then the host's final chunk.
        """
        llama = self.llama
        vocab = llama_cpp.llama_model_get_vocab(llama.model)
        trace = CompletionTrace(
            detokenize=llama.detokenize,
            log_softmax=Llama.logits_to_logprobs,
            scores=lambda: llama.scores[: llama.n_tokens, :],
            is_eog=lambda token: bool(llama_cpp.llama_vocab_is_eog(vocab, token)),
            bos_token_id=llama.token_bos(),
            request=request,
        )
        end = object()
        template: dict[str, Any] | None = None
        try:
            generate = llama.generate

            def watched_generate(tokens: Sequence[int], *args: Any, **kwargs: Any) -> Iterator[int]:
                # No reference to the watcher is kept here: the host's loop owns it, and dropping it (a break)
                # closes the generation at once, as without the watcher.
                return trace.watch(tokens, generate(tokens, *args, **kwargs))

            llama.generate = watched_generate
            try:
                chunk = next(completion, end)
            finally:
                if llama.__dict__.get("generate") is watched_generate:
                    llama.generate = generate
            if not request.stream:
                if chunk is not end:
                    chunk["choices"][0]["logprobs"] = trace.logprobs(llama.scores[: llama.n_tokens, :])
                    yield chunk
                yield from completion
                return
            while chunk is not end:
                template = chunk
                if trace.error is not None:
                    yield from trace.take(chunk)
                    raise trace.error
                if chunk["choices"][0]["finish_reason"] is None:
                    yield from trace.take(chunk)  # the host's own chunk stands for tokens the trace yields itself
                else:
                    trace.tail()
                    yield from trace.take(chunk)
                    yield chunk
                chunk = next(completion, end)
        except Exception:
            # What the host had yielded before failing (it yields as it goes) still reaches the client.
            if template is not None and trace.pending:
                yield from trace.take(template)
            raise
        finally:
            close = getattr(completion, "close", None)
            if close is not None:
                close()

    def generate(self, tokens: Sequence[int], *args: Any, **kwargs: Any) -> Iterator[int]:
        bound = self._generate_signature.bind(self.llama, tokens, *args, **kwargs)
        reset = bound.arguments.get("reset", True)
        stopping = bound.arguments.get("stopping_criteria") is not None
        return self._generate_with_prepare(list(tokens), reset, stopping, args, kwargs)

    def _generate_with_prepare(
        self, tokens: list[int], reset: bool, stopping: bool, args: tuple, kwargs: dict
    ) -> Iterator[int]:
        generation = _Generation()
        reads, self.pending_reads = self.pending_reads, None
        logprobs, echo = reads or (False, False)
        with self.manager.lock:
            # The newest generation owns the slot: an older one the host abandoned mid-stream is simply superseded.
            self.current = generation
            prompt = np.asarray(tokens, dtype=np.int32)
            generation.prompt_end = len(tokens) if reset else self.llama.n_tokens + len(tokens)
            needs = generation_needs(generation.prompt_end, logprobs=logprobs, echo=echo, stopping_criteria=stopping,
                                     draft=self.llama.draft_model is not None)
            limit = self.backend.begin_generation(needs, prompt if reset else prompt[:0])
            if reset and tokens:
                n_keep = self.manager.prepare(prompt, max_keep=limit)
                self._sync_host(n_keep, prompt)
        request = current_request.get()
        try:
            if request is None:
                yield from self._generate(tokens, *args, **kwargs)
                return
            # The server's limits and its client's disconnect end the generation at the next token: the host then
            # finishes the response as if max_tokens was reached, and the model is free for the next request.
            for generated, token in enumerate(self._generate(tokens, *args, **kwargs)):
                if request.should_stop(generated):
                    return
                yield token
        finally:
            generation.finished = True
            if self.current is generation:
                self.backend.end_generation()

    def save_state(self) -> SharedLlamaState:
        with self.manager.lock:
            self.manager.reconcile()
            return SharedLlamaState(self.manager.save(), host.seed(self.llama))

    def load_state(self, state: LlamaState) -> None:
        with self.manager.lock:
            if isinstance(state, SharedLlamaState):
                n_keep = self.manager.load(state.entry)
                self._sync_host(n_keep, state.entry.tokens)
                host.set_seed(self.llama, state.seed)
                return
            self.backend.load_host_state(self._load_state, state)
            self.manager.adopt_memory(np.asarray(state.input_ids[: state.n_tokens], dtype=np.int32))

    def set_cache(self, cache: BaseLlamaCache | None) -> None:
        if cache is None or isinstance(cache, HostPromptCache):
            self.llama.cache = cache
            return
        with self.manager.lock:
            self.manager.use_shared_tiers(*_tiers_for_host_cache(cache, self.manager.settings))
        self.llama.cache = HostPromptCache(self.manager, self.llama)


def open_llama(model_path: str, **kwargs: Any) -> Llama:
    """Create a ``llama_cpp.Llama`` (``verbose=False`` unless given), for hosts built on this package."""
    kwargs.setdefault("verbose", False)
    return Llama(model_path=model_path, **kwargs)


def count_evaluated_tokens(llama: Llama) -> Callable[[], int]:
    """Count the tokens an unattached ``llama`` evaluates (wraps its ``eval``); return a reader of the count."""
    evaluated = [0]
    inner = llama.eval

    def counting_eval(tokens: Sequence[int]) -> None:
        evaluated[0] += len(tokens)
        inner(tokens)

    llama.eval = counting_eval
    return lambda: evaluated[0]


def attach(
    llama: Llama,
    settings: CheckpointSettings | None = None,
    *,
    cache: PromptCache | None = None,
    disk: DiskTier | None = None,
    **overrides: Any,
) -> CheckpointManager:
    """Give ``llama`` shared checkpoints and a prefix-indexed prompt cache; return its manager.

    :param llama: A ``llama_cpp.Llama`` created by the host.
    :param settings: :class:`~ckpt_plugin.config.CheckpointSettings`; keyword arguments override fields.
    :param cache: A :class:`~ckpt_plugin.cache.PromptCache` shared with other managers of the same model.
    :param disk: A :class:`~ckpt_plugin.disk_tier.DiskTier` shared likewise.
    :raises UnsupportedHostError: ``llama`` is not a ``Llama``, is already attached, serves embeddings, has no
        context (``vocab_only=True``, or closed), or llama-cpp-python is outside the tested versions; nothing is
        patched then.
    """
    if not isinstance(llama, Llama):
        raise UnsupportedHostError(f"attach() needs a llama_cpp.Llama, got {type(llama).__name__}")
    version = _version_tuple(getattr(llama_cpp, "__version__", "0"))
    low, high = TESTED_VERSIONS
    if not (low <= version < high):
        raise UnsupportedHostError(
            f"llama-cpp-python {llama_cpp.__version__} is outside the tested range "
            f"{'.'.join(map(str, low))} to {'.'.join(map(str, high))} (exclusive)"
        )
    if getattr(llama, _MANAGER_ATTR, None) is not None:
        raise UnsupportedHostError("this Llama is already attached; detach() it first")
    if llama.context_params.embeddings:
        raise UnsupportedHostError("embedding contexts have no generation state to checkpoint")
    if not host.has_context(llama) or llama_cpp.llama_get_memory(llama.ctx) is None:
        raise UnsupportedHostError("this Llama has no context memory (vocab_only, closed, or created without one)")
    backend = LlamaBackend(llama)
    manager = CheckpointManager(backend, settings, cache=cache, disk=disk, **overrides)
    attachment = _Attachment(llama, manager, backend)
    attachment.install()
    manager.hooks.on_attach()
    return manager


def detach(llama: Llama) -> CheckpointManager:
    """Undo :func:`attach`: restore ``llama``'s own methods and cache; return the (closed) manager."""
    attachment = getattr(llama, _MANAGER_ATTR, None)
    if attachment is None:
        raise UnsupportedHostError("this Llama is not attached")
    attachment.uninstall()
    attachment.manager.close()
    return attachment.manager


def manager_of(llama: Llama) -> CheckpointManager | None:
    """The manager attached to ``llama``, or ``None``."""
    attachment = getattr(llama, _MANAGER_ATTR, None)
    return attachment.manager if attachment is not None else None
