"""What one prompt-cache entry of a loaded model needs at least, read from its GGUF metadata before any state exists.

A byte budget smaller than one entry does not fail: every entry is refused and nothing is ever reused, which reads
as a slow server. ckpt-serve compares its budget with :func:`entry_floor_bytes` at start and refuses one that
cannot hold a single entry.
"""

from __future__ import annotations

from typing import Any

import llama_cpp

__all__ = ["entry_floor_bytes"]

# Bytes per element of the KV cache types a context may use (llama.cpp's ggml types); a quantized type not listed
# counts as half a byte, the smallest there is, so that the floor stays a lower bound.
_TYPE_BYTES = {
    getattr(llama_cpp, f"GGML_TYPE_{name}"): size
    for name, size in (("F32", 4.0), ("F16", 2.0), ("BF16", 2.0), ("Q8_0", 1.0625))
    if hasattr(llama_cpp, f"GGML_TYPE_{name}")  # bindings of some versions lack a name
}


def _number(metadata: dict[str, str], key: str) -> int | None:
    try:
        return int(metadata[key])
    except (KeyError, ValueError):  # absent, or an array (per-layer counts) llama-cpp-python writes as text
        return None


def kv_bytes_per_token(llama: Any) -> float:
    """KV cache bytes one token takes in ``llama``'s context over all its layers; 0 for a model whose metadata
    names no attention heads (recurrent models: their state does not grow with the tokens)."""
    metadata = dict(getattr(llama, "metadata", None) or {})
    arch = metadata.get("general.architecture", "")
    n_layer = _number(metadata, f"{arch}.block_count")
    n_head = _number(metadata, f"{arch}.attention.head_count")
    n_head_kv = _number(metadata, f"{arch}.attention.head_count_kv") or n_head
    if not n_layer or not n_head or not n_head_kv:
        return 0.0
    n_embd = _number(metadata, f"{arch}.embedding_length") or 0
    key = _number(metadata, f"{arch}.attention.key_length") or n_embd // n_head
    value = _number(metadata, f"{arch}.attention.value_length") or n_embd // n_head
    params = llama.context_params
    k_bytes = _TYPE_BYTES.get(int(params.type_k), 0.5)
    v_bytes = _TYPE_BYTES.get(int(params.type_v), 0.5)
    return float(n_layer * n_head_kv * (key * k_bytes + value * v_bytes))


def entry_floor_bytes(llama: Any, n_tokens: int) -> int:
    """A lower bound of the bytes of one prompt-cache entry of ``n_tokens`` tokens (the smallest the cache keeps,
    ``cache_min_tokens``): their KV cache; 0 where the metadata does not tell."""
    return int(kv_bytes_per_token(llama) * n_tokens)
