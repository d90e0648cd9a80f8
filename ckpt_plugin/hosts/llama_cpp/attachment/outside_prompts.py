"""A generation served while the memory holds positions written from outside the engine (embeddings, a direct
decode) by the host code about to complete them: what the host's record of those positions lets the attachment
reuse (:meth:`~ckpt_plugin.hosts.llama_cpp.attachment.patches.Attachment.generate` standing aside)."""

from __future__ import annotations

import numpy as np
from llama_cpp.llama import Llama

from ckpt_plugin.core.errors import OpaqueMemoryError
from ckpt_plugin.core.memory import common_prefix
from ckpt_plugin.engine.slot_controller import SlotController
from ckpt_plugin.hosts.llama_cpp.attachment.backend import HostRows
from ckpt_plugin.hosts.llama_cpp.attachment.outside_writes import UNNAMED, Watched
from ckpt_plugin.hosts.llama_cpp.seam import compat as host

__all__ = ["serve_outside_writes"]


def serve_outside_writes(
    llama: Llama, controller: SlotController, backend: HostRows, prompt: np.ndarray
) -> int | None:
    """Serve a generation of ``prompt`` (with the host's reset) while the memory holds positions written from
    outside by the host code about to complete them; return how many prompt tokens the host skips (it evaluates
    the others after the memory's end, without its reset), or ``None`` when the engine serves the prompt.

    The host alone, given exactly the tokens it holds, samples from the context's logits; otherwise it keeps
    what its record shares with the prompt and evaluates from there, or, where the memory cannot drop its last
    positions (recurrent, hybrid), empties it and evaluates its record again, stale ids in place of embeddings
    included. Here nothing is evaluated at positions whose content the ids do not name:

    - the prompt is what the memory holds (by the host's record) and the context holds the logits of its last
      position: sampled from them, nothing evaluated (0);
    - the prompt continues what the memory holds: only the tokens after it are evaluated (the memory's length);
    - the prompt reuses only positions whose token ids are known (the engine's own record, the ids decoded there
      from outside): the host's record is the truth there; it is recorded, the rest dropped, and the prompt is
      served like any other, evaluated in full where the memory cannot be cut (``None``);
    - an attention memory, which can drop positions: the host keeps the prefix its record shares with the prompt
      (embeddings included) and evaluates the rest, provided none of it is an embedding's position (0);
    - otherwise: refused, :class:`~ckpt_plugin.core.errors.OpaqueMemoryError`.
    """
    watched = getattr(backend, "watched", None)
    if watched is None:
        return 0  # nothing tells what the positions hold: as the host alone
    n_host, memory_end = int(llama.n_tokens), int(backend.pos_max()) + 1
    n = min(n_host, memory_end)
    record = np.asarray(llama.input_ids[:n], dtype=np.int64)
    common = common_prefix(record, prompt)
    if n_host == memory_end == common:
        if len(prompt) == common and watched.logits_end == memory_end:
            host.set_logits_current(llama, True)
            return 0
        if len(prompt) > common:
            return common
    reuse = min(common, len(prompt) - 1)  # the host evaluates at least the last prompt token
    truth = _record_truth(controller, record, watched)
    named = int(np.argmin(truth == 1)) if not bool((truth == 1).all()) else n
    if reuse <= named:
        slot = controller.slot
        if named > slot.n_tokens:
            controller.record_evaluated(record[slot.n_tokens : named].astype(np.int32))
        return None
    if (not controller.kind.recurrent and controller.window_serves(reuse)
            and not bool((truth[:reuse] < 0).any()) and (reuse == common or truth[reuse] == 1)):
        llama.n_tokens = n
        host.set_logits_current(llama, False)
        return 0
    raise OpaqueMemoryError(
        "the prompt names positions written outside the engine (embeddings or a direct decode) by the host's "
        "record of them, and serving it would evaluate those ids in place of what the memory holds there")


def _record_truth(controller: SlotController, record: np.ndarray, watched: Watched) -> np.ndarray:
    """Per position of the host's ``record``: 1 where the memory holds that token, 0 where what it holds is
    unknown (embeddings, a copy, a write not seen), -1 where it holds another token."""
    slot = controller.slot
    k = min(slot.n_tokens, len(record))
    held = np.concatenate((slot.tokens[:k].astype(np.int64), watched.names(k, len(record))))
    return np.where(held == record, 1, np.where(held == UNNAMED, 0, -1))
