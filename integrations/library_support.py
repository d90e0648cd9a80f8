"""What the library helpers share: importing the library with an install hint, finding the ``Llama`` a library
object holds, attaching it (or taking the manager auto-attach already gave it), and the constructor arguments that
make prefix reuse pay."""

from __future__ import annotations

import importlib
import logging
from types import ModuleType
from typing import Any, Callable

from llama_cpp import Llama

import ckpt_plugin
from ckpt_plugin import CheckpointManager

log = logging.getLogger("ckpt_plugin.integrations")

DEFAULT_N_CTX = 4096
"""Context length the helpers ask for: room for a multi-turn chat (LangChain's default, 512, is not)."""

DEFAULT_N_BATCH = 512
"""Prompt tokens evaluated per llama.cpp batch (llama-cpp-python's default; LangChain's 8 is ~10x slower)."""


def require(module: str, extra: str) -> ModuleType:
    """Import ``module``, or say which ckpt_plugin extra installs it.

    :raises ImportError: With ``pip install ckpt_plugin[extra]`` in the message.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(f"{module} is not installed: pip install 'ckpt_plugin[{extra}]' ({exc})") from exc


class HeldLlama:
    """Where a library object keeps its ``llama_cpp.Llama``, and attach/detach through it.

    :param attribute: The attribute holding the ``Llama`` (``client`` for LangChain, ...).
    :param what: What the object is, for the error when it holds none.
    """

    def __init__(self, attribute: str, what: str) -> None:
        self.attribute = attribute
        self.what = what

    def llama_of(self, owner: Any) -> Llama:
        """The ``llama_cpp.Llama`` that ``owner`` holds.

        :raises TypeError: ``owner`` holds none there.
        """
        llama = getattr(owner, self.attribute, None)
        if not isinstance(llama, Llama):
            raise TypeError(
                f"expected {self.what} holding a llama_cpp.Llama in .{self.attribute}, got {type(owner).__name__}"
            )
        return llama

    def attach(self, owner: Any, **settings: Any) -> CheckpointManager:
        """Attach the ``Llama`` ``owner`` holds (``settings`` as for :func:`ckpt_plugin.attach`); return its manager.

        Under ``ckpt-run`` the ``Llama`` is attached already: its manager is returned.
        """
        return attach_llama(self.llama_of(owner), **settings)

    def detach(self, owner: Any) -> CheckpointManager:
        """``ckpt_plugin.detach`` the ``Llama`` ``owner`` holds: its own behaviour again; returns the closed manager."""
        return ckpt_plugin.detach(self.llama_of(owner))

    def functions(self) -> tuple[Callable[[Any], Llama], Callable[..., CheckpointManager], Callable[[Any], Any]]:
        """``(llama_of, attach, detach)`` for a helper module's namespace."""
        return self.llama_of, self.attach, self.detach


def attach_llama(llama: Llama, **settings: Any) -> CheckpointManager:
    """``ckpt_plugin.attach(llama, **settings)``, or the manager ``llama`` already has (auto-attach, ckpt-run).

    Settings cannot change on an attached ``Llama``: if some are given then, they are ignored with a warning.
    """
    manager = ckpt_plugin.manager_of(llama)
    if manager is None:
        return ckpt_plugin.attach(llama, **settings)
    if settings:
        log.warning("this Llama is already attached (ckpt-run or CKPT_AUTO_ATTACH?): ignoring %s", sorted(settings))
    return manager


def llama_kwargs(n_ctx: int = DEFAULT_N_CTX, n_batch: int = DEFAULT_N_BATCH, swa_full: bool = False) -> dict[str, Any]:
    """``llama_cpp.Llama`` arguments for prefix reuse (``docs/integrations/settings.md``).

    ``swa_full=False`` keeps only the sliding window of Gemma-3-like models in memory (llama.cpp's default keeps the
    whole context): correct with checkpoints, which restore the window llama-cpp-python alone would have lost.
    Models without a sliding window ignore it.
    """
    if n_ctx < 0 or n_batch < 1:
        raise ValueError(f"n_ctx must be >= 0 and n_batch >= 1, got n_ctx={n_ctx}, n_batch={n_batch}")
    return {"n_ctx": n_ctx, "n_batch": n_batch, "swa_full": swa_full}
