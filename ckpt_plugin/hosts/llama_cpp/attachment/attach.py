"""Attaching an engine to one ``llama_cpp.Llama``: :func:`attach` installs the patched methods of an
:class:`~ckpt_plugin.hosts.llama_cpp.attachment.patches.Attachment` (what each does: that module), :func:`detach`
removes them, :func:`manager_of` finds the manager of an attached ``Llama``.
"""

from __future__ import annotations

from typing import Any

import llama_cpp
from llama_cpp.llama import Llama

from ckpt_plugin.core.config import CheckpointSettings
from ckpt_plugin.core.errors import UnsupportedHostError
from ckpt_plugin.engine.manager import CheckpointManager
from ckpt_plugin.hosts.llama_cpp.attachment.backend import LlamaBackend
from ckpt_plugin.hosts.llama_cpp.attachment.patches import Attachment, attachment_of
from ckpt_plugin.hosts.llama_cpp.seam import compat as host
from ckpt_plugin.hosts.llama_cpp.seam.context import version_tuple
from ckpt_plugin.tiers.disk import DiskTier
from ckpt_plugin.tiers.ram import PromptCache

__all__ = ["TESTED_VERSIONS", "attach", "detach", "manager_of"]

TESTED_VERSIONS = ((0, 3, 36), (0, 4, 0))
"""llama-cpp-python versions attach accepts: from the first (inclusive) to the second (exclusive)."""


def attach(
    llama: Llama,
    settings: CheckpointSettings | None = None,
    *,
    cache: PromptCache | None = None,
    disk: DiskTier | None = None,
    **overrides: Any,
) -> CheckpointManager:
    """Give ``llama`` shared checkpoints and a prefix-indexed prompt cache; return its manager.

    :param llama: A ``llama_cpp.Llama`` created by the host.
    :param settings: :class:`~ckpt_plugin.core.config.CheckpointSettings`; keyword arguments override fields.
    :param cache: A :class:`~ckpt_plugin.tiers.ram.PromptCache` shared with other managers of the same model.
    :param disk: A :class:`~ckpt_plugin.tiers.disk.DiskTier` shared likewise.
    :raises UnsupportedHostError: ``llama`` is not a ``Llama``, is already attached, serves embeddings, has no
        context (``vocab_only=True``, or closed), or llama-cpp-python is outside the tested versions; nothing is
        patched then.
    """
    if not isinstance(llama, Llama):
        raise UnsupportedHostError(f"attach() needs a llama_cpp.Llama, got {type(llama).__name__}")
    version = version_tuple(getattr(llama_cpp, "__version__", "0"))
    low, high = TESTED_VERSIONS
    if not (low <= version < high):
        raise UnsupportedHostError(
            f"llama-cpp-python {llama_cpp.__version__} is outside the tested range "
            f"{'.'.join(map(str, low))} to {'.'.join(map(str, high))} (exclusive)"
        )
    if attachment_of(llama) is not None:
        raise UnsupportedHostError("this Llama is already attached; detach() it first")
    if llama.context_params.embeddings:
        raise UnsupportedHostError("embedding contexts have no generation state to checkpoint")
    if not host.has_context(llama) or llama_cpp.llama_get_memory(llama.ctx) is None:
        raise UnsupportedHostError("this Llama has no context memory (vocab_only, closed, or created without one)")
    backend = LlamaBackend(llama)
    manager = CheckpointManager(backend, settings, cache=cache, disk=disk, **overrides)
    attachment = Attachment(llama, manager, backend, manager.controllers[0])
    attachment.install()
    manager.hooks.call(manager.hooks.hook.on_attach)
    return manager


def detach(llama: Llama) -> CheckpointManager:
    """Undo :func:`attach`: restore ``llama``'s own methods and cache; return the (closed) manager."""
    attachment = attachment_of(llama)
    if attachment is None:
        raise UnsupportedHostError("this Llama is not attached")
    attachment.uninstall()
    attachment.manager.close()
    return attachment.manager


def manager_of(llama: Llama) -> CheckpointManager | None:
    """The manager attached to ``llama``, or ``None``."""
    attachment = attachment_of(llama)
    return attachment.manager if attachment is not None else None
