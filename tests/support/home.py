"""An empty home directory, as on a machine where ckpt_plugin was just installed."""

from __future__ import annotations

import contextlib
import pathlib
import shutil
import tempfile
from typing import Iterator

import pytest

FRESH_HOME_DIRECTORIES: dict[str, str] = {
    "XDG_CACHE_HOME": ".cache",
    "XDG_CONFIG_HOME": ".config",
    "XDG_DATA_HOME": ".local/share",
    "XDG_STATE_HOME": ".local/state",
    "PIP_CACHE_DIR": ".cache/pip",
}
"""The per-user directories a fresh home gives this process and its children (under ``HOME``, as their defaults
are), set explicitly so that variables pointing elsewhere on this machine do not leak a warm cache in."""


@contextlib.contextmanager
def fresh_machine_home() -> Iterator[pathlib.Path]:
    """An empty home directory for this process and its children while the block runs, removed after it.

    ``HOME`` and :data:`FRESH_HOME_DIRECTORIES` point into it, so whatever an earlier run left in ``~/.cache`` (the
    embedded model assembled, pip's wheels and downloads) is not found: the block runs as on a machine where
    ckpt_plugin was just installed. The machine's own configuration (``/etc``) still applies.
    """
    home = pathlib.Path(tempfile.mkdtemp(prefix="fresh-home-"))
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("HOME", str(home))
            for variable, directory in FRESH_HOME_DIRECTORIES.items():
                patch.setenv(variable, str(home / directory))
            yield home
    finally:
        # Not left to pytest's temporary directories: each holds a 270 MB model where a test assembled it.
        shutil.rmtree(home, ignore_errors=True)
