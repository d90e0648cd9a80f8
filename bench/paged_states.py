"""Paged, content-addressed states against whole states, side by side in one run, on Gemma-3-270M.

Each configuration is a page size (``--page-positions``; 0 keeps every state whole, as before pages) and runs the
same work, each part in a fresh process (the page store is per process, as a replica's is):

- **shared tier**: 4 users x 5 turns sharing a ~1,100-token system prompt, each turn adding ~30 tokens (14 of the
  user's, 16 generated), one replica publishing to a fresh redis-server after every turn: bytes written per turn
  (the tier's ``bytes_written``), Redis memory per user (``used_memory`` after, less before, over the users);
- **moved turn**: a second replica (another process, the same redis-server) serves each user's next turn: time to
  the first token against a plain ``llama_cpp.Llama`` evaluating the whole prompt (what a replica without the
  shared tier does), and the pages it read or found live;
- **budget**: one replica with a 512 MiB prompt-cache budget serves users who share the system prompt, each with a
  60-token message and a 16-token reply, one after the other, until the first eviction: conversations held;
- **restore**: restoring a 1,200-token conversation's full state (pages assembled, then ``llama_state_seq_set``)
  against restoring it whole, by page size.

Run: ``.venv/bin/python bench/paged_states.py`` (about 15 minutes), ``--quick`` (page sizes 0 and 32 only),
``--page-sizes``, ``--budget-sizes`` (default 0 and 32: the budget run of other sizes is skipped),
``--markdown PATH`` (default ``docs/bench-sections/52-paged-states.md``), ``--json PATH``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import pathlib
import statistics
import sys
import time
from typing import Any, Sequence

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from _common import GEMMA_VOCAB, fmt_bytes, greedy, markdown_table, open_gemma, random_prompt, random_tokens  # noqa: E402
from redis_servers import redis_server  # noqa: E402

MARKDOWN_PATH = ROOT / "docs" / "bench-sections" / "52-paged-states.md"
USERS, TURNS, SYSTEM_TOKENS, USER_TOKENS, REPLY_TOKENS = 4, 5, 1100, 14, 16
BUDGET, BUDGET_MESSAGE, MAX_BUDGET_USERS = 512 << 20, 60, 160
PAGE_SIZES = (0, 16, 32, 64, 128)
GOALS = {"bytes_per_turn": 2e6, "redis_per_user": 18e6, "moved_over_local": 0.25, "budget_ratio": 3.0}


def system_prompt() -> list[int]:
    return random_prompt(np.random.default_rng(48), SYSTEM_TOKENS, GEMMA_VOCAB, bos=2)


def attached(page_positions: int, **settings: Any) -> tuple[Any, Any]:
    import ckpt_plugin

    llama = open_gemma()
    manager = ckpt_plugin.attach(llama, page_positions=page_positions, load_entrypoints=False, **settings)
    return llama, manager


def write_turns(page_positions: int, url: str) -> dict[str, Any]:
    """The shared-tier workload on one replica: bytes written per turn, Redis memory, the conversations."""
    import redis

    from ckpt_plugin.services.publishing import publish

    client = redis.Redis.from_url(url)
    before = int(client.info("memory")["used_memory"])
    llama, manager = attached(page_positions, redis_url=url, redis_prefix=f"p{page_positions}")
    shared = manager.store.shared
    rng = np.random.default_rng(7)
    system = system_prompt()
    conversations = [list(system) for _ in range(USERS)]
    written: list[list[int]] = []
    for _ in range(TURNS):
        row = []
        for user in range(USERS):
            conversations[user] += random_tokens(rng, USER_TOKENS, GEMMA_VOCAB)
            conversations[user] += greedy(llama, conversations[user], REPLY_TOKENS)
            start = shared.stats()["bytes_written"]
            assert publish(manager)
            assert shared.drain(60)
            row.append(int(shared.stats()["bytes_written"] - start))
        written.append(row)
    after = int(client.info("memory")["used_memory"])
    stats = shared.stats()
    return {"written": written, "redis_per_user": (after - before) / USERS, "conversations": conversations,
            "pages_written": stats["pages_written"], "pages_present": stats["pages_present"]}


def move_turns(page_positions: int, url: str, conversations: list[list[int]]) -> dict[str, Any]:
    """Each user's next turn on a replica that never served it, against a fresh context evaluating it all."""
    from llama_cpp import Llama

    llama, manager = attached(page_positions, redis_url=url, redis_prefix=f"p{page_positions}")
    plain = open_gemma()
    rng = np.random.default_rng(11)
    moved, local = [], []
    for conversation in conversations:
        prompt = conversation + random_tokens(rng, USER_TOKENS, GEMMA_VOCAB)
        started = time.perf_counter()
        greedy(llama, prompt, 1)
        moved.append(time.perf_counter() - started)
        plain.reset()
        started = time.perf_counter()
        greedy(plain, prompt, 1)
        local.append(time.perf_counter() - started)
    stats = manager.store.shared.stats()
    assert isinstance(plain, Llama)
    return {"moved": moved, "local": local, "hits": stats["hits"], "pages_read": stats["pages_read"],
            "pages_held": stats["pages_held"], "bytes_read": stats["bytes_read"]}


def fill_budget(page_positions: int) -> dict[str, Any]:
    """Users on one system prompt, one after the other, until the prompt cache first evicts one."""
    llama, manager = attached(page_positions, cache_max_bytes=BUDGET)
    rng = np.random.default_rng(5)
    system = system_prompt()
    held = MAX_BUDGET_USERS
    started = time.perf_counter()
    for user in range(MAX_BUDGET_USERS):
        prompt = system + random_tokens(rng, BUDGET_MESSAGE, GEMMA_VOCAB)
        greedy(llama, prompt, REPLY_TOKENS)
        if manager.counters.cache_evictions:
            held = len(manager.cache.entries())
            break
    stats = manager.stats()
    return {"held": held, "evicted": bool(manager.counters.cache_evictions), "users": user + 1,
            "seconds": time.perf_counter() - started, "resident_bytes": stats["resident_bytes"],
            "referenced_bytes": stats["referenced_bytes"], "sharing_ratio": stats["sharing_ratio"]}


def restore_times(page_sizes: Sequence[int], repeats: int = 15) -> dict[str, Any]:
    """Restoring one 1,200-token conversation's full state, whole and paged at each size."""
    from ckpt_plugin.core.counters import Counters
    from ckpt_plugin.core.pages import PagedState, PageStore
    from ckpt_plugin.engine.paging import StatePager

    llama, manager = attached(0)
    prompt = system_prompt() + random_tokens(np.random.default_rng(3), 100, GEMMA_VOCAB)
    greedy(llama, prompt, 1)
    backend = manager.primary.backend
    whole = np.empty(backend.state_size(False), dtype=np.uint8)
    assert backend.read_state(whole, False) == whole.nbytes
    whole.flags.writeable = False
    out: dict[str, Any] = {"state_bytes": int(whole.nbytes)}
    pool = manager.store.ram.pool
    for size in page_sizes:
        target: Any = whole
        if size:
            target = StatePager(manager.kind, backend.fingerprint, size, Counters(), PageStore()).page(
                whole, manager.primary.slot.tokens, "default", False)
            assert isinstance(target, PagedState)
        samples = []
        for _ in range(repeats):
            started = time.perf_counter()
            buffer = target.assemble(pool.allocate(target.nbytes)) if size else target
            assert backend.write_state(buffer, False) == whole.nbytes
            samples.append(time.perf_counter() - started)
            del buffer
        out[str(size)] = statistics.median(samples)
    return out


def _child(queue: Any, function: str, args: tuple) -> None:
    try:
        queue.put(("ok", globals()[function](*args)))
    except BaseException as exc:  # the parent reports it
        queue.put(("error", repr(exc)))


def in_process(function: str, *args: Any) -> Any:
    """``function(*args)`` in a fresh process (its own page store, as another replica)."""
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=_child, args=(queue, function, args))
    process.start()
    status, value = queue.get()
    process.join()
    if status != "ok":
        raise RuntimeError(f"{function} failed: {value}")
    return value


def run(page_sizes: Sequence[int], budget_sizes: Sequence[int], progress: bool = True) -> dict[str, Any]:
    results: dict[str, Any] = {"page_sizes": list(page_sizes), "configs": {}}
    for size in page_sizes:
        if progress:
            print(f"page_positions={size}: shared tier", flush=True)
        with redis_server() as url:
            written = in_process("write_turns", size, url)
            moved = in_process("move_turns", size, url, written.pop("conversations"))
        budget = None
        if size in budget_sizes:
            if progress:
                print(f"page_positions={size}: budget", flush=True)
            budget = in_process("fill_budget", size)
        results["configs"][str(size)] = {"shared": written, "moved": moved, "budget": budget}
    if progress:
        print("restore times", flush=True)
    results["restore"] = in_process("restore_times", list(page_sizes))
    return results


def summarize(results: dict[str, Any]) -> list[list[Any]]:
    rows = []
    for size, config in results["configs"].items():
        written = config["shared"]["written"]
        moved = config["moved"]
        budget = config["budget"]
        rows.append([
            "whole states" if size == "0" else f"pages of {size}",
            fmt_bytes(statistics.mean(written[0])),
            fmt_bytes(statistics.mean([b for row in written[2:] for b in row])),
            fmt_bytes(config["shared"]["redis_per_user"]),
            f"{statistics.median(moved['moved']) * 1e3:.0f} ms / {statistics.median(moved['local']) * 1e3:.0f} ms "
            f"= {statistics.median(moved['moved']) / statistics.median(moved['local']):.2f}x",
            f"{moved['pages_read']} / {moved['pages_held']}",
            "-" if budget is None else f"{budget['held']}{'' if budget['evicted'] else '+ (no eviction)'}",
            "-" if budget is None else f"{budget['sharing_ratio']:.1f}",
            f"{results['restore'][size] * 1e3:.1f} ms",
        ])
    return rows


def markdown(results: dict[str, Any], command: str) -> str:
    configs = results["configs"]
    headers = ["states", "written, turn 1 (a user)", "written, turns 3+ (a user)", "Redis memory a user",
               "moved turn TTFT / local evaluation", "pages read / found live (moved turns)",
               "conversations in 512 MiB", "sharing ratio (budget run)", "restore, full state"]
    lines = ["## Paged, content-addressed states (`bench/paged_states.py`)", "",
             f"Measured on this 2-core machine, Gemma-3-270M Q4_K_M, n_ctx 4096, 2 threads; `{command}`. "
             f"A full state of a 1,200-token conversation is {fmt_bytes(results['restore']['state_bytes'])}. "
             f"Shared tier: {USERS} users x {TURNS} turns on one ~{SYSTEM_TOKENS}-token system prompt, each turn "
             f"adding {USER_TOKENS + REPLY_TOKENS} tokens, one replica publishing after each turn to a fresh "
             "redis-server; moved turns on a second replica (another process). Budget: users on the same system "
             f"prompt with {BUDGET_MESSAGE}-token messages and {REPLY_TOKENS}-token replies until the first eviction "
             f"of a {BUDGET >> 20} MiB prompt cache (at most {MAX_BUDGET_USERS}).", "",
             markdown_table(headers, summarize(results)), ""]
    if "0" in configs and "32" in configs:
        whole, paged = configs["0"], configs["32"]
        turn = statistics.mean([b for row in paged["shared"]["written"][2:] for b in row])
        moved = statistics.median(paged["moved"]["moved"]) / statistics.median(paged["moved"]["local"])
        ratio = paged["budget"]["held"] / max(1, whole["budget"]["held"])
        goals = [["shared tier: bytes written per turn (turns 3+)", fmt_bytes(turn), "<= 2 MB"],
                 ["shared tier: Redis memory per user", fmt_bytes(paged["shared"]["redis_per_user"]), "<= 18 MB"],
                 ["moved turn / evaluating locally", f"{moved:.2f}x", "<= 0.25x"],
                 ["conversations in 512 MiB, pages / whole states",
                  f"{ratio:.1f}x{'' if paged['budget']['evicted'] else ' (at least: no eviction)'}", ">= 3x"],
                 ["restore of a full state, pages of 32 / whole",
                  f"{results['restore']['32'] / results['restore']['0']:.2f}x", "-"]]
        lines += ["| figure | measured | goal |", "| --- | --- | --- |", *(f"| {' | '.join(g)} |" for g in goals), ""]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="page sizes 0 and 32 only")
    parser.add_argument("--page-sizes", default=None, help="comma-separated page sizes (0: whole states)")
    parser.add_argument("--budget-sizes", default="0,32", help="the page sizes whose budget run is measured")
    parser.add_argument("--markdown", type=pathlib.Path, default=MARKDOWN_PATH)
    parser.add_argument("--json", type=pathlib.Path)
    parser.add_argument("--render", type=pathlib.Path, help="write the markdown of a run saved with --json again")
    args = parser.parse_args(argv)
    command = ".venv/bin/python bench/paged_states.py" + (" --quick" if args.quick else "")
    if args.render:
        results = json.loads(args.render.read_text())
    else:
        sizes = [int(s) for s in args.page_sizes.split(",")] if args.page_sizes else (
            [0, 32] if args.quick else list(PAGE_SIZES))
        results = run(sizes, [int(s) for s in args.budget_sizes.split(",")])
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))
    text = markdown(results, command)
    args.markdown.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
