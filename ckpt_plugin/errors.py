"""Exceptions raised by ckpt_plugin."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """Base class of every ckpt_plugin error."""


class UnsupportedHostError(CheckpointError):
    """The object or the llama-cpp-python version cannot be attached to; nothing was patched."""


class IncompatibleStateError(CheckpointError):
    """A checkpoint, entry or state belongs to another model or context and was refused."""


class PluginError(CheckpointError):
    """A plugin's hook implementation raised; the slot is left consistent.

    :ivar plugin: The name the plugin was registered under.
    :ivar hook: The hook name.
    """

    def __init__(self, plugin: str, hook: str, exc: BaseException) -> None:
        super().__init__(f"plugin {plugin!r} failed in hook {hook!r}: {type(exc).__name__}: {exc}")
        self.plugin = plugin
        self.hook = hook
