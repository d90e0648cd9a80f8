"""Hook-level testing kit: a pure-Python fake backend, a hook recorder and reference helpers.

ckpt_plugin's pytest plugin (the ``pytest11`` entry point ``ckpt_plugin_integrations.pytest_plugin``) serves them
as fixtures to any project that installs ckpt_plugin:

- ``tiny_model``: ``tiny_model("gemma3") -> Path`` builds (once per session) a tiny random-weight GGUF model of a
  kind (``llama``, ``gemma3`` with a 32-token window, ``mamba``, ``hybrid``);
- ``fake_manager``: ``fake_manager(kind="swa", **settings) -> CheckpointManager`` over a :class:`FakeBackend`, for
  testing plugins without a model (no entry-point plugins unless ``load_entrypoints=True``);
- ``hook_recorder``: a :class:`HookRecorder` that records every hook call of the managers it watches.

:class:`FakeBackend` simulates the truncation rules of each memory kind on token lists and records a violation
(``corrupted``) instead of silently computing garbage the way a real sliding window would, so policy bugs show.
:func:`run_prompt` serves a prompt as a host does, in a tenant's namespace if given (:func:`namespace_for` computes
the one a server derives from a bearer token or a header): docs/hooks.md, "Testing kit".
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ckpt_plugin.core.request import RequestScope, current_request
from ckpt_plugin.engine.manager import CheckpointManager
from ckpt_plugin.http.tenants import namespace_for
from ckpt_plugin.core.memory import MemoryKind

__all__ = [
    "FAKE_KINDS",
    "FakeBackend",
    "HookRecorder",
    "NOISE",
    "assert_same_answer",
    "fake_manager",
    "fresh_greedy_tokens",
    "greedy_tokens",
    "namespace_for",
    "run_prompt",
    "tiny_models_in",
]

FAKE_KINDS: dict[str, MemoryKind] = {
    "plain": MemoryKind(),
    "swa": MemoryKind(n_swa=8),
    "recurrent": MemoryKind(recurrent=True, attention=False),
    "hybrid": MemoryKind(recurrent=True, attention=True),
}


class FakeBackend:
    """A model context simulated on token lists, following llama.cpp's memory rules.

    The state bytes are the token ids (``int32``) plus a header; a sliding-window memory keeps ``window_cells``
    positions, so truncating below its window sets :attr:`corrupted` (a real context would silently lose tokens).

    :param kind: The memory kind to simulate.
    :param window_cells: Cells of the sliding window (``>= n_swa``).
    """

    fingerprint = "fake-model"

    def __init__(self, kind: MemoryKind, n_ctx: int = 4096, window_cells: int | None = None) -> None:
        self.kind = kind
        self.n_ctx = n_ctx
        self.window_cells = window_cells or 2 * max(kind.n_swa, 1)
        self.memory: list[int] = []
        self.window_start = 0
        self.corrupted = False
        self.decoded = 0

    def pos_min(self) -> int:
        if not self.memory:
            return -1
        if self.kind.recurrent and not self.kind.attention:
            return len(self.memory) - 1
        return self.window_start if self.kind.swa else 0

    def pos_max(self) -> int:
        return len(self.memory) - 1

    def _serialize(self, partial: bool) -> np.ndarray:
        header = [len(self.memory), self.window_start, int(partial)]
        return np.asarray(header + self.memory, dtype=np.int32).view(np.uint8)

    def state_size(self, partial: bool) -> int:
        return int(self._serialize(partial).nbytes)

    def read_state(self, buffer: np.ndarray, partial: bool) -> int:
        data = self._serialize(partial)
        if len(buffer) < len(data):
            return 0  # as llama.cpp: a buffer too small fails the whole write
        buffer[: len(data)] = data
        return len(data)

    def write_state(self, buffer: np.ndarray, partial: bool) -> int:
        values = np.frombuffer(buffer.tobytes(), dtype=np.int32)
        n, window_start, _ = (int(v) for v in values[:3])
        tokens = values[3 : 3 + n].tolist()
        if partial and self.kind.attention:
            # The attention part stays; only the window / recurrent part comes from the buffer.
            if self.memory[: min(n, len(self.memory))] != tokens[: min(n, len(self.memory))]:
                self.corrupted = True
        self.memory = tokens
        self.window_start = max(window_start, n - self.kind.n_swa) if self.kind.swa else 0  # pos_max - n_swa + 1
        return int(buffer.nbytes)

    def truncate(self, n_keep: int) -> bool:
        if n_keep >= len(self.memory):
            return True
        if self.kind.recurrent:
            return False
        if self.kind.swa and self.window_start > max(0, n_keep - self.kind.n_swa + 1):
            self.corrupted = True
        del self.memory[n_keep:]
        return True

    def clear(self) -> None:
        self.memory = []
        self.window_start = 0

    def decode(self, tokens: np.ndarray) -> None:
        self.memory.extend(int(t) for t in tokens)
        self.decoded += len(tokens)
        if self.kind.swa:
            self.window_start = max(self.window_start, len(self.memory) - self.window_cells)


@dataclass
class HookRecorder:
    """Records ``(hook name, kwargs)`` of every hook call of the managers it watches, decisions included.

    Built on pluggy's ``add_hookcall_monitoring``: one record per call (not per implementation), in call order.
    """

    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    def watch(self, manager: CheckpointManager) -> None:
        """Record the hook calls of ``manager`` from now on."""
        manager.plugins.add_hookcall_monitoring(self._before, self._after)

    def names(self) -> list[str]:
        """The hook names called, in order."""
        return [name for name, _ in self.calls]

    def _before(self, hook_name: str, hook_impls: Any, kwargs: dict[str, Any]) -> None:
        self.calls.append((hook_name, dict(kwargs)))

    def _after(self, outcome: Any, hook_name: str, hook_impls: Any, kwargs: dict[str, Any]) -> None:
        pass


def fake_manager(kind: str = "swa", *, n_ctx: int = 4096, window_cells: int | None = None,
                 **settings: Any) -> CheckpointManager:
    """A manager over a :class:`FakeBackend` of ``kind`` (``plain``, ``swa``, ``recurrent``, ``hybrid``).

    It loads no plugins of the ``ckpt_plugin`` entry-point group unless ``load_entrypoints=True`` is given: a test
    sees only the plugins it registers, whatever else is installed in its environment.
    """
    settings.setdefault("load_entrypoints", False)
    return CheckpointManager(FakeBackend(FAKE_KINDS[kind], n_ctx, window_cells), **settings)


def run_prompt(manager: CheckpointManager, prompt: list[int] | np.ndarray, n_generate: int = 0, *,
               namespace: str | None = None) -> int:
    """Serve ``prompt`` the way a host does: prepare, process the rest, then ``n_generate`` dummy tokens.

    :param namespace: Serve it as a request of this tenant (:func:`namespace_for`); by default the manager's own
        ``namespace`` setting, as outside any request.
    :return: Tokens evaluated for this prompt.
    """
    before = manager.counters.tokens_evaluated
    prompt = np.asarray(prompt, dtype=np.int32)
    # The namespace of a request is its scope's (what the HTTP middleware sets for each request), not the slot's.
    token = current_request.set(RequestScope(namespace=namespace)) if namespace is not None else None
    try:
        n_keep = manager.primary.prepare(prompt)
        manager.primary.process(prompt[n_keep:], len(prompt))
        for i in range(n_generate):
            manager.primary.process(np.asarray([7 + i], dtype=np.int32), len(prompt))
    finally:
        if token is not None:
            current_request.reset(token)
    return manager.counters.tokens_evaluated - before


NOISE = 0.02
"""Top-2 logit gap below which two contexts may pick different greedy tokens from batch-size rounding alone."""


def greedy_tokens(llama: Any, prompt: list[int], n: int, gaps: list[float] | None = None) -> list[int]:
    """``n`` greedy tokens of ``llama`` (attached or not) for ``prompt``; with ``gaps``, the top-2 logit gap of
    each step."""
    from ckpt_plugin.hosts.llama_cpp.seam.context import last_logits

    out: list[int] = []
    for token in llama.generate(prompt, temp=0.0, top_k=1, repeat_penalty=1.0):
        if gaps is not None:
            top2 = np.partition(last_logits(llama), -2)[-2:]
            gaps.append(float(abs(top2[1] - top2[0])))
        out.append(int(token))
        if len(out) == n:
            break
    return out


def fresh_greedy_tokens(reference: Any, prompt: list[int], n: int, gaps: list[float]) -> list[int]:
    """Greedy tokens of an unattached ``reference`` evaluated from an empty memory."""
    reference.reset()
    from ckpt_plugin.hosts.llama_cpp.seam.context import clear_memory

    clear_memory(reference)
    return greedy_tokens(reference, prompt, n, gaps)


def assert_same_answer(got: list[int], want: list[int], gaps: list[float], what: str, noise: float = NOISE) -> None:
    """``got`` equals ``want``, except after a step where the reference itself was within ``noise`` of a tie."""
    for step, (g, w) in enumerate(zip(got, want)):
        if g != w:
            assert gaps[step] < noise, f"{what}: token {step} is {g}, a fresh context gives {w} (gap {gaps[step]})"
            return
    assert len(got) == len(want), f"{what}: {len(got)} tokens, a fresh context gives {len(want)}"


def tiny_models_in(root: pathlib.Path) -> Callable[[str], pathlib.Path]:
    """``get(kind) -> Path``: a tiny GGUF model of ``kind`` in ``root``, built on first use (what the pytest
    plugin's ``tiny_model`` fixture returns)."""
    from ckpt_plugin.testing.tiny_models import build_tiny_model

    built: dict[str, pathlib.Path] = {}

    def get(kind: str) -> pathlib.Path:
        if kind not in built:
            built[kind] = build_tiny_model(kind, root / f"{kind}.gguf")
        return built[kind]

    return get

