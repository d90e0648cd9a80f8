"""Per-request views of one ``Llama``: llama-cpp-python's own completion code, run on one sequence of a shared
context.

A :class:`SlotLlama` is a shallow copy of the host's ``Llama`` (same model, tokenizer, chat format and handlers)
with its own evaluation bookkeeping (``input_ids``, ``n_tokens``, ``scores``, seed, sampler) and, instead of the
host's context, a :class:`SequenceHandle`: the memory operations the host's code makes (``kv_cache_seq_rm(-1, ...)``
on "every" sequence, ``reset`` of a recurrent memory) act on the view's own sequence only. Evaluation goes through
the engine slot the view is bound to (:mod:`ckpt_plugin.hosts.llama_cpp.parallel.parallel_llama`), and sampling reads
that slot's logits rows instead of llama.cpp's output buffer, which the next batched step overwrites.

Everything else (chat templates, tools, grammars, stop strings, logprobs, streaming) is the host's code, unchanged.
"""

from __future__ import annotations

import contextlib
import ctypes
import inspect
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import llama_cpp
import numpy as np
from llama_cpp._internals import LlamaSampler, LlamaTokenDataArray
from llama_cpp.llama import Llama

from ckpt_plugin.hosts.llama_cpp.seam import compat as host
from ckpt_plugin.hosts.llama_cpp.attachment.guarded_sampling import GuardedSampler, fill_candidates
from ckpt_plugin.hosts.llama_cpp.parallel.submissions import release_hold
from ckpt_plugin.hosts.llama_cpp.parallel.sequences import SequenceBackend, SequenceContext

__all__ = ["SlotLlama", "view_of"]

_SAMPLE_SIGNATURE = inspect.signature(Llama.sample)
_INIT_SAMPLER_SIGNATURE = inspect.signature(Llama._init_sampler)
_SAMPLER_PARAMETERS = frozenset(_INIT_SAMPLER_SIGNATURE.parameters) - {"self"}


@dataclass(frozen=True)
class RowSampling:
    """What a view knows of a sampler chain it made, to sample a logits row with less work than the host's chain.

    :ivar processors: The request's logits processors. The host runs them in a custom sampler first in the chain, on
        the whole vocabulary in vocabulary order, through a record array built per token; a view leaves that sampler
        out of the chain and runs them on the row itself before the chain, which is the same computation.
    :ivar greedy: The chain is greedy with penalties that do nothing (temperature 0, no grammar, repeat penalty 1,
        no frequency or presence penalty): its choice is the row's first largest logit, found without filling the
        vocabulary-sized candidates array.
    """

    processors: Sequence[Callable[[np.ndarray, np.ndarray], np.ndarray]]
    greedy: bool


def _penalties_do_nothing(last_n: int, repeat: float, frequency: float, presence: float) -> bool:
    # llama.cpp's own test, on the values as the sampler stores them (32-bit floats).
    return last_n == 0 or (np.float32(repeat) == 1.0 and np.float32(frequency) == 0.0
                           and np.float32(presence) == 0.0)


class SequenceHandle:
    """Stands for a ``Llama``'s context wrapper in a :class:`SlotLlama`: one sequence of a shared context.

    :param context: The shared context.
    :param n_ctx: The most positions the sequence holds (what the view's ``n_ctx()`` says).
    """

    def __init__(self, context: SequenceContext, n_ctx: int) -> None:
        self.context = context
        self.ctx = context.ctx
        self._n_ctx = n_ctx
        self._sequence: SequenceBackend | None = None

    def bind(self, sequence: SequenceBackend | None) -> None:
        """Act on ``sequence`` from now on (the view's request holds its slot); ``None``: on no sequence (its lease
        ended: what the host's code clears afterwards is another request's slot, left alone)."""
        self._sequence = sequence

    @property
    def seq_id(self) -> int | None:
        """The sequence, once the view is bound to a slot (``None`` before)."""
        return None if self._sequence is None else self._sequence.seq_id

    def n_ctx(self) -> int:
        return self._n_ctx

    def pooling_type(self) -> int:
        return int(llama_cpp.llama_pooling_type(self.ctx))

    def kv_cache_seq_rm(self, seq_id: int, p0: int, p1: int) -> bool:
        """Remove positions ``[p0, p1)`` of the view's own sequence, whatever ``seq_id`` the host names (it names
        -1, every sequence, which would be every other slot's too)."""
        if self._sequence is None:
            return True  # nothing of this view is in the memory yet
        return self._sequence.remove(p0, p1)

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

    Made by :func:`view_of`, never by its constructor. ``sequence`` is its context handle, ``slot_rows`` returns the
    logits rows of the slot's last evaluation, ``candidates`` a reusable candidates array, once the view is bound to
    a slot; ``row_sampling`` says how each sampler chain the view made samples a row (:class:`RowSampling`).
    """

    sequence: SequenceHandle
    slot_rows: Callable[[], np.ndarray]
    candidates: Callable[[], LlamaTokenDataArray]
    end_generations: Callable[[], None] = staticmethod(lambda: None)
    row_sampling: weakref.WeakKeyDictionary[LlamaSampler, RowSampling]

    def reset(self) -> None:
        """The host's ``reset``, on the view's own sequence only (the host clears every sequence of a recurrent
        memory)."""
        self.n_tokens = 0
        host.set_evaluated_prefix(self, self.input_ids, 0)
        self.sequence.kv_cache_clear()

    def _init_sampler(self, *args: Any, **kwargs: Any) -> LlamaSampler:
        """The host's sampler chain without its logits-processor sampler, and how to sample a row with it
        (:class:`RowSampling`, kept for :meth:`sample`). The view's attachment guards the chain it returns
        (:class:`~ckpt_plugin.hosts.llama_cpp.attachment.guarded_sampling.GuardedSampler`) where the request needs
        it."""
        bound = _INIT_SAMPLER_SIGNATURE.bind(self, *args, **kwargs)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        processors = arguments.pop("logits_processor")
        del arguments["self"]
        sampler = Llama._init_sampler(self, logits_processor=None, **arguments)
        greedy = (arguments["temp"] == 0.0 and arguments["grammar"] is None
                  and _penalties_do_nothing(self.last_n_tokens_size, arguments["repeat_penalty"],
                                            arguments["frequency_penalty"], arguments["presence_penalty"]))
        self.row_sampling[sampler] = RowSampling(list(processors or ()), greedy)
        return sampler

    def sample(self, *args: Any, **kwargs: Any) -> int:
        """The host's ``sample``, reading the slot's logits rows (``idx`` counts as in the host)."""
        release_hold()  # a token is about to go to the host's code: nothing is held across it
        sampler = self._sampler
        if sampler is None or args:
            bound = _SAMPLE_SIGNATURE.bind(self, *args, **kwargs)
            bound.apply_defaults()
            arguments = bound.arguments
            if sampler is None:  # the host makes a temporary sampler for a direct call too
                sampler = self._init_sampler(**{k: v for k, v in arguments.items() if k in _SAMPLER_PARAMETERS})
            idx = arguments["idx"]
        else:  # the host's own calls name every argument: no binding needed
            idx = kwargs.get("idx")
        rows = self.slot_rows()
        row = rows[idx - self.n_tokens if idx is not None else -1]
        guarded = sampler if isinstance(sampler, GuardedSampler) else None
        plan = self.row_sampling.get(sampler if guarded is None else guarded.chain)
        if plan is not None and plan.processors:
            row = row.copy()  # the processors may write to it; the slot's rows are the request's logprobs too
            input_ids = self._input_ids
            for processor in plan.processors:
                row[:] = processor(input_ids, row)
        if guarded is not None:
            return guarded.sample_row(row, self.candidates())
        if plan is not None and plan.greedy:
            token = int(np.argmax(row))
            if not np.isnan(row[token]):  # llama.cpp's greedy sampler skips NaN, numpy's argmax picks it
                llama_cpp.llama_sampler_accept(sampler.sampler, token)
                return token
        return sample_row(sampler, row, self.candidates())

    def close(self) -> None:
        """End the request on this view: a generation it left suspended ends (its slot is released). A view owns
        no model or context: closing it frees nothing the host's ``Llama`` holds."""
        self.end_generations()
        self._stack.close()


def sample_row(sampler: LlamaSampler, row: np.ndarray, candidates: LlamaTokenDataArray) -> int:
    """Sample a token from one logits ``row`` with ``sampler``, as ``llama_sampler_sample`` does from the context's
    output buffer: the candidates in vocabulary order, the sampler chain applied, the chosen token accepted."""
    fill_candidates(candidates, row)
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
    view.row_sampling = weakref.WeakKeyDictionary()
    return view
