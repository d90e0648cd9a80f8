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
(:attr:`~ckpt_plugin.hosts.llama_cpp.parallel.sequences.SequenceContext.lock`), which a step holds while it decodes:
llama.cpp contexts are not thread-safe.

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
import threading
import time
from typing import Iterator

from ckpt_plugin.core.errors import StateRestoreError
from ckpt_plugin.hosts.llama_cpp.parallel.lanes import DecodeLane
from ckpt_plugin.hosts.llama_cpp.parallel.sequences import SequenceContext
from ckpt_plugin.hosts.llama_cpp.parallel.submissions import held_until_submitted

__all__ = ["BatchScheduler"]


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
        with held_until_submitted((slot_lock, self.context.lock)):
            yield

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
