"""Shared tier: interleaved chat across 2 ckpt-serve replicas with round-robin routing (no affinity), on Gemma-3-270M.

The conversation of ``bench/chat.py`` (each user a ~660-token system prompt of its own, short user messages, fixed
assistant replies), with an odd number of users so that round-robin routing sends every turn after the first to the
replica that did *not* serve the user's previous turn. Configurations, each with fresh servers (and a fresh
redis-server where it has one), run one after the other, in ``--rounds`` rounds with the order rotated:

- ``shared``: 2 replicas sharing one redis-server (``--checkpoint-redis-url``), round-robin;
- ``local``: the same 2 replicas without the shared tier, round-robin;
- ``one``: 1 replica alone (every turn on the replica that served the previous one);
- ``one-shared``: 1 replica alone with the shared tier (what the tier costs a single replica);
- ``one-shared-far``: the same with redis-server at the lowest CPU priority (nice 19), standing for a server on
  another machine: on these 2 cores, storing 21 MB a turn is CPU the replica would otherwise have;
- ``cluster``: 2 replicas sharing a 3-node Redis Cluster, each given another node's URL, round-robin (with
  ``shared`` and ``local``: the cluster against one Redis, ``docs/bench-sections/61-shared-cluster.md``).

TTFT (time to the first content chunk of a streamed response) medians over the turns after the first; Redis round
trips and bytes per request from the replicas' ``ckpt_shared_*`` counters. Goals: moved turns with the shared tier
within 1.5x of same-replica turns and at most 0.25x of moved turns without it; a single replica with the tier within
5% of one without it.

Run: ``.venv/bin/python bench/shared_tier.py`` (3 users x 4 turns, 3 rounds, about 13 minutes), ``--quick`` (1
round), ``--users``, ``--turns``, ``--rounds``, ``--configs``, ``--markdown PATH`` (default
``docs/bench-sections/60-shared-tier.md``), ``--json PATH``; ``--render JSON`` writes the markdown of a saved run again.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from _common import fmt_bytes, fmt_ratio, markdown_table, ratio  # noqa: E402
from chat import N_BATCH, N_CTX, N_THREADS, Config, ForeignLoad, Request, _stream, conversation, start  # noqa: E402
from chat import token_counter  # noqa: E402
from redis_servers import redis_cluster, redis_server  # noqa: E402  (bench/cost.py takes redis_server from here)

MARKDOWN_PATH = ROOT / "docs" / "bench-sections/60-shared-tier.md"
DEFAULT_USERS, DEFAULT_TURNS, DEFAULT_ROUNDS, MAX_TOKENS = 3, 4, 3, 16
CONFIGS = ("shared", "local", "one", "one-shared", "one-shared-far", "cluster")
DEFAULT_CONFIGS = CONFIGS[:5]  # the cluster runs on its own: --configs shared,cluster,local
CLUSTER_MARKDOWN_PATH = ROOT / "docs" / "bench-sections/61-shared-cluster.md"
GOALS = {"moved_over_same": 1.5, "moved_over_local": 0.25, "unseen_over_local": 0.25, "one_shared_over_one": 1.05,
         "one_shared_far_over_one": 1.05, "cluster_over_shared": 1.25, "cluster_over_fresh": 0.25}


def replica_config(model: str, name: str, redis_url: str | None) -> Config:
    command = [sys.executable, "-m", "ckpt_plugin_integrations.llama_cpp_server", "--model", model,
               "--n_ctx", str(N_CTX), "--n_batch", str(N_BATCH), "--n_ubatch", str(N_BATCH),
               "--n_threads", str(N_THREADS), "--n_threads_batch", str(N_THREADS), "--seed", "0",
               "--verbose", "false"]
    if redis_url is not None:
        command += ["--checkpoint-redis-url", redis_url]
    return Config(name, name, command, ckpt=True)


@dataclass
class Turn:
    """One request: where it went, whether its user's previous turn went elsewhere, what it cost."""

    index: int
    user: int
    turn: int
    replica: int
    moved: bool
    unseen: bool  # the replica never served this user before: the whole conversation is new to it
    ttft: float
    prompt_tokens: int | None
    cached_tokens: int | None
    content: str


@dataclass
class Outcome:
    """One configuration in one round."""

    config: str
    round: int
    turns: list[Turn] = field(default_factory=list)
    shared: dict[str, float] = field(default_factory=dict)  # ckpt_shared_* counter deltas, summed over replicas
    foreign_cores: float = 0.0


TIMINGS = ("ckpt_shared_lookup_seconds", "ckpt_shared_fetch_seconds", "ckpt_restore_seconds")


def shared_counters(url: str) -> dict[str, float]:
    """``ckpt_shared_<name>_total`` counters of a replica (none without a shared tier), and the ``_sum`` and
    ``_count`` of its latency histograms (lookup, fetch, restore)."""
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if line.startswith("ckpt_shared_") and name.endswith("_total"):
            key = name[len("ckpt_shared_"):].removesuffix("_total")
        elif name.removesuffix("_sum").removesuffix("_count") in TIMINGS and name.endswith(("_sum", "_count")):
            key = name
        else:
            continue
        out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def drained(url: str, timeout: float = 30.0) -> None:
    """Wait until a replica's write-behind queue is empty."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = httpx.get(url + "/metrics", timeout=30).text
        depth = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                    if line.startswith("ckpt_shared_queue_depth"))
        if depth == 0:
            return
        time.sleep(0.05)


def run_config(name: str, model: str, requests: Sequence[Request], round_index: int, progress: bool) -> Outcome:
    """Start ``name``'s replicas (and redis-server), send the conversation through its routing, stop them."""
    import openai

    n_replicas = 2 if name in ("shared", "local", "cluster") else 1
    outcome = Outcome(name, round_index)
    with contextlib.ExitStack() as stack:
        if name == "cluster":
            urls: list[str | None] = list(stack.enter_context(redis_cluster(3)))  # replica i: node i's URL
        else:
            url = stack.enter_context(redis_server(19 if name.endswith("-far") else 0)) if "shared" in name else None
            urls = [url] * n_replicas
        servers = [stack.enter_context(start(replica_config(model, f"{name}-{i}", urls[i])))
                   for i in range(n_replicas)]
        clients = [openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=900) for s in servers]
        for client in clients:  # load the model's pages before the first timed request
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hello"}],
                                           max_tokens=2, temperature=0)
        before = [shared_counters(s.url) for s in servers]
        last_replica: dict[int, int] = {}
        seen: set[tuple[int, int]] = set()
        load = ForeignLoad(servers[0])
        for request in requests:
            replica = request.index % n_replicas  # round-robin, no affinity
            result = _stream(clients[replica], request, MAX_TOKENS, False)
            moved = request.user in last_replica and last_replica[request.user] != replica
            unseen = moved and (replica, request.user) not in seen
            last_replica[request.user] = replica
            seen.add((replica, request.user))
            outcome.turns.append(Turn(request.index, request.user, request.turn, replica, moved, unseen, result.ttft,
                                      result.prompt_tokens, result.cached_tokens, result.content))
            if progress:
                print(f"  [{name} r{round_index}] request {request.index:2d} user {request.user} turn {request.turn} "
                      f"on replica {replica}{' (moved)' if moved else ''}: TTFT {result.ttft:6.3f} s, cached "
                      f"{result.cached_tokens}/{result.prompt_tokens}", file=sys.stderr, flush=True)
        outcome.foreign_cores = load.cores()
        for server in servers:
            drained(server.url)
        after = [shared_counters(s.url) for s in servers]
        for old, new in zip(before, after):
            for key, value in new.items():
                outcome.shared[key] = outcome.shared.get(key, 0.0) + value - old.get(key, 0.0)
    return outcome


def _milliseconds(value: float) -> str:
    return "-" if value != value else f"{value * 1e3:.1f} ms"


def _seconds(value: float) -> str:
    return "n/a" if value != value else f"{value:.3f} s"


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def summarize(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    """TTFT medians (turns after the first, pooled over rounds), per-request Redis figures, ratios, goals."""
    by_config: dict[str, dict[str, Any]] = {}
    for name in CONFIGS:
        runs = [o for o in outcomes if o.config == name]
        if not runs:
            continue
        later = [t for o in runs for t in o.turns if t.turn > 0]
        n_requests = sum(len(o.turns) for o in runs)
        totals: dict[str, float] = {}
        for o in runs:
            for key, value in o.shared.items():
                totals[key] = totals.get(key, 0.0) + value
        means = {metric.removeprefix("ckpt_").removesuffix("_seconds"):
                 ratio(totals.get(f"{metric}_sum", 0.0), totals.get(f"{metric}_count", 0.0)) for metric in TIMINGS}
        by_config[name] = {
            "mean_seconds": means,
            "ttft_later": _median([t.ttft for t in later]),
            "ttft_later_per_round": [_median([t.ttft for t in o.turns if t.turn > 0]) for o in runs],
            "ttft_moved": _median([t.ttft for t in later if t.moved]),
            "ttft_unseen": _median([t.ttft for t in later if t.unseen]),
            "ttft_first": _median([t.ttft for o in runs for t in o.turns if t.turn == 0]),
            "cached_later": _median([float(t.cached_tokens or 0) for t in later]),
            "prompt_later": _median([float(t.prompt_tokens or 0) for t in later]),
            "n_requests": n_requests,
            "per_request": {key: value / n_requests for key, value in totals.items() if not key.startswith("ckpt_")},
            "foreign_cores": _median([o.foreign_cores for o in runs]),
        }
    ratios = {}
    if "shared" in by_config and "one" in by_config:
        ratios["moved_over_same"] = ratio(by_config["shared"]["ttft_moved"], by_config["one"]["ttft_later"])
    if "shared" in by_config and "local" in by_config:
        ratios["moved_over_local"] = ratio(by_config["shared"]["ttft_moved"], by_config["local"]["ttft_moved"])
        ratios["unseen_over_local"] = ratio(by_config["shared"]["ttft_unseen"], by_config["local"]["ttft_unseen"])
    if "cluster" in by_config and "shared" in by_config:
        ratios["cluster_over_shared"] = ratio(by_config["cluster"]["ttft_moved"], by_config["shared"]["ttft_moved"])
    if "cluster" in by_config and "local" in by_config:
        ratios["cluster_over_fresh"] = ratio(by_config["cluster"]["ttft_moved"], by_config["local"]["ttft_unseen"])
    for name, key in (("one-shared", "one_shared_over_one"), ("one-shared-far", "one_shared_far_over_one")):
        if name in by_config and "one" in by_config:
            ratios[key] = ratio(by_config[name]["ttft_later"], by_config["one"]["ttft_later"])
    reference = {t.index: t.content for o in outcomes if o.config == "one" for t in o.turns}
    same_answers = {name: sum(t.content == reference.get(t.index) for o in outcomes if o.config == name
                              for t in o.turns) for name in by_config}
    return {"configs": by_config, "ratios": ratios, "same_answers": same_answers}


LABELS = {
    "shared": "2 replicas + shared tier, round-robin",
    "local": "2 replicas, no shared tier, round-robin",
    "one": "1 replica alone",
    "one-shared": "1 replica alone + shared tier",
    "one-shared-far": "1 replica alone + shared tier, redis-server at nice 19",
    "cluster": "2 replicas + shared tier on a 3-node Redis Cluster (each given another node's URL), round-robin",
}


def markdown(summary: dict[str, Any], users: int, turns: int, rounds: int, command: str) -> str:
    configs, ratios = summary["configs"], summary["ratios"]
    rows = []
    for name, figures in configs.items():
        per = figures["per_request"]
        rows.append([
            f"`{name}`: {LABELS[name]}",
            f"{figures['ttft_later']:.3f} s ({', '.join(f'{v:.2f}' for v in figures['ttft_later_per_round'])})",
            _seconds(figures["ttft_moved"]),
            _seconds(figures["ttft_unseen"]),
            f"{figures['ttft_first']:.3f} s",
            f"{figures['cached_later']:.0f} / {figures['prompt_later']:.0f}",
            f"{per.get('round_trips', 0):.2f} + {per.get('write_round_trips', 0):.2f}" if per else "-",
            f"{fmt_bytes(per.get('bytes_read', 0))} / {fmt_bytes(per.get('bytes_written', 0))}" if per else "-",
            f"{summary['same_answers'][name]}/{figures['n_requests']}" if "one" in configs else "-",
            " / ".join(_milliseconds(figures["mean_seconds"][key]) for key in ("shared_lookup", "shared_fetch",
                                                                                 "restore")),
            f"{figures['foreign_cores']:.2f}",
        ])
    goal_rows = []
    for key, label in (("moved_over_same", "moved turns, shared tier / same-replica turns (`one`)"),
                       ("moved_over_local", "moved turns, shared tier / moved turns without it (`local`)"),
                       ("unseen_over_local", "... on a replica new to the conversation"),
                       ("one_shared_over_one", "single replica, with / without the shared tier"),
                       ("one_shared_far_over_one", "... redis-server at nice 19 (as on another machine)"),
                       ("cluster_over_shared", "moved turns, 3-node cluster / one redis-server (`shared`)"),
                       ("cluster_over_fresh", "moved turns, 3-node cluster / a fresh prompt (moved to a replica new to "
                        "the conversation without the tier, `local`)")):
        if key in ratios:
            value = ratios[key]
            goal_rows.append([label, fmt_ratio(value), f"<= {GOALS[key]}x",
                              "met" if value <= GOALS[key] else "missed"])
    per_shared = configs.get("shared", {}).get("per_request", {})
    lines = [
        "## Shared tier on a 3-node Redis Cluster and on one Redis (`bench/shared_tier.py --configs "
        "shared,cluster,local`)" if "cluster" in configs and "one" not in configs else
        "## Shared tier: replicas behind round-robin routing (`bench/shared_tier.py`)",
        "",
        "Written by `bench/shared_tier.py`; see `docs/shared-tier.md` for the design and `bench/README.md` for how "
        "benchmarks are run.",
        "",
        f"Gemma-3-270M Q4_K_M, `n_ctx` {N_CTX}, `n_batch` {N_BATCH}, {N_THREADS} threads; the conversation of "
        f"`bench/chat.py`: {users} users x {turns} turns, each user a ~660-token system prompt of its own, short user "
        f"messages, fixed assistant replies, {MAX_TOKENS} tokens generated per request, streamed. Requests go "
        f"round-robin over the replicas of a configuration with no affinity: with {users} users and 2 replicas, "
        "every turn after the first lands on the replica that did not serve the user's previous turn (a *moved* "
        f"turn). Each configuration starts fresh servers (and a fresh redis-server); {rounds} round(s), "
        "configurations in rotated order, TTFT medians pooled over the rounds, over the turns after the first.",
        "",
        f"Command: `{command}`",
        "",
        markdown_table(["configuration", "TTFT median, turns 2+ (per round)", "... moved turns",
                        "... moved to a replica new to the conversation", "TTFT median, first turns",
                        "cached / prompt tokens, turns 2+ (median)",
                        "Redis round trips / request (request path + write-behind)",
                        "bytes read / written per request", "same answer as `one`",
                        "mean lookup / fetch / restore", "other load (cores)"], rows),
        "",
        markdown_table(["ratio", "measured", "goal", ""], goal_rows),
        "",
    ]
    if per_shared:
        lines += [
            f"With the shared tier, a request costs {per_shared.get('round_trips', 0):.2f} round trips on its own "
            f"path on average (lookup: 1 `MGET` of index keys, 1 `MGET` of manifests when a stored prefix can beat "
            f"the local tiers; fetch: 1 `MGET` of blobs when the plan restores a shared entry) and "
            f"{per_shared.get('write_round_trips', 0):.2f} on the write-behind thread after the response; "
            f"{fmt_bytes(per_shared.get('bytes_read', 0))} read and {fmt_bytes(per_shared.get('bytes_written', 0))} "
            "written per request (the full state of the conversation and the checkpoint the next turn restores; "
            "checkpoints shared by entries are written once). "
            f"Shared-tier hits: {per_shared.get('hits', 0) * configs['shared']['n_requests']:.0f} of "
            f"{configs['shared']['n_requests']} requests.",
            "",
        ]
    per_cluster = configs.get("cluster", {}).get("per_request", {})
    if per_cluster:
        n_cluster = configs["cluster"]["n_requests"]
        lines += [
            f"On the 3-node cluster, a request costs {per_cluster.get('round_trips', 0):.2f} round trips on its own "
            f"path and {per_cluster.get('write_round_trips', 0):.2f} on the write-behind thread, "
            f"{fmt_bytes(per_cluster.get('bytes_read', 0))} read and "
            f"{fmt_bytes(per_cluster.get('bytes_written', 0))} written; shared-tier hits: "
            f"{per_cluster.get('hits', 0) * n_cluster:.0f} of {n_cluster} requests. A round trip there is one "
            "exchange with every node it involves at once (redis-py sends each node its commands, then reads the "
            "replies): the lookup's two `MGET`s go to the one node of the partition's hash slot, a fetch's blobs "
            "and a write's to the nodes of their own slots (docs/shared-tier.md). A moved turn restores the user's turn "
            "before last from the replica's own memory when the previous turn's entry is not stored yet, or when "
            "the planner, by the fetch rate it measured, finds evaluating the difference cheaper than the fetch: "
            "fewer hits and bytes read, and that turn evaluates two turns' tokens.",
            "",
        ]
    lines += [
        "How to read it:",
        "",
        "- Without the shared tier, a turn moved to a replica new to the conversation evaluates its whole prompt "
        "(the first moved turn of each user: column 4); later moved turns find the user's turn before last on the "
        "replica (with 2 replicas and round-robin, every other turn of a user lands on each), so they evaluate two "
        "turns' worth of tokens instead of one. The moved-turn ratio over all turns 2+ (second row of the goals) "
        "therefore mixes both cases; with more replicas, or any routing that does not bring a user back to a "
        "replica every other turn, moved turns are of the first kind. With the shared tier both kinds restore the "
        "previous turn's state and evaluate only the new tokens.",
        "- A moved turn costs what a same-replica turn costs plus the fetch of the state (the full state and the one "
        "checkpoint the plan restores, about 17 MB here) and its check: the mean lookup / fetch / restore column. "
        "The fetch runs over loopback on a machine where 2 replicas, the redis-server and other work share 2 cores.",
        "- The machine is shared: the last column is the CPU other processes used during the run, in cores of the 2 "
        "there are, and the per-round medians show how much a figure moves between rounds. Ratios within about "
        "0.2 of 1 are within that noise (a single replica with the tier cannot be faster than without it).",
        "- `same answer as one`: Gemma-3 Q4_K_M's logits depend slightly on how a prompt is split into batches "
        "(docs/correctness.md), and a replica that restores a different state splits differently; `local` differs "
        "as often as `shared` does. On the tiny test models, every answer equals a fresh context's "
        "(tests/server/test_shared_replicas.py).",
        "- The single replica with the tier writes every turn's state (21 MB) after the response; with redis-server "
        "on the same 2 cores, storing it takes CPU from the next request; at nice 19 (`one-shared-far`) the server "
        "uses only idle CPU, as one on another machine costs the replica nothing but the send.",
        "",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one round")
    parser.add_argument("--users", type=int, default=DEFAULT_USERS, help="users (odd: every later turn moves)")
    parser.add_argument("--turns", type=int, default=DEFAULT_TURNS)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                        help="comma-separated subset of " + ",".join(CONFIGS))
    parser.add_argument("--markdown", type=pathlib.Path, help=f"default: {MARKDOWN_PATH.relative_to(ROOT)}, or "
                        f"{CLUSTER_MARKDOWN_PATH.relative_to(ROOT)} for a run with the cluster")
    parser.add_argument("--json", type=pathlib.Path)
    parser.add_argument("--render", type=pathlib.Path, help="write the markdown of a run saved with --json again")
    args = parser.parse_args(argv)
    if args.markdown is None:
        args.markdown = CLUSTER_MARKDOWN_PATH if "cluster" in args.configs.split(",") else MARKDOWN_PATH
    if args.render is not None:
        saved = json.loads(args.render.read_text())
        outcomes = [Outcome(o["config"], o["round"], [Turn(**t) for t in o["turns"]], o["shared"],
                            o["foreign_cores"]) for o in saved["outcomes"]]
        summary = summarize(outcomes)
        args.markdown.write_text(markdown(summary, saved["users"], saved["turns"], saved["rounds"], saved["command"]))
        _print_ratios(summary)
        return
    rounds = args.rounds or (1 if args.quick else DEFAULT_ROUNDS)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle replicas must not spin on the 2 cores
    from ckpt_plugin.hosts.llama_cpp.serving.default_model import default_model_path

    model = str(default_model_path(progress=True))
    requests = conversation(args.users, args.turns, count=token_counter(model))
    chosen = [c for c in args.configs.split(",") if c]
    outcomes = []
    for round_index in range(rounds):
        order = chosen[round_index % len(chosen):] + chosen[: round_index % len(chosen)]
        for name in order:
            print(f"{name} (round {round_index + 1}/{rounds}): {LABELS[name]}", file=sys.stderr, flush=True)
            outcomes.append(run_config(name, model, requests, round_index, progress=True))
    summary = summarize(outcomes)
    defaults = {"users": DEFAULT_USERS, "turns": DEFAULT_TURNS, "rounds": 1 if args.quick else DEFAULT_ROUNDS}
    given = {"users": args.users, "turns": args.turns, "rounds": rounds}
    command = ".venv/bin/python bench/shared_tier.py" + (" --quick" if args.quick else "") + "".join(
        f" --{key} {value}" for key, value in given.items() if value != defaults[key]) + (
        f" --configs {','.join(chosen)}" if chosen != list(DEFAULT_CONFIGS) else "")
    text = markdown(summary, args.users, args.turns, rounds, command)
    args.markdown.write_text(text)
    if args.json is not None:
        args.json.write_text(json.dumps({"users": args.users, "turns": args.turns, "rounds": rounds,
                                         "command": command, "summary": summary,
                                         "outcomes": [asdict(o) for o in outcomes]}, indent=1))
    print(text)
    _print_ratios(summary)


def _print_ratios(summary: dict[str, Any]) -> None:
    for key, value in summary["ratios"].items():
        print(f"{key}: {fmt_ratio(value)} (goal <= {GOALS[key]}x)")


if __name__ == "__main__":
    main()
