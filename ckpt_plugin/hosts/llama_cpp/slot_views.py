"""Per-request views of one ``Llama``: llama-cpp-python's own completion code, run on one sequence of a shared
context.

A :class:`SlotLlama` is a shallow copy of the host's ``Llama`` (same model, tokenizer, chat format and handlers)
with its own evaluation bookkeeping (``input_ids``, ``n_tokens``, ``scores``, seed, sampler) and, instead of the
host's context, a :class:`SequenceHandle`: the memory operations the host's code makes (``kv_cache_seq_rm(-1, ...)``
on "every" sequence, ``reset`` of a recurrent memory) act on the view's own sequence only. Evaluation goes through
the engine slot the view is bound to (:mod:`ckpt_plugin.hosts.llama_cpp.parallel`), and sampling reads that slot's
logits rows instead of llama.cpp's output buffer, which the next batched step overwrites.

Everything else (chat templates, tools, grammars, stop strings, logprobs, streaming) is the host's code, unchanged.
"""

from __future__ import annotations

import contextlib
import ctypes
import inspect
from typing import Any, Callable

import llama_cpp
import numpy as np
from llama_cpp._internals import LlamaSampler, LlamaTokenDataArray
from llama_cpp.llama import Llama

from ... import host_compat as host
from .sequences import SequenceContext

_SAMPLE_SIGNATURE = inspect.signature(Llama.sample)
_SAMPLER_PARAMETERS = frozenset(inspect.signature(Llama._init_sampler).parameters) - {"self"}


class SequenceHandle:
    """Stands for a ``Llama``'s context wrapper in a :class:`SlotLlama`: one sequence of a shared context.

    :param context: The shared context.
    :param n_ctx: The most positions the sequence holds (what the view's ``n_ctx()`` says).
    :ivar seq_id: The sequence, once the view is bound to a slot (``None`` before).
    """

    def __init__(self, context: SequenceContext, n_ctx: int) -> None:
        self.context = context
        self.ctx = context.ctx
        self.seq_id: int | None = None
        self._n_ctx = n_ctx

    def n_ctx(self) -> int:
        return self._n_ctx

    def pooling_type(self) -> int:
        return int(llama_cpp.llama_pooling_type(self.ctx))

    def kv_cache_seq_rm(self, seq_id: int, p0: int, p1: int) -> bool:
        """Remove positions ``[p0, p1)`` of the view's own sequence, whatever ``seq_id`` the host names (it names
        -1, every sequence, which would be every other slot's too)."""
        if self.seq_id is None:
            return True  # nothing of this view is in the memory yet
        with self.context.lock:
            return bool(llama_cpp.llama_memory_seq_rm(self.context.memory, self.seq_id, p0, p1))

    def kv_cache_clear(self) -> None:
        self.kv_cache_seq_rm(-1, -1, -1)

    def reset_timings(self) -> None:
        """Timings are the shared context's; a request does not reset them for the others."""

    def print_timings(self) -> None:
        """See :meth:`reset_timings`."""

    def decode(self, batch: Any) -> None:
        raise RuntimeError("a slot view evaluates through its engine slot, not through the context wrapper")

    def get_logits(self) -> Any:
        raise RuntimeError("a slot view's logits are its slot's rows (SlotLlama.slot_rows)")


class SlotLlama(Llama):
    """A per-request view of a ``Llama`` on one sequence of a shared context (see the module docstring).

    Made by :func:`view_of`, never by its constructor. ``sequence`` is its context handle, ``slot_rows`` returns the logits rows of the slot's last
    evaluation, ``candidates`` a reusable candidates array, once the view is bound to a slot.
    """

    sequence: SequenceHandle
    slot_rows: Callable[[], np.ndarray]
    candidates: Callable[[], LlamaTokenDataArray]
    end_generations: Callable[[], None] = staticmethod(lambda: None)

    def reset(self) -> None:
        """The host's ``reset``, on the view's own sequence only (the host clears every sequence of a recurrent
        memory)."""
        self.n_tokens = 0
        host.set_evaluated_prefix(self, self.input_ids, 0)
        self.sequence.kv_cache_clear()

    def sample(self, *args: Any, **kwargs: Any) -> int:
        """The host's ``sample``, reading the slot's logits rows (``idx`` counts as in the host)."""
        bound = _SAMPLE_SIGNATURE.bind(self, *args, **kwargs)
        bound.apply_defaults()
        arguments = bound.arguments
        sampler = self._sampler
        if sampler is None:  # the host makes a temporary sampler for a direct call too
            sampler = self._init_sampler(**{k: v for k, v in arguments.items() if k in _SAMPLER_PARAMETERS})
        idx = arguments["idx"]
        rows = self.slot_rows()
        row = rows[idx - self.n_tokens if idx is not None else -1]
        return sample_row(sampler, row, self.candidates())

    def close(self) -> None:
        """End the request on this view: a generation it left suspended ends (its slot is released). A view owns
        no model or context: closing it frees nothing the host's ``Llama`` holds."""
        self.end_generations()
        self._stack.close()


def sample_row(sampler: LlamaSampler, row: np.ndarray, candidates: LlamaTokenDataArray) -> int:
    """Sample a token from one logits ``row`` with ``sampler``, as ``llama_sampler_sample`` does from the context's
    output buffer: the candidates in vocabulary order, the sampler chain applied, the chosen token accepted."""
    candidates.copy_logits(row)
    array = candidates.candidates
    # A sampler may point the array elsewhere (and shrink it): start from the full candidates each time.
    array.data = candidates.candidates_data.ctypes.data_as(llama_cpp.llama_token_data_p)
    array.selected = -1
    llama_cpp.llama_sampler_apply(sampler.sampler, ctypes.byref(array))
    if not 0 <= array.selected < array.size:
        raise RuntimeError("the sampler chain selected no token")
    token = int(array.data[array.selected].id)
    llama_cpp.llama_sampler_accept(sampler.sampler, token)
    return token


def view_of(llama: Llama, context: SequenceContext) -> SlotLlama:
    """A :class:`SlotLlama` of ``llama`` on ``context`` (not yet bound to a sequence)."""
    view = SlotLlama.__new__(SlotLlama)
    view.__dict__.update(llama.__dict__)
    n_ctx = int(llama.n_ctx())
    view.sequence = SequenceHandle(context, n_ctx)
    host.give_own_state(view, view.sequence, contextlib.ExitStack())
    view.input_ids = np.zeros(n_ctx, dtype=np.intc)
    view.scores = np.zeros((1, int(llama.n_vocab())), dtype=np.single)
    view.n_tokens = 0
    view.cache = None
    return view
