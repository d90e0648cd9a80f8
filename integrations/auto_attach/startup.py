"""What turns auto-attach on at interpreter start (the wrapper of ``Llama.__init__`` itself: :mod:`.llama_hook`).

Run at interpreter start (the installed ``.pth`` file, or ckpt-run's ``sitecustomize``) when ``CKPT_AUTO_ATTACH``
is set, :func:`start` registers an import hook that wraps ``Llama.__init__`` as soon as ``llama_cpp`` is imported.
This module imports nothing heavy, and neither does the hook: ckpt_plugin is imported (and the settings read) when
the first ``Llama`` is created, because ``llama_cpp`` is often imported by ckpt_plugin itself, half-way through
its own import. A process that never creates a ``Llama`` pays for ``wrapt`` only.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any, Callable

from ckpt_plugin_integrations.auto_attach.llama_hook import enabled, wrap_llama_init

__all__ = ["enabled", "start", "start_quietly"]

_started = False


def start() -> None:
    """Wrap ``Llama.__init__`` when ``llama_cpp`` is imported, if ``CKPT_AUTO_ATTACH`` is set (once per process)."""
    global _started
    if _started or not enabled():
        return
    _started = True
    import wrapt

    # On the package, not llama_cpp.llama: the hook must run once llama_cpp's __init__ has finished.
    wrapt.register_post_import_hook(_wrap_on_import, "llama_cpp")


def start_quietly() -> None:
    """:func:`start`, reporting a failure on stderr instead of raising (interpreter start must not fail)."""
    try:
        start()
    except Exception as exc:  # noqa: BLE001
        print(f"ckpt_plugin: auto-attach is off: {exc}", file=sys.stderr)


def _construct_lazily(wrapped: Callable[..., None], instance: Any, args: tuple, kwargs: dict) -> None:
    # ckpt_plugin is imported with the first Llama, not when llama_cpp is: ckpt_plugin imports llama_cpp itself.
    from ckpt_plugin_integrations.auto_attach.attacher import construct

    construct(wrapped, instance, args, kwargs)


def _wrap_on_import(llama_cpp: ModuleType) -> None:
    wrap_llama_init(llama_cpp, _construct_lazily)
