"""Grammars compiled in a child process before the host compiles them, so that none can kill the server.

The same child answers vocabulary sizes of models the server has not loaded (token ids are checked against them).

llama.cpp's grammar code is what crashes on hostile input: a grammar it cannot parse leaves llama-cpp-python with a
null sampler (segfault when sampling), a deeply nested one overflows the compiler's stack inside the parse itself,
and one that compiles but matches nothing somewhere (``root ::= [z-a]``) makes the sampler throw, which aborts the
process. The host compiles and samples with every grammar in the server process. :class:`GrammarGuard` compiles each
one first in a child process that holds only the vocabulary, and samples with it there over the whole vocabulary for
a few steps, timing each (a step's cost grows with the grammar's alternatives times the vocabulary, and the host pays
it for every token): a grammar the child refuses, that crashes or stalls it, or whose step takes longer than
``step_budget``, is refused with a 422 and never reaches the host; the child is started again for the next one.
Verdicts are remembered by digest (clients resend the same schema with every request), so a repeated grammar costs a
dictionary lookup.

The check runs before the request waits for a slot, and is bounded in time: compiling (a JSON schema's conversion
included) may take ``timeout`` seconds (1 s in ckpt-serve: ``grammar_check_seconds``), after which the grammar is
refused and the child replaced; the sampling walk that follows ends by itself after about a second. Loading a
model's vocabulary into the child (once per child and model) is not counted against a grammar.

This check is no longer what keeps the server alive: the host's sampler is guarded where tokens are chosen
(``ckpt_plugin.hosts.llama_cpp.attachment.guarded_sampling``), so a dead end that the walk misses ends its generation
with a 422 instead of aborting the process. The walk still answers most such grammars with a 422 before any token.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import select
import struct
import subprocess
import sys
import threading
from collections import OrderedDict
from typing import IO, Any

from ckpt_plugin.http.request_checks import GrammarSource

__all__ = ["GrammarGuard", "serve"]

log = logging.getLogger("ckpt_plugin")

CRASHED = ("compiling or sampling with it crashed llama.cpp's grammar code (nested too deeply, or a point where no "
           "token can follow)")
TIMED_OUT = "compiling it took longer than the {seconds:g} s allowed (grammar_check_seconds)"
WALK_TIMED_OUT = "sampling with it took longer than {seconds:g} s"
_COMPILED = "compiled"  # the child's word between compiling a grammar and its verdict
_VOCAB_SECONDS = 120.0  # loading a model's vocabulary into the child: not a grammar's time
_SILENT = object()  # no answer in time (a verdict of None means the grammar passed)
_LENGTH = struct.Struct("<Q")
# The answers go to a copy of stdout; stdout itself goes to stderr, where whatever llama.cpp prints belongs.
_CHILD = ("import os, sys; answers = os.fdopen(os.dup(1), 'wb', buffering=0); os.dup2(2, 1); "
          "from ckpt_plugin.http.grammar_guard import serve; serve(sys.stdin.buffer, answers)")


def _write(stream: IO[bytes], message: Any) -> None:
    data = pickle.dumps(message)
    stream.write(_LENGTH.pack(len(data)) + data)
    stream.flush()


def _read_exactly(stream: IO[bytes], n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = stream.read(n - len(data))
        if not chunk:
            raise EOFError("the other side closed the pipe")
        data.extend(chunk)
    return bytes(data)


def _read(stream: IO[bytes]) -> Any:
    (length,) = _LENGTH.unpack(_read_exactly(stream, _LENGTH.size))
    # Pickles only ever come from the parent or the child it started, never from a client.
    return pickle.loads(_read_exactly(stream, length))


def serve(requests: IO[bytes], answers: IO[bytes]) -> None:
    """The child's loop: compile what the parent sends, answer with the problem (or ``None``); or the vocabulary's
    size and longest token (in bytes) when no grammar is sent."""
    from ckpt_plugin.hosts.llama_cpp.seam.context import grammar_problem_in_worker, vocab_facts_in_worker

    while True:
        try:
            model_path, text, is_schema, step_budget = _read(requests)
        except EOFError:
            return
        try:
            answer: Any = (vocab_facts_in_worker(model_path) if text is None
                           else grammar_problem_in_worker(model_path, text, is_schema, step_budget,
                                                          lambda: _write(answers, _COMPILED)))
        except Exception as exc:  # a model that cannot be read: reported, not a verdict on the grammar
            answer = OSError(str(exc))
        try:
            _write(answers, answer)
        except OSError:  # the server went away (shutdown) while this answer was computed
            return


class GrammarGuard:
    """Compiles grammars in a child process (started on first use, again after a crash) and remembers verdicts.

    :param timeout: Seconds a compilation (a schema's conversion included) may take before the grammar is refused
        and the child replaced.
    :param remembered: Verdicts kept (least recently used go first).
    :param step_budget: The most seconds one sampling step with a grammar may take over the model's vocabulary
        (``None``: no limit).
    """

    def __init__(self, timeout: float = 1.0, remembered: int = 1024, step_budget: float | None = None) -> None:
        self.timeout = timeout
        self.remembered = remembered
        self.step_budget = step_budget
        # The sampling walk ends by itself after about a second; a step may take up to the budget and be measured
        # twice; what is beyond that is a stalled child.
        self.walk_timeout = 5.0 + 3 * (step_budget or 1.0)
        self._loaded: set[str] = set()  # models whose vocabulary the running child holds
        self._verdicts: OrderedDict[bytes, str | None] = OrderedDict()
        self._lock = threading.Lock()  # one compilation at a time: the child answers in order
        self._vocab_facts: dict[str, tuple[int, int]] = {}
        self._process: subprocess.Popen[bytes] | None = None
        self.crashes = 0

    def problem(self, model_path: str, source: GrammarSource) -> str | None:
        """Why ``source`` must be refused for the model at ``model_path``, or ``None`` if the host can compile it.

        Blocks for the compilation (run it off the event loop).
        """
        key = hashlib.sha256(f"{model_path}\0{int(source.is_schema)}\0{source.text}".encode("utf-8",
                                                                                          "surrogatepass")).digest()
        with self._lock:
            if key in self._verdicts:
                self._verdicts.move_to_end(key)
                return self._verdicts[key]
            verdict = self._compile(model_path, source)
            self._verdicts[key] = verdict
            while len(self._verdicts) > self.remembered:
                self._verdicts.popitem(last=False)
            return verdict

    def vocab_size(self, model_path: str) -> int:
        """The vocabulary size of the model at ``model_path``, read by the child (remembered per path).

        :raises OSError: The child cannot read the model.
        """
        return self._facts(model_path)[0]

    def longest_token_bytes(self, model_path: str) -> int:
        """The most bytes of text one token of the model at ``model_path`` stands for, read by the child (remembered
        per path): a text of ``n`` bytes is at least ``n / longest_token_bytes`` tokens.

        :raises OSError: The child cannot read the model.
        """
        return self._facts(model_path)[1]

    def _facts(self, model_path: str) -> tuple[int, int]:
        with self._lock:
            facts = self._vocab_facts.get(model_path)
            if facts is None:
                facts = self._vocab_facts[model_path] = self._load(model_path)
            return facts

    def _load(self, model_path: str) -> tuple[int, int]:
        """Have the child load ``model_path``'s vocabulary; its size and longest token (lock held)."""
        answer = self._ask(model_path, None, False)
        if not isinstance(answer, tuple):
            raise OSError(f"could not read the vocabulary of {model_path}: {answer}")
        self._loaded.add(model_path)
        return answer

    def _compile(self, model_path: str, source: GrammarSource) -> str | None:
        if model_path not in self._loaded or self._process is None or self._process.poll() is not None:
            self._vocab_facts[model_path] = self._load(model_path)
        return self._ask(model_path, source.text, source.is_schema)  # type: ignore[no-any-return]

    def _ask(self, model_path: str, text: str | None, is_schema: bool) -> Any:
        child = self._child()
        assert child.stdin is not None and child.stdout is not None
        try:
            _write(child.stdin, (model_path, text, is_schema, self.step_budget))
            answer = self._answer(child.stdout, _VOCAB_SECONDS if text is None else self.timeout)
            if answer is _SILENT:
                self._stop()
                return TIMED_OUT.format(seconds=self.timeout)
            if answer == _COMPILED:
                answer = self._answer(child.stdout, self.walk_timeout)
                if answer is _SILENT:
                    self._stop()
                    return WALK_TIMED_OUT.format(seconds=self.walk_timeout)
        except (EOFError, OSError):
            self.crashes += 1
            log.warning("grammar check: the child process died compiling a grammar (%d so far); refused it",
                        self.crashes)
            self._stop()
            return CRASHED
        if isinstance(answer, Exception):
            raise answer
        return answer

    @staticmethod
    def _answer(stream: IO[bytes], seconds: float) -> Any:
        """The child's next message, or :data:`_SILENT` if none came within ``seconds``."""
        ready, _, _ = select.select([stream], [], [], seconds)
        return _read(stream) if ready else _SILENT

    def _child(self) -> subprocess.Popen[bytes]:
        if self._process is not None and self._process.poll() is None:
            return self._process
        self._stop()
        # A fresh interpreter, not multiprocessing: spawn and forkserver import the host program's main module in
        # the child, and a fork would copy the model and the server's threads.
        # No backtrace on an abort: ggml runs gdb for one, seconds during which the child answers nothing.
        self._process = subprocess.Popen(
            [sys.executable, "-c", _CHILD],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0, env={**os.environ, "GGML_NO_BACKTRACE": "1"},
        )
        return self._process

    def _stop(self) -> None:
        process, self._process = self._process, None
        self._loaded.clear()
        if process is None:
            return
        if process.poll() is None:
            process.kill()
        process.wait(timeout=5)
        for stream in (process.stdin, process.stdout):
            if stream is not None:
                stream.close()

    def close(self) -> None:
        """Stop the child process."""
        with self._lock:
            self._stop()
