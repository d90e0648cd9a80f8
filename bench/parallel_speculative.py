"""Speculative decoding with parallel slots: four concurrent generations on ``ParallelLlama(llama, 4)`` without a draft,
with a draft model per slot, and with prompt lookup decoding per slot, side by side in one run.

Gemma-3-270M serves as its own draft (the only model of its vocabulary here), so the draft costs as much as the target
and the figure to read is the machinery's: acceptance, drafting steps shared by the slots, and what a draft step costs
next to a target step. Prompts repeat themselves, as code and chat histories do, which gives both drafters something to
agree on. With C++ ``llama-server`` on ``PATH`` (``bash bench/build_llama_server.sh``), the same prompts (as token
ids) go to ``llama-server -np 4`` without and with ``-md --spec-type draft-simple`` (the same file as draft, 4
tokens a step, no minimum probability) through ``/completion``, four at a time; its decode speed is its own
``timings`` (tokens after the first over the time they took), its acceptance ``draft_n_accepted / draft_n``. Writes
``docs/bench-sections/46-parallel-speculative.md``.
"""

from __future__ import annotations

import pathlib
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

import httpx

from _common import GEMMA_VOCAB, Report, cli, emit, fmt_ratio, gemma_path, open_gemma, random_prompt
from chat_servers import Config, start

SLOTS = 4
SECTION = pathlib.Path(__file__).resolve().parent.parent / "docs" / "bench-sections" / "46-parallel-speculative.md"


def prompts(rng: np.random.Generator, n: int, n_prompt: int) -> list[list[int]]:
    out = []
    for _ in range(n):
        body = random_prompt(rng, n_prompt // 2, GEMMA_VOCAB, bos=2)
        out.append(body + body[1:])
    return out


def run_config(name: str, batch: list[list[int]], n_generate: int) -> dict[str, Any]:
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    from ckpt_plugin.hosts.llama_cpp.parallel.parallel_llama import ParallelLlama

    target = open_gemma(n_ctx=2048, draft_model=LlamaPromptLookupDecoding(num_pred_tokens=4)
                        if name == "prompt lookup per slot" else None)
    draft = open_gemma(n_ctx=2048) if name == "draft model per slot" else None
    parallel = ParallelLlama(target, SLOTS, draft=draft, n_draft=4, load_entrypoints=False)

    def one(prompt: list[int]) -> tuple[float, int]:
        view = parallel.view()
        started, n = time.perf_counter(), 0
        first = None
        for n, _ in enumerate(view.generate(prompt, temp=0.0, top_k=1, repeat_penalty=1.0), 1):
            if first is None:
                first = time.perf_counter()
            if n == n_generate:
                break
        view.close()
        return time.perf_counter() - (first or started), n - 1

    try:
        with ThreadPoolExecutor(SLOTS) as pool:
            list(pool.map(one, batch[:SLOTS]))  # warm-up: the prompts' first evaluation
            started = time.perf_counter()
            timed = list(pool.map(one, batch[SLOTS:]))
            wall = time.perf_counter() - started
        decode_tokens = sum(n for _, n in timed)
        drafts = parallel.drafts
        return {
            "decode_tokens_per_second": decode_tokens / sum(seconds for seconds, _ in timed) * SLOTS,
            "wall": wall,
            "acceptance": drafts.acceptance if drafts is not None else float("nan"),
            "draft_steps": drafts.lane.steps if drafts is not None else 0,
            "draft_shared_steps": drafts.lane.shared_steps if drafts is not None else 0,
            "target_steps": parallel.scheduler.steps,
        }
    finally:
        parallel.close()
        target.close()
        if draft is not None:
            draft.close()


def run_llama_server(binary: str, with_draft: bool, batch: list[list[int]], n_generate: int) -> dict[str, Any]:
    """``llama-server -np 4`` (with ``-md``: the same file as draft) on the same prompts, four at a time."""
    model = gemma_path()
    command = [binary, "-m", model, "-c", str(2048 * SLOTS), "-np", str(SLOTS), "-b", "512", "-ub", "512", "-t", "2",
               "-tb", "2", "--seed", "0"]
    if with_draft:
        command += ["-md", model, "--spec-type", "draft-simple", "--spec-draft-n-max", "4", "--spec-draft-n-min", "0",
                    "--spec-draft-p-min", "0", "-td", "2", "-tbd", "2"]
    label = f"llama-server -np {SLOTS}" + (" -md" if with_draft else "")
    with start(Config("ls", label, command, health="/health", llama_server=True)) as server:

        def one(prompt: list[int]) -> dict[str, Any]:
            body = {"prompt": prompt, "n_predict": n_generate, "temperature": 0, "top_k": 1, "repeat_penalty": 1.0,
                    "ignore_eos": True, "cache_prompt": True}
            response = httpx.post(f"{server.url}/completion", json=body, timeout=600)
            response.raise_for_status()
            return dict(response.json()["timings"])

        with ThreadPoolExecutor(SLOTS) as pool:
            list(pool.map(one, batch[:SLOTS]))
            started = time.perf_counter()
            timed = list(pool.map(one, batch[SLOTS:]))
            wall = time.perf_counter() - started
    # predicted_ms runs from the first generated token to the last: per slot, tokens after the first over that time.
    seconds = sum(t["predicted_ms"] / 1000 for t in timed)
    drafted = sum(int(t.get("draft_n", 0)) for t in timed)
    accepted = sum(int(t.get("draft_n_accepted", 0)) for t in timed)
    return {
        "decode_tokens_per_second": sum(int(t["predicted_n"]) - 1 for t in timed) / seconds * SLOTS,
        "wall": wall,
        "acceptance": accepted / drafted if drafted else float("nan"),
        "draft_steps": 0, "draft_shared_steps": 0, "target_steps": "-",
    }


def run(quick: bool = False) -> Report:
    rng = np.random.default_rng(5)
    n_generate = 32 if quick else 64
    batch = prompts(rng, 2 * SLOTS, 200 if quick else 400)
    configs = ["no draft", "draft model per slot", "prompt lookup per slot"]
    results = {name: run_config(name, batch, n_generate) for name in configs}
    binary = shutil.which("llama-server")
    if binary:
        results[f"llama-server -np {SLOTS}"] = run_llama_server(binary, False, batch, n_generate)
        results[f"llama-server -np {SLOTS} -md"] = run_llama_server(binary, True, batch, n_generate)
    report = Report("Speculative decoding with parallel slots")
    report.text(f"Gemma-3-270M Q4_K_M, `ParallelLlama(llama, {SLOTS})`, n_ctx 2048 per slot, 2 threads; {SLOTS} "
                f"concurrent greedy generations of {n_generate} tokens on self-repeating prompts of "
                f"{len(batch[0])} tokens, after a warm-up round; the draft model is Gemma-3-270M itself (4 tokens a "
                "step), prompt lookup is llama-cpp-python's `LlamaPromptLookupDecoding(num_pred_tokens=4)`, one per "
                "slot. Command: `.venv/bin/python bench/parallel_speculative.py`.")
    report.table(
        ["configuration", "decode tokens/s (all slots)", "wall", "acceptance", "draft steps (shared by slots)",
         "target steps"],
        [[name, f"{r['decode_tokens_per_second']:.1f}", f"{r['wall']:.2f} s",
          "-" if np.isnan(r["acceptance"]) else f"{r['acceptance']:.2f}",
          f"{r['draft_steps']} ({r['draft_shared_steps']})" if r["draft_steps"] else "-", r["target_steps"]]
         for name, r in results.items()],
    )
    report.text("With the target as its own draft, each drafting step costs what a target step costs, so a draft model cannot pay here (a draft several times smaller than its target is what speculative decoding needs); the run shows the draft kept in step (acceptance) and the slots' drafting steps batched together. Prompt lookup costs nothing to draft and pays on repetitive text." + (
        "" if binary else " Not run side by side: llama-server -np 4 -md (no `llama-server` on PATH)."))
    base = results["no draft"]["decode_tokens_per_second"]
    report.figure("decode tokens/s, draft model per slot / no draft",
                  fmt_ratio(results["draft model per slot"]["decode_tokens_per_second"] / base))
    report.figure("decode tokens/s, prompt lookup per slot / no draft",
                  fmt_ratio(results["prompt lookup per slot"]["decode_tokens_per_second"] / base))
    if binary:
        plain, drafted = results[f"llama-server -np {SLOTS}"], results[f"llama-server -np {SLOTS} -md"]
        report.figure("decode tokens/s, llama-server -np 4 -md / llama-server -np 4",
                      fmt_ratio(drafted["decode_tokens_per_second"] / plain["decode_tokens_per_second"]))
        report.figure("decode tokens/s with a draft model: ckpt_plugin per slot / llama-server -np 4 -md",
                      fmt_ratio(results["draft model per slot"]["decode_tokens_per_second"]
                                / drafted["decode_tokens_per_second"]))
    return report


if __name__ == "__main__":
    args = cli(__doc__).parse_args()
    result = run(quick=args.quick)
    emit(result, args.json)
    result.title += " (`bench/parallel_speculative.py`)"
    figures = "\n".join(f"- {figure.name}: {figure.value}" for figure in result.figures)
    SECTION.write_text(f"{result.markdown()}\n{figures}\n")
