"""The import path earlier releases documented for the hook specifications, ``hookspec`` and ``hookimpl``: :mod:`ckpt_plugin.plugins.hookspecs`."""

from ckpt_plugin.plugins.hookspecs import *  # noqa: F401,F403
