"""The one wrapper of ``Llama.__init__``: every ``Llama`` created afterwards goes through the constructor given last.

Light on purpose (imported at interpreter start by :mod:`.startup`): it imports neither ckpt_plugin nor llama_cpp.
Both ways of turning auto-attach on wrap through it: :func:`~.startup.start` (``CKPT_AUTO_ATTACH``, a constructor
that imports the attacher with the first ``Llama``) and :func:`~.attacher.install` (the attacher's own).
"""

from __future__ import annotations

import os
import threading
from types import ModuleType
from typing import Any, Callable

Construct = Callable[[Callable[..., None], Any, tuple, dict], None]
"""``construct(init, instance, args, kwargs)``: runs ``Llama.__init__`` (``init``) and attaches ``instance``."""

_TRUE = ("1", "true", "yes", "on", "t", "y")
_wrapped = False
_construct: Construct | None = None
_lock = threading.Lock()


def enabled(environ: "os._Environ[str] | dict[str, str]" = os.environ) -> bool:
    """Whether ``CKPT_AUTO_ATTACH`` asks for auto-attach (1, true, yes or on)."""
    return environ.get("CKPT_AUTO_ATTACH", "").strip().lower() in _TRUE


def wrap_llama_init(llama_cpp: ModuleType, construct: Construct) -> None:
    """Send every ``llama_cpp.Llama`` construction through ``construct`` (``Llama.__init__`` is wrapped once per
    process; a later call only replaces the constructor)."""
    global _wrapped, _construct
    with _lock:
        _construct = construct
        if _wrapped:
            return
        import wrapt

        wrapt.wrap_function_wrapper(llama_cpp.llama, "Llama.__init__", _init)
        _wrapped = True


def _init(wrapped: Callable[..., None], instance: Any, args: tuple, kwargs: dict) -> None:
    construct = _construct
    if construct is None:  # pragma: no cover - set before the wrapper is installed
        wrapped(*args, **kwargs)
        return
    construct(wrapped, instance, args, kwargs)
