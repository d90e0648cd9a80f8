"""The lanes of the batch scheduler: per context, the queued submissions, the batch they are decoded in, and the
counters (:class:`DecodeLane`). The scheduler's thread (:mod:`ckpt_plugin.hosts.llama_cpp.parallel.scheduler`) runs
every lane's steps; a lane composes and decodes each step, making room in a pool of cells the slots share.
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING

import llama_cpp
import numpy as np

from ckpt_plugin.core.errors import PoolFullError, StateRestoreError
from ckpt_plugin.core.request import current_request
from ckpt_plugin.hosts.llama_cpp.parallel.sequences import SequenceContext
from ckpt_plugin.hosts.llama_cpp.parallel.submissions import (
    Submission,
    decoding,
    release_hold,
    run_callbacks,
    take_callbacks,
)

if TYPE_CHECKING:
    from ckpt_plugin.hosts.llama_cpp.parallel.scheduler import BatchScheduler

__all__ = ["DecodeLane"]

_GENERATED_TOKENS = 8
"""Submissions this short are a generated token (or a few drafted ones): they go first in a step."""
_MAX_STALL_SECONDS = 5.0
"""Tokens waiting for cells in a shared pool while no step decodes anything: after this long, one is refused."""


class DecodeLane:
    """The submissions for one context, decoded by a :class:`BatchScheduler`'s thread: its batch, its queue and its
    counters. A scheduler is the lane of its own context; :meth:`BatchScheduler.add_lane` adds one for another.

    :ivar steps: Decodes run so far.
    :ivar batched_tokens: Tokens decoded so far; ``batched_tokens / steps`` is the mean batch size.
    :ivar shared_steps: Decodes that carried the tokens of more than one sequence.
    :ivar decode_seconds: Time spent in ``llama_decode``.
    :ivar pos_min_after: Per sequence, its smallest position after its last evaluation (``None``: not read, as in a
        shared pool).
    """

    def __init__(self, context: SequenceContext, scheduler: BatchScheduler) -> None:
        self.context = context
        self.steps = 0
        self.batched_tokens = 0
        self.shared_steps = 0
        self.decode_seconds = 0.0
        self.pos_min_after: dict[int, int | None] = {}
        self._scheduler = scheduler
        self._pending: deque[Submission] = deque()
        self._stalled = False  # the last step put prompts back to wait for cells: the next waits for a change
        self._stalled_since: float | None = None  # since when steps decoded nothing for want of cells
        self._refused_in_stall = False  # a request was refused since then: wait for its cells before another
        self._batch = llama_cpp.llama_batch_init(context.n_batch, 0, 1)
        n = context.n_batch
        self._tokens = np.ctypeslib.as_array(self._batch.token, shape=(n,))
        self._positions = np.ctypeslib.as_array(self._batch.pos, shape=(n,))
        self._n_seq_id = np.ctypeslib.as_array(self._batch.n_seq_id, shape=(n,))
        self._logits = np.ctypeslib.as_array(self._batch.logits, shape=(n,))
        self._n_seq_id[:] = 1

    def stats(self) -> dict[str, float]:
        """The counters above, and the mean batch, as ``/checkpoints/stats`` shows them under ``batching``."""
        return {"steps": self.steps, "batched_tokens": self.batched_tokens, "shared_steps": self.shared_steps,
                "mean_batch": self.batched_tokens / self.steps if self.steps else 0.0,
                "decode_seconds": self.decode_seconds}

    def decode(self, seq_id: int, tokens: np.ndarray, n_past: int, first: int) -> np.ndarray:
        """Evaluate ``tokens`` on sequence ``seq_id`` at positions ``n_past...``; block until done.

        :param first: Logits are computed for ``tokens[first:]`` (and always for the last token).
        :return: Those logits rows, in order (a new array, the caller's own).
        :raises StateRestoreError: llama.cpp refused the batch (the sequence's memory is then unchanged past
            ``n_past`` only as far as earlier steps got; the caller reconciles with the memory).
        """
        tokens = np.asarray(tokens, dtype=np.int32)
        if not len(tokens):
            return np.empty((0, self.context.n_vocab), dtype=np.single)
        return self._run_submission(Submission(seq_id, tokens, n_past, first, self.context.n_vocab)).outputs

    def draft(self, seq_id: int, tokens: np.ndarray, n_past: int, n_draft: int) -> list[int]:
        """Evaluate ``tokens`` on sequence ``seq_id`` at positions ``n_past...``, then draft ``n_draft`` tokens
        greedily (each the largest logit after the one before); block until done.

        The drafting runs in the scheduler's thread, one token a step, in the steps of every other slot's drafting:
        the sequence then holds ``tokens`` and every drafted token but the last.

        :return: The drafted tokens.
        :raises StateRestoreError: As :meth:`decode`; how far the sequence got is then unknown.
        """
        tokens = np.asarray(tokens, dtype=np.int32)
        if not len(tokens) or n_draft < 1:
            raise ValueError("a draft starts from at least one token and drafts at least one")
        submission = Submission(seq_id, tokens, n_past, len(tokens) - 1, self.context.n_vocab, extend=n_draft)
        return self._run_submission(submission).drafted

    def _run_submission(self, submission: Submission) -> Submission:
        scheduler = self._scheduler
        seq_id = submission.seq_id
        submission.at_step = take_callbacks()
        with scheduler._cond:
            if scheduler._closed:
                if submission.at_step:
                    run_callbacks(submission.at_step)
                raise StateRestoreError("the batch scheduler is closed")
            scheduler._came_back(seq_id)
            self._pending.append(submission)
            scheduler._cond.notify_all()
        release_hold()  # queued: the step waiting for the context carries it
        submission.done.wait()
        self.pos_min_after[seq_id] = submission.pos_min
        if submission.error is not None:
            scope = current_request.get()
            if isinstance(submission.error, PoolFullError) and scope is not None:
                scope.unavailable = str(submission.error)
            raise submission.error
        return submission

    def _fail_pending(self, error: BaseException) -> None:
        """Fail every queued submission (the scheduler closes). The scheduler's condition is held."""
        for submission in self._pending:
            submission.error = error
            if submission.at_step and not submission.taken:
                run_callbacks(submission.at_step)
            submission.done.set()
        self._pending.clear()

    def _free(self) -> None:
        llama_cpp.llama_batch_free(self._batch)

    def _take(self) -> list[tuple[Submission, int, int]]:
        """This step's tokens: ``(submission, start, count)``; short submissions first, then prompt chunks."""
        capacity = self.context.n_batch
        order = sorted(self._pending, key=lambda s: s.remaining > _GENERATED_TOKENS)  # stable: FIFO within each
        step: list[tuple[Submission, int, int]] = []
        for submission in order:
            if capacity == 0:
                break
            count = min(submission.remaining, capacity)
            step.append((submission, submission.taken, count))
            submission.taken += count
            capacity -= count
            if submission.remaining == 0:
                self._pending.remove(submission)
        # In sequence order: with a KV stream per sequence llama.cpp splits a batch into micro-batches of consecutive
        # sequence ids, so this order makes the fewest.
        step.sort(key=lambda entry: entry[0].seq_id)
        return step

    def _submit(self, step: list[tuple[Submission, int, int]]) -> int:
        """Decode ``step``; llama.cpp's status. The context is held."""
        batch, at = self._batch, 0
        for submission, start, count in step:
            end = at + count
            self._tokens[at:end] = submission.tokens[start : start + count]
            self._positions[at:end] = submission.positions[start : start + count]
            self._logits[at:end] = submission.flags[start : start + count]
            for i in range(at, end):
                batch.seq_id[i][0] = submission.seq_id
            at = end
        batch.n_tokens = at
        context = self.context
        status = int(llama_cpp.llama_decode(context.ctx, batch))
        # No room in a pool of cells the slots share (llama.cpp changed nothing): the context frees an idle slot's
        # cells and the step is tried again (SequenceContext.make_room).
        while status == 1 and context.make_room is not None and context.make_room():
            status = int(llama_cpp.llama_decode(context.ctx, batch))
        return status

    def _without_room(
        self, step: list[tuple[Submission, int, int]]
    ) -> tuple[list[tuple[Submission, int, int]], list[tuple[Submission, int, int]], int]:
        """A shared pool had no cell for ``step`` with every idle slot's freed: ``(decoded, refused, status)``.

        Running generations come first: prompts give way to their tokens and wait for cells (a slot whose request
        ends is freed at the next step). When the generations' tokens themselves do not fit, one request is refused
        (a prompt first, else the longest generation), and its cells come back once it ends; the others wait.
        Another is refused only after :data:`_MAX_STALL_SECONDS` without a step decoded (prompts that filled the
        pool together wait for each other that long). llama-server refuses every slot of such a batch at once.
        """
        prompts = [entry for entry in step if len(entry[0].tokens) > _GENERATED_TOKENS]
        tokens = [entry for entry in step if len(entry[0].tokens) <= _GENERATED_TOKENS]
        if tokens and prompts:
            status = self._submit(tokens)
            if status != 1:
                self._defer(prompts)
                return tokens, [], status
        now = time.monotonic()
        if self._stalled_since is None:
            self._stalled_since, self._refused_in_stall = now, False
        collided = bool(tokens) and (bool(prompts) or len(tokens) > 1)
        refused: list[tuple[Submission, int, int]] = []
        waiting = step
        if (collided and not self._refused_in_stall) or now - self._stalled_since >= _MAX_STALL_SECONDS:
            longest = max(prompts or tokens, key=lambda entry: int(entry[0].positions[entry[1]]))
            refused, waiting = [longest], [entry for entry in step if entry is not longest]
            self._stalled_since, self._refused_in_stall = now, True
        self._defer(waiting)
        self._stalled = True
        return [], refused, 0

    def _defer(self, entries: list[tuple[Submission, int, int]]) -> None:
        """Put these chunks back at the front of the queue, untaken."""
        with self._scheduler._cond:
            for submission, start, _ in reversed(entries):
                submission.taken = start
                if submission not in self._pending:
                    self._pending.appendleft(submission)

    def _decode(self, step: list[tuple[Submission, int, int]]) -> None:
        context, scheduler = self.context, self._scheduler
        for submission, start, _ in step:
            if start == 0 and submission.at_step:
                callbacks, submission.at_step = submission.at_step, None
                run_callbacks(callbacks)
        refused: list[tuple[Submission, int, int]] = []
        with context.lock:
            started = time.perf_counter()
            with decoding(scheduler):
                status = self._submit(step)
                if status == 1 and context.make_room is not None:
                    step, refused, status = self._without_room(step)
            self.decode_seconds += time.perf_counter() - started
            if status == 0:
                self._collect(step)
                if not context.unified:  # read now, so that the slot need not wait for the next step to ask
                    for submission, start, count in step:
                        if start + count == len(submission.tokens):
                            submission.pos_min = int(
                                llama_cpp.llama_memory_seq_pos_min(context.memory, submission.seq_id))
        if step:
            self.steps += 1
            self.batched_tokens += sum(count for _, _, count in step)
            self.shared_steps += len({submission.seq_id for submission, _, _ in step}) > 1
            if status == 0:
                self._stalled_since = None
        for submission, _, count in refused:
            submission.error = PoolFullError(
                f"the {context.n_ctx} cells the slots share are all held by busy slots: no room for sequence "
                f"{submission.seq_id}'s next {count} tokens; retry when a request has finished, or raise --n_ctx")
        if status != 0:
            for submission, _, _ in step:
                submission.error = StateRestoreError(
                    f"llama_decode failed with {status} on sequence {submission.seq_id}")
        step = step + refused
        finished = [submission for submission, start, count in step
                    if submission.error is None and start + count == len(submission.tokens)]
        # A drafting submission drafts its next token at once: its slot's thread is not woken until it is done.
        drafting = [submission for submission in finished if submission.extend > 0 and submission.draft_next()]
        with scheduler._cond:
            for submission, _, _ in step:
                if submission.error is not None and submission in self._pending:
                    self._pending.remove(submission)  # its later chunks are not evaluated either
            self._pending.extend(drafting)
            now = time.monotonic()
            for submission in finished:
                if submission.extend <= 0:
                    scheduler._done_at[submission.seq_id] = now
        for submission, start, count in step:
            if submission.error is not None or (start + count == len(submission.tokens) and submission.extend <= 0):
                submission.done.set()

    def _collect(self, step: list[tuple[Submission, int, int]]) -> None:
        """Copy each submission's logits rows out of llama.cpp's buffer before the next step overwrites it.

        llama.cpp keeps the rows of the flagged tokens together, in the batch's order: one view of the whole block,
        then a slice per submission (not a view per row, each made through ctypes)."""
        counts = [int(np.count_nonzero(submission.flags[start : start + count])) for submission, start, count in step]
        n_outputs = sum(counts)
        if not n_outputs:
            return
        logits = llama_cpp.llama_get_logits(self.context.ctx)
        if not logits:
            raise StateRestoreError("llama.cpp holds no logits after a step that asked for them")
        block = np.ctypeslib.as_array(logits, shape=(n_outputs, self.context.n_vocab))
        at = 0
        for (submission, _, _), m in zip(step, counts):
            submission.outputs[submission.rows : submission.rows + m] = block[at : at + m]
            submission.rows += m
            at += m
