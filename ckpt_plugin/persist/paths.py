"""Entry file names: client-supplied names confined to a directory, listing, stale temporary files."""

from __future__ import annotations
import os
import time
from pathlib import Path
from typing import Iterator
from ckpt_plugin.core.errors import UnsafePathError

from ckpt_plugin.persist.layout import SAFE_NAME, TEMP_PREFIX

__all__ = ["iter_entry_files", "remove_stale_temp_files", "safe_path"]

def safe_path(directory: str | os.PathLike[str], filename: str) -> Path:
    """Confine a client-supplied ``filename`` to ``directory``; return ``directory / filename``.

    Only a plain name of ``[A-Za-z0-9._-]`` (1 to 255 characters, not starting with ``.``) is accepted: no absolute
    path, separator, ``..``, NUL or hidden name (temporary files are hidden names). If the name exists as a symlink,
    its real path must still lie inside the directory's real path.

    The check cannot stop a symlink created afterwards by someone with write access to the directory; keep the
    directory writable by the server only.

    :raises UnsafePathError: The name is refused.
    """
    if not isinstance(filename, str):
        raise UnsafePathError(f"file name must be a string, got {type(filename).__name__}")
    if not SAFE_NAME.fullmatch(filename):
        shown = filename if len(filename) <= 80 else filename[:80] + "..."
        raise UnsafePathError(
            f"refusing file name {shown!r}: only a plain name of letters, digits, '.', '_' and '-' "
            f"(1 to 255 characters, not starting with '.') is allowed"
        )
    base = Path(directory)
    candidate = base / filename
    real_directory = Path(os.path.realpath(base))
    real = Path(os.path.realpath(candidate))
    if real == real_directory or not real.is_relative_to(real_directory):
        raise UnsafePathError(
            f"refusing file name {filename!r}: it resolves to {str(real)!r}, outside {str(real_directory)!r}"
        )
    return candidate


def iter_entry_files(directory: str | os.PathLike[str]) -> Iterator[Path]:
    """Regular files of ``directory`` whose names :func:`safe_path` accepts (temporary files of writes are skipped)."""
    with os.scandir(directory) as entries:
        for item in entries:
            if SAFE_NAME.fullmatch(item.name) and item.is_file(follow_symlinks=False):
                yield Path(directory) / item.name


def remove_stale_temp_files(directory: str | os.PathLike[str], *, min_age_seconds: float = 3600.0) -> list[Path]:
    """Delete temporary files left by writes that crashed, if older than ``min_age_seconds``; return them.

    Younger ones may belong to a write in progress (in this or another process) and are kept.
    """
    removed = []
    now = time.time()
    with os.scandir(directory) as entries:
        for item in entries:
            if not (item.name.startswith(TEMP_PREFIX) and item.name.endswith(".tmp")):
                continue
            try:
                if not item.is_file(follow_symlinks=False):
                    continue
                if now - item.stat(follow_symlinks=False).st_mtime < min_age_seconds:
                    continue
                os.unlink(item.path)
            except FileNotFoundError:
                continue
            removed.append(Path(directory) / item.name)
    return removed
