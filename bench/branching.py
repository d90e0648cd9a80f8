"""Branching-agent benchmark: tokens evaluated per request against the ideal, with and without the plugin.

One 1,400-token prompt P, then requests that diverge and come back (4 greedy tokens each, through the host's own
``Llama.generate``):

1. P;  2. P[:1100] + 3 new tokens;  3. P again;  4. P[:600] + 3 new tokens;  5. P again.

A second workload, "shared system prompt": 4 new conversations, each a 1,000-token system prompt S plus 200 tokens
of its own, one after the other.

Ideal prompt tokens of a request: the prompt tokens after the longest prefix it shares with any state the context
held after an earlier request (prompt + the generated tokens that were evaluated), at least 1.

Configurations: Gemma-3-270M with ``swa_full=False`` (sliding window 512), and tiny generated models: llama (plain
attention), mamba (recurrent), hybrid (LFM2), gemma3 (sliding window 32). Each runs side by side, request by request:
WITH the plugin (``ckpt_plugin.attach``; counted by ``manager.counters.tokens_evaluated``), WITHOUT it (plain
llama-cpp-python; counted by wrapping ``llama.eval`` on the instance), and a FRESH reference (``reset()`` before each
request) whose answer each request is compared with. The three run one after the other in the same process (one
model context open at a time), the whole sequence repeated with the order rotated. Both counts are cross-checked
against the tokens actually passed to ``llama_decode``. Prompt tokens evaluated are the count at the first generated
token.

Run: ``.venv/bin/python bench/branching.py [--quick]``.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
from _common import (
    GEMMA_OPTIONS,
    GEMMA_VOCAB,
    TINY_OPTIONS,
    TINY_VOCAB,
    Report,
    cli,
    emit,
    fmt_ms,
    fmt_ratio,
    gemma_path,
    open_llama,
    random_prompt,
    random_tokens,
    ratio,
    tiny_path,
)

import ckpt_plugin
from ckpt_plugin.core.memory import common_prefix

PROMPT_TOKENS = 1400
N_GENERATE = 4
WITH, WITHOUT, FRESH = "with plugin", "without plugin", "fresh"


@dataclass(frozen=True)
class ModelConfig:
    name: str
    memory: str
    path: Callable[[], str]
    options: dict[str, Any]
    vocab: tuple[int, int]


CONFIGS = [
    ModelConfig("Gemma-3-270M Q4_K_M, swa_full=False", "SWA (window 512)", gemma_path, GEMMA_OPTIONS, GEMMA_VOCAB),
    ModelConfig("tiny llama", "plain", lambda: tiny_path("llama"), TINY_OPTIONS, TINY_VOCAB),
    ModelConfig("tiny mamba", "recurrent", lambda: tiny_path("mamba"), TINY_OPTIONS, TINY_VOCAB),
    ModelConfig("tiny hybrid (LFM2)", "hybrid", lambda: tiny_path("hybrid"), TINY_OPTIONS, TINY_VOCAB),
    ModelConfig("tiny gemma3, swa_full=False", "SWA (window 32)", lambda: tiny_path("gemma3"),
                {**TINY_OPTIONS, "swa_full": False}, TINY_VOCAB),
]


def branching_requests(bos: int, vocab: tuple[int, int], seed: int = 0) -> list[tuple[str, list[int]]]:
    rng = np.random.default_rng(seed)
    p = random_prompt(rng, PROMPT_TOKENS, vocab, bos)
    return [
        ("P (1,400)", p),
        ("P[:1100] + 3 new", p[:1100] + random_tokens(rng, 3, vocab)),
        ("back to P", p),
        ("P[:600] + 3 new", p[:600] + random_tokens(rng, 3, vocab)),
        ("back to P", p),
    ]


SYSTEM_TOKENS, CONVERSATION_TOKENS, N_CONVERSATIONS = 1000, 200, 4


def shared_system_requests(bos: int, vocab: tuple[int, int], seed: int = 1) -> list[tuple[str, list[int]]]:
    """New conversations on one system prompt, as an agent's sessions: each leaves the others at its end."""
    rng = np.random.default_rng(seed)
    system = random_prompt(rng, SYSTEM_TOKENS, vocab, bos)
    return [(f"S + conversation {i + 1}", system + random_tokens(rng, CONVERSATION_TOKENS, vocab))
            for i in range(N_CONVERSATIONS)]


WORKLOADS: dict[str, Callable[[int, tuple[int, int]], list[tuple[str, list[int]]]]] = {
    "branching": branching_requests,
    "shared system prompt": shared_system_requests,
}


def ideal_counts(prompts: list[list[int]], answers: list[list[int]]) -> list[int]:
    """Prompt tokens after the longest prefix shared with an earlier held state (at least 1)."""
    held: list[np.ndarray] = []
    ideal = []
    for prompt, answer in zip(prompts, answers, strict=False):
        array = np.asarray(prompt, dtype=np.int32)
        keep = max((min(common_prefix(h, array), len(prompt) - 1) for h in held), default=0)
        ideal.append(len(prompt) - keep)
        held.append(np.asarray(prompt + answer[:-1], dtype=np.int32))  # the last token is sampled, not evaluated
    return ideal


# ---------------------------------------------------------------------------------------------------------------------
# counting


class TokenCounter:
    """Counts tokens given to ``llama.eval`` and to ``llama_decode`` on one ``Llama`` instance."""

    def __init__(self, llama: Any, count_eval: bool) -> None:
        self.evaluated = 0
        self.decoded = 0
        if count_eval:
            inner_eval = llama.eval

            def eval_counting(tokens: Any) -> None:
                self.evaluated += len(tokens)
                inner_eval(tokens)

            llama.eval = eval_counting
        ctx = llama._ctx
        inner_decode = ctx.decode

        def decode_counting(batch: Any) -> None:
            self.decoded += int(batch.batch.n_tokens)
            inner_decode(batch)

        ctx.decode = decode_counting


@dataclass
class Served:
    answer: list[int]
    prompt_evaluated: int
    prompt_decoded: int
    seconds: float


@dataclass
class Runner:
    """One Llama serving the requests, with how its evaluated tokens are counted."""

    name: str
    llama: Any
    counter: TokenCounter
    evaluated: Callable[[], int]
    manager: ckpt_plugin.CheckpointManager | None = None
    reset_each: bool = False

    def serve(self, prompt: list[int]) -> Served:
        if self.reset_each:
            self.llama.reset()
        before, decoded_before = self.evaluated(), self.counter.decoded
        at_first: tuple[int, int] | None = None
        answer: list[int] = []
        started = time.perf_counter()
        for token in self.llama.generate(prompt, temp=0.0, top_k=1, repeat_penalty=1.0):
            if at_first is None:
                at_first = (self.evaluated(), self.counter.decoded)
            answer.append(int(token))
            if len(answer) == N_GENERATE:
                break
        seconds = time.perf_counter() - started
        assert at_first is not None
        return Served(answer, at_first[0] - before, at_first[1] - decoded_before, seconds)

    def close(self) -> None:
        if self.manager is not None:
            ckpt_plugin.detach(self.llama)
        self.llama.close()


def open_runner(name: str, cfg: ModelConfig) -> Runner:
    llama = open_llama(cfg.path(), **cfg.options)
    if name == WITH:
        manager = ckpt_plugin.attach(llama, load_entrypoints=False)
        return Runner(name, llama, TokenCounter(llama, count_eval=False),
                      lambda: manager.counters.tokens_evaluated, manager)
    counter = TokenCounter(llama, count_eval=True)
    return Runner(name, llama, counter, lambda: counter.evaluated, reset_each=name == FRESH)


# ---------------------------------------------------------------------------------------------------------------------
# running


@dataclass
class ConfigResult:
    cfg: ModelConfig
    labels: list[str]
    prompt_lengths: list[int]
    ideal: list[int]
    runs: list[dict[str, list[Served]]]  # one per repeat
    stats: dict[str, Any]

    def served(self, runner: str) -> list[Served]:
        return self.runs[0][runner]

    def evaluated(self, runner: str) -> list[int]:
        return [s.prompt_evaluated for s in self.served(runner)]

    def median_seconds(self, runner: str, i: int) -> float:
        return statistics.median(run[runner][i].seconds for run in self.runs)

    def counts_stable(self) -> bool:
        first = self.runs[0]
        return all(
            [s.prompt_evaluated for s in run[name]] == [s.prompt_evaluated for s in first[name]]
            for run in self.runs for name in (WITH, WITHOUT)
        )

    def equal_to_fresh(self, runner: str) -> list[bool]:
        return [a.answer == f.answer for a, f in zip(self.served(runner), self.served(FRESH), strict=False)]


def serve_all(name: str, cfg: ModelConfig, prompts: list[list[int]]) -> tuple[list[Served], dict[str, Any]]:
    """Serve every request on a new ``Llama`` of ``cfg`` (only one model context is open at a time: several
    Gemma contexts alive in one process slowed each other's evaluation down by up to 5x on this machine)."""
    runner = open_runner(name, cfg)
    try:
        served = [runner.serve(prompt) for prompt in prompts]
        return served, runner.manager.stats() if runner.manager is not None else {}
    finally:
        runner.close()


def run_once(cfg: ModelConfig, prompts: list[list[int]], order: list[str]) -> tuple[dict[str, list[Served]], dict]:
    served: dict[str, list[Served]] = {}
    stats: dict[str, Any] = {}
    for name in order:
        served[name], runner_stats = serve_all(name, cfg, prompts)
        stats.update(runner_stats)
    return served, stats


def bos_of(cfg: ModelConfig) -> int:
    llama = open_llama(cfg.path(), **{**cfg.options, "vocab_only": True})
    try:
        return int(llama.token_bos())
    finally:
        llama.close()


def run_config(cfg: ModelConfig, repeats: int, workload: str = "branching") -> ConfigResult:
    requests = WORKLOADS[workload](bos_of(cfg), cfg.vocab)
    prompts = [prompt for _, prompt in requests]
    names = [WITH, WITHOUT, FRESH]
    runs, stats = [], {}
    for i in range(repeats):
        order = names[i % 3:] + names[: i % 3]  # rotate which configuration runs first
        served, stats = run_once(cfg, prompts, order)
        runs.append(served)
    ideal = ideal_counts(prompts, [s.answer for s in runs[0][FRESH]])
    return ConfigResult(cfg, [label for label, _ in requests], [len(p) for p in prompts], ideal, runs, stats)


# ---------------------------------------------------------------------------------------------------------------------
# report


def _yes(flag: bool) -> str:
    return "yes" if flag else "NO"


def config_table(r: ConfigResult) -> tuple[list[str], list[list[str]]]:
    headers = ["request", "prompt", "ideal", "without", "with", "llama_decode (without / with)",
               "= fresh (without / with)", "time without", "time with", "time fresh"]
    rows = []
    eq_without, eq_with = r.equal_to_fresh(WITHOUT), r.equal_to_fresh(WITH)
    for i, label in enumerate(r.labels):
        without, with_ = r.served(WITHOUT)[i], r.served(WITH)[i]
        rows.append([
            label, f"{r.prompt_lengths[i]:,}", f"{r.ideal[i]:,}", f"{without.prompt_evaluated:,}",
            f"{with_.prompt_evaluated:,}", f"{without.prompt_decoded:,} / {with_.prompt_decoded:,}",
            f"{_yes(eq_without[i])} / {_yes(eq_with[i])}", fmt_ms(r.median_seconds(WITHOUT, i)),
            fmt_ms(r.median_seconds(WITH, i)), fmt_ms(r.median_seconds(FRESH, i)),
        ])
    return headers, rows


def total_row(r: ConfigResult) -> list[str]:
    ideal = sum(r.ideal)
    without, with_ = sum(r.evaluated(WITHOUT)), sum(r.evaluated(WITH))
    n = len(r.labels)
    time_without = sum(r.median_seconds(WITHOUT, i) for i in range(n))
    time_with = sum(r.median_seconds(WITH, i) for i in range(n))
    return [
        r.cfg.name, r.cfg.memory, f"{ideal:,}", f"{without:,}", fmt_ratio(ratio(without, ideal)), f"{with_:,}",
        fmt_ratio(ratio(with_, ideal)), f"{sum(r.equal_to_fresh(WITHOUT))}/{n}", f"{sum(r.equal_to_fresh(WITH))}/{n}",
        f"{ratio(time_with, time_without):.2f}",
    ]


def totals_table(report: Report, results: list[ConfigResult]) -> None:
    report.table(
        ["model", "memory", "ideal", "without", "without / ideal", "with", "with / ideal", "= fresh without",
         "= fresh with", "time with / without"],
        [total_row(r) for r in results],
    )


def build_report(results: list[ConfigResult], repeats: int,
                 shared: list[ConfigResult] | None = None) -> Report:
    report = Report("Branching agent: tokens evaluated per request vs the ideal")
    report.text(
        f"One {PROMPT_TOKENS:,}-token prompt P (random ordinary tokens), then P[:1100] + 3 new tokens, P, "
        f"P[:600] + 3 new tokens, P; {N_GENERATE} greedy tokens each through `Llama.generate`. 'ideal': prompt tokens "
        "after the longest prefix shared with any state held after an earlier request (at least 1). Counts are prompt "
        "tokens evaluated before the first generated token: 'with' by `manager.counters.tokens_evaluated`, "
        "'without' by a wrapper of `llama.eval`, both cross-checked against the tokens passed to `llama_decode`. "
        "'= fresh': the answer equals that of a reference `Llama` reset before the request (information only: "
        "Gemma Q4_K_M logits depend slightly on how the prompt is split into batches). With plugin, without and fresh "
        "run one after the other in the same process, one model context open at a time (several Gemma contexts "
        "alive at once slowed each other down by up to 5x here); the whole sequence is repeated "
        f"{repeats} time(s) with the order rotated, and times are medians over the repeats."
    )
    totals_table(report, results)
    for r in results:
        headers, rows = config_table(r)
        report.text(f"**{r.cfg.name}** ({r.cfg.memory}); counts identical across repeats: {_yes(r.counts_stable())}; "
                    f"manager: {_manager_summary(r.stats)}")
        report.table(headers, rows)
    for r in results:
        report.figure(f"branching evaluated / ideal, {r.cfg.name} ({r.cfg.memory}): without -> with plugin",
                      f"{fmt_ratio(ratio(sum(r.evaluated(WITHOUT)), sum(r.ideal)))} -> "
                      f"{fmt_ratio(ratio(sum(r.evaluated(WITH)), sum(r.ideal)))}", "<= 1.1 (with plugin)")
    if shared:
        report.text(
            f"**Shared system prompt**: {N_CONVERSATIONS} new conversations, each a {SYSTEM_TOKENS:,}-token system "
            f"prompt S followed by {CONVERSATION_TOKENS} tokens of its own, one after the other on the same context "
            "(as an agent's sessions); same columns. Where the live memory cannot be cut back to the end of S (a "
            "recurrent state, a sliding window that has moved past it), the second conversation restores the "
            "nearest checkpoint below it and leaves one at S's end (its branch point, docs/design.md), where every "
            "later conversation restores."
        )
        totals_table(report, shared)
        for r in shared:
            headers, rows = config_table(r)
            report.text(f"{r.cfg.name} ({r.cfg.memory}); manager: {_manager_summary(r.stats)}")
            report.table(headers, rows)
            report.figure(f"shared system prompt, evaluated / ideal, {r.cfg.name}: without -> with plugin",
                          f"{fmt_ratio(ratio(sum(r.evaluated(WITHOUT)), sum(r.ideal)))} -> "
                          f"{fmt_ratio(ratio(sum(r.evaluated(WITH)), sum(r.ideal)))}", "")
    return report


def _manager_summary(stats: dict[str, Any]) -> str:
    keys = ("checkpoints_created", "checkpoints_restored", "cache_hits", "cache_saves", "forced_reprocess",
            "tokens_reprocessed")
    return ", ".join(f"{k}={stats[k]}" for k in keys)


def run(quick: bool = False) -> Report:
    repeats = 1 if quick else 3
    results = [run_config(cfg, repeats) for cfg in CONFIGS]
    shared = [run_config(cfg, repeats, "shared system prompt") for cfg in CONFIGS if cfg.memory != "plain"]
    return build_report(results, repeats, shared)


def main() -> None:
    args = cli(__doc__, "one repeat").parse_args()
    emit(run(args.quick), args.json)


if __name__ == "__main__":
    main()
