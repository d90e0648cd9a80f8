"""Plans by cost: what the plugin adds to a cold prompt, and a far shared tier that never makes a request slower.

On Gemma-3-270M (the default model; n_ctx 4096, n_batch 512, 2 threads, ``swa_full=False``):

- cold prompt: a new 2,000-token prompt through ``Llama.create_completion`` (one token generated) on an empty
  context, attached against plain on the same ``Llama`` (attached and detached in turn, the attached side keeping one
  prompt cache so that its buffers are recycled as in a running server), in interleaved rounds with the order
  alternating; medians and the median of the per-round ratios. Goal: attached / plain <= 1.03.
- far tier: a redis-server behind a link of 20 ms round trips and 50 MB/s (``ckpt_plugin/testing/delay_proxy.py``)
  holding what other replicas served (a 1,500-token conversation and a 1,064-token one); three requests, each timed
  with the tier (plans by cost), without the tier, and with the tier but planning by tokens (``plan_by_cost=False``,
  what the planner did before it knew costs), in interleaved rounds after one warm-up round (where the engine measures
  the link): a short suffix the live memory nearly holds, a long prefix only the tier holds, a short prefix only the
  tier holds. Goal: with / without the tier <= 1.05 for every request.

Run: ``.venv/bin/python bench/cost.py`` (7 rounds, about 3 minutes), ``--quick`` (3 rounds), ``--only cold|far``,
``--markdown PATH`` (default ``docs/bench-sections/70-plans-by-cost.md``; ``-`` for none), ``--json PATH``.
"""

from __future__ import annotations

import gc
import pathlib
import statistics
import sys
import time
from typing import Any, Callable

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from _common import GEMMA_VOCAB, Report, cli, emit, fmt_ratio, open_gemma, random_prompt, random_tokens  # noqa: E402

import ckpt_plugin  # noqa: E402
from ckpt_plugin.testing.delay_proxy import delay_proxy  # noqa: E402
from ckpt_plugin.tiers.ram import PromptCache  # noqa: E402
from ckpt_plugin.hosts.llama_cpp.seam.context import clear_memory  # noqa: E402

MARKDOWN_PATH = ROOT / "docs" / "bench-sections" / "70-plans-by-cost.md"
COLD_TOKENS = 2000
GOAL_COLD, GOAL_FAR = 1.03, 1.05
VARIANTS = ("tier, by cost", "no tier", "tier, by tokens")
FAR_NOTES = """How to read it:

- Short suffix: the tier holds 64 tokens more than the live memory, 110 ms of evaluation here, but fetching them
  means the entry's full state (11 MB at 50 MB/s: 0.23 s) after the lookup's two round trips; planning by tokens
  fetched it anyway. By cost the tier is not even asked: its lookup alone would cost more than
  5% of what is left to evaluate (`cost_probes.CostProbe`).
- Long prefix: 1,500 tokens to evaluate (2.7 s) against three round trips and the bytes: fetched either way.
- Short prefix: a lookup would cost 10% of the request, and even the tier's best answer could save little: not
  asked. Planning by tokens, the fetch moved no bytes here (its blobs were still held in this process from the
  long-prefix request of the same round, which the shared tier reuses by digest), which is why it is faster in
  this run; a replica that never held them fetches the 1,500-token entry's full state and a checkpoint (20 MB).
- The rates are measured by the engine as it serves (decode calls, restores, the lookups' round trips, the fetches);
  the warm-up round is where it first measures the link."""


def complete(llama: Any, prompt: list[int]) -> None:
    llama.create_completion(prompt, max_tokens=1, temperature=0.0)


def fmt_s(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 10 else f"{seconds:.1f} s"


# ---------------------------------------------------------------------------------------------------------------------
# cold prompt


def cold(report: Report, rounds: int) -> None:
    llama = open_gemma()
    bos = int(llama.token_bos())
    rng = np.random.default_rng(3)
    cache = PromptCache(1 << 30)
    manager: list[Any] = []

    def empty() -> None:
        clear_memory(llama)
        llama.reset()

    def plain() -> float:
        if manager:
            ckpt_plugin.detach(llama)
            manager.clear()
        empty()
        prompt = random_prompt(rng, COLD_TOKENS, GEMMA_VOCAB, bos)
        started = time.perf_counter()
        complete(llama, prompt)
        return time.perf_counter() - started

    def attached() -> float:
        if not manager:
            empty()
            manager.append(ckpt_plugin.attach(llama, cache=cache, load_entrypoints=False))
        manager[0].clear_slot()
        cache.clear()
        empty()
        prompt = random_prompt(rng, COLD_TOKENS, GEMMA_VOCAB, bos)
        started = time.perf_counter()
        complete(llama, prompt)
        return time.perf_counter() - started

    times: dict[str, list[float]] = {"attached": [], "plain": []}
    ratios = []
    gc.collect()
    for index in range(rounds + 1):
        order = [("attached", attached), ("plain", plain)]
        if index % 2:
            order.reverse()
        got = {name: run() for name, run in order}
        if index == 0:
            continue  # warm-up: first decodes, first mappings
        for name, seconds in got.items():
            times[name].append(seconds)
        ratios.append(got["attached"] / got["plain"])
    if manager:
        ckpt_plugin.detach(llama)
    llama.close()
    median = {name: statistics.median(values) for name, values in times.items()}
    paired = statistics.median(ratios)
    report.text(f"### Cold prompt\n\nA new {COLD_TOKENS:,}-token prompt on an empty context, one token generated "
                f"(`Llama.create_completion`), attached against plain on the same `Llama`, {rounds} interleaved rounds "
                "after a warm-up round, the order alternating.")
    report.table(["", "median", "per round"], [
        [name, fmt_s(median[name]), ", ".join(f"{s:.2f}" for s in times[name])] for name in ("attached", "plain")])
    report.text(f"attached / plain: {fmt_ratio(median['attached'] / median['plain'])} (medians), "
                f"{fmt_ratio(paired)} (median of the per-round ratios); goal <= {GOAL_COLD}x.")
    report.figure(f"new {COLD_TOKENS:,}-token prompt, attached / plain `Llama`", fmt_ratio(paired), f"<= {GOAL_COLD}x")


# ---------------------------------------------------------------------------------------------------------------------
# far shared tier


def far(report: Report, rounds: int) -> None:
    from shared_tier import redis_server

    from ckpt_plugin.services.publishing import publish

    with redis_server() as url:
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        with delay_proxy("127.0.0.1", port, one_way_delay=0.010, bandwidth=50e6) as proxy:
            llama = open_gemma()
            manager = ckpt_plugin.attach(llama, redis_url=proxy.url, redis_timeout=30, redis_prefix="cost",
                                         load_entrypoints=False)
            tier = manager.store.shared
            assert tier is not None
            bos = int(llama.token_bos())
            rng = np.random.default_rng(11)
            base = random_prompt(rng, 1500, GEMMA_VOCAB, bos)

            def reset() -> None:
                manager.store.clear()
                manager.primary.clear_slot()
                llama.reset()
                gc.collect()

            # What other replicas served, in the tier.
            for prompt in (base, base[:1064]):
                reset()
                complete(llama, prompt)
                assert publish(manager) and tier.drain(120)
            # What this replica served itself: the live state of the first request.
            reset()
            manager.store.shared = None
            complete(llama, base[:1000])
            local = manager.primary.save()
            manager.store.shared = tier

            requests: dict[str, tuple[Callable[[], None], list[int]]] = {
                "short suffix: the live memory holds 1,000 of 1,068 tokens, the tier 1,064":
                    (lambda: manager.primary.load(local), base[:1064] + random_tokens(rng, 4, GEMMA_VOCAB)),
                "long prefix: only the tier holds 1,500 of 1,504 tokens":
                    (lambda: None, base + random_tokens(rng, 4, GEMMA_VOCAB)),
                "short prefix: only the tier holds 64 of 264 tokens":
                    (lambda: None, base[:64] + random_tokens(rng, 200, GEMMA_VOCAB)),
            }

            def variant(name: str) -> None:
                manager.store.shared = None if name == "no tier" else tier
                manager.rules.costs.enabled = name != "tier, by tokens"

            times = {(r, v): [] for r in requests for v in VARIANTS}
            counts: dict[tuple[str, str], tuple[int, int, int]] = {}
            for index in range(rounds + 1):
                for request, (setup, prompt) in requests.items():
                    order = VARIANTS if index % 2 == 0 else tuple(reversed(VARIANTS))
                    for name in order:
                        variant(name)
                        reset()
                        setup()
                        evaluated, hits, trips = (manager.counters.tokens_evaluated, tier.counters.hits,
                                                  tier.counters.round_trips)
                        started = time.perf_counter()
                        complete(llama, prompt)
                        seconds = time.perf_counter() - started
                        counts[request, name] = (manager.counters.tokens_evaluated - evaluated,
                                                 tier.counters.hits - hits, tier.counters.round_trips - trips)
                        if index:
                            times[request, name].append(seconds)
            variant("tier, by cost")
            costs = manager.rules.costs.snapshot()
            ckpt_plugin.detach(llama)
            llama.close()

    median = {key: statistics.median(values) for key, values in times.items()}
    report.text("### A far shared tier\n\nredis-server behind a link of 20 ms round trips and 50 MB/s each way "
                "(`ckpt_plugin/testing/delay_proxy.py`), holding a 1,500-token and a 1,064-token conversation other "
                "replicas served; each request with the tier (plans by cost), without it, and with it but planning by "
                f"tokens (`plan_by_cost=False`); {rounds} interleaved rounds after a warm-up round in which the engine "
                "measured the link. Tokens evaluated, shared-tier hits and round trips are those of the last round.")
    rows, worst = [], 0.0
    for request in requests:
        with_tier = median[request, "tier, by cost"] / median[request, "no tier"]
        by_tokens = median[request, "tier, by tokens"] / median[request, "no tier"]
        worst = max(worst, with_tier)
        rows.append([request, *(f"{fmt_s(median[request, v])} ({counts[request, v][0]} / {counts[request, v][1]} / "
                                f"{counts[request, v][2]})" for v in VARIANTS), fmt_ratio(with_tier),
                     fmt_ratio(by_tokens)])
    report.table(["request", *(f"{v}: median (evaluated / hits / round trips)" for v in VARIANTS),
                  "by cost / no tier", "by tokens / no tier"], rows)
    shared, ram = costs["transfers"]["shared"], costs["transfers"]["ram"]
    measured = {batch: seconds for batch, seconds in costs["eval_seconds_per_token"].items() if seconds is not None}
    eval_rates = ", ".join(f"{batch}+: {seconds * 1000:.2f} ms" for batch, seconds in measured.items())
    report.text(f"Rates the engine measured: evaluation per token by batch size {eval_rates}; shared tier "
                f"{shared['latency_seconds'] * 1000:.1f} ms a round trip, {shared['bytes_per_second'] / 1e6:.0f} MB/s; "
                f"restore into the context {ram['bytes_per_second'] / 1e9:.1f} GB/s. Plans: {costs['plans']}, "
                f"{costs['plans_by_cost']} of them by cost, {costs['lookups_skipped_by_cost']} lookups and "
                f"{costs['fetches_skipped_by_cost']} fetches skipped; actual / estimated time "
                f"{costs['actual_seconds'] / max(costs['estimated_seconds'], 1e-9):.2f} over all plans.")
    report.text(FAR_NOTES)
    report.figure("far shared tier: slowest request with / without the tier", fmt_ratio(worst), f"<= {GOAL_FAR}x")


def main(argv: list[str] | None = None) -> None:
    parser = cli(__doc__)
    parser.add_argument("--only", choices=("cold", "far"), action="append", help="run only these parts")
    parser.add_argument("--markdown", default=str(MARKDOWN_PATH), help="where to write the section ('-': nowhere)")
    args = parser.parse_args(argv)
    rounds = 3 if args.quick else 7
    report = Report("Plans by cost (`bench/cost.py`)")
    report.text("Written by `bench/cost.py`. Gemma-3-270M Q4_K_M, `n_ctx` 4096, `n_batch` 512, 2 threads, "
                f"`swa_full=False`. Command: `.venv/bin/python bench/cost.py{' --quick' if args.quick else ''}`.")
    parts = args.only or ["cold", "far"]
    if "cold" in parts:
        cold(report, rounds)
    if "far" in parts:
        far(report, rounds)
    report.table(["figure", "measured", "goal"], [[f.name, f.value, f.goal] for f in report.figures])
    emit(report, args.json)
    if args.markdown != "-":
        pathlib.Path(args.markdown).write_text(report.markdown())


if __name__ == "__main__":
    main()
