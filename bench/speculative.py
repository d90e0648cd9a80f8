"""Speculative decoding: tokens/s and acceptance with and without restoring the draft's state from checkpoints.

Gemma-3-270M serves as its own draft (same vocabulary). A branching session (a long prompt, a second conversation,
then follow-ups and edits of the first) runs three ways on fresh contexts, side by side in one run:

- ``no speculation``: the attached target alone;
- ``draft, state not restored``: a draft model whose context re-processes what it lacks after a target restore
  (what llama-cpp-python's own path would do);
- ``draft, state restored``: the draft's state stored with every checkpoint and restored with the target.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from _common import GEMMA_VOCAB, Report, cli, emit, fmt_ratio, open_gemma, random_prompt

N_GENERATE = 24


def session(rng: np.random.Generator, n_prompt: int) -> list[list[int]]:
    # A prompt that repeats itself gives the draft something to agree on, as code and chat histories do.
    body = random_prompt(rng, n_prompt // 2, GEMMA_VOCAB, bos=2)
    first = body + body[1:]
    other = random_prompt(rng, n_prompt, GEMMA_VOCAB, bos=2)
    cut = int(len(first) * 0.6)
    return [first, other, first + body[1:9], other + body[1:9], first[:cut] + body[1:9], first + body[1:17]]


def run_config(name: str, prompts: list[list[int]]) -> dict[str, Any]:
    import ckpt_plugin
    from ckpt_plugin.hosts.llama_cpp.speculative.drafts import enable_speculative

    target = open_gemma(n_ctx=2048, logits_all=name != "no speculation")
    manager = ckpt_plugin.attach(target, load_entrypoints=False)
    draft = None
    if name != "no speculation":
        draft = enable_speculative(target, manager, open_gemma(n_ctx=2048), n_draft=4,
                                   store_draft_state=name == "draft, state restored")
    request_seconds, decode_seconds = [], 0.0
    for prompt in prompts:
        started = time.perf_counter()
        first = None
        for i, _ in enumerate(target.generate(prompt, temp=0.0, top_k=1, repeat_penalty=1.0)):
            if i == 0:
                first = time.perf_counter()
            if i + 1 == N_GENERATE:
                break
        done = time.perf_counter()
        request_seconds.append(done - started)
        decode_seconds += done - (first or done)
    result = {
        "tokens_per_second": len(prompts) * (N_GENERATE - 1) / decode_seconds,
        "request_tokens_per_second": len(prompts) * N_GENERATE / sum(request_seconds),
        "seconds": request_seconds,
        "acceptance": draft.acceptance if draft is not None else float("nan"),
        "draft_evaluated": draft.manager.counters.tokens_evaluated if draft is not None else 0,
        "target_evaluated": manager.counters.tokens_evaluated,
    }
    target.close()
    return result


def run(quick: bool = False) -> Report:
    rng = np.random.default_rng(11)
    prompts = session(rng, 400 if quick else 1000)
    configs = ["no speculation", "draft, state not restored", "draft, state restored"]
    results = {name: run_config(name, prompts) for name in configs}
    report = Report("Speculative decoding")
    report.text(f"Gemma-3-270M Q4_K_M as target and as its own draft (4 tokens per step), n_ctx 2048, 2 threads; "
                f"{len(prompts)} requests of a branching session (prompts of {len(prompts[0])} tokens), "
                f"{N_GENERATE} tokens generated each, greedy. Command: `.venv/bin/python bench/speculative.py`.")
    report.table(
        ["configuration", "decode tokens/s", "tokens/s incl. prompt", "acceptance", "draft tokens evaluated",
         "target tokens evaluated"],
        [[name, f"{r['tokens_per_second']:.1f}", f"{r['request_tokens_per_second']:.1f}",
          "-" if np.isnan(r["acceptance"]) else f"{r['acceptance']:.2f}", r["draft_evaluated"],
          r["target_evaluated"]] for name, r in results.items()],
    )
    restored, not_restored = results["draft, state restored"], results["draft, state not restored"]
    report.figure("speculative tokens/s incl. prompt: draft state restored / not restored",
                  fmt_ratio(restored["request_tokens_per_second"] / not_restored["request_tokens_per_second"]))
    report.figure("draft tokens evaluated: restored / not restored",
                  fmt_ratio(restored["draft_evaluated"] / max(1, not_restored["draft_evaluated"])))
    return report


if __name__ == "__main__":
    args = cli(__doc__).parse_args()
    emit(run(quick=args.quick), args.json)
