"""What publishing KV events costs a turn: 4 users taking turns on one Gemma-3-270M context (each turn parks the
previous user's state and restores the next one's, checkpoints every 256 tokens: the captures that make pages), with
the ZeroMQ publisher of ``--kv-events-config`` listening on the page store (its PUB socket sends every batch; a
subscriber, in another process, costs the ZeroMQ I/O thread, not this one).

Figures: events and batches per turn, the time the capturing thread spent announcing pages (``PageStore
.announce_seconds``: describing each new page, queueing the notification, watching the page go), the publisher
thread's CPU time, and their sum as a share of the turn's wall time (goal: <= 1%, issue 49).

Run: ``.venv/bin/python bench/kv_events.py`` (4 users x 6 turns, about a minute on 2 cores), ``--quick`` (the tiny
random llama, 2 users x 3 turns), ``--json PATH``.
"""

from __future__ import annotations

import pathlib
import sys
import time
from collections.abc import Sequence

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from _common import GEMMA_OPTIONS, TINY_OPTIONS, Report, cli, emit, gemma_path, open_llama, tiny_path  # noqa: E402

from ckpt_plugin import attach  # noqa: E402
from ckpt_plugin.core.kv_events_config import KvEventsConfig  # noqa: E402
from ckpt_plugin.core.pages import PAGES  # noqa: E402
from ckpt_plugin.services.kv_publisher import KvEventPublisher  # noqa: E402
from ckpt_plugin.testing.ports import free_port  # noqa: E402

SYSTEM = "You answer questions about the weather in a small harbour town, briefly and kindly. "
USERS = ["Will it rain today?", "And tomorrow morning?", "Is the wind strong?", "Should I take the ferry?",
         "What about the weekend?", "Thanks, and next week?"]


def main(argv: Sequence[str] | None = None) -> None:
    args = cli(__doc__, quick_help="the tiny llama, 2 users x 3 turns").parse_args(argv)
    users, turns = (2, 3) if args.quick else (4, 6)
    path, options = (tiny_path("llama"), TINY_OPTIONS) if args.quick else (gemma_path(), GEMMA_OPTIONS)
    llama = open_llama(path, **options)
    attach(llama, checkpoint_min_step=256)
    publisher = KvEventPublisher(KvEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{free_port()}"))
    PAGES.listen(publisher)
    conversations = [[{"role": "system", "content": f"Visitor {user}. " + SYSTEM * 8}] for user in range(users)]
    wall = 0.0
    for turn in range(turns):
        for messages in conversations:
            messages.append({"role": "user", "content": USERS[turn % len(USERS)]})
            started = time.perf_counter()
            reply = llama.create_chat_completion(messages=messages, max_tokens=16, temperature=0)
            wall += time.perf_counter() - started
            messages.append({"role": "assistant", "content": reply["choices"][0]["message"]["content"]})
    time.sleep(0.5)
    PAGES.listen(None)
    publisher.close()
    n_turns = users * turns
    stats = publisher.stats()
    spent = PAGES.announce_seconds + stats["thread_seconds"]
    report = Report("What KV events cost a turn")
    report.text(f"{users} users x {turns} turns on one context of "
                f"{'the tiny llama' if args.quick else 'Gemma-3-270M'}, each turn parking the previous user's state "
                "(a capture: pages) and restoring the next one's; the publisher listening.")
    report.table(["turns", "turn (mean)", "events / turn", "batches / turn", "bytes / turn",
                  "announcing / turn", "publisher thread / turn", "share of a turn"],
                 [[n_turns, f"{1000 * wall / n_turns:.1f} ms", f"{stats['events'] / n_turns:.1f}",
                   f"{stats['batches'] / n_turns:.1f}", f"{stats['bytes'] / n_turns:.0f}",
                   f"{1e6 * PAGES.announce_seconds / n_turns:.0f} µs", f"{1e6 * stats['thread_seconds'] / n_turns:.0f} µs",
                   f"{100 * spent / wall:.3f}%"]])
    report.figure("KV events: share of a turn", f"{100 * spent / wall:.3f}%", "<= 1%")
    emit(report, args.json)


if __name__ == "__main__":
    main()
