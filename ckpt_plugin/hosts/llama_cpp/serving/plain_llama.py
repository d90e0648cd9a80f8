"""A plain ``llama_cpp.Llama``, as a host built on this package opens one, and the count of the tokens one that is not
attached evaluates: the baseline the demo and the benchmarks compare with."""

from __future__ import annotations

from typing import Any, Callable, Sequence

from llama_cpp.llama import Llama

__all__ = ["count_evaluated_tokens", "open_llama"]


def open_llama(model_path: str, **kwargs: Any) -> Llama:
    """Create a ``llama_cpp.Llama`` (``verbose=False`` unless given), for hosts built on this package."""
    kwargs.setdefault("verbose", False)
    return Llama(model_path=model_path, **kwargs)


def count_evaluated_tokens(llama: Llama) -> Callable[[], int]:
    """Count the tokens an unattached ``llama`` evaluates (wraps its ``eval``); return a reader of the count."""
    evaluated = [0]
    inner = llama.eval

    def counting_eval(tokens: Sequence[int]) -> None:
        evaluated[0] += len(tokens)
        inner(tokens)

    llama.eval = counting_eval
    return lambda: evaluated[0]
