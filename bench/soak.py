"""Soak: concurrent real clients against ckpt-serve for a while; counts hangs, 5xx and wrong answers, samples RSS.

    python bench/soak.py --minutes 10 --clients 16 [--model PATH] [--budget 256MiB] [--out docs/soak.json]

Each client loops over a mix: multi-turn chats (checked against the answers the same server gave the same request
earlier, greedy), branches (an earlier turn edited), streams dropped mid-way (20%), malformed bodies (5%), slot saves
and restores. A request that takes longer than ``--hang-seconds`` counts as a hang. The server's resident memory is
sampled every second from /proc. Prints a JSON summary and writes it (with the RSS series) to ``--out``; with
matplotlib installed, ``--plot`` draws RSS over time against the budget.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

import httpx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
from servers import run_server  # noqa: E402

SYSTEMS = [f"You are assistant number {i}. " + "Answer briefly and kindly about the house and the dog. " * 12
           for i in range(8)]
TURNS = ["hello", "tell me more", "and the dog?", "what about the house", "one more thing", "thanks"]


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class Soak:
    def __init__(self, url: str, hang_seconds: float) -> None:
        self.url = url
        self.hang_seconds = hang_seconds
        self.lock = threading.Lock()
        self.served = self.hangs = self.server_errors = self.wrong = self.client_errors = 0
        self.kinds: dict[str, int] = {}
        self.ttft: list[float] = []
        self.answers: dict[str, str] = {}

    def note(self, kind: str, status: int, elapsed: float) -> None:
        with self.lock:
            self.served += 1
            self.kinds[kind] = self.kinds.get(kind, 0) + 1
            if status >= 500:
                self.server_errors += 1
            if elapsed > self.hang_seconds:
                self.hangs += 1

    def check(self, key: str, text: str) -> None:
        with self.lock:
            known = self.answers.setdefault(key, text)
            if known != text:
                self.wrong += 1

    def chat(self, http: httpx.Client, messages: list[dict[str, str]]) -> str:
        body = {"model": "m", "messages": messages, "max_tokens": 12, "temperature": 0, "stream": True}
        started = time.monotonic()
        first = None
        text = ""
        status = 0
        finished = False
        try:
            with http.stream("POST", "/v1/chat/completions", json=body) as response:
                status = response.status_code
                for line in response.iter_lines():
                    if first is None:
                        first = time.monotonic() - started
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        for choice in chunk.get("choices") or []:
                            text += (choice.get("delta") or {}).get("content") or ""
                            finished = finished or bool(choice.get("finish_reason"))
        except httpx.TimeoutException:
            status = 0
        elapsed = time.monotonic() - started
        self.note("chat", status, elapsed)
        if first is not None:
            with self.lock:
                self.ttft.append(first)
        # the host interrupts a stream when another request arrives (llama_cpp.server's default), ending it without
        # a finish_reason: only streams that ran to their end are compared
        return text if status == 200 and finished else ""

    def dropped(self, http: httpx.Client, messages: list[dict[str, str]], rng: random.Random) -> None:
        body = {"model": "m", "messages": messages, "max_tokens": 48, "temperature": 0, "stream": True}
        started = time.monotonic()
        status = 0
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            status = response.status_code
            for i, _ in enumerate(response.iter_lines()):
                if i >= rng.randint(1, 5):
                    break
        self.note("dropped", status, time.monotonic() - started)

    def malformed(self, http: httpx.Client, rng: random.Random) -> None:
        bodies = [b"{not json", b"[1, 2]", b'{"messages": "nope"}', b'{"messages": ' + b"[" * 5000,
                  b'{"messages": [], "grammar": "root ::= ("}']
        started = time.monotonic()
        response = http.post("/v1/chat/completions", content=rng.choice(bodies),
                             headers={"content-type": "application/json"})
        self.note("malformed", response.status_code, time.monotonic() - started)

    def slot(self, http: httpx.Client, rng: random.Random, client_id: int) -> None:
        action = rng.choice(["save", "restore"])
        started = time.monotonic()
        response = http.post(f"/slots/0?action={action}", json={"filename": f"soak-{client_id % 4}.bin"})
        self.note("slot", response.status_code, time.monotonic() - started)

    def client(self, client_id: int, deadline: float) -> None:
        rng = random.Random(client_id)
        http = httpx.Client(base_url=self.url, timeout=self.hang_seconds * 2)
        conversation = [{"role": "system", "content": SYSTEMS[client_id % len(SYSTEMS)]}]
        while time.monotonic() < deadline:
            roll = rng.random()
            try:
                if roll < 0.20:
                    self.dropped(http, conversation + [{"role": "user", "content": rng.choice(TURNS)}], rng)
                elif roll < 0.25:
                    self.malformed(http, rng)
                elif roll < 0.30:
                    self.slot(http, rng, client_id)
                elif roll < 0.40 and len(conversation) > 3:
                    cut = 1 + 2 * rng.randint(0, (len(conversation) - 1) // 2 - 1)
                    conversation = conversation[:cut]  # a branch: back to an earlier turn
                else:
                    conversation.append({"role": "user", "content": rng.choice(TURNS)})
                    key = json.dumps(conversation)
                    text = self.chat(http, conversation)
                    if text:
                        self.check(key, text)
                    conversation.append({"role": "assistant", "content": text or "ok"})
                    if len(conversation) > 13:
                        conversation = conversation[:1]
            except httpx.HTTPError:
                with self.lock:
                    self.client_errors += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--model", default=None, help="GGUF to serve (default: the embedded Gemma-3-270M)")
    parser.add_argument("--budget", default="256MiB")
    parser.add_argument("--hang-seconds", type=float, default=120.0)
    parser.add_argument("--out", type=pathlib.Path, default=None)
    parser.add_argument("--plot", type=pathlib.Path, default=None)
    args = parser.parse_args()
    slots = tempfile.mkdtemp(prefix="soak-slots-")
    server_args = ["--n_ctx", "4096", "--n_threads", "2", "--checkpoint-budget", args.budget,
                   "--slot-save-path", slots]
    if args.model:
        server_args += ["--model", args.model]
    with run_server(server_args, timeout=600) as server:
        baseline = rss_bytes(server.process.pid)
        soak = Soak(server.url, args.hang_seconds)
        deadline = time.monotonic() + args.minutes * 60
        samples: list[tuple[float, int]] = []
        threads = [threading.Thread(target=soak.client, args=(i, deadline), daemon=True)
                   for i in range(args.clients)]
        started = time.monotonic()
        for thread in threads:
            thread.start()
        while any(t.is_alive() for t in threads):
            samples.append((time.monotonic() - started, rss_bytes(server.process.pid)))
            time.sleep(1.0)
            if time.monotonic() > deadline + 4 * args.hang_seconds:
                break
        stuck = sum(t.is_alive() for t in threads)
        after = httpx.get(f"{server.url}/v1/models", timeout=args.hang_seconds).status_code
    budget = _parse(args.budget)
    ttft = sorted(soak.ttft)
    summary = {
        "minutes": args.minutes, "clients": args.clients, "budget_bytes": budget,
        "requests_served": soak.served, "by_kind": soak.kinds, "hangs": soak.hangs + stuck,
        "server_errors_5xx": soak.server_errors, "wrong_answers": soak.wrong, "client_errors": soak.client_errors,
        "ttft_p50_s": statistics.median(ttft) if ttft else None,
        "ttft_p95_s": ttft[int(0.95 * (len(ttft) - 1))] if ttft else None,
        "rss_start_bytes": baseline, "rss_peak_bytes": max((r for _, r in samples), default=baseline),
        "rss_growth_over_budget": (max((r for _, r in samples), default=baseline) - baseline) / budget,
        "server_answers_after": after,
    }
    print(json.dumps(summary, indent=2))
    if args.out:
        args.out.write_text(json.dumps({**summary, "rss_series": samples}, indent=1))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 3.5))
        ax.plot([t for t, _ in samples], [r / 2**20 for _, r in samples], label="ckpt-serve RSS")
        ax.axhline((baseline + budget) / 2**20, color="red", linestyle="--", label="start + checkpoint budget")
        ax.set_xlabel("seconds")
        ax.set_ylabel("MiB")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot)


def _parse(size: str) -> int:
    from ckpt_plugin.config import parse_size

    return parse_size(size)


if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    main()
