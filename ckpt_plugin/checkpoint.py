"""The import path earlier releases documented for checkpoints, extra-state names and state buffers: :mod:`ckpt_plugin.core.checkpoint`."""

from ckpt_plugin.core.checkpoint import *  # noqa: F401,F403
