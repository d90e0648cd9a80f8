"""The import path earlier releases documented for ``CheckpointMiddleware``: :mod:`ckpt_plugin.http.middleware`."""

from ckpt_plugin.http import middleware as _home
from ckpt_plugin.http.middleware import CheckpointMiddleware

# The names its home exports, no more (the home module is the one list of them).
__all__ = list(_home.__all__)
