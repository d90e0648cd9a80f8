"""The import path earlier releases documented for ``CheckpointMiddleware``: :mod:`ckpt_plugin.http.middleware`."""

from ckpt_plugin.http.middleware import *  # noqa: F401,F403
