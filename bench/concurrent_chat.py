"""Concurrent chat: U users at once, each a multi-turn conversation, through real HTTP servers, one server at a time.

Every user has its own long system prompt (bench/chat.py's, about 400 tokens here) and fixed assistant turns (so
every server sees the same prompts); the users' conversations run at the same time, each sending its next turn as
soon as the previous reply ended. Replies are streamed, up to ``--max-tokens`` tokens (32; exactly that many with
``--fixed-replies``) at temperature 0, with the same chat format and ``repeat_penalty`` on every server. Per
server: wall time, completion tokens, TTFT p50 / p95 of the turns after the first, failed requests, and how many
replies equal those of the same server with one slot in the first round (ckpt-serve ``--parallel 1``,
``llama-server -np 1``).

Servers (same model, same settings): ckpt-serve ``--parallel 1`` and ``--parallel 4`` (both with
``--interrupt_requests false``: the host's default cuts a running stream short when the next request arrives);
``llama_cpp.server --interrupt_requests false`` (``--host-alone``); C++ ``llama-server -np 4`` and ``-np 1`` when an
executable of that name is on ``PATH``; ckpt-serve ``--parallel 4 --kv-unified true`` with ``--kv-unified``, its
pool the same number of cells as ``--parallel 4``'s streams (``--n_ctx`` four times as large); ``--servers p4,p4u``
runs only those. ``--shared-system N``: every user gets one N-token system prompt (a tool list shared by agents)
instead of one of its own. Peak resident memory: ``VmHWM`` of the server process after the run.

Run: ``.venv/bin/python bench/chat.py --concurrent 8,16`` (or this file: ``--users 8,16``, ``--turns 3``,
``--repeats 2``, ``--markdown OUT``, ``--report-json OUT``). ``p8u`` and ``ls8u`` (``--servers``): eight slots over
one pool of the cells of four streams, ckpt-serve ``--parallel 8 --kv-unified true`` and ``llama-server -np 8 -kvu``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import httpx

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from _common import Report, gemma_path  # noqa: E402
from ckpt_plugin.hosts.llama_cpp.serving.chat_formats import TRANSCRIPT_FORMAT, TRANSCRIPT_STOP  # noqa: E402
from chat_servers import Config, start  # noqa: E402
from chat_workload import ASSISTANT_REPLIES, USER_MESSAGES, system_prompt, token_counter  # noqa: E402

N_CTX, N_BATCH, N_THREADS = 4096, 512, 2
SYSTEM_TOKENS = 400
END_OF_GENERATION = (1, 106, 212)
"""Gemma-3's end-of-generation tokens (``<eos>``, ``<end_of_turn>``, and ``</s>``, which llama.cpp counts as one)."""


@dataclass
class Turn:
    user: int
    turn: int
    ttft: float | None = None
    seconds: float = 0.0
    text: str = ""
    completion_tokens: int = 0
    error: str | None = None


@dataclass
class Outcome:
    label: str
    users: int
    wall: float = 0.0
    turns: list[Turn] = field(default_factory=list)
    peak_rss: int = 0
    state_bytes: int = 0

    @property
    def later_ttfts(self) -> list[float]:
        return sorted(t.ttft for t in self.turns if t.turn > 0 and t.ttft is not None)


ONLY_WHEN_NAMED = {"p8u", "ls8u", "p4w"}
"""Servers run only when ``--servers`` names them."""


def servers(model: str, host_alone: bool, fixed: bool = False, unified: int = 0) -> list[Config]:
    python = sys.executable
    settings = ["--model", model, "--n_ctx", str(N_CTX), "--n_batch", str(N_BATCH), "--n_ubatch", str(N_BATCH),
                "--n_threads", str(N_THREADS), "--n_threads_batch", str(N_THREADS), "--seed", "0",
                "--interrupt_requests", "false"]
    # The plain transcript (the embedded model's default adds example turns), named because --model names the file
    # (llama-server gets the same through bench/transcript.jinja); with fixed replies, a format without stop strings
    # (bench/alpaca.jinja).
    chat_format, template = ("alpaca", "alpaca.jinja") if fixed else (TRANSCRIPT_FORMAT, "transcript.jinja")
    ours = [python, "-m", "ckpt_plugin_integrations.llama_cpp_server", *settings, "--chat_format", chat_format,
            "--admin", "true"]  # /checkpoints/stats: the states held at the end
    out = [Config("p1", "ckpt-serve --parallel 1", [*ours, "--parallel", "1"], ckpt=True),
           Config("p4", "ckpt-serve --parallel 4", [*ours, "--parallel", "4"], ckpt=True),
           # states kept whole (as before pages): what pages change, side by side
           Config("p4w", "ckpt-serve --parallel 4 --page-positions 0", [*ours, "--parallel", "4",
                                                                         "--page-positions", "0"], ckpt=True)]
    if unified:  # one pool of ``unified`` cells: --n_ctx is the pool's size
        pooled = [*ours, "--parallel", "4", "--kv-unified", "true", "--n_ctx", str(unified)]
        out.append(Config("p4u", f"ckpt-serve --parallel 4 --kv-unified --n_ctx {unified}", pooled, ckpt=True))
    # Eight slots over the cells of four streams (one pool): more requests in flight at once, the same KV memory.
    wide = [*ours, "--parallel", "8", "--kv-unified", "true", "--n_ctx", str(4 * N_CTX)]
    out.append(Config("p8u", f"ckpt-serve --parallel 8 --kv-unified true --n_ctx {4 * N_CTX}", wide, ckpt=True))
    if host_alone:
        out.append(Config("host", "llama_cpp.server", [python, "-m", "llama_cpp.server", *settings]))
    binary = shutil.which("llama-server")
    if binary:
        for key, n, flags in (("ls4", 4, []), ("ls1", 1, []), ("ls8u", 8, ["-kvu"])):
            cells = N_CTX * (4 if flags else n)
            out.append(Config(key, " ".join([f"llama-server -np {n}", *flags] + ([f"-c {cells}"] if flags else [])), [
                binary, "-m", model, "-c", str(cells), "-b", str(N_BATCH), "-ub", str(N_BATCH), "-t",
                str(N_THREADS), "-tb", str(N_THREADS), "-np", str(n), *flags, "--seed", "0",
                "--chat-template-file", str(ROOT / "bench" / template)], health="/health", llama_server=True))
    return out


def conversations(users: int, turns: int, count: Any, shared_system: int = 0) -> list[list[list[dict[str, str]]]]:
    """Per user, the messages of each turn (fixed assistant replies, so every server sees the same prompts); with
    ``shared_system``, every user's system prompt is one of that many tokens."""
    out = []
    for user in range(users):
        system = system_prompt(0, shared_system, count) if shared_system else system_prompt(user, SYSTEM_TOKENS, count)
        history = [{"role": "system", "content": system}]
        per_turn = []
        for turn in range(turns):
            history.append({"role": "user", "content": USER_MESSAGES[(user * 3 + turn) % len(USER_MESSAGES)]})
            per_turn.append([dict(m) for m in history])
            history.append({"role": "assistant", "content": ASSISTANT_REPLIES[(user + turn) % len(ASSISTANT_REPLIES)]})
        out.append(per_turn)
    return out


def one_turn(
    url: str, messages: list[dict[str, str]], max_tokens: int, result: Turn, llama_server: bool = False,
    fixed: bool = False,
) -> None:
    # repeat_penalty named: llama_cpp.server's default is 1.1 and llama-server's 1.0 (off), and a penalty costs a
    # pass over the whole vocabulary per token; both servers sample alike with it named.
    body = {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "repeat_penalty": 1.0}
    if fixed:
        # Every reply max_tokens long: no end-of-generation token (the alpaca format has no stop string).
        body["logit_bias"] = {str(token): -100 for token in END_OF_GENERATION}
    elif llama_server:
        # The same prompts and stops as ckpt-serve's chat format for the template-less default model
        # (bench/transcript.jinja renders it), so that both servers do the same work.
        body["stop"] = list(TRANSCRIPT_STOP)
    started = time.perf_counter()
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}"
                return
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                for choice in chunk.get("choices") or []:
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        if result.ttft is None:
                            result.ttft = time.perf_counter() - started
                        result.text += content
                if chunk.get("usage"):
                    result.completion_tokens = int(chunk["usage"]["completion_tokens"])
    except httpx.HTTPError as exc:
        result.error = type(exc).__name__
    finally:
        result.seconds = time.perf_counter() - started


def run_server(config: Config, plan: list[list[list[dict[str, str]]]], max_tokens: int, fixed: bool = False
               ) -> Outcome:
    outcome = Outcome(config.label, len(plan))
    with start(config) as server:
        # One warm-up request (not measured): model pages in, kernels ready.
        one_turn(server.url, [{"role": "user", "content": "Hello"}], 4, Turn(-1, -1))

        def user_loop(user: int) -> None:
            for turn, messages in enumerate(plan[user]):
                result = Turn(user, turn)
                one_turn(server.url, messages, max_tokens, result, config.llama_server, fixed)
                outcome.turns.append(result)

        threads = [threading.Thread(target=user_loop, args=(u,)) for u in range(len(plan))]
        started = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        outcome.wall = time.perf_counter() - started
        outcome.peak_rss = server.proc_status().get("VmHWM", 0)
        if config.ckpt:
            (stats,) = httpx.get(f"{server.url}/checkpoints/stats", timeout=30).json()["models"].values()
            outcome.state_bytes = int(stats["resident_bytes"])
    return outcome


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def run(users: Sequence[int], turns: int, max_tokens: int, host_alone: bool, repeats: int = 1,
        fixed: bool = False, *, unified: int = 0, only: Sequence[str] = (), shared_system: int = 0) -> Report:
    model = gemma_path()
    count = token_counter(model)
    report = Report("Concurrent users" + (f", {max_tokens}-token replies" if fixed else ""))
    replies = (f"exactly {max_tokens} tokens per reply (chat format `alpaca` / bench/alpaca.jinja, which has no stop "
               "string, and end-of-generation tokens banned)" if fixed else
               f"up to {max_tokens} tokens per reply, ending where the model starts the next turn (chat format "
               "`ckpt-transcript` / bench/transcript.jinja, same stops)")
    systems = (f"one {shared_system}-token system prompt for all" if shared_system else
               f"each user a {SYSTEM_TOKENS}-token system prompt of its own")
    report.text(f"Gemma-3-270M (Q4_K_M), n_ctx {N_CTX} per slot, n_batch {N_BATCH}, {N_THREADS} threads; {systems} and "
                f"{turns} turns, all users at once, streamed, "
                f"{replies}, at temperature 0. Both servers get the same prompts. One server at a time; the servers "
                f"take turns ({repeats} round{'s' if repeats > 1 else ''}, medians), so that a slower period of the "
                "machine falls on all of them.")
    for n_users in users:
        plan = conversations(n_users, turns, count, shared_system)
        configs = [c for c in servers(model, host_alone, fixed, unified)
                   if (c.key in only if only else c.key not in ONLY_WHEN_NAMED)]
        runs: dict[str, list[Outcome]] = {config.key: [] for config in configs}
        for round_ in range(repeats):
            for config in configs if round_ % 2 == 0 else configs[::-1]:
                runs[config.key].append(run_server(config, plan, max_tokens, fixed))
        # Each server against its one-slot counterpart's first round: ckpt-serve against --parallel 1, llama-server
        # against -np 1 (the two evaluate in other batch splits, so their own replies differ at near ties).
        one_slot = {"p1": "p1", "p4": "p1", "ls4": "ls1", "ls1": "ls1", "ls8u": "ls1"}
        rows = []
        walls: dict[str, float] = {}
        p50s: dict[str, float] = {}
        p95s: dict[str, float] = {}
        for config in configs:
            outcomes = runs[config.key]
            walls[config.key] = statistics.median(o.wall for o in outcomes)
            p50 = statistics.median(percentile(o.later_ttfts, 50) for o in outcomes)
            p95 = statistics.median(percentile(o.later_ttfts, 95) for o in outcomes)
            turns_done = [t for o in outcomes for t in o.turns]
            base_key = one_slot.get(config.key, "p1")
            base = {(t.user, t.turn): t.text for t in runs.get(base_key, runs[config.key])[0].turns}
            equal = sum(base.get((t.user, t.turn)) == t.text for t in turns_done)
            p50s[config.key], p95s[config.key] = p50, p95
            rows.append([config.label, f"{walls[config.key]:.1f} s",
                         round(statistics.median(sum(t.completion_tokens for t in o.turns) for o in outcomes)),
                         f"{p50:.2f} s", f"{p95:.2f} s", sum(t.error is not None for t in turns_done),
                         f"{equal}/{len(turns_done)}",
                         f"{statistics.median(o.peak_rss for o in outcomes) / 1e9:.2f} GB",
                         f"{statistics.median(o.state_bytes for o in outcomes) / 1e6:.0f} MB" if config.ckpt else "-"])
        report.text(f"**{n_users} users at once**")
        report.table(["server", "wall", "completion tokens", "TTFT p50 (turns 2+)", "p95", "failed",
                      "replies equal to one slot's first round", "peak RSS",
                              "states held at the end"], rows)
        if "p1" in walls and "p4" in walls:
            report.figure(f"{n_users} users: wall --parallel 4 / --parallel 1", f"{walls['p4'] / walls['p1']:.2f}x",
                          "<= 0.8x")
        if "ls4" in walls and "p4" in walls:
            for name, ours, theirs in (("wall", walls, walls), ("TTFT p50", p50s, p50s), ("TTFT p95", p95s, p95s)):
                report.figure(f"{n_users} users: {name} --parallel 4 / llama-server -np 4",
                              f"{ours['p4'] / theirs['ls4']:.2f}x", "<= 1.0x")
        for key, label in (("p8u", "--parallel 8 --kv-unified"), ("p4", "--parallel 4")):
            for other, other_label in (("ls4", "llama-server -np 4"), ("ls8u", "llama-server -np 8 -kvu")):
                if key in walls and other in walls and (key, other) != ("p4", "ls4"):
                    for name, values in (("wall", walls), ("TTFT p50", p50s)):
                        report.figure(f"{n_users} users: {name} {label} / {other_label}",
                                      f"{values[key] / values[other]:.2f}x")
    return report


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", default="8,16", help="user counts, comma-separated (default 8,16)")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--host-alone", action="store_true", help="also llama_cpp.server without the plugin")
    parser.add_argument("--fixed-replies", action="store_true",
                        help="every reply --max-tokens long (a chat format without stop strings, end-of-generation "
                        "tokens banned) instead of ending where the model starts the next turn")
    parser.add_argument("--repeats", type=int, default=2, help="rounds, the servers taking turns (default 2)")
    parser.add_argument("--kv-unified", type=int, nargs="?", const=4 * N_CTX, default=0, metavar="CELLS",
                        help="also ckpt-serve --parallel 4 --kv-unified true with a pool of CELLS (default: the "
                        "cells of --parallel 4's streams)")
    parser.add_argument("--servers", default="",
                        help="only these servers, comma-separated (p1,p4,p4u,p8u,host,ls4,ls1,ls8u)")
    parser.add_argument("--shared-system", type=int, default=0,
                        help="one system prompt of this many tokens for every user (default: one of its own each)")
    parser.add_argument("--markdown", type=pathlib.Path)
    parser.add_argument("--report-json", type=pathlib.Path)
    args = parser.parse_args(argv)
    report = run([int(u) for u in args.users.split(",")], args.turns, args.max_tokens, args.host_alone, args.repeats,
                 args.fixed_replies, unified=args.kv_unified, only=[k for k in args.servers.split(",") if k],
                 shared_system=args.shared_system)
    text = report.markdown()
    print(text)
    if args.markdown:
        args.markdown.write_text(text)
    if args.report_json:
        args.report_json.write_text(report.to_json())


if __name__ == "__main__":
    main()
