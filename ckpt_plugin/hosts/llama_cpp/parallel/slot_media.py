"""Multimodal chat handlers on parallel slots: the slot a request's handler evaluates on before its completion.

llama-cpp-python's MTMD chat handlers evaluate a request's prompt (text chunks with ``Llama.eval``, media chunks
with libmtmd) before they start the completion whose generation leases a slot
(:mod:`ckpt_plugin.hosts.llama_cpp.parallel.parallel_llama`). On a parallel slot's view, the handler's relay
(:mod:`ckpt_plugin.hosts.llama_cpp.attachment.multimodal`) arms the view's media flow when the handler tokenizes the
prompt; the first evaluation of that flow then leases a slot for the request, chosen for the whole prompt (its media
positions included: a follow-up about an image goes to the slot holding the image, if idle), and the flow is evaluated
there. The completion's generation takes that lease over instead of leasing another slot, and releases it when it ends.

:class:`MediaLease` keeps that lease between the handler's evaluations and the generation, and makes sure it is
released whatever happens in between: the generation took it over, the handler failed, or the request's view was
closed (a client that left). A lease is never released while the handler's thread is evaluating on it: a close from
another thread then releases it when that evaluation returns.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

__all__ = ["MediaLease"]


class MediaLease:
    """The slot lease a view's multimodal chat handler holds from its first evaluation until the completion's
    generation takes it over (see the module docstring).

    The lease itself is an :class:`contextlib.ExitStack` whose closing releases the slot (and whatever was entered
    with the lease: its binding, its prefix in flight).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stack: contextlib.ExitStack | None = None
        self._evaluating = 0
        self._release_when_idle = False

    @property
    def held(self) -> bool:
        """Whether a lease is held for the handler now."""
        return self._stack is not None

    def hold(self, stack: contextlib.ExitStack) -> None:
        """Keep ``stack`` (a slot lease just entered) until it is taken over or released."""
        with self._lock:
            if self._stack is not None:
                raise RuntimeError("a multimodal handler's slot lease is already held")
            self._stack, self._release_when_idle = stack, False

    def take(self) -> contextlib.ExitStack | None:
        """Take the lease over (the completion's generation, which closes it when it ends); ``None`` if none is
        held."""
        with self._lock:
            stack, self._stack = self._stack, None
            self._release_when_idle = False
            return stack

    @contextlib.contextmanager
    def evaluating(self) -> Iterator[None]:
        """Mark the handler's thread as evaluating on the lease while the block runs: a :meth:`release` meanwhile
        waits for the block's end.

        :raises RuntimeError: No lease is held, or its release is pending (released by another thread: the request
            ended).
        """
        with self._lock:
            if self._stack is None or self._release_when_idle:
                raise RuntimeError("the request ended while its multimodal handler was evaluating its prompt: its slot "
                                   "was released")
            self._evaluating += 1
        try:
            yield
        finally:
            with self._lock:
                self._evaluating -= 1
                stack = None
                if not self._evaluating and self._release_when_idle:
                    stack, self._stack, self._release_when_idle = self._stack, None, False
            if stack is not None:
                stack.close()

    def release(self) -> bool:
        """Release the lease (the handler failed, or the request ended before its generation took it over); if the
        handler's thread is evaluating on it, when that evaluation returns. Returns whether a lease was held."""
        with self._lock:
            stack = self._stack
            if stack is None:
                return False
            if self._evaluating:
                self._release_when_idle = True
                return True
            self._stack = None
        stack.close()
        return True
