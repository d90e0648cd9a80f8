"""Speculative decoding whose state rides in every checkpoint.

- :class:`DraftModel`: a ``llama_cpp.llama_speculative.LlamaDraftModel`` backed by a second ``Llama`` with the same
  vocabulary. Its context is kept in step with the target incrementally by a checkpoint manager of its own (only new
  tokens are evaluated; rejected drafts are rolled back by truncation), and it drafts ``n_draft`` tokens greedily.
- :class:`DraftStatePlugin`: stores the draft context's state with every checkpoint and cache entry of the target
  (``on_checkpoint_capture``, as the extra state named ``"draft"``) and puts it back after the target was restored (``on_slot_restore``), so that after a
  restore the draft evaluates only the tokens past the checkpoint.
- :class:`NgramDraft`: prompt-lookup drafting over an incremental n-gram index, and :class:`NgramStatePlugin`, which
  stores that index with the checkpoints (extra state ``"speculative"``): the example of a speculative-state plugin.

What a checkpoint keeps of the target: only its sequence state. llama-cpp-python's ``logits_all`` (forced on by any
``draft_model``) makes ``Llama.save_state`` copy an ``n_tokens x n_vocab`` float array; checkpoints never hold logits,
because a restore always re-evaluates at least one token, which produces the logits sampling needs.

Draft data carries the draft's fingerprint in a 64-byte header written in front of the state by the same single
``get`` call (the buffer is allocated with room for it), so data made for another draft model or context is recognised
and dropped with a warning and the ``draft_dropped`` counter; the request is served all the same.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol, Sequence

import numpy as np
from llama_cpp.llama_speculative import LlamaDraftModel

from ckpt_plugin.core.entry import CacheEntry
from ckpt_plugin.core.checkpoint import DRAFT, SPECULATIVE, Checkpoint, ExtraState, StateBufferPool, allocate_state_buffer, freeze
from ckpt_plugin.core.errors import IncompatibleStateError, UnsupportedHostError
from ckpt_plugin.plugins.hookspecs import hookimpl, restored_extra
from ckpt_plugin.hosts.llama_cpp.attachment.attach import attach
from ckpt_plugin.hosts.llama_cpp.seam.context import last_logits, vocab_digest
from ckpt_plugin.engine.manager import CheckpointManager
from ckpt_plugin.engine.slot_controller import SlotController

__all__ = [
    "DRAFT_ENGINE_SETTINGS",
    "DraftModel",
    "DraftStatePlugin",
    "HEADER",
    "KeptInStep",
    "NgramDraft",
    "NgramStatePlugin",
    "accepted_prefix",
    "check_draft_pair",
    "draft_buffer",
    "enable_speculative",
    "parse_draft_header",
]

log = logging.getLogger("ckpt_plugin")

HEADER = 64
_MAGIC = b"CKPTDRFT"


DRAFT_ENGINE_SETTINGS: dict[str, Any] = {"load_entrypoints": False, "checkpoint_min_step": 1 << 30,
                                          "max_checkpoints": 0, "cache_max_bytes": 0, "redis_url": None,
                                          "disk_dir": None}
"""A draft's own engine: the target's checkpoints and cache entries carry the draft state, so the draft keeps no
checkpoints, cache or tiers of its own (``CKPT_REDIS_URL`` or ``CKPT_DISK_DIR`` in the environment are the target's).
Its cuts after rejected drafts are a few tokens, which a sliding window's live cells serve."""


def check_draft_pair(draft: Any, target: Any, n_draft: int) -> None:
    """Refuse a draft that cannot draft for ``target``: no tokens per call, or another vocabulary."""
    if n_draft < 1:
        raise ValueError(f"n_draft must be >= 1, got {n_draft}")
    if vocab_digest(draft) != vocab_digest(target):
        raise IncompatibleStateError("the draft model's vocabulary differs from the target's")


def accepted_prefix(tokens: np.ndarray, start: int, drafted: Sequence[int]) -> int:
    """How many of the tokens ``drafted`` after position ``start`` the target kept: those ``tokens`` holds there."""
    accepted = 0
    for offset, token in enumerate(drafted):
        if start + offset >= len(tokens) or int(tokens[start + offset]) != token:
            break
        accepted += 1
    return accepted


class DraftModel(LlamaDraftModel):
    """Greedy drafts from a second model, kept in step with the target through its own checkpoint manager.

    :param draft: The draft ``Llama`` (attached to a manager here; do not use it for anything else).
    :param target: The target ``Llama``; its vocabulary must be the draft's.
    :param n_draft: Tokens drafted per call.
    """

    def __init__(self, draft: Any, target: Any, n_draft: int = 4) -> None:
        check_draft_pair(draft, target, n_draft)
        self.llama = draft
        self.n_draft = n_draft
        self.manager: CheckpointManager = attach(draft, **DRAFT_ENGINE_SETTINGS)
        self.drafted = 0
        self.accepted = 0
        self._last: tuple[int, list[int]] | None = None

    @property
    def controller(self) -> SlotController:
        """The draft engine's slot (the draft context's one sequence)."""
        return self.manager.controllers[0]

    @property
    def acceptance(self) -> float:
        """Fraction of drafted tokens the target accepted (as seen at the next call)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    def _score_last_draft(self, tokens: np.ndarray) -> None:
        if self._last is None:
            return
        self.accepted += accepted_prefix(tokens, *self._last)

    def sync(self, tokens: np.ndarray) -> None:
        """Make the draft context hold ``tokens`` (evaluating only what it does not hold yet)."""
        # From n_tokens 0, the attached eval restores the longest prefix its manager can serve, then evaluates.
        self.llama.n_tokens = 0
        self.llama.eval(tokens)

    def __call__(self, input_ids: np.ndarray, /, **kwargs: Any) -> np.ndarray:
        tokens = np.asarray(input_ids, dtype=np.int32)
        if len(tokens) == 0:
            return np.empty(0, dtype=np.intc)
        self._score_last_draft(tokens)
        self.sync(tokens)
        drafted: list[int] = []
        for i in range(self.n_draft):
            drafted.append(int(np.argmax(last_logits(self.llama))))
            if i + 1 < self.n_draft:
                self.llama.eval(drafted[-1:])
        self.drafted += len(drafted)
        self._last = (len(tokens), drafted)
        return np.asarray(drafted, dtype=np.intc)


class KeptInStep(Protocol):
    """A draft kept in step with a target slot: what :class:`DraftStatePlugin` stores and restores."""

    @property
    def controller(self) -> SlotController:
        """The draft engine's slot that holds the draft's sequence."""

    def sync(self, tokens: np.ndarray) -> None:
        """Make the draft sequence hold ``tokens``."""


class DraftStatePlugin:
    """Stores the draft context's state with every checkpoint of the target and restores it after the target.

    :param draft: The :class:`DraftModel` (or one slot's draft, :class:`~.slot_drafts.SlotDraft`).
    """

    def __init__(self, draft: KeptInStep) -> None:
        self.draft = draft
        self.dropped = 0
        self.restored = 0

    @hookimpl
    def on_attach(self, manager: CheckpointManager) -> None:
        if manager.kind.recurrent:
            raise UnsupportedHostError(
                "speculative decoding needs a target whose memory can be rolled back (plain or sliding-window "
                "attention); recurrent and hybrid targets would re-process on every rejected draft"
            )

    @hookimpl
    def on_checkpoint_capture(
        self, manager: CheckpointManager, slot: Any, n_tokens: int, partial: bool
    ) -> ExtraState | None:
        draft = self.draft.controller
        with draft.lock:  # the sequence captured is the one synced
            self.draft.sync(slot.tokens)
            # Full draft state, whatever ``partial`` says: the draft's own memory may not hold the attention part a
            # partial state would need once the target restores it.
            size = draft.backend.state_size(partial=False)
            buffer = draft_buffer(size, manager.cache.pool)
            written = draft.backend.read_state(buffer[HEADER:], partial=False)
        if written != size:
            log.warning("draft state capture wrote %d of %d bytes; checkpoint kept without draft state", written, size)
            return None
        header = _MAGIC + draft.fingerprint.encode()[:48].ljust(48, b"\0") + int(n_tokens).to_bytes(8, "little")
        buffer[:HEADER] = np.frombuffer(header, dtype=np.uint8)
        return ExtraState(DRAFT, freeze(buffer))

    @hookimpl(tryfirst=True)
    def on_slot_restore(
        self, manager: CheckpointManager, slot: Any, checkpoint: Checkpoint | None, entry: CacheEntry | None,
        n_tokens: int,
    ) -> None:
        data = restored_extra(DRAFT, checkpoint, entry)
        if data is None:
            return
        draft = self.draft.controller
        fingerprint, n_saved = parse_draft_header(data)
        if fingerprint != draft.fingerprint.encode()[:48] or n_saved > len(slot.lineage):
            self._drop(manager, "it was made for another draft model or context")
            return
        pos_min = draft.kind.restored_pos_min(0, n_saved - 1)
        state = Checkpoint(n_tokens=n_saved, pos_min=pos_min, pos_max=n_saved - 1, partial=False,
                           target=data[HEADER:], fingerprint=draft.fingerprint)
        try:
            with draft.lock:
                draft.load(CacheEntry(slot.lineage[:n_saved].copy(), state, ()))
        except IncompatibleStateError as exc:
            self._drop(manager, str(exc))
            return
        self.restored += 1

    def _drop(self, manager: CheckpointManager, why: str) -> None:
        self.dropped += 1
        manager.counters.add(draft_dropped=1)
        log.warning("draft state dropped: %s; the draft catches up by evaluating the prompt", why)


def draft_buffer(size: int, pool: StateBufferPool | None = None) -> np.ndarray:
    """A writable buffer with room for the draft header in front of ``size`` state bytes (from ``pool``: the
    cache's, so that its recycled mappings stay within the budget)."""
    return allocate_state_buffer(HEADER + size, pool)


def parse_draft_header(data: np.ndarray) -> tuple[bytes, int]:
    """``(fingerprint bytes, n_tokens)`` of draft data, or ``(b"", 0)`` if it has no valid header."""
    if len(data) < HEADER or bytes(data[:8]) != _MAGIC:
        return b"", 0
    return bytes(data[8:56]).rstrip(b"\0"), int.from_bytes(bytes(data[56:64]), "little")


class NgramDraft(LlamaDraftModel):
    """Prompt-lookup drafting over an incremental n-gram index.

    The index maps each n-gram of the sequence to the position after its latest occurrence; it is extended with the
    tokens added since the last call and rebuilt only when the sequence diverged from what it indexed.

    :param n: n-gram length.
    :param n_draft: Tokens drafted per call.
    """

    def __init__(self, n: int = 2, n_draft: int = 4) -> None:
        self.n = n
        self.n_draft = n_draft
        self.tokens: list[int] = []
        self.index: dict[tuple[int, ...], int] = {}
        self.indexed_tokens = 0

    def update(self, tokens: Sequence[int]) -> None:
        """Index ``tokens`` (only what was not indexed yet, unless the sequence diverged)."""
        tokens = [int(t) for t in tokens]
        common = 0
        for a, b in zip(self.tokens, tokens):
            if a != b:
                break
            common += 1
        if common < len(self.tokens):
            self.tokens, self.index = [], {}
            common = 0
        start = max(self.n, len(self.tokens))
        self.tokens = tokens
        for end in range(start, len(tokens)):
            # the n-gram ending just before ``end`` was followed by the token at ``end``
            self.index[tuple(tokens[end - self.n : end])] = end
            self.indexed_tokens += 1

    def __call__(self, input_ids: np.ndarray, /, **kwargs: Any) -> np.ndarray:
        self.update(np.asarray(input_ids).tolist())
        key = tuple(self.tokens[-self.n :])
        follow = self.index.get(key)
        if follow is None or len(self.tokens) < self.n:
            return np.empty(0, dtype=np.intc)
        return np.asarray(self.tokens[follow : follow + self.n_draft], dtype=np.intc)

    def state(self) -> np.ndarray:
        """The index as bytes: the tokens it covers (it is derived from them deterministically)."""
        return np.asarray([self.n, *self.tokens], dtype=np.int32).view(np.uint8)

    def load(self, data: np.ndarray) -> None:
        values = np.frombuffer(data, dtype=np.int32)
        if len(values) == 0 or int(values[0]) != self.n:
            raise ValueError("n-gram state of another n")
        self.tokens, self.index = [], {}
        self.update(values[1:].tolist())


class NgramStatePlugin:
    """Stores an :class:`NgramDraft`'s index with every checkpoint and restores it with the slot."""

    def __init__(self, ngram: NgramDraft) -> None:
        self.ngram = ngram

    @hookimpl
    def on_checkpoint_capture(
        self, manager: CheckpointManager, slot: Any, n_tokens: int, partial: bool
    ) -> ExtraState | None:
        self.ngram.update(slot.tokens)
        return ExtraState(SPECULATIVE, freeze(self.ngram.state()))

    @hookimpl
    def on_slot_restore(
        self, manager: CheckpointManager, slot: Any, checkpoint: Checkpoint | None, entry: CacheEntry | None,
        n_tokens: int,
    ) -> None:
        data = restored_extra(SPECULATIVE, checkpoint, entry)
        if data is None:
            return
        try:
            self.ngram.load(data)
        except ValueError as exc:
            manager.counters.add(draft_dropped=1)
            log.warning("speculative state dropped: %s", exc)


def enable_speculative(
    target: Any, manager: CheckpointManager, draft: Any, n_draft: int = 4, store_draft_state: bool = True
) -> DraftModel:
    """Give an attached target ``Llama`` a :class:`DraftModel` whose state rides in the target's checkpoints.

    With ``store_draft_state=False`` the draft re-processes what it lacks after a restore instead (for comparison).

    The target must have been created with ``logits_all=True`` (llama-cpp-python samples every drafted position)
    or with any ``draft_model`` (which forces it).
    """
    if not getattr(target, "_logits_all", False):
        raise UnsupportedHostError("speculative decoding needs the target Llama created with logits_all=True")
    model = DraftModel(draft, target, n_draft)
    plugin = DraftStatePlugin(model)
    plugin.on_attach(manager)
    if store_draft_state:
        manager.plugins.register(plugin, name="ckpt_plugin.draft")
    target.draft_model = model
    return model
