"""The ``logprobs`` of llama-cpp-python's completions, equal to the host's own and computed vectorized.

llama-cpp-python 0.3.36 builds completion logprobs in ``Llama._create_completion`` with a Python loop per token that
sorts the whole vocabulary (``sorted(zip(logprobs_row, range(n_vocab)), reverse=True)``), and for a non-streamed
response first takes ``Llama.logits_to_logprobs`` of every row of the ``n_ctx x n_vocab`` array: on Gemma-3's
262,144-word vocabulary about a quarter of a second per token. The attachment
(:mod:`ckpt_plugin.hosts.llama_cpp.attachment.patches`) runs the host's completion with ``logprobs=None`` (no
per-token work) and fills in the logprobs from here:

- :func:`top_indices`: the ``k`` first entries of that sort, by ``np.partition`` over one row and a sort of the few
  candidates, in the same order (descending value, ties broken by the larger index first);
- :func:`completion_logprobs`: the ``logprobs`` object of a non-streamed response, ``logits_to_logprobs`` applied to
  the rows it reads only (each row's values depend on that row alone, so they are the host's bit for bit);
- :class:`CompletionTrace`: watches the tokens the host's ``generate`` yields and replays what the host's loop does
  with each of them when it streams with logprobs (one chunk per token, its stop-string and multi-byte hold-backs, the
  tail after the loop), since without logprobs the host groups tokens into chunks differently.

Everything the host would compute is computed the same way, with the same quirks (offsets counted in characters in
the loop but in bytes in the stream's tail, ``prev_tokens`` passed in some places and not others, the row a prompt
without a leading BOS pairs with each token); each is replayed literally, not corrected, so that a response does not
change with the plugin. Values have the host's types: ``np.float32`` in non-streamed responses (read from a numpy
row), ``float`` in streamed chunks (from ``.tolist()``).

Pure: no ``llama_cpp`` import; the host's tokenizer, ``logits_to_logprobs`` and end-of-generation test are passed in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Generator, Iterator, Sequence

import numpy as np

__all__ = ["CompletionTrace", "LogprobsRequest", "ROW_BLOCK", "stop_sequences", "top_indices"]

Detokenize = Callable[..., bytes]
"""``Llama.detokenize(tokens, prev_tokens=None) -> bytes``."""

LogSoftmax = Callable[[np.ndarray], np.ndarray]
"""``Llama.logits_to_logprobs``: row-wise log-softmax over the last axis."""

ROW_BLOCK = 64
"""Rows turned into logprobs at a time: bounds the temporary arrays (64 rows of Gemma-3: 64 MiB) where the host
converts its whole ``n_ctx x n_vocab`` array at once."""


def top_indices(values: np.ndarray, k: int) -> np.ndarray:
    """The indices of ``sorted(zip(values, range(len(values))), reverse=True)[:k]``, in that order.

    Descending value, equal values by descending index (tuples compare their second item on a tie), ``-0.0`` equal to
    ``0.0``; ``k`` is a slice bound as in the host (negative: all but the last ``-k``, beyond the length: all).
    A row holding NaN, where the order Python's sort produces depends on its algorithm, is sorted the host's way.
    """
    values = np.asarray(values)
    n = len(values)
    m = len(range(n)[:k])
    if m == 0:
        return np.zeros(0, dtype=np.intp)
    if np.isnan(values).any():
        return np.array([i for _, i in sorted(zip(values.tolist(), range(n)), reverse=True)[:k]], dtype=np.intp)
    if m < n:
        # Every one of the m largest is >= the m-th largest value; ties at that value are all kept as candidates,
        # so the exact tie order is decided below, over few elements.
        kth = np.partition(values, n - m)[n - m]
        candidates = np.flatnonzero(values >= kth)
    else:
        candidates = np.arange(n)
    # Ascending by (value, index) with a stable sort, then reversed: descending value, then descending index.
    order = np.lexsort((candidates, values[candidates]))[::-1][:m]
    return candidates[order]


def stop_sequences(stop: str | list[str] | None) -> list[bytes]:
    """The host's ``stop_sequences``: ``stop`` as a list of UTF-8 strings (anything else: none)."""
    stops = stop if isinstance(stop, list) else [stop] if isinstance(stop, str) else []
    return [s.encode("utf-8") for s in stops] if stops != [] else []


@dataclass(frozen=True, slots=True)
class LogprobsRequest:
    """What a completion request says about its logprobs.

    :ivar prompt: The ``prompt`` argument as given (its ``len`` starts the text offsets).
    :ivar logprobs: How many of the most likely tokens each entry lists (a slice bound).
    :ivar echo: Whether the prompt's own logprobs are returned too.
    :ivar stream: Whether the response is streamed.
    :ivar stop: The stop sequences, encoded (:func:`stop_sequences`).
    """

    prompt: str | list[int]
    logprobs: int
    echo: bool
    stream: bool
    stop: list[bytes]


def _decode(data: bytes) -> str:
    return data.decode("utf-8", errors="ignore")


def completion_logprobs(
    detokenize: Detokenize,
    log_softmax: LogSoftmax,
    scores: np.ndarray,
    request: LogprobsRequest,
    prompt_tokens: list[int],
    completion_tokens: list[int],
    bos_token_id: int,
) -> dict[str, Any]:
    """The ``logprobs`` of a non-streamed completion, as ``Llama._create_completion`` builds them.

    :param scores: The host's ``_scores``: its logits rows ``[0, n_tokens)`` after the generation.
    :param completion_tokens: The host's ``completion_tokens`` (the sampled tokens without the end-of-generation
        token, after a BOS when the prompt was empty).
    """
    echo = request.echo
    text_offset = 0 if echo else len(request.prompt)
    token_offset = 0 if echo else len(prompt_tokens[1:])
    if echo:
        # The host drops a leading BOS and pairs the rest with rows from 0 (so without a BOS each token gets the row
        # after it; the first entry is blanked below either way).
        all_tokens = prompt_tokens[1 if prompt_tokens[0] == bos_token_id else 0 :] + completion_tokens
    else:
        all_tokens = completion_tokens
    if len(scores) == 0:
        log_softmax(scores)  # the host's reduction over no rows raises; so does this
    # The host zips the tokens with rows [token_offset, n_tokens): the shorter one decides.
    count = min(len(all_tokens), len(scores[token_offset:]))
    text_offsets: list[int] = []
    token_logprobs: list[Any] = []
    tokens: list[str] = []
    top_logprobs: list[Any] = []
    for start in range(0, count, ROW_BLOCK):
        stop = min(count, start + ROW_BLOCK)
        block = log_softmax(scores[token_offset + start : token_offset + stop])
        for idx in range(start, stop):
            token = all_tokens[idx]
            if token == bos_token_id:
                continue
            row = block[idx - start]
            token_str = _decode(detokenize([token], prev_tokens=all_tokens[:idx]))
            text_offsets.append(text_offset + len(_decode(detokenize(all_tokens[:idx]))))
            tokens.append(token_str)
            token_logprobs.append(row[int(token)])
            top_logprob: dict[str, Any] | None = {
                _decode(detokenize([int(i)], prev_tokens=all_tokens[:idx])): row[i]
                for i in top_indices(row, request.logprobs).tolist()
            }
            top_logprob.update({token_str: row[int(token)]})
            top_logprobs.append(top_logprob)
    # OpenAI's API has no logprobs for the first token of an echo (an empty list raises, as in the host).
    if echo and len(all_tokens) > 0:
        token_logprobs[0] = None
        top_logprobs[0] = None
    return {
        "tokens": tokens,
        "text_offset": text_offsets,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
    }


def _stream_entry(
    detokenize: Detokenize, log_softmax: LogSoftmax, logits: np.ndarray, k: int, token: int, token_str: str,
    text_offset: int,
) -> dict[str, Any]:
    """One streamed chunk's ``logprobs``: floats, as the host's ``.tolist()`` gives them; top keys without
    ``prev_tokens``."""
    row = log_softmax(logits)
    top_logprob = {_decode(detokenize([int(i)])): float(row[i]) for i in top_indices(row, k).tolist()}
    value = float(row[int(token)])
    top_logprob.update({token_str: value})
    return {"tokens": [token_str], "text_offset": [text_offset], "token_logprobs": [value],
            "top_logprobs": [top_logprob]}


@dataclass(slots=True)
class CompletionTrace:
    """The host's completion loop, replayed on the tokens its ``generate`` yields.

    The host runs with ``logprobs=None``; :meth:`watch` wraps the token iterator it generates from and keeps
    ``completion_tokens`` as the host does. For a streamed request it also replays, per token, what the host's loop
    yields when it has logprobs (the chunks wait in :attr:`pending` until :meth:`take` or :meth:`tail`): computed when
    the token arrives, as the host computes it, from the rows the host would read then.

    :ivar detokenize: ``Llama.detokenize``.
    :ivar log_softmax: ``Llama.logits_to_logprobs``.
    :ivar scores: Returns the host's ``_scores`` now (``scores[:n_tokens]``).
    :ivar is_eog: Whether a token ends the generation (``llama_vocab_is_eog``).
    :ivar bos_token_id: ``Llama.token_bos()``.
    :ivar error: What the host's streamed loop would have raised (the generation then stopped), to raise after the
        :attr:`pending` chunks.
    """

    detokenize: Detokenize
    log_softmax: LogSoftmax
    scores: Callable[[], np.ndarray]
    is_eog: Callable[[int], bool]
    bos_token_id: int
    request: LogprobsRequest
    prompt_tokens: list[int] = field(default_factory=list)
    completion_tokens: list[int] = field(default_factory=list)
    pending: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    done: bool = False
    returned_tokens: int = 0
    multibyte_fix: int = 0
    error: Exception | None = None

    def watch(self, prompt_tokens: Sequence[int], tokens: Iterator[int]) -> Generator[int, Any, None]:
        """Yield ``tokens`` (the host's ``generate(prompt_tokens, ...)``), replaying the host's loop on each one."""
        self.prompt_tokens = list(prompt_tokens)
        # The host starts ``completion_tokens`` with a BOS when the prompt is empty.
        self.completion_tokens = [] if len(self.request.prompt) > 0 else [self.bos_token_id]
        sent: Any = None
        try:
            while True:
                try:
                    token = next(tokens) if sent is None else tokens.send(sent)  # type: ignore[attr-defined]
                except StopIteration:
                    return
                try:
                    self._on_token(token)
                except Exception as error:
                    # The host's loop fails here (it does on an empty prompt, reading a row past the evaluated
                    # ones), after yielding the chunks before: the generation stops, and the error is raised once
                    # those are yielded.
                    self.error = error
                    return
                sent = yield token
        finally:
            close = getattr(tokens, "close", None)
            if close is not None:
                close()

    def _on_token(self, token: int) -> None:
        """The host's loop body for one token, up to and including its streamed chunks (the ``max_tokens`` check
        after them ends the loop without changing what was yielded)."""
        if self.done:
            return
        if self.is_eog(token):
            self.done = True
            return
        completion_tokens = self.completion_tokens
        completion_tokens.append(token)
        if not self.request.stream:
            return
        all_text = self.detokenize(completion_tokens, prev_tokens=self.prompt_tokens)
        # Multi-byte UTF-8 held back, with the host's arithmetic.
        for k, char in enumerate(all_text[-3:]):
            k = 3 - k
            for num, pattern in [(2, 192), (3, 224), (4, 240)]:
                if num > k and pattern & char == pattern:
                    self.multibyte_fix = num - k
        if self.multibyte_fix > 0:
            self.multibyte_fix -= 1
            return
        if any(s in all_text for s in self.request.stop):
            self.done = True
            return
        self._stream_loop_chunks()

    def _prev(self) -> list[int]:
        return self.prompt_tokens + self.completion_tokens[: self.returned_tokens]

    def _stream_loop_chunks(self) -> None:
        """The chunks the host's loop yields for the tokens not returned yet (``if stream:`` with logprobs)."""
        detokenize, request = self.detokenize, self.request
        completion_tokens = self.completion_tokens
        remaining_tokens = completion_tokens[self.returned_tokens :]
        remaining_text = detokenize(remaining_tokens, prev_tokens=self._prev())
        remaining_length = len(remaining_text)
        # Text that may be the start of a stop sequence is held back.
        first_stop_position = 0
        for s in request.stop:
            for i in range(min(len(s), remaining_length), 0, -1):
                if remaining_text.endswith(s[:i]):
                    if i > first_stop_position:
                        first_stop_position = i
                    break
        token_end_position = 0
        for token in remaining_tokens:
            if token == self.bos_token_id:
                continue
            token_end_position += len(detokenize([token], prev_tokens=self._prev()))
            if token_end_position > (remaining_length - first_stop_position):
                break
            token_str = _decode(detokenize([token], prev_tokens=self._prev()))
            text_offset = len(request.prompt) + len(
                _decode(detokenize(completion_tokens[: self.returned_tokens], prev_tokens=self._prev()))
            )
            token_offset = len(self.prompt_tokens) + self.returned_tokens
            logits = self.scores()[token_offset - 1, :]
            entry = _stream_entry(detokenize, self.log_softmax, logits, request.logprobs, token, token_str,
                                  text_offset)
            self.returned_tokens += 1
            self.pending.append((_decode(detokenize([token], prev_tokens=self._prev())), entry))

    def tail(self) -> None:
        """The chunks the host yields after its loop for the tokens it had held back (``if stream:`` after the loop,
        with logprobs): byte offsets, the row before each token, text cut at the first stop sequence."""
        detokenize, request = self.detokenize, self.request
        completion_tokens = self.completion_tokens
        remaining_tokens = completion_tokens[self.returned_tokens :]
        remaining_text = detokenize(remaining_tokens, prev_tokens=self._prev())
        any_stop = [s for s in request.stop if s in remaining_text]
        if len(any_stop) > 0:
            end = min(remaining_text.index(stop) for stop in any_stop)
        else:
            end = len(remaining_text)
        token_end_position = 0
        for token in remaining_tokens:
            token_end_position += len(detokenize([token], prev_tokens=self._prev()))
            if token == self.bos_token_id:
                continue
            token_str = _decode(detokenize([token]))
            text_offset = len(request.prompt) + len(
                detokenize(completion_tokens[: self.returned_tokens], prev_tokens=self._prev())
            )
            token_offset = len(self.prompt_tokens) + self.returned_tokens - 1
            logits = self.scores()[token_offset, :]
            entry = _stream_entry(detokenize, self.log_softmax, logits, request.logprobs, token, token_str,
                                  text_offset)
            if token_end_position >= end:
                last_text = detokenize([token])
                if token_end_position == end - 1:
                    break
                self.returned_tokens += 1
                self.pending.append((_decode(last_text[: len(last_text) - (token_end_position - end)]), entry))
                break
            self.returned_tokens += 1
            self.pending.append((_decode(detokenize([token])), entry))

    def take(self, template: dict[str, Any]) -> list[dict[str, Any]]:
        """The pending chunks, with the ``id``, ``object``, ``created`` and ``model`` of the host's ``template``
        chunk (the same for every chunk of a response)."""
        chunks = [
            {
                "id": template["id"],
                "object": template["object"],
                "created": template["created"],
                "model": template["model"],
                "choices": [{"text": text, "index": 0, "logprobs": entry, "finish_reason": None}],
            }
            for text, entry in self.pending
        ]
        self.pending.clear()
        return chunks

    def logprobs(self, scores: np.ndarray) -> dict[str, Any]:
        """The non-streamed response's ``logprobs`` (:func:`completion_logprobs`), from the host's ``_scores`` after
        the generation."""
        return completion_logprobs(self.detokenize, self.log_softmax, scores, self.request, self.prompt_tokens,
                                   self.completion_tokens, self.bos_token_id)
