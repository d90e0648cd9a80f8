"""Streaming side by side: time to first token, inter-token latency and output tokens/s of ``ckpt-serve --parallel 4``
and C++ ``llama-server -np 4`` on the same prompts, byte for byte, in one run.

The three workloads of GuideLLM's runs (the vLLM project's benchmark client), driven here by a small client of our own
so that the prompts are the same bytes on both servers and nothing needs a tokenizer download:

- ``shared``: 4 concurrent streams, 24 requests, each a ~1,000-token shared prefix plus ~128 tokens of its own, 32
  tokens out (a new request starts as soon as one ends: constant concurrency);
- ``turns``: 4 concurrent users, 3 turns each, each turn the conversation so far plus a new question, 32 out;
- ``sync``: one request at a time, 8 requests of ~512 tokens, 32 out.

Every reply is exactly 32 tokens on both servers (``ignore_eos``), sampled with each server's defaults (temperature
0.8, top-k 40, top-p 0.95, min-p 0.05 on both), flash attention on both, ``n_batch`` 512, 2 threads, a 4,096-token
context per slot. Inter-token latency is the gap between two consecutive chunks of one stream, over every stream of
the run (median); TTFT is from sending the request to its first chunk. The servers take turns, one round after the
other (``--rounds``, 2 by default), and each figure is the median of its rounds.

``python bench/streaming.py`` (``--quick``: fewer requests; ``--markdown PATH``: the section of docs/benchmarks.md). Needs ``llama-server`` on ``PATH`` for the ratios
(``bash bench/build_llama_server.sh``).
"""

from __future__ import annotations

import json
import pathlib
import queue
import shutil
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from _common import Report, cli, emit, fmt_ratio, gemma_path
from chat_servers import N_BATCH, N_CTX, N_THREADS, Config, start

SLOTS = 4
MAX_TOKENS = 32
WORDS = ("river", "mountain", "quiet", "garden", "lantern", "copper", "harbor", "meadow", "signal", "winter",
         "orchard", "engine", "violet", "canyon", "paper", "thunder", "marble", "forest", "silver", "window")


def words(seed: int, n: int) -> str:
    """``n`` words chosen by ``seed`` (about one Gemma token each)."""
    state = seed * 2654435761 % 2**32 or 1
    out = []
    for _ in range(n):
        state = (1103515245 * state + 12345) % 2**31
        out.append(WORDS[state % len(WORDS)])
    return " ".join(out)


@dataclass
class Stream:
    """One streamed request's timings."""

    sent: float
    chunks: list[float] = field(default_factory=list)
    tokens: int = 0

    @property
    def ttft(self) -> float:
        return self.chunks[0] - self.sent

    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.chunks, self.chunks[1:])]


def stream(url: str, prompt: str) -> tuple[Stream, str]:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    record = Stream(sent=time.perf_counter())
    text = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[len("data: "):])
            if chunk.get("usage"):
                record.tokens = chunk["usage"]["completion_tokens"]
            piece = "".join(choice.get("text") or "" for choice in chunk.get("choices") or ())
            if piece:
                record.chunks.append(time.perf_counter())
                text.append(piece)
    return record, "".join(text)


def shared_prompts(count: int) -> list[list[str]]:
    prefix = "Background: " + words(1, 1000) + "\n"
    return [[prefix + f"Request {i}: " + words(100 + i, 128) + "\nAnswer:"] for i in range(count)]


def sync_prompts(count: int) -> list[list[str]]:
    return [[f"Document {i}: " + words(500 + i, 512) + "\nSummary:"] for i in range(count)]


def run_jobs(url: str, jobs: list[list[str]], concurrency: int, turns: bool) -> tuple[list[Stream], float]:
    """Run ``jobs`` (each a list of prompts: one, or a conversation's turns, each following the last reply) on
    ``concurrency`` workers; the streams and the wall time."""
    work: queue.Queue[list[str]] = queue.Queue()
    for job in jobs:
        work.put(job)
    done: list[Stream] = []
    lock = threading.Lock()

    def worker() -> None:
        while True:
            try:
                job = work.get_nowait()
            except queue.Empty:
                return
            transcript = ""
            for prompt in job:
                transcript = (transcript + prompt) if turns else prompt
                record, reply = stream(url, transcript)
                transcript += reply + "\n"
                with lock:
                    done.append(record)

    started = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return done, time.perf_counter() - started


def workloads(quick: bool) -> dict[str, tuple[list[list[str]], int, bool]]:
    users = 4
    conversation = [[f"User {u} asks: " + words(900 + 10 * u + t, 100 if t else 600) + "\nAssistant:"
                     for t in range(3)] for u in range(users)]
    return {
        "shared": (shared_prompts(12 if quick else 24), SLOTS, False),
        "turns": (conversation, SLOTS, True),
        "sync": (sync_prompts(4 if quick else 8), 1, False),
    }


def summary(streams: list[Stream], wall: float) -> dict[str, float]:
    ttfts = sorted(s.ttft for s in streams)
    gaps = [gap for s in streams for gap in s.gaps()]
    return {"ttft_median": statistics.median(ttfts), "ttft_p95": ttfts[min(len(ttfts) - 1, int(0.95 * len(ttfts)))],
            "itl_median": statistics.median(gaps), "itl_p95": sorted(gaps)[int(0.95 * (len(gaps) - 1))],
            "output_tps": sum(s.tokens for s in streams) / wall, "tokens": sum(s.tokens for s in streams),
            "wall": wall}


def side_by_side(name: str, ours: dict[str, float], theirs: dict[str, float] | None
                 ) -> tuple[list[list[str]], list[tuple[str, float, str]]]:
    """One workload's table rows (figure, ours, theirs, ratio) and its figures with goals: ``(label, ratio, goal)``
    for inter-token latency and output tokens/s."""
    rows, goals = [], []
    for metric, label in (("ttft_median", "TTFT median"), ("ttft_p95", "TTFT p95"),
                          ("itl_median", "inter-token latency median"), ("output_tps", "output tokens/s")):
        value, other = ours[metric], (theirs or {}).get(metric)
        shown = (lambda v: f"{v:.1f}") if metric == "output_tps" else (lambda v: f"{v * 1000:.1f} ms")
        rows.append([name, label, shown(value), shown(other) if other else "-",
                     fmt_ratio(value / other) if other else "-"])
        if other and metric in ("itl_median", "output_tps"):
            goals.append((label, value / other, "<= 1.0x" if metric == "itl_median" else ">= 1.0x"))
    return rows, goals


def servers(model: str) -> list[Config]:
    python = sys.executable
    ours = [python, "-m", "ckpt_plugin_integrations.llama_cpp_server", "--model", model, "--n_ctx", str(N_CTX),
            "--n_batch", str(N_BATCH), "--n_ubatch", str(N_BATCH), "--n_threads", str(N_THREADS),
            "--n_threads_batch", str(N_THREADS), "--seed", "0", "--parallel", str(SLOTS), "--flash_attn", "true"]
    out = [Config("ours", f"ckpt-serve --parallel {SLOTS}", ours, ckpt=True)]
    binary = shutil.which("llama-server")
    if binary:
        out.append(Config("ls", f"llama-server -np {SLOTS}", [
            binary, "-m", model, "-c", str(N_CTX * SLOTS), "-b", str(N_BATCH), "-ub", str(N_BATCH), "-t",
            str(N_THREADS), "-tb", str(N_THREADS), "-np", str(SLOTS), "-fa", "on", "--seed", "0"],
            health="/health", llama_server=True))
    return out


def main() -> None:
    parser = cli(__doc__, quick_help="fewer requests")
    parser.add_argument("--markdown", type=pathlib.Path, help="also write the report as a section of docs/benchmarks.md")
    parser.add_argument("--rounds", type=int, default=2, help="rounds, each server in turn (default 2)")
    args = parser.parse_args()
    model = gemma_path()
    rounds: dict[str, dict[str, list[dict[str, float]]]] = {}
    plan = workloads(args.quick)
    # Rounds alternate the servers, so that a slower minute of a shared machine does not fall on one of them only;
    # each figure is the median of its rounds.
    for round_index in range(args.rounds):
        for config in servers(model):
            with start(config) as server:
                stream(server.url, "Warm up: " + words(7, 64))  # loads what a first request loads
                for name, (jobs, concurrency, turns) in plan.items():
                    streams, wall = run_jobs(server.url, jobs, concurrency, turns)
                    figures = summary(streams, wall)
                    rounds.setdefault(name, {}).setdefault(config.key, []).append(figures)
                    print(f"round {round_index}", name, config.label,
                          json.dumps({k: round(v, 4) for k, v in figures.items()}), flush=True)
    results = {name: {key: {metric: statistics.median(r[metric] for r in runs) for metric in runs[0]}
                      for key, runs in by_server.items()} for name, by_server in rounds.items()}
    report = Report("Streaming side by side: TTFT, inter-token latency, output tokens/s (`bench/streaming.py`)")
    report.text(__doc__.split("\n\n", 1)[1].split("``python bench/streaming.py``")[0])
    rows = []
    for name, by_server in results.items():
        table, goals = side_by_side(name, by_server["ours"], by_server.get("ls"))
        rows += table
        for label, ratio, goal in goals:
            report.figure(f"{name}: {label}, ckpt-serve / llama-server", fmt_ratio(ratio), goal)
    report.table(["workload", "figure", f"ckpt-serve --parallel {SLOTS}", f"llama-server -np {SLOTS}", "ratio"], rows)
    emit(report, args.json)
    if args.markdown is not None:
        args.markdown.write_text(report.markdown())


if __name__ == "__main__":
    main()
