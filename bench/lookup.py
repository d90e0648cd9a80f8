"""Lookup benchmark: the prefix-indexed prompt cache against ``llama_cpp.llama_cache.LlamaRAMCache`` on the same keys.

Entries of 2,000 tokens: every entry starts with the same 1,000-token system prompt; entries come in groups of 10
(5 at 10 entries) that share a longer prefix of 1,000-1,500 tokens, then a random tail. No model is needed: both
caches hold dummy states. Two kinds of query, 16 of each, cycled:

- continuing: one entry's tokens up to a random point 0-500 tokens past its group's prefix, then new tokens, so that
  exactly one entry holds the longest prefix;
- new conversation: the system prompt, then new tokens (every entry shares exactly the system prompt with it).

Timed, side by side on the same Python ``list`` key (what ``Llama.__call__`` passes to ``self.cache[...]``), made
anew from the query right before each call, outside the timing, as the host's tokenizer makes it:

- ``LlamaRAMCache[key]``: ``_find_longest_prefix_key``, a Python scan over every key;
- ``HostPromptCache[key]``: ckpt_plugin's ``BaseLlamaCache`` view (what an attached ``Llama`` uses), list -> int32
  bytes (``struct``) -> radix-tree lookup -> ``SharedLlamaState``;
- ``PromptCache.lookup``: the radix-tree lookup alone, on an ``int32`` array.

Run: ``.venv/bin/python bench/lookup.py [--quick]``; writes ``docs/lookup.png``.
"""

from __future__ import annotations

import itertools
import pathlib
import types
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
from _common import Case, Report, Samples, cli, emit, fmt_ms, fmt_ratio, measure, ratio
from llama_cpp.llama import LlamaState
from llama_cpp.llama_cache import LlamaRAMCache

from ckpt_plugin.core.entry import CacheEntry
from ckpt_plugin.tiers.ram import PromptCache
from ckpt_plugin.core.checkpoint import Checkpoint, freeze
from ckpt_plugin.hosts.llama_cpp.attachment.host_cache import HostPromptCache
from ckpt_plugin.engine.manager import CheckpointManager
from ckpt_plugin.core.memory import common_prefix
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
class Queries:
    """Query token arrays and the common-prefix length the best entry must share with each."""

    arrays: list[np.ndarray]
    expected: list[int]

    @property
    def keys(self) -> list[list[int]]:
        return [q.tolist() for q in self.arrays]


@dataclass
class Workload:
    entries: list[np.ndarray]
    continuing: Queries
    new: Queries


def _diverging_tail(rng: np.random.Generator, n: int, avoid: set[int]) -> np.ndarray:
    """``n`` random tokens whose first is none of ``avoid`` (so the query leaves the cached prefixes there)."""
    tail = rng.integers(0, VOCAB, n).astype(np.int32)
    while int(tail[0]) in avoid:
        tail[0] = rng.integers(0, VOCAB)
    return tail


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
        entries.append(np.concatenate((prefix, rng.integers(0, VOCAB, ENTRY_TOKENS - len(prefix)).astype(np.int32))))
    continuing = Queries([], [])
    for _ in range(N_QUERIES):
        i = int(rng.integers(n_entries))
        keep = min(len(prefixes[i % n_groups]) + int(rng.integers(*QUERY_EXTRA)), ENTRY_TOKENS - 1)
        tail = _diverging_tail(rng, ENTRY_TOKENS - keep, {int(entries[i][keep])})
        continuing.arrays.append(np.concatenate((entries[i][:keep], tail)))
        continuing.expected.append(keep)
    after_system = {int(e[SYSTEM_TOKENS]) for e in entries}
    new = Queries([], [])
    for _ in range(N_QUERIES):
        new.arrays.append(np.concatenate((system, _diverging_tail(rng, ENTRY_TOKENS - SYSTEM_TOKENS, after_system))))
        new.expected.append(SYSTEM_TOKENS)
    return Workload(entries, continuing, new)


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
    return Checkpoint(n_tokens=len(tokens), pos_min=0, pos_max=len(tokens) - 1, partial=False, target=buffer,
                      fingerprint=fingerprint)


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


def agree(queries: Queries, ram: LlamaRAMCache, host: HostPromptCache) -> bool:
    """Both caches return an entry sharing the expected prefix with every query."""
    for query, key, want in zip(queries.arrays, queries.keys, queries.expected, strict=False):
        for state in (ram[key], host[key]):
            if common_prefix(np.asarray(state.input_ids, dtype=np.int32), query) != want:
                return False
    return True


# ---------------------------------------------------------------------------------------------------------------------
# measurement


CACHE_SWEEP = np.zeros(64 << 20, dtype=np.uint8)  # twice this machine's L3 (32 MiB; L2 2 MiB per core)


def evict_caches() -> None:
    """Push the lookup's data out of L2 and L3, as a decode streaming the model's weights does between lookups."""
    CACHE_SWEEP.fill(1)


def cycling(queries: list[np.ndarray], lookup: Callable[[Any], object], sweep: bool = False,
            as_list: bool = False) -> Case:
    """A case looking up the next query each call; picking it (and the optional cache sweep) is not timed.

    ``as_list``: the key is a new Python list made from the query right before the call (after the sweep), as
    ``Llama.tokenize`` makes one right before the host's ``self.cache[...]``: its int objects are new, and in the
    CPU caches, as on a server (a list built once and reused would be scattered and cold after the sweeps).
    """
    order = itertools.cycle(queries)

    def setup() -> Any:
        if sweep:
            evict_caches()
        query = next(order)
        return query.tolist() if as_list else query

    return Case(setup=setup, run=lookup)


@dataclass
class SizeResult:
    n_entries: int
    samples: dict[str, Samples]
    agree: dict[str, bool]


CONTINUING, NEW = "continuing", "new conversation"
RAM, HOST, HOST_COLD, INDEX_COLD, INDEX_WARM = (
    "LlamaRAMCache[key]",
    "HostPromptCache[key]",
    "HostPromptCache[key], caches swept",
    "PromptCache.lookup, caches swept",
    "PromptCache.lookup, warm",
)


def case_name(kind: str, what: str) -> str:
    return f"{kind}: {what}"


def measure_size(n_entries: int, rounds: int, rng: np.random.Generator) -> SizeResult:
    workload = make_workload(n_entries, rng)
    ram, host = ram_cache(workload), host_cache(workload)
    cases: dict[str, Case] = {}
    for kind, queries in ((CONTINUING, workload.continuing), (NEW, workload.new)):
        arrays = queries.arrays
        cases[case_name(kind, RAM)] = cycling(arrays, lambda key: ram[key], as_list=True)
        if kind == CONTINUING:  # right after the scan, while the CPU caches hold the RAM cache's keys
            cases[case_name(kind, HOST)] = cycling(arrays, lambda key: host[key], as_list=True)
        cases[case_name(kind, HOST_COLD)] = cycling(arrays, lambda key: host[key], sweep=True, as_list=True)
        cases[case_name(kind, INDEX_COLD)] = cycling(
            queries.arrays, lambda query: prompt_cache_best(host, query), sweep=True
        )
        # the same query again right away: what the walk costs with everything it touches in the CPU caches
        cases[case_name(kind, INDEX_WARM)] = cycling(queries.arrays, lambda query: prompt_cache_best(host, query))
    agreement = {CONTINUING: agree(workload.continuing, ram, host), NEW: agree(workload.new, ram, host)}
    return SizeResult(n_entries, measure(cases, rounds, warmup=1), agreement)


def rounds_for(n_entries: int, quick: bool) -> int:
    rounds = {10: 301, 100: 201, 1000: 41, 3000: 15, 10000: 9}[n_entries]
    return max(3, rounds // 4) if quick else rounds


def plot(results: list[SizeResult], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [r.n_entries for r in results]
    fig, ax = plt.subplots(figsize=(7.2, 4.6))
    for name in results[0].samples:
        style = "-" if name.startswith(CONTINUING) else "--"
        marker = {RAM: "o", HOST: "s", HOST_COLD: "D", INDEX_COLD: "^", INDEX_WARM: "v"}[name.split(": ", 1)[1]]
        ax.plot(sizes, [r.samples[name].median * 1e3 for r in results], style, marker=marker, label=name)
    ax.axhline(0.2, color="grey", linewidth=0.8, linestyle=":", label="goal: 0.2 ms")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("cache entries (2,000 tokens each, shared prefixes)")
    ax.set_ylabel("lookup time, median (ms)")
    ax.set_title("Prompt-cache lookup vs entries")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _median(r: SizeResult, kind: str, what: str) -> float:
    return r.samples[case_name(kind, what)].median


def _growth(results: list[SizeResult], kind: str, what: str) -> str:
    return fmt_ratio(ratio(_median(results[-1], kind, what), _median(results[0], kind, what)))


def _kind_table(report: Report, results: list[SizeResult], kind: str, columns: list[str]) -> None:
    host = HOST if HOST in columns else HOST_COLD
    rows = []
    for r in results:
        rows.append([f"{r.n_entries:,}", *(fmt_ms(_median(r, kind, c)) for c in columns),
                     fmt_ratio(ratio(_median(r, kind, RAM), _median(r, kind, host))),
                     len(r.samples[case_name(kind, RAM)].seconds), "yes" if r.agree[kind] else "NO"])
    report.table(["entries", *columns, f"RAM / {host}", "rounds", "same answer"], rows)
    growth = ", ".join(f"{c} {_growth(results, kind, c)}" for c in columns)
    report.text(f"Growth from {results[0].n_entries:,} to {results[-1].n_entries:,} entries: {growth}.")


def build_report(results: list[SizeResult]) -> Report:
    report = Report("Lookup: prefix-indexed prompt cache vs LlamaRAMCache")
    report.text(
        f"Entries of {ENTRY_TOKENS:,} tokens: a {SYSTEM_TOKENS:,}-token system prompt shared by all, groups of 10 "
        f"(5 at 10 entries) sharing {GROUP_PREFIX[0]:,}-{GROUP_PREFIX[1]:,}-token prefixes, random tails. "
        f"{N_QUERIES} queries of each kind, cycled. Every case looks up the same key, a Python list (what `Llama` passes "
        "to `self.cache[...]`) made anew from the query right before each call, outside the timing, as the host's "
        "tokenizer makes it (a list built once and reused would be scattered and cold after the sweeps); the cases "
        "run in rounds, side by side, in the column order; medians. "
        "`HostPromptCache[key]` runs right after the `LlamaRAMCache` scan, which has just streamed every key through "
        "the CPU caches (the cold case, as in a server where a decode streams the weights between two lookups); the "
        "'caches swept' cases write 64 MB (twice the L3) before each call instead, so that each of them finds "
        "nothing of the index in the CPU caches, whatever ran before it. `PromptCache.lookup` is the "
        "radix-tree walk alone on an int32 array (no list conversion, no `LlamaState`); its 'warm' case repeats the "
        "query just looked up, so everything the walk touches is in the CPU caches: the algorithmic cost, apart from "
        "cache and TLB misses, which grow with the memory the index spans. 'same answer': both caches "
        "return an entry with the longest common prefix for every query. Plot: [lookup.png](lookup.png)."
    )
    report.text("**Continuing a cached conversation** (the query shares its group's prefix plus 0-500 tokens with "
                "exactly one entry):")
    _kind_table(report, results, CONTINUING, [RAM, HOST, HOST_COLD, INDEX_COLD, INDEX_WARM])
    report.text(f"**New conversation** (the query shares only the {SYSTEM_TOKENS:,}-token system prompt, with every "
                "entry):")
    _kind_table(report, results, NEW, [RAM, HOST_COLD, INDEX_COLD, INDEX_WARM])
    first, last = results[0], results[-1]
    for r in (first, last):
        report.figure(
            f"lookup at {r.n_entries:,} entries, continuing: HostPromptCache (after the scan / caches swept) vs "
            "LlamaRAMCache",
            f"{fmt_ms(_median(r, CONTINUING, HOST))} / {fmt_ms(_median(r, CONTINUING, HOST_COLD))} vs "
            f"{fmt_ms(_median(r, CONTINUING, RAM))} (LlamaRAMCache / HostPromptCache = "
            f"{fmt_ratio(ratio(_median(r, CONTINUING, RAM), _median(r, CONTINUING, HOST)))})",
            "< 0.2 ms" if r is last else "",
        )
    report.figure(
        f"lookup at {last.n_entries:,} entries, new conversation: HostPromptCache (caches swept) vs LlamaRAMCache",
        f"{fmt_ms(_median(last, NEW, HOST_COLD))} vs {fmt_ms(_median(last, NEW, RAM))}", "< 0.2 ms",
    )
    report.figure(
        f"HostPromptCache lookup growth {first.n_entries:,} -> {last.n_entries:,} entries (continuing after scan; "
        "continuing, caches swept; new conversation, caches swept)",
        f"{_growth(results, CONTINUING, HOST)}; {_growth(results, CONTINUING, HOST_COLD)}; "
        f"{_growth(results, NEW, HOST_COLD)}",
        "flat in the number of entries",
    )
    report.figure(
        f"PromptCache.lookup growth {first.n_entries:,} -> {last.n_entries:,} entries, warm (continuing; new "
        "conversation)",
        f"{_growth(results, CONTINUING, INDEX_WARM)}; {_growth(results, NEW, INDEX_WARM)}",
        "flat in the number of entries",
    )
    return report


def run(quick: bool = False, plot_path: pathlib.Path | None = PLOT) -> Report:
    rng = np.random.default_rng(0)
    results = [measure_size(n, rounds_for(n, quick), rng) for n in SIZES]
    if plot_path is not None:
        plot(results, plot_path)
    return build_report(results)


def main() -> None:
    parser = cli(__doc__)
    parser.add_argument("--no-plot", action="store_true", help="do not write docs/lookup.png")
    args = parser.parse_args()
    emit(run(args.quick, None if args.no_plot else PLOT), args.json)


if __name__ == "__main__":
    main()
