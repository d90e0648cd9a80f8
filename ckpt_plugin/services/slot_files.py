"""Slot files: the live slot written to and read from a file (llama.cpp server's ``/slots/{id}?action=save``).

The file holds the tokens, the full state, the checkpoints and their extra states (a draft model's, a speculative
decoder's, any plugin's) in the project's format (:mod:`ckpt_plugin.persist`), with the saving caller's namespace.
Each operation holds the slot's lock for its whole length: no request can use the slot meanwhile.

A restore reads the file once into state buffers of the manager's pool and validates those bytes; the file is never
mapped, so a slot file truncated or rewritten while (or after) it is restored cannot fault the server (``SIGBUS``).
A file that fails validation is refused and counted (``corrupt_slot_files``, part of ``corrupt_files`` in
``manager.stats()`` and ``ckpt_corrupt_files_total``).
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

from ckpt_plugin.core.errors import (
    CorruptFileError,
    EmptySlotError,
    ForeignNamespaceError,
    IncompatibleStateError,
    StateRestoreError,
)
from ckpt_plugin.persist.read import read_entry
from ckpt_plugin.persist.write import write_entry

if TYPE_CHECKING:
    from ckpt_plugin.plugins.view import SlotView

__all__ = ["erase_slot", "restore_slot", "save_slot"]


def save_slot(controller: SlotView, path: str | os.PathLike[str], namespace: str | None = None) -> dict[str, Any]:
    """Write the slot (tokens, full state, checkpoints, extra states) to ``path`` atomically.

    :param namespace: The caller's namespace (the manager's own by default); the file records it.
    :raises EmptySlotError: The slot holds nothing of ``namespace`` (another tenant's state is never saved).
    :return: ``{"n_saved": tokens, "n_written": bytes, "save_ms": ...}``.
    """
    started = time.perf_counter()
    namespace = namespace or controller.settings.namespace
    with controller.lock:
        controller.reconcile()
        if controller.slot.namespace != namespace or controller.slot.n_tokens == 0:
            raise EmptySlotError("the slot holds no state of this caller to save")
        entry = controller.save()
        written = write_entry(path, entry, model_fingerprint=controller.fingerprint)
    return {"n_saved": entry.n_tokens, "n_written": written, "save_ms": (time.perf_counter() - started) * 1e3}


def restore_slot(controller: SlotView, path: str | os.PathLike[str],
                 namespace: str | None = None) -> dict[str, Any]:
    """Restore the slot from a slot file; a file that is corrupt, made for another model or context, or saved by
    another namespace is refused and the slot stays exactly as it was.

    :param namespace: The caller's namespace (the manager's own by default); it must be the file's.
    :return: ``{"n_restored": tokens, "n_read": bytes, "restore_ms": ...}``.
    """
    started = time.perf_counter()
    namespace = namespace or controller.settings.namespace
    try:
        # The cache's pool: the restored buffers are pinned against its budget and recycled within it.
        entry = read_entry(path, expected_fingerprint=controller.fingerprint, pool=controller.store.ram.pool)
    except CorruptFileError:
        controller.counters.add(corrupt_slot_files=1)
        raise
    if entry.namespace != namespace:
        raise ForeignNamespaceError("the slot file was saved by another namespace")
    with controller.lock:
        controller.reconcile()
        # Another tenant's live state is parked in its own partition, never handed over.
        controller.enter_namespace(namespace)
        previous = controller.save() if controller.slot.n_tokens else None
        try:
            controller.load(entry)
        except (IncompatibleStateError, StateRestoreError):
            if previous is not None:
                controller.load(previous)
            raise
    n_read = sum(int(b.nbytes) for b in {id(b): b for b in entry.buffers()}.values())
    return {"n_restored": entry.n_tokens, "n_read": n_read, "restore_ms": (time.perf_counter() - started) * 1e3}


def erase_slot(controller: SlotView, namespace: str | None = None) -> dict[str, Any]:
    """Empty the slot (memory and checkpoints) if it holds ``namespace``'s state; the prompt cache keeps its entries.
    Another namespace's live state is left alone (``n_erased`` 0)."""
    namespace = namespace or controller.settings.namespace
    with controller.lock:
        if controller.slot.namespace != namespace:
            return {"n_erased": 0}
        controller.reconcile()
        n_erased = controller.slot.n_tokens
        controller.clear_slot()
    return {"n_erased": n_erased}
