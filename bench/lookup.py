"""Lookup benchmark: the prefix-indexed prompt cache against ``llama_cpp.llama_cache.LlamaRAMCache`` on the same keys.

Entries of 2,000 tokens: every entry starts with the same 1,000-token system prompt; entries come in groups of 10
(5 at 10 entries) that share a longer prefix of 1,000-1,500 tokens, then a random tail. A query takes one entry's
tokens up to a random point 0-500 tokens past its group's prefix and continues with new tokens, so exactly one entry
holds the longest prefix. No model is needed: both caches hold dummy states.

Timed, side by side on the same Python ``list`` key (what ``Llama.__call__`` passes to ``self.cache[...]``):

- ``LlamaRAMCache[key]``: ``_find_longest_prefix_key``, a Python scan over every key;
- ``HostPromptCache[key]``: ckpt_plugin's ``BaseLlamaCache`` view (what an attached ``Llama`` uses), list -> int32
  array -> radix-tree lookup -> ``SharedLlamaState``;
- ``PromptCache.lookup``: the radix-tree lookup alone, on an ``int32`` array.

Run: ``.venv/bin/python bench/lookup.py [--quick]``; writes ``docs/lookup.png``.
"""

from __future__ import annotations

import argparse
import itertools
import pathlib
import types
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
from llama_cpp.llama import LlamaState
from llama_cpp.llama_cache import LlamaRAMCache

from _common import Case, Report, Samples, fmt_ms, fmt_ratio, measure, ratio
from ckpt_plugin.cache import CacheEntry, PromptCache
from ckpt_plugin.checkpoint import Checkpoint, freeze
from ckpt_plugin.llama_backend import HostPromptCache
from ckpt_plugin.manager import CheckpointManager
from ckpt_plugin.policy import common_prefix
from ckpt_plugin.testing import FAKE_KINDS, FakeBackend

ENTRY_TOKENS = 2000
SYSTEM_TOKENS = 1000
GROUP_PREFIX = (1000, 1500)
QUERY_EXTRA = (0, 500)
VOCAB = 20000
N_QUERIES = 16
SIZES = (10, 100, 1000, 3000, 10000)
PLOT = pathlib.Path(__file__).resolve().parent.parent / "docs" / "lookup.png"


@dataclass
class Workload:
    """Entry token arrays, their groups' prefix lengths, and queries with the prefix length each should find."""

    entries: list[np.ndarray]
    queries: list[np.ndarray]
    expected: list[int]


def make_workload(n_entries: int, rng: np.random.Generator) -> Workload:
    system = rng.integers(0, VOCAB, SYSTEM_TOKENS).astype(np.int32)
    group_size = 5 if n_entries < 100 else 10
    n_groups = max(1, n_entries // group_size)
    prefixes = []
    for _ in range(n_groups):
        length = int(rng.integers(GROUP_PREFIX[0], GROUP_PREFIX[1] + 1))
        prefixes.append(np.concatenate((system, rng.integers(0, VOCAB, length - SYSTEM_TOKENS).astype(np.int32))))
    entries = []
    for i in range(n_entries):
        prefix = prefixes[i % n_groups]
        tail = rng.integers(0, VOCAB, ENTRY_TOKENS - len(prefix)).astype(np.int32)
        entries.append(np.concatenate((prefix, tail)))
    queries, expected = [], []
    for _ in range(N_QUERIES):
        i = int(rng.integers(n_entries))
        keep = min(len(prefixes[i % n_groups]) + int(rng.integers(*QUERY_EXTRA)), ENTRY_TOKENS - 1)
        tail = rng.integers(0, VOCAB, ENTRY_TOKENS - keep).astype(np.int32)
        tail[0] = (entries[i][keep] + 1) % VOCAB  # diverge exactly at ``keep``
        queries.append(np.concatenate((entries[i][:keep], tail)))
        expected.append(keep)
    return Workload(entries, queries, expected)


# ---------------------------------------------------------------------------------------------------------------------
# the caches


def ram_cache(workload: Workload) -> LlamaRAMCache:
    """A ``LlamaRAMCache`` holding dummy states (token ints shared between keys, as a host's lists would be)."""
    pool = list(range(VOCAB))
    cache = LlamaRAMCache(capacity_bytes=1 << 62)
    empty_scores = np.empty((0, 0), dtype=np.single)
    for tokens in workload.entries:
        key = tuple([pool[t] for t in tokens.tolist()])
        cache.cache_state[key] = LlamaState(tokens, empty_scores, len(tokens), b"", 0, 0)
    return cache


def _dummy_checkpoint(tokens: np.ndarray, buffer: np.ndarray, fingerprint: str) -> Checkpoint:
    return Checkpoint(len(tokens), 0, len(tokens) - 1, False, buffer, fingerprint)


def host_cache(workload: Workload) -> HostPromptCache:
    """ckpt_plugin's ``HostPromptCache`` over a ``PromptCache`` of dummy entries (one shared 64-byte buffer)."""
    backend = FakeBackend(FAKE_KINDS["plain"])
    cache = PromptCache()
    buffer = freeze(np.zeros(64, dtype=np.uint8))
    for tokens in workload.entries:
        frozen = tokens.copy()
        frozen.flags.writeable = False
        admitted, _ = cache.insert(CacheEntry(frozen, _dummy_checkpoint(frozen, buffer, backend.fingerprint), ()))
        assert admitted
    manager = CheckpointManager(backend, cache=cache, load_entrypoints=False)
    return HostPromptCache(manager, types.SimpleNamespace(_seed=0))


def prompt_cache_best(host: HostPromptCache, query: np.ndarray) -> tuple[CacheEntry, int] | None:
    manager = host.manager
    found = manager.cache.lookup(manager.settings.namespace, manager.fingerprint, query)
    return max(found, key=lambda pair: pair[1], default=None)


def check_agreement(workload: Workload, ram: LlamaRAMCache, host: HostPromptCache) -> bool:
    """Both caches return an entry sharing the expected prefix with every query."""
    for query, want in zip(workload.queries, workload.expected):
        key = query.tolist()
        ram_state = ram[key]
        host_state = host[key]
        if common_prefix(np.asarray(ram_state.input_ids, dtype=np.int32), query) != want:
            return False
        if common_prefix(np.asarray(host_state.input_ids), query) != want:
            return False
    return True


# ---------------------------------------------------------------------------------------------------------------------
# measurement


L2_SWEEP = np.zeros(8 << 20, dtype=np.uint8)  # twice this machine's per-core L2


def evict_l2() -> None:
    L2_SWEEP.fill(1)


def cycling(queries: list[Any], lookup: Callable[[Any], object], sweep: bool = False) -> Case:
    """A case looking up the next query each call; picking it (and the optional L2 sweep) is not timed."""
    order = itertools.cycle(queries)

    def setup() -> Any:
        if sweep:
            evict_l2()
        return next(order)

    return Case(setup=setup, run=lookup)


@dataclass
class SizeResult:
    n_entries: int
    samples: dict[str, Samples]
    agree: bool


RAM, HOST, HOST_L2, INDEX_L2 = (
    "LlamaRAMCache[key]",
    "HostPromptCache[key]",
    "HostPromptCache[key], L2 swept",
    "PromptCache.lookup, L2 swept",
)


def measure_size(n_entries: int, rounds: int, rng: np.random.Generator) -> SizeResult:
    workload = make_workload(n_entries, rng)
    ram, host = ram_cache(workload), host_cache(workload)
    agree = check_agreement(workload, ram, host)
    keys = [q.tolist() for q in workload.queries]
    cases = {
        RAM: cycling(keys, lambda key: ram[key]),
        HOST: cycling(keys, lambda key: host[key]),  # right after the scan: CPU caches hold the RAM cache's keys
        HOST_L2: cycling(keys, lambda key: host[key], sweep=True),
        INDEX_L2: cycling(workload.queries, lambda query: prompt_cache_best(host, query), sweep=True),
    }
    return SizeResult(n_entries, measure(cases, rounds, warmup=1), agree)


def rounds_for(n_entries: int, quick: bool) -> int:
    rounds = {10: 301, 100: 201, 1000: 41, 3000: 15, 10000: 9}[n_entries]
    return max(3, rounds // 4) if quick else rounds


def plot(results: list[SizeResult], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [r.n_entries for r in results]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, marker in ((RAM, "o"), (HOST, "s"), (HOST_L2, "D"), (INDEX_L2, "^")):
        ax.plot(sizes, [r.samples[name].median * 1e3 for r in results], marker=marker, label=name)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("cache entries (2,000 tokens each, shared prefixes)")
    ax.set_ylabel("lookup time, median (ms)")
    ax.set_title("Prompt-cache lookup vs entries")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _growth(results: list[SizeResult], name: str) -> str:
    return fmt_ratio(ratio(results[-1].samples[name].median, results[0].samples[name].median))


def build_report(results: list[SizeResult]) -> Report:
    report = Report("Lookup: prefix-indexed prompt cache vs LlamaRAMCache")
    report.text(
        f"Entries of {ENTRY_TOKENS:,} tokens: a {SYSTEM_TOKENS:,}-token system prompt shared by all, groups of 10 "
        f"(5 at 10 entries) sharing {GROUP_PREFIX[0]:,}-{GROUP_PREFIX[1]:,}-token prefixes, random tails; "
        f"{N_QUERIES} queries cycled, each sharing its group's prefix plus 0-500 tokens with exactly one entry. "
        "Every case looks up the same Python list key (what `Llama` passes to `self.cache[...]`); the cases run in "
        "rounds, side by side, in the column order; medians. `HostPromptCache[key]` runs right after the "
        "`LlamaRAMCache` scan, which has just streamed every key through the CPU caches (the cold case, as in a "
        "server where a decode streams the weights between two lookups); the 'L2 swept' columns write 8 MB "
        "(twice the per-core L2) before each call instead. `PromptCache.lookup` is the radix-tree walk alone on an "
        "int32 array (no list conversion, no `LlamaState`). 'same answer': both caches return an entry with the "
        "longest common prefix for every query."
    )
    rows = []
    for r in results:
        s = r.samples
        rows.append([
            f"{r.n_entries:,}", fmt_ms(s[RAM].median), fmt_ms(s[HOST].median), fmt_ms(s[HOST_L2].median),
            fmt_ms(s[INDEX_L2].median), fmt_ratio(ratio(s[RAM].median, s[HOST].median)), len(s[RAM].seconds),
            "yes" if r.agree else "NO",
        ])
    report.table(["entries", RAM, HOST, HOST_L2, INDEX_L2, "RAM / Host", "rounds", "same answer"], rows)
    first, last = results[0], results[-1]
    report.text(
        f"Growth from {first.n_entries:,} to {last.n_entries:,} entries: {RAM} {_growth(results, RAM)}, "
        f"{HOST} {_growth(results, HOST)}, {HOST_L2} {_growth(results, HOST_L2)}, "
        f"{INDEX_L2} {_growth(results, INDEX_L2)}. Plot: [lookup.png](lookup.png)."
    )
    by_size = {r.n_entries: r for r in results}
    for n in (10, 10000):
        if n in by_size:
            s = by_size[n].samples
            report.figure(f"lookup at {n:,} entries: HostPromptCache (after the scan / L2 swept) vs LlamaRAMCache",
                          f"{fmt_ms(s[HOST].median)} / {fmt_ms(s[HOST_L2].median)} vs {fmt_ms(s[RAM].median)} "
                          f"(LlamaRAMCache / HostPromptCache = {fmt_ratio(ratio(s[RAM].median, s[HOST].median))})",
                          "< 0.2 ms" if n == 10000 else "")
    report.figure(f"lookup growth {first.n_entries:,} -> {last.n_entries:,} entries (Host after scan; L2 swept; RAM)",
                  f"{_growth(results, HOST)}; {_growth(results, HOST_L2)}; {_growth(results, RAM)}",
                  "flat in the number of entries")
    return report


def run(quick: bool = False, plot_path: pathlib.Path | None = PLOT) -> Report:
    rng = np.random.default_rng(0)
    results = [measure_size(n, rounds_for(n, quick), rng) for n in SIZES]
    if plot_path is not None:
        plot(results, plot_path)
    return build_report(results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument("--no-plot", action="store_true", help="do not write docs/lookup.png")
    args = parser.parse_args()
    print(run(args.quick, None if args.no_plot else PLOT).markdown())


if __name__ == "__main__":
    main()
