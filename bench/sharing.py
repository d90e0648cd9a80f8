"""Sharing benchmark: many holders of the same checkpoints, resident bytes against what copies would cost.

A branching session on Gemma-3-270M (``swa_full=False``): one 1,000-token system prompt, then K requests that each
append a different 100-token user turn to it (4 greedy tokens each) through the attached ``Llama``'s own
``generate``. Every switch puts the previous branch into the prompt cache, so the cache ends up with K entries that
all reference the system prompt's checkpoints. Then the host takes K ``save_state()`` handles of the live state
(K "slots" holding one state).

Figures: ``manager.stats()['resident_bytes']`` (each buffer once) against the unique bytes counted independently here
(buffers deduplicated by address), against ``referenced_bytes`` (each buffer once per holder: what a copying cache
would hold), and against the bytes the process really keeps allocated for them (tracemalloc, started before the
session).

Run: ``.venv/bin/python bench/sharing.py [--quick]``.
"""

from __future__ import annotations

import tracemalloc
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import llama_cpp
import numpy as np
from _common import (
    GEMMA_VOCAB,
    Report,
    buffer_address,
    cli,
    emit,
    fmt_bytes,
    fmt_ratio,
    greedy,
    open_gemma,
    random_prompt,
    random_tokens,
    ratio,
    rss_anon_bytes,
)

import ckpt_plugin

SYSTEM_TOKENS = 1000
TURN_TOKENS = 100


def holder_buffers(manager: ckpt_plugin.CheckpointManager) -> Iterator[list[np.ndarray]]:
    """The buffers of each holder: the slot's checkpoints, then each cache entry."""
    yield [b for c in manager.primary.slot.checkpoints for b in c.buffers()]
    for entry in manager.cache.entries():
        yield list(entry.buffers())


def unique_bytes(holders: Iterable[Iterable[np.ndarray]]) -> int:
    """Bytes of the distinct memory ranges the holders reference (deduplicated by address, not object identity)."""
    ranges = {(buffer_address(b), int(b.nbytes)) for buffers in holders for b in buffers}
    return sum(size for _, size in ranges)


@dataclass
class Accounting:
    holders: int
    referenced: int
    resident: int
    unique: int
    traced_alive: int | None = None
    rss_growth: int | None = None


def account(manager: ckpt_plugin.CheckpointManager, extra_holders: list[list[np.ndarray]] = ()) -> Accounting:
    stats = manager.stats()
    holders = list(holder_buffers(manager)) + list(extra_holders)
    referenced = stats["referenced_bytes"] + sum(int(b.nbytes) for buffers in extra_holders for b in buffers)
    return Accounting(len(holders), referenced, stats["resident_bytes"], unique_bytes(holders))


@dataclass
class Session:
    llama: Any
    manager: ckpt_plugin.CheckpointManager
    branches: list[list[int]]


def warm_up(llama: Any, rng: np.random.Generator) -> None:
    """Evaluate one full batch before attaching, then empty the memory, so that llama.cpp's compute buffers are
    resident before the memory figures are taken."""
    llama.eval(random_prompt(rng, int(llama.n_batch), GEMMA_VOCAB, llama.token_bos()))
    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(llama.ctx), True)
    llama.reset()


def open_session(n_branches: int) -> Session:
    rng = np.random.default_rng(1)
    llama = open_gemma()
    warm_up(llama, rng)
    manager = ckpt_plugin.attach(llama, load_entrypoints=False)
    system = random_prompt(rng, SYSTEM_TOKENS, GEMMA_VOCAB, llama.token_bos())
    branches = [system + random_tokens(rng, TURN_TOKENS, GEMMA_VOCAB) for _ in range(n_branches)]
    return Session(llama, manager, branches)


def pool_free_bytes() -> int:
    """Bytes of freed state buffers the plugin keeps mapped for reuse (0 if it has no such pool)."""
    pool = getattr(ckpt_plugin.core.checkpoint, "DEFAULT_POOL", None)
    return int(getattr(pool, "free_bytes", 0))


def run_branches(session: Session) -> tuple[int, int]:
    """Serve every branch; return the bytes allocated meanwhile and still allocated (tracemalloc), and the growth of
    anonymous resident memory not explained by the plugin's pool of freed buffers."""
    rss = rss_anon_bytes() - pool_free_bytes()
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        for prompt in session.branches:
            greedy(session.llama, prompt)
        session.manager.primary.save_to_cache()  # the last branch too
        alive, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return alive - base, rss_anon_bytes() - pool_free_bytes() - rss


def share_handles(session: Session, k: int) -> tuple[list[Any], int]:
    """``k`` host ``save_state()`` handles of the live state; returns them and the state bytes captured meanwhile."""
    before = session.manager.counters.bytes_captured
    handles = [session.llama.save_state() for _ in range(k)]
    return handles, session.manager.counters.bytes_captured - before


def entry_rows(manager: ckpt_plugin.CheckpointManager) -> list[list[str]]:
    counts: dict[int, int] = {}
    for entry in manager.cache.entries():
        for b in {id(b): b for b in entry.buffers()}.values():
            counts[buffer_address(b)] = counts.get(buffer_address(b), 0) + 1
    rows = []
    for i, entry in enumerate(manager.cache.entries()):
        buffers = {id(b): b for b in entry.buffers()}.values()
        shared = sum(int(b.nbytes) for b in buffers if counts[buffer_address(b)] > 1)
        rows.append([str(i), f"{entry.n_tokens:,}", str(len(entry.checkpoints)), fmt_bytes(entry.nbytes),
                     fmt_bytes(shared), fmt_bytes(entry.nbytes - shared)])
    return rows


def _maybe_bytes(n: int | None) -> str:
    return "n/a" if n is None else fmt_bytes(n)


def accounting_row(name: str, a: Accounting) -> list[str]:
    return [name, str(a.holders), fmt_bytes(a.referenced), fmt_bytes(a.resident), fmt_bytes(a.unique),
            _maybe_bytes(a.traced_alive), _maybe_bytes(a.rss_growth), f"{ratio(a.resident, a.unique):.2f}",
            fmt_ratio(ratio(a.referenced, a.resident))]


def run(quick: bool = False) -> Report:
    k = 4 if quick else 8
    session = open_session(k)
    try:
        manager = session.manager
        alive, rss_growth = run_branches(session)
        cache_view = account(manager)
        cache_view.traced_alive = alive
        cache_view.rss_growth = rss_growth
        handles, captured = share_handles(session, k)
        handle_buffers = [list(h.entry.buffers()) for h in handles]
        with_handles = account(manager, handle_buffers)
        host_state = int(llama_cpp.llama_state_get_size(session.llama.ctx))
        logits = int(session.llama.scores.nbytes)
        return build_report(k, manager, cache_view, with_handles, captured, host_state, logits)
    finally:
        ckpt_plugin.detach(session.llama)
        session.llama.close()


def build_report(k: int, manager: ckpt_plugin.CheckpointManager, cache_view: Accounting, with_handles: Accounting,
                 captured: int, host_state: int, logits: int) -> Report:
    report = Report("Sharing: resident vs referenced bytes")
    report.text(
        f"Gemma-3-270M, `swa_full=False`: a {SYSTEM_TOKENS:,}-token system prompt, then {k} requests each appending a "
        f"different {TURN_TOKENS}-token turn (4 greedy tokens) through the attached `Llama.generate`; each switch puts "
        f"the previous branch into the prompt cache, and the last one is saved at the end. Then {k} host "
        "`save_state()` handles of the live state are taken. 'referenced' counts each buffer once per holder (what "
        "copies would cost), 'resident' is `manager.stats()['resident_bytes']`, 'unique' is counted here by "
        "deduplicating buffer addresses, 'alive (tracemalloc)' is what tracemalloc saw allocated during the requests "
        "and still allocated after them (numpy heap buffers, token arrays, Python objects; it does not see raw "
        "`mmap`s), 'RSS growth' is the growth of the process's anonymous resident memory (`RssAnon + RssShmem`) "
        "over the requests (llama.cpp's buffers were made resident by a warm-up batch before)."
    )
    report.table(
        ["holders", "n", "referenced", "resident", "unique (by address)", "alive (tracemalloc)", "RSS growth",
         "resident / unique", "referenced / resident"],
        [accounting_row("slot + cache entries", cache_view),
         accounting_row(f"... + {k} save_state() handles", with_handles)],
    )
    report.text("Cache entries (oldest first): bytes shared with another entry vs own:")
    report.table(["entry", "tokens", "checkpoints", "bytes", "shared", "own"], entry_rows(manager))
    if pool_free_bytes():
        report.text(f"'RSS growth' leaves out the {fmt_bytes(pool_free_bytes())} of freed state buffers the plugin's "
                    "`StateBufferPool` keeps mapped for reuse at the end (referenced by no holder).")
    copying = k * (host_state + logits)
    report.text(
        f"State bytes captured while taking the {k} `save_state()` handles: {fmt_bytes(captured)}. For comparison "
        f"(computed, not allocated): llama-cpp-python's own `save_state()` copies the whole context state "
        f"({fmt_bytes(host_state)} here) and the logits array ({fmt_bytes(logits)}) per state, so {k} cached "
        f"states would hold {fmt_bytes(copying)}, {fmt_ratio(ratio(copying, cache_view.resident))} the resident "
        "bytes above."
    )
    report.figure("resident / unique bytes (slot + cache; + handles)",
                  f"{ratio(cache_view.resident, cache_view.unique):.2f}; "
                  f"{ratio(with_handles.resident, with_handles.unique):.2f}", "1.00")
    report.figure("referenced / resident bytes (slot + cache; + handles)",
                  f"{fmt_ratio(ratio(cache_view.referenced, cache_view.resident))}; "
                  f"{fmt_ratio(ratio(with_handles.referenced, with_handles.resident))}")
    report.figure("RSS growth over the session / resident bytes",
                  f"{ratio(cache_view.rss_growth or 0, cache_view.resident):.2f}")
    report.figure(f"state bytes copied by {k} save_state() shares", fmt_bytes(captured), "0")
    return report


def main() -> None:
    args = cli(__doc__, "fewer branches").parse_args()
    emit(run(args.quick), args.json)


if __name__ == "__main__":
    main()
