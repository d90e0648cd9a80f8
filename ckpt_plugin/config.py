"""The import path earlier releases documented for the settings: :mod:`ckpt_plugin.core.config`."""

from ckpt_plugin.core import config as _home
from ckpt_plugin.core.config import (
    CheckpointSettings,
    ServeSettings,
    check_redis_url,
    combination_error,
    parse_size,
    physical_memory_bytes,
    setting_variables,
    unknown_variables,
)

# The names its home exports, no more (the home module is the one list of them).
__all__ = list(_home.__all__)
