"""The one wrapper of ``Llama.__init__``, and what turns it on at interpreter start.

Run at interpreter start (the installed ``.pth`` file, or ckpt-run's ``sitecustomize``) when ``CKPT_AUTO_ATTACH``
is set, :func:`start` registers an import hook that wraps ``Llama.__init__`` as soon as ``llama_cpp`` is imported.
This module imports nothing heavy, and neither does the hook: ckpt_plugin is imported (and the settings read) when
the first ``Llama`` is created, because ``llama_cpp`` is often imported by ckpt_plugin itself, half-way through
its own import. A process that never creates a ``Llama`` pays for ``wrapt`` only.
"""

from __future__ import annotations

import os
import sys
import threading
from types import ModuleType
from typing import Any, Callable

_TRUE = ("1", "true", "yes", "on", "t", "y")
_started = False
_wrapped = False
_wrap_lock = threading.Lock()


def enabled(environ: "os._Environ[str] | dict[str, str]" = os.environ) -> bool:
    """Whether ``CKPT_AUTO_ATTACH`` asks for auto-attach (1, true, yes or on)."""
    return environ.get("CKPT_AUTO_ATTACH", "").strip().lower() in _TRUE


def start() -> None:
    """Wrap ``Llama.__init__`` when ``llama_cpp`` is imported, if ``CKPT_AUTO_ATTACH`` is set (once per process)."""
    global _started
    if _started or not enabled():
        return
    _started = True
    import wrapt

    # On the package, not llama_cpp.llama: the hook must run once llama_cpp's __init__ has finished.
    wrapt.register_post_import_hook(wrap_llama_init, "llama_cpp")


def start_quietly() -> None:
    """:func:`start`, reporting a failure on stderr instead of raising (interpreter start must not fail)."""
    try:
        start()
    except Exception as exc:  # noqa: BLE001
        print(f"ckpt_plugin: auto-attach is off: {exc}", file=sys.stderr)


def wrap_llama_init(llama_cpp: ModuleType) -> None:
    """Wrap ``llama_cpp.Llama.__init__`` with :func:`_init` (once per process)."""
    global _wrapped
    with _wrap_lock:
        if _wrapped:
            return
        import wrapt

        wrapt.wrap_function_wrapper(llama_cpp.llama, "Llama.__init__", _init)
        _wrapped = True


def _init(wrapped: Callable[..., None], instance: Any, args: tuple, kwargs: dict) -> None:
    from .attacher import construct

    construct(wrapped, instance, args, kwargs)
