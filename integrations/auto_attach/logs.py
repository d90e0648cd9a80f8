"""ckpt_plugin's log records on stderr for ``ckpt-run --log-level`` (a program's own logging is left alone)."""

from __future__ import annotations

import logging

_HANDLER_NAME = "ckpt_plugin.auto_attach.stderr"


def show_logs(level: str | None) -> None:
    """Print records of the ``ckpt_plugin`` loggers at ``level`` and above to stderr (``None``: change nothing)."""
    if level is None:
        return
    logger = logging.getLogger("ckpt_plugin")
    logger.setLevel(level.upper())
    if any(handler.get_name() == _HANDLER_NAME for handler in logger.handlers):
        return
    handler = logging.StreamHandler()
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(logging.Formatter("ckpt_plugin %(levelname)s %(name)s: %(message)s"))
    logger.addHandler(handler)
