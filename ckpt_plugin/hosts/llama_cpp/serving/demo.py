"""A short demonstration on the default model: a branching conversation with and without checkpoints.

Run with ``python -m ckpt_plugin.hosts.llama_cpp.serving.demo``. It prints, per request, the time and the prompt tokens
evaluated by a plain ``llama_cpp.Llama`` and by one with :func:`ckpt_plugin.attach`, on Gemma-3-270M with its sliding
window (``swa_full=False``), where llama-cpp-python alone cannot reuse a prefix after an edit.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable

import numpy as np

from ckpt_plugin.hosts.llama_cpp.serving.default_model import default_model_path
from ckpt_plugin.hosts.llama_cpp.attachment.attach import attach
from ckpt_plugin.hosts.llama_cpp.serving.plain_llama import count_evaluated_tokens, open_llama

__all__ = ["main"]


def requests(n_tokens: int, seed: int = 0) -> list[tuple[str, list[int]]]:
    rng = np.random.default_rng(seed)
    base = [2, *rng.integers(1000, 20000, n_tokens - 1).tolist()]
    new = lambda: rng.integers(1000, 20000, 3).tolist()  # noqa: E731
    edit_late, edit_early = int(n_tokens * 0.78), int(n_tokens * 0.43)
    return [
        ("first prompt", base),
        (f"edit at {edit_late}", base[:edit_late] + new()),
        ("back to the first", base),
        (f"edit at {edit_early}", base[:edit_early] + new()),
        ("back to the first", base),
    ]


def serve(llama: Any, prompt: list[int], evaluated: Callable[[], int]) -> tuple[float, int, str]:
    before = evaluated()
    started = time.perf_counter()
    out = llama.create_completion(prompt, max_tokens=4, temperature=0)
    return time.perf_counter() - started, evaluated() - before, out["choices"][0]["text"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF file (default: the embedded Gemma-3-270M)")
    parser.add_argument("--tokens", type=int, default=1400, help="length of the first prompt")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    path = args.model or str(default_model_path())
    options = dict(n_ctx=4096, n_batch=512, n_threads=args.threads, swa_full=False)

    plain = open_llama(path, **options)
    plain_evaluated = count_evaluated_tokens(plain)
    with_plugin = open_llama(path, **options)
    manager = attach(with_plugin)
    print(f"model: {path}  memory kind: {manager.kind.name}")
    print(f"{'request':<20} {'plain s':>8} {'plain tok':>10} {'ckpt s':>8} {'ckpt tok':>9}")
    for name, prompt in requests(args.tokens):
        t_plain, n_plain, _ = serve(plain, prompt, plain_evaluated)
        t_ckpt, n_ckpt, _ = serve(with_plugin, prompt, lambda: manager.counters.tokens_evaluated)
        print(f"{name:<20} {t_plain:8.2f} {n_plain:10d} {t_ckpt:8.2f} {n_ckpt:9d}")
    stats = manager.stats()
    print({k: stats[k] for k in ("cache_hits", "checkpoints_created", "checkpoints_restored", "resident_bytes",
                                 "referenced_bytes")})


if __name__ == "__main__":
    main()
