"""How the tests open a real ``llama_cpp.Llama`` on a tiny model (tests/conftest.py, ``make_llama``)."""

from __future__ import annotations

from typing import Any

# Small batches make the sliding window (32) and checkpoint spacing show on prompts of a few hundred tokens.
TINY_LLAMA_KWARGS: dict[str, Any] = dict(n_ctx=1024, n_batch=64, n_ubatch=64, n_threads=2, verbose=False, seed=0)
KIND_OPTIONS: dict[str, dict[str, Any]] = {
    "llama": {},
    "gemma3": {"swa_full": False},
    "gemma3-swa-full": {"swa_full": True},
    # ckpt-serve's default: flash attention (its kernel's rounding depends on how the cache was filled)
    "gemma3-flash": {"swa_full": False, "flash_attn": True},
    "mamba": {},
    "hybrid": {},
}


def model_file(kind: str) -> str:
    return kind.split("-")[0]
