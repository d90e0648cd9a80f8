"""Sampling that never hands llama.cpp's grammar sampler a token it refuses, and that can leave out end-of-generation
tokens (``ignore_eos``).

llama.cpp's grammar sampler sets every token the grammar refuses to -inf. Where the grammar matches nothing (an
inverted range such as ``[z-a]``, a character no token holds, reached at any depth), every token is -inf; the
host's chain (``llama_sampler_sample``) picks one all the same, and accepting it throws ("Unexpected empty grammar
stack after accepting piece"): a C++ exception through ctypes terminates the whole server. Checking grammars
beforehand can only sample a few paths, so it cannot find every dead end; the check has to happen where the token is
chosen.

A :class:`GuardedSampler` stands for the host's sampler chain wherever a request has a grammar or asks for
``ignore_eos``. It runs the same chain, sampler by sampler, in the host's order (logits processors, penalties,
grammar, then the choosing samplers), so the token chosen is the one the host's chain chooses, with two checks:

- after the grammar, some token must be left; if none is, :class:`~ckpt_plugin.core.errors.GrammarDeadEnd` is raised
  and nothing is accepted (the generation ends; servers answer 422);
- with ``ignore_eos``, end-of-generation tokens are set to -inf right after the grammar (before the choosing
  samplers), unless the grammar allows nothing else (it is complete: the reply ends there).

It also applies the repetition penalties (``repeat_penalty``, ``frequency_penalty``, ``presence_penalty``) itself,
where a request asks for them (llama_cpp.server's default ``repeat_penalty`` is 1.1): llama.cpp's penalties sampler
looks every candidate of the vocabulary up in a hash map for each token (0.8 ms a token with Gemma 3's 262,144
tokens, more than the rest of the chain), where :class:`WindowPenalties` changes the few logits of the tokens in its
window, with the same arithmetic, at the same place in the chain (the chain's own penalties sampler is built
neutral).

Requests with none of these keep the host's own chain, untouched.
"""

from __future__ import annotations

import ctypes
import inspect
import threading
import weakref
from collections import deque
from typing import Any, Callable

import llama_cpp
import numpy as np
from llama_cpp._internals import LlamaSampler, LlamaTokenDataArray
from llama_cpp.llama import Llama

from ckpt_plugin.core.errors import GrammarDeadEnd
from ckpt_plugin.core.request import current_request
from ckpt_plugin.hosts.llama_cpp.seam import compat as host
from ckpt_plugin.hosts.llama_cpp.seam.context import end_of_generation_mask

__all__ = ["GuardedSampler", "WindowPenalties", "end_of_generation_ids", "fill_candidates", "guard", "guarded_chain"]

_INIT_SAMPLER_SIGNATURE = inspect.signature(Llama._init_sampler)

_GRAMMAR_NAME = b"grammar"


def _chain_names(chain: LlamaSampler) -> list[bytes]:
    """The name of each sampler in ``chain``; llama-cpp-python's own Python samplers (logits processors) have none,
    and asking llama.cpp for it would call a null function pointer."""
    custom = {index for index, _ in chain.custom_samplers}
    return [b"" if i in custom else llama_cpp.llama_sampler_name(llama_cpp.llama_sampler_chain_get(chain.sampler, i))
            or b"" for i in range(llama_cpp.llama_sampler_chain_n(chain.sampler))]


_FILLS: weakref.WeakKeyDictionary[LlamaTokenDataArray, tuple[np.ndarray, np.ndarray]] = weakref.WeakKeyDictionary()


def fill_candidates(candidates: LlamaTokenDataArray, row: np.ndarray) -> None:
    """``candidates.copy_logits(row)`` in two passes instead of three: every entry ``(id, logit, 0)`` in vocabulary
    order, the array's full size, unsorted. The ids and zeros come from a template copied whole (one contiguous
    copy), the logits go into their column (half the time of the host's three strided writes, paid for every token
    of every slot)."""
    fill = _FILLS.get(candidates)
    if fill is None:
        data = candidates.candidates_data.view(np.ndarray)
        if data.dtype.itemsize != 12:  # another layout of llama_token_data: the host's own way
            candidates.copy_logits(row)
            return
        template = np.zeros_like(data)
        template["id"] = np.arange(len(data), dtype=np.intc)
        # The entry is three 4-byte fields (id, logit, p): as a float32 matrix, the logits are column 1.
        fill = _FILLS[candidates] = (data.view(np.float32).reshape(len(data), 3),
                                     template.view(np.float32).reshape(len(data), 3))
    entries, template = fill
    np.copyto(entries, template)
    entries[:, 1] = row
    array = candidates.candidates
    array.sorted = False
    array.size = candidates.n_vocab


_EOG_IDS: weakref.WeakKeyDictionary[Any, np.ndarray] = weakref.WeakKeyDictionary()
_EOG_LOCK = threading.Lock()


def end_of_generation_ids(model: Any) -> np.ndarray:
    """The ids of the end-of-generation tokens of ``model``, a ``LlamaModel``; found once per model."""
    with _EOG_LOCK:
        ids = _EOG_IDS.get(model)
        if ids is None:
            ids = _EOG_IDS[model] = np.flatnonzero(end_of_generation_mask(model.vocab)).astype(np.intc)
        return ids


class WindowPenalties:
    """llama.cpp's repetition penalties over the last ``last_n`` accepted tokens, applied to a vocabulary-ordered
    logits array in a few vectorized operations instead of a hash lookup per candidate.

    For each token seen ``count`` times in the window: a logit ``<= 0`` is multiplied by ``repeat``, a larger one
    divided by it, then ``count * frequency + presence`` is subtracted, in 32-bit floats, as llama.cpp's sampler
    does.

    :param last_n: Tokens in the window (the host's ``last_n_tokens_size``).
    :param repeat: ``repeat_penalty``; :param frequency: ``frequency_penalty``; :param presence: ``presence_penalty``.
    """

    def __init__(self, last_n: int, repeat: float, frequency: float, presence: float) -> None:
        self.last_n = last_n
        self.repeat = np.float32(repeat)
        self.frequency = np.float32(frequency)
        self.presence = np.float32(presence)
        self._window: deque[int] = deque()
        self._counts: dict[int, int] = {}

    @staticmethod
    def needed(last_n: int, repeat: float, frequency: float, presence: float) -> bool:
        """Whether penalties with these settings change anything (llama.cpp's own test, on 32-bit floats)."""
        return last_n != 0 and not (np.float32(repeat) == 1.0 and np.float32(frequency) == 0.0
                                    and np.float32(presence) == 0.0)

    def accept(self, token: int) -> None:
        counts = self._counts
        counts[token] = counts.get(token, 0) + 1
        if len(self._window) >= self.last_n:  # the oldest token leaves the window (after the new one was counted)
            old = self._window.popleft()
            left = counts[old] - 1
            if left:
                counts[old] = left
            else:
                del counts[old]
        self._window.append(token)

    def apply(self, logits: np.ndarray) -> None:
        """Penalize ``logits`` (in vocabulary order, written in place)."""
        counts = self._counts
        if not counts:
            return
        ids = np.fromiter(counts.keys(), dtype=np.intp, count=len(counts))
        seen = np.fromiter(counts.values(), dtype=np.float32, count=len(counts))
        values = logits[ids]
        values = np.where(values <= 0, values * self.repeat, values / self.repeat)
        values -= seen * self.frequency + self.presence
        logits[ids] = values

    def reset(self) -> None:
        self._window.clear()
        self._counts.clear()


class GuardedSampler:
    """The host's sampler chain ``chain``, applied step by step with the checks of the module docstring.

    It answers what the host's code calls on a ``LlamaSampler`` (``sample``, ``accept``, ``reset``, ``close``, and
    ``sampler``, the chain's handle) and owns ``chain`` (closing one closes the other).

    :param chain: The chain the host built for the request (grammar included).
    :param n_vocab: The model's vocabulary size.
    :param banned: Token ids never chosen while the grammar (if any) allows another (``None``: none).
    :param names: The name of each sampler of ``chain`` (read once, by :func:`guard`).
    :param penalties: The request's repetition penalties, applied before the chain (whose own penalties sampler
        was built neutral); ``None``: none, or the chain's own.
    """

    def __init__(self, chain: LlamaSampler, n_vocab: int, banned: np.ndarray | None, names: list[bytes],
                 penalties: WindowPenalties | None = None) -> None:
        self.chain = chain
        self.sampler = chain.sampler
        self.n_vocab = n_vocab
        self.banned = banned if banned is not None and len(banned) else None
        self.penalties = penalties
        self._grammar = names.index(_GRAMMAR_NAME) if _GRAMMAR_NAME in names else None
        self._n = len(names)
        self._candidates: LlamaTokenDataArray | None = None
        self.accepted = 0

    def candidates(self) -> LlamaTokenDataArray:
        """A candidates array of the vocabulary's size, made once per sampler."""
        if self._candidates is None:
            self._candidates = LlamaTokenDataArray(n_vocab=self.n_vocab)
        return self._candidates

    def sample(self, ctx: Any, idx: int = -1) -> int:
        """What ``LlamaSampler.sample`` does (the logits of output ``idx`` of the context ``ctx`` wraps), checked."""
        pointer = llama_cpp.llama_get_logits_ith(ctx.ctx, idx)
        if not pointer:
            raise RuntimeError(f"llama.cpp holds no logits for output {idx}")
        row = np.ctypeslib.as_array(pointer, shape=(self.n_vocab,))
        return self.sample_row(row)

    def sample_row(self, row: np.ndarray, candidates: LlamaTokenDataArray | None = None) -> int:
        """Choose a token from one logits ``row`` and accept it into the chain (see the module docstring).

        :raises GrammarDeadEnd: The grammar allows no token here; nothing was accepted.
        """
        candidates = candidates or self.candidates()
        fill_candidates(candidates, row)
        data = candidates.candidates_data
        if self.penalties is not None:  # first, where the chain's penalties sampler is: the row in vocabulary order
            self.penalties.apply(data.logit)
        array = candidates.candidates
        array.data = data.ctypes.data_as(llama_cpp.llama_token_data_p)
        array.selected = -1
        chain = self.sampler
        reference = ctypes.byref(array)
        if self._grammar is None:
            # Only tokens to leave out: set before the chain, where the candidates are still the row in vocabulary
            # order (what a logit bias of -inf does).
            if self.banned is not None:
                data.logit[self.banned] = -np.inf
            llama_cpp.llama_sampler_apply(chain, reference)
        else:
            for i in range(self._grammar + 1):
                llama_cpp.llama_sampler_apply(llama_cpp.llama_sampler_chain_get(chain, i), reference)
            entries = _entries(array, data)
            allowed = np.isfinite(entries["logit"])
            if not allowed.any():
                raise GrammarDeadEnd(self.accepted)
            if self.banned is not None:
                banned = (np.isin(entries["id"], self.banned) if len(entries) != self.n_vocab or array.sorted
                          else _mask(self.n_vocab, self.banned))
                if (allowed & ~banned).any():  # else the grammar is complete: its end is the reply's
                    entries["logit"][banned] = -np.inf
            for i in range(self._grammar + 1, self._n):
                llama_cpp.llama_sampler_apply(llama_cpp.llama_sampler_chain_get(chain, i), reference)
        if not 0 <= array.selected < array.size:
            raise RuntimeError("the sampler chain selected no token")
        chosen = array.data[array.selected]
        if self._grammar is not None and not np.isfinite(chosen.logit):
            raise GrammarDeadEnd(self.accepted)  # a choosing sampler that ignores -inf: never accept its token
        token = int(chosen.id)
        self.accept(token)
        return token

    def accept(self, token: int) -> None:
        llama_cpp.llama_sampler_accept(self.sampler, token)
        if self.penalties is not None:
            self.penalties.accept(token)
        self.accepted += 1

    def reset(self) -> None:
        llama_cpp.llama_sampler_reset(self.sampler)
        if self.penalties is not None:
            self.penalties.reset()
        self.accepted = 0

    def close(self) -> None:
        self.chain.close()


def _entries(array: Any, data: np.ndarray) -> np.ndarray:
    """The candidates ``array`` points at now, as a record view: ``data`` itself unless a sampler pointed the array
    at a buffer of its own."""
    address = ctypes.addressof(array.data.contents)
    if address == data.ctypes.data:
        return data[: array.size]
    entries = (llama_cpp.llama_token_data * array.size).from_address(address)
    return np.ctypeslib.as_array(entries)


def _mask(n: int, ids: np.ndarray) -> np.ndarray:
    mask = np.zeros(n, dtype=bool)
    mask[ids] = True
    return mask


def guard(chain: LlamaSampler, n_vocab: int, banned: np.ndarray | None = None,
          penalties: WindowPenalties | None = None) -> LlamaSampler | GuardedSampler:
    """``chain`` itself when it needs no checks (no grammar, nothing banned) and no penalties of ours, else a
    :class:`GuardedSampler` over it."""
    names = _chain_names(chain)
    if _GRAMMAR_NAME not in names and (banned is None or not len(banned)) and penalties is None:
        return chain
    return GuardedSampler(chain, n_vocab, banned, names, penalties)


def guarded_chain(llama: Llama, init_sampler: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """The sampler chain ``init_sampler(*args, **kwargs)`` builds for ``llama`` (the class's own ``_init_sampler``,
    bound), guarded where the request has a grammar or asks for ``ignore_eos``, and with the request's repetition
    penalties applied by :class:`WindowPenalties` instead of the chain's own sampler (:func:`guard`)."""
    bound = _INIT_SAMPLER_SIGNATURE.bind(llama, *args, **kwargs)
    bound.apply_defaults()
    arguments = {name: value for name, value in bound.arguments.items() if name != "self"}
    settings = (int(llama.last_n_tokens_size), arguments["repeat_penalty"], arguments["frequency_penalty"],
                arguments["presence_penalty"])
    penalties = None
    if WindowPenalties.needed(*settings):
        penalties = WindowPenalties(*settings)
        arguments.update(repeat_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0)
    chain = init_sampler(**arguments)
    request = current_request.get()
    banned = None
    if request is not None and request.ignore_eos:
        banned = end_of_generation_ids(host.model_wrapper(llama))
    return guard(chain, int(llama.n_vocab()), banned, penalties)
