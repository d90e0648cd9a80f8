"""Continuous batching: the tokens of every busy slot evaluated together, one ``llama_decode`` per step.

Each slot's request runs in its own thread and evaluates through :meth:`BatchScheduler.decode`, which blocks until
its tokens are evaluated. One scheduler thread gathers what the slots submitted and decodes it in one batch:
generated tokens first (one per generating slot), then prompt chunks filling the rest of ``n_batch``, as llama.cpp's
server does. A long prompt is evaluated over several steps while the other slots keep generating.

A step waits for the slots that are generating and between two tokens (their next token comes a sampling later)
to submit, so that their tokens share one decode instead of each paying its own, and so that no
request thread works while llama.cpp computes: on a machine whose cores all run llama.cpp's threads, a Python
thread sampling during a decode stalls every one of them at the next barrier. The wait is learned per slot (how long
it took to come back after its last steps) and bounded (``max_wait``): a slot whose tokens go out through a slow
stream is not waited for.

Every other llama.cpp call on the context (state copies, sequence removal) takes the context's lock
(:attr:`~ckpt_plugin.hosts.llama_cpp.sequences.SequenceContext.lock`), which a step holds while it decodes: llama.cpp
contexts are not thread-safe.

A scheduler can serve more than one context (:meth:`BatchScheduler.add_lane`): a draft model's context for
speculative decoding. Its thread then runs one loop for both, as llama.cpp's server does: each step decodes one
context's batch, drafting steps first (every speculating slot's drafts together), then one target step that verifies
every slot's drafts with the other slots' tokens. A drafting submission drafts greedily in the scheduler's thread
(``extend``): the slots' threads are not woken between two drafting steps, so their drafts stay in step, and the two
contexts never compute at once on the same cores. A slot counts as one for the waits whichever context it
submits to.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from typing import Callable, Iterator

import llama_cpp
import numpy as np

from ckpt_plugin.core.errors import PoolFullError, StateRestoreError
from ckpt_plugin.core.request import current_request
from ckpt_plugin.hosts.llama_cpp.sequences import SequenceContext

__all__ = ["BatchScheduler", "DecodeLane", "at_next_step", "release_hold"]

log = logging.getLogger("ckpt_plugin")

_GENERATED_TOKENS = 8
"""Submissions this short are a generated token (or a few drafted ones): they go first in a step."""
_MAX_STALL_SECONDS = 5.0
"""Tokens waiting for cells in a shared pool while no step decodes anything: after this long, one is refused."""


_next_step = threading.local()
_decoding: set[int] = set()  # the schedulers in llama_decode now (set.add and discard are atomic)


def at_next_step(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the calling thread's next submission goes into a step, just before that step's decode.

    For work a slot's thread hands to other threads (a streamed chunk for the event loop to send): done then, it
    runs while llama.cpp computes, instead of between two steps, where every slot's own Python work is on the path
    to the next step. While a step is being decoded the callback runs at once: the next step would start only
    after it (a long prompt chunk can take most of a second). A callback that raises is logged and ignored.
    """
    if _decoding:
        _run_callbacks([callback])
        return
    callbacks = getattr(_next_step, "callbacks", None)
    if callbacks is None:
        callbacks = _next_step.callbacks = []
    callbacks.append(callback)


class _Hold:
    """The locks a thread holds until its next submission is queued (see
    :meth:`BatchScheduler.held_until_submitted`)."""

    __slots__ = ("locks", "held")

    def __init__(self, locks: tuple[threading.RLock, ...]) -> None:
        self.locks = locks
        self.held = True

    def release(self) -> None:
        if self.held:
            self.held = False
            for lock in reversed(self.locks):
                lock.release()


def release_hold() -> None:
    """Let go of the calling thread's hold (:meth:`BatchScheduler.held_until_submitted`), if it still has one:
    before anything that may wait on other code without a submission to release it."""
    hold = getattr(_next_step, "hold", None)
    if hold is not None:
        _next_step.hold = None
        hold.release()


def _run_callbacks(callbacks: list[Callable[[], None]]) -> None:
    for callback in callbacks:
        try:
            callback()
        except Exception:
            log.exception("a callback run at a batched step failed")


class _Submission:
    """Tokens of one slot waiting for evaluation, with the logits rows it asked for."""

    __slots__ = ("seq_id", "tokens", "positions", "flags", "outputs", "taken", "rows", "done", "error", "at_step",
                 "pos_min", "extend", "drafted")

    def __init__(self, seq_id: int, tokens: np.ndarray, n_past: int, first: int, n_vocab: int,
                 extend: int = 0) -> None:
        n = len(tokens)
        self.seq_id = seq_id
        self.tokens = tokens
        self.positions = np.arange(n_past, n_past + n, dtype=np.int32)
        self.flags = np.zeros(n, dtype=np.int8)
        self.flags[min(first, n - 1):] = 1
        self.outputs = np.empty((n - min(first, n - 1), n_vocab), dtype=np.single)
        self.taken = 0  # tokens already placed in a step
        self.rows = 0  # output rows already filled
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.at_step: list[Callable[[], None]] | None = None
        self.pos_min: int | None = None  # the sequence's smallest position after its last chunk's step
        self.extend = extend  # greedy tokens still to draft after the last token
        self.drafted: list[int] = []

    @property
    def remaining(self) -> int:
        return len(self.tokens) - self.taken

    def draft_next(self) -> bool:
        """After the submission's last token was decoded: take the greedy token of its last row; return whether
        that token is evaluated next (more tokens to draft), the submission then holding only it."""
        row = self.outputs[self.rows - 1]
        token = int(np.argmax(row))
        self.drafted.append(token)
        self.extend -= 1
        if self.extend <= 0:
            return False
        position = int(self.positions[-1]) + 1
        self.tokens = np.array([token], dtype=np.int32)
        self.positions = np.array([position], dtype=np.int32)
        self.flags = np.ones(1, dtype=np.int8)
        self.outputs = self.outputs[-1:]
        self.taken = self.rows = 0
        return True


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
        self._pending: deque[_Submission] = deque()
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
        return self._run_submission(_Submission(seq_id, tokens, n_past, first, self.context.n_vocab)).outputs

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
        submission = _Submission(seq_id, tokens, n_past, len(tokens) - 1, self.context.n_vocab, extend=n_draft)
        return self._run_submission(submission).drafted

    def _run_submission(self, submission: _Submission) -> _Submission:
        scheduler = self._scheduler
        seq_id = submission.seq_id
        submission.at_step, _next_step.callbacks = getattr(_next_step, "callbacks", None), None
        with scheduler._cond:
            if scheduler._closed:
                if submission.at_step:
                    _run_callbacks(submission.at_step)
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
                _run_callbacks(submission.at_step)
            submission.done.set()
        self._pending.clear()

    def _free(self) -> None:
        llama_cpp.llama_batch_free(self._batch)

    def _take(self) -> list[tuple[_Submission, int, int]]:
        """This step's tokens: ``(submission, start, count)``; short submissions first, then prompt chunks."""
        capacity = self.context.n_batch
        order = sorted(self._pending, key=lambda s: s.remaining > _GENERATED_TOKENS)  # stable: FIFO within each
        step: list[tuple[_Submission, int, int]] = []
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

    def _submit(self, step: list[tuple[_Submission, int, int]]) -> int:
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
        self, step: list[tuple[_Submission, int, int]]
    ) -> tuple[list[tuple[_Submission, int, int]], list[tuple[_Submission, int, int]], int]:
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
        refused: list[tuple[_Submission, int, int]] = []
        waiting = step
        if (collided and not self._refused_in_stall) or now - self._stalled_since >= _MAX_STALL_SECONDS:
            longest = max(prompts or tokens, key=lambda entry: int(entry[0].positions[entry[1]]))
            refused, waiting = [longest], [entry for entry in step if entry is not longest]
            self._stalled_since, self._refused_in_stall = now, True
        self._defer(waiting)
        self._stalled = True
        return [], refused, 0

    def _defer(self, entries: list[tuple[_Submission, int, int]]) -> None:
        """Put these chunks back at the front of the queue, untaken."""
        with self._scheduler._cond:
            for submission, start, _ in reversed(entries):
                submission.taken = start
                if submission not in self._pending:
                    self._pending.appendleft(submission)

    def _decode(self, step: list[tuple[_Submission, int, int]]) -> None:
        context, scheduler = self.context, self._scheduler
        for submission, start, _ in step:
            if start == 0 and submission.at_step:
                callbacks, submission.at_step = submission.at_step, None
                _run_callbacks(callbacks)
        refused: list[tuple[_Submission, int, int]] = []
        with context.lock:
            started = time.perf_counter()
            _decoding.add(id(scheduler))
            try:
                status = self._submit(step)
                if status == 1 and context.make_room is not None:
                    step, refused, status = self._without_room(step)
            finally:
                _decoding.discard(id(scheduler))
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

    def _collect(self, step: list[tuple[_Submission, int, int]]) -> None:
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


class BatchScheduler(DecodeLane):
    """Decodes the tokens every slot of ``context`` submits, batched across slots (see the module docstring); the
    lane of ``context`` itself, and the thread of every lane added to it.

    :param context: The context whose sequences are the slots.
    :param max_wait: The longest a step waits for generating slots to submit, in seconds.
    :ivar idle_seconds: Time the scheduler waited with nothing submitted (every slot idle, or working in Python).
    """

    def __init__(self, context: SequenceContext, max_wait: float = 0.03) -> None:
        self._cond = threading.Condition()
        super().__init__(context, self)
        self.max_wait = max_wait
        self.idle_seconds = 0.0
        self._lanes: list[DecodeLane] = [self]
        self._done_at: dict[int, float] = {}  # when each slot's last submission completed
        self._comeback: dict[int, float] = {}  # how long each generating slot takes to submit again (EWMA)
        self._generating: dict[int, int] = {}
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="ckpt-batch-scheduler", daemon=True)
        self._thread.start()

    def add_lane(self, context: SequenceContext) -> DecodeLane:
        """A lane for another context (a draft model's), decoded by this scheduler's thread between this context's
        steps, its drafting steps first. Its sequence ids name the same slots as this context's."""
        lane = DecodeLane(context, self)
        with self._cond:
            if self._closed:
                lane._free()
                raise StateRestoreError("the batch scheduler is closed")
            self._lanes.append(lane)
        return lane

    @contextlib.contextmanager
    def held_until_submitted(self, slot_lock: threading.RLock) -> Iterator[None]:
        """Hold ``slot_lock``, then the context (no step starts), from now until the calling thread's next
        submission is queued, or the block ends.

        For a slot changing hands: its prepare (a look at the memory, a state parked and one restored, a cut: each
        a call on the context) and the submission of its prompt then happen between two steps, and the next step
        carries the prompt, as in llama.cpp's server, whose loop does the same between two decodes. Without the
        hold, each call waits for the step in flight, and the step that was waiting for the context starts without
        the prompt.

        The slot's lock is taken first and kept throughout, so the order is the one every other path takes (a slot
        file action holds its slot's lock, then calls on the context): the slot's own code, which takes its lock
        again between the prepare and the submission, then never waits for it while holding the context.
        """
        slot_lock.acquire()
        try:
            self.context.lock.acquire()
        except BaseException:
            slot_lock.release()
            raise
        hold = _Hold((slot_lock, self.context.lock))
        _next_step.hold = hold
        try:
            yield
        finally:
            if getattr(_next_step, "hold", None) is hold:
                _next_step.hold = None
            hold.release()

    @contextlib.contextmanager
    def generating(self, seq_id: int) -> Iterator[None]:
        """Mark slot ``seq_id`` as generating while the block runs: steps wait briefly for its next tokens, on
        whichever lane it submits them."""
        with self._cond:
            self._generating[seq_id] = self._generating.get(seq_id, 0) + 1
            self._done_at.pop(seq_id, None)  # not expected at a step until its first evaluation is done
        try:
            yield
        finally:
            with self._cond:
                left = self._generating[seq_id] - 1
                if left:
                    self._generating[seq_id] = left
                else:
                    del self._generating[seq_id]
                    self._comeback.pop(seq_id, None)
                self._cond.notify_all()

    def stats(self) -> dict[str, float]:
        return {**super().stats(), "idle_seconds": self.idle_seconds}

    def close(self) -> None:
        """Stop the scheduler thread (pending submissions fail) and free every lane's batch."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=10)
        for lane in self._lanes:
            lane._free()

    def _came_back(self, seq_id: int) -> None:
        """Slot ``seq_id`` submits: learn how long it took since its last submission was done. The condition is
        held."""
        done_at = self._done_at.get(seq_id)
        if done_at is not None and seq_id in self._generating:
            seconds = time.monotonic() - done_at
            known = self._comeback.get(seq_id)
            self._comeback[seq_id] = seconds if known is None else 0.7 * known + 0.3 * seconds

    # -- the scheduler thread --------------------------------------------------------------------------------------

    def _next_lane(self) -> DecodeLane | None:
        """The lane of the next step: one with drafting to do first (the target verifies drafts), else this
        context's. The condition is held."""
        for lane in self._lanes[1:]:
            if lane._pending:
                return lane
        return self if self._pending else None

    def _run(self) -> None:
        while True:
            with self._cond:
                lane = self._next_lane()
                if lane is None:
                    idle_from = time.perf_counter()
                    while lane is None and not self._closed:
                        self._cond.wait()
                        lane = self._next_lane()
                    self.idle_seconds += time.perf_counter() - idle_from
                if self._closed:
                    for each in self._lanes:
                        each._fail_pending(StateRestoreError("the batch scheduler is closed"))
                    return
                self._gather()
                lane = self._next_lane()
            if lane is None:
                continue
            # The step is composed once the context is ours: a slot that held it for its prepare has queued its
            # prompt by then (see held_until_submitted).
            with lane.context.lock:
                with self._cond:
                    step = lane._take()
                if not step:
                    continue
                try:
                    lane._decode(step)
                except BaseException as exc:  # whatever broke, no slot may wait forever on this step
                    with self._cond:
                        for submission, _, _ in step:
                            submission.error = exc
                            if submission in lane._pending:
                                lane._pending.remove(submission)
                            submission.done.set()
            if lane._stalled:
                # Waiting prompts: until a generation submits or ends (or briefly), not in a loop on the context.
                lane._stalled = False
                with self._cond:
                    self._cond.wait(self.max_wait)

    def _gather(self) -> None:
        """Wait (boundedly) until every generating slot that is between two steps has submitted its next tokens (on
        any lane), if it usually comes back within ``max_wait``. A slot already gone longer than that since its last
        step is not waited for (its request is sampling slowly, or its client left and its generation is not yet
        closed)."""
        comeback, done_at = self._comeback, self._done_at
        now = time.monotonic()
        expected = [seq_id for seq_id in self._generating
                    if seq_id in done_at and comeback.get(seq_id, 0.0) <= self.max_wait
                    and now - done_at[seq_id] <= self.max_wait]
        if not expected:
            return
        wait = min(self.max_wait, 2 * max(comeback.get(seq_id, self.max_wait / 4) for seq_id in expected))
        deadline = now + wait
        while not self._closed:
            waiting = {s.seq_id for lane in self._lanes for s in lane._pending}
            if all(seq_id in waiting for seq_id in expected):
                return
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._cond.wait(left)
