"""Auto-attach: every ``llama_cpp.Llama`` a program creates gets checkpoints, with no change to the program.

- ``ckpt-run [options] -- python app.py`` (or ``python -m ckpt_plugin_integrations.auto_attach``) runs a program so;
- ``CKPT_AUTO_ATTACH=1`` in the environment does the same for any Python started in this environment (through the
  ``ckpt_plugin_autoattach.pth`` file installed with the package);
- :func:`install` / :func:`uninstall` do it from inside a program, :func:`managers` lists what was attached.

See ``docs/ckpt-run.md``. This package's ``__init__`` imports nothing heavy: interpreter start imports it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["AutoAttacher", "current", "install", "managers", "uninstall"]


def __getattr__(name: str) -> Any:
    # The attacher imports llama_cpp and ckpt_plugin; startup must not.
    if name in __all__:
        from ckpt_plugin_integrations.auto_attach import attacher

        return getattr(attacher, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
