"""The import path earlier releases documented for the settings: :mod:`ckpt_plugin.core.config`."""

from ckpt_plugin.core.config import *  # noqa: F401,F403
