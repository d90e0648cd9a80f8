"""Soak: concurrent real clients against ckpt-serve, then llama_cpp.server alone, under the same mix of traffic.

    python bench/soak.py --minutes 10 --clients 16 [--model PATH] [--budget 256MiB] [--out docs/soak.json]
                         [--plot docs/soak-rss.png] [--no-plain] [--parallel N]

Each client loops over a mix: multi-turn chats (checked against the answers the same server gave the same request
earlier, greedy), branches (an earlier turn edited), streams dropped mid-way (20%; a third of them during a long
prompt, before its first token), malformed and hostile bodies (5%: grammars that match nothing, NUL in schemas,
grammars of 30,000 alternatives, 20 MB prompts, bodies without a content type among them), slot saves and restores
(ckpt-serve only: the host alone has no slot routes). A request that takes longer than ``--hang-seconds`` counts as a
hang.

Memory: the server's RSS is sampled every second from /proc, with the resident part of the host's large per-position
arrays (llama-cpp-python's ``n_ctx x n_vocab`` ``scores`` and llama.cpp's output buffer, both from
``logits_all=True``; their pages become resident as positions are written), and for ckpt-serve the state bytes the
plugin reports (``/checkpoints/stats``: unique buffers of slot and cache plus recycled mappings). The host alone grows
too under the same traffic (heap, thread arenas, compute buffers): what the plugin adds is its run's growth beyond the
host arrays minus the host's own, measured side by side in one run from warmed-up servers; the goal is that this, and
the plugin's own state bytes, stay within the budget + 10%. Prints a JSON summary and writes it (with the series) to
``--out``; ``--plot`` draws the series against the budget (matplotlib, in the ``bench`` extra).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import statistics
import tempfile
import threading
import time
from typing import Any

import httpx

from ckpt_plugin.testing.servers import run_server

SYSTEMS = [f"You are assistant number {i}. " + "Answer briefly and kindly about the house and the dog. " * 12
           for i in range(8)]
TURNS = ["hello", "tell me more", "and the dog?", "what about the house", "one more thing", "thanks"]


HUGE_GRAMMAR = json.dumps({"prompt": "hi", "max_tokens": 4, "grammar": "root ::= " + " | ".join(
    f'"w{i:05d}x"' for i in range(30_000))}).encode()
HUGE_PROMPT = json.dumps({"prompt": "the cat and the dog " * 1_000_000, "max_tokens": 4}).encode()  # 20 MB


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


HOST_ARRAY_MIN_BYTES = 256 << 20
"""Anonymous mappings at least this large are the host's per-position logits arrays: llama-cpp-python's ``scores``
(``n_ctx x n_vocab`` floats) and llama.cpp's output buffer (``n_batch x n_vocab`` floats), both that large because of
``logits_all=True``. Nothing else of the server is: state buffers, the KV cache and Python's heap are far smaller,
and the model's weights are file-backed."""


def plugin_state_bytes(url: str) -> int:
    """State bytes the plugin holds (unique buffers of slot and cache, plus recycled mappings), from its stats."""
    try:
        views = httpx.get(f"{url}/checkpoints/stats", timeout=10).json()["models"]
    except (httpx.HTTPError, ValueError, KeyError):
        return -1
    return sum(v.get("resident_bytes", 0) + v.get("pool_free_bytes", 0) for v in views.values())


def host_array_rss_bytes(pid: int) -> int:
    """Resident bytes of the host's large per-position arrays, from ``/proc/PID/smaps``."""
    total, size, anonymous = 0, 0, False
    with open(f"/proc/{pid}/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if not fields[0].endswith(":"):
                # A mapping header: "start-end perms offset dev inode [path]".
                anonymous, size = len(fields) < 6, 0
            elif fields[0] == "Size:":
                size = int(fields[1]) * 1024
            elif fields[0] == "Rss:" and anonymous and size >= HOST_ARRAY_MIN_BYTES:
                total += int(fields[1]) * 1024
    return total


def rss_breakdown(pid: int, top: int = 12) -> list[dict[str, object]]:
    """The largest resident mappings (what the RSS is made of), from ``/proc/PID/smaps``."""
    rows: list[dict[str, object]] = []
    with open(f"/proc/{pid}/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if not fields[0].endswith(":"):
                rows.append({"mapping": fields[5] if len(fields) >= 6 else "[anonymous]", "address": fields[0],
                             "size": 0, "rss": 0})
            elif fields[0] == "Size:":
                rows[-1]["size"] = int(fields[1]) * 1024
            elif fields[0] == "Rss:":
                rows[-1]["rss"] = int(fields[1]) * 1024
    return sorted(rows, key=lambda row: -int(row["rss"]))[:top]  # type: ignore[call-overload]


class Soak:
    def __init__(self, url: str, hang_seconds: float, slot_routes: bool = True) -> None:
        self.url = url
        self.slot_routes = slot_routes
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
        if rng.random() < 1 / 3:
            # Gone during the prompt, before its first token: the slot is free within one batch.
            long_turn = {"role": "user", "content": "the cat and the dog " * rng.randint(300, 600)}
            try:
                with http.stream("POST", "/v1/chat/completions", json={**body, "messages": [long_turn]},
                                 timeout=httpx.Timeout(self.hang_seconds * 2, read=0.3)) as response:
                    status = response.status_code
                    response.read()
            except httpx.ReadTimeout:
                status = 200
            self.note("dropped-prompt", status, time.monotonic() - started)
            return
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            status = response.status_code
            for i, _ in enumerate(response.iter_lines()):
                if i >= rng.randint(1, 5):
                    break
        self.note("dropped", status, time.monotonic() - started)

    def malformed(self, http: httpx.Client, rng: random.Random) -> None:
        json_type = {"content-type": "application/json"}
        chat = "/v1/chat/completions"
        requests: list[tuple[str, str, bytes, dict[str, str]]] = [
            ("POST", chat, body, json_type)
            for body in (b"{not json", b"[1, 2]", b'{"messages": "nope"}', b'{"messages": ' + b"[" * 5000)
        ]
        if self.slot_routes:
            # Each of these kills llama_cpp.server alone (segfault or abort) or gets a 500 from it: not sent to it.
            requests += [
                ("POST", chat, b'{"messages": [], "grammar": "root ::= ("}', json_type),
                ("POST", "/v1/engines/copilot-codex/completions",
                 b'{"prompt": "hi", "max_tokens": 4, "grammar": "root ::= ("}', json_type),
                ("POST", "/v1/completions", b'{"prompt": "hi", "grammar": "root ::= ' + b"(" * 50_000 + b'"a"'
                 + b")" * 50_000 + b'"}', json_type),
                ("POST", chat, json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                                           "response_format": {"type": "json_object", "schema": {
                                               "type": "object", "properties": {'a"b': {"type": "string"}}}}}
                                          ).encode(), json_type),
                ("POST", "/extras/detokenize", b'{"tokens": [999999999]}', json_type),
                ("POST", "/extras/detokenize", b'{"tokens": [-1]}', json_type),
                ("POST", "/v1/completions", b'{"prompt": "hi"}', {"content-type": "text/plain"}),
                ("POST", "/v1/completions", b'{"prompt": "\\ud800"}', json_type),
                ("POST", "/v1/completions", b'{"prompt": "hi", "logit_bias": {"abc": 5}}', json_type),
                ("POST", "/extras/tokenize", b"\xff\xfe", json_type),
                ("TRACE", "/metrics", b"", {}),
                # each of these aborted ckpt-serve itself, or held a slot or the queue for tens of seconds
                ("POST", "/v1/completions", b'{"prompt": "hi", "max_tokens": 4, "grammar": "root ::= \\"a\\" [z-a]"}',
                 json_type),
                ("POST", chat, json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                                           "response_format": {"type": "json_object", "schema": {
                                               "type": "object", "properties": {"\0": {"type": "string"}},
                                               "required": ["\0"]}}}).encode(), json_type),
                ("POST", "/v1/completions", HUGE_GRAMMAR, json_type),
                ("POST", "/v1/completions", HUGE_PROMPT, json_type),
                ("POST", "/v1/completions", b'{"prompt": "hi", "max_tokens": 4}', {}),
            ]
        method, path, body, headers = rng.choice(requests)
        started = time.monotonic()
        response = http.request(method, path, content=body, headers=headers)
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
                elif roll < 0.30 and self.slot_routes:
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


def soak_server(server_args: list[str], args: argparse.Namespace, plain: bool) -> dict[str, Any]:
    """Run the client mix against one server for ``--minutes``; return its figures and series."""
    with run_server(server_args, plain=plain, timeout=600) as server:
        pid = server.process.pid
        soak = Soak(server.url, args.hang_seconds, slot_routes=not plain)
        # Warm up: the first request maps the model's pages and the context's compute and output buffers.
        with httpx.Client(base_url=server.url, timeout=args.hang_seconds) as http:
            soak.chat(http, [{"role": "user", "content": "warm up"}])
        soak.served, soak.kinds, soak.ttft = 0, {}, []
        baseline, host_baseline = rss_bytes(pid), host_array_rss_bytes(pid)
        deadline = time.monotonic() + args.minutes * 60
        samples: list[tuple[float, int, int]] = []
        state: list[tuple[float, int]] = []  # (seconds, state bytes the plugin holds: buffers + recycled mappings)
        threads = [threading.Thread(target=soak.client, args=(i, deadline), daemon=True)
                   for i in range(args.clients)]
        started = time.monotonic()
        for thread in threads:
            thread.start()
        while any(t.is_alive() for t in threads) and server.process.poll() is None:
            samples.append((time.monotonic() - started, rss_bytes(pid), host_array_rss_bytes(pid)))
            if not plain:
                state.append((samples[-1][0], plugin_state_bytes(server.url)))
            time.sleep(1.0)
            if time.monotonic() > deadline + 4 * args.hang_seconds:
                break
        stuck = sum(t.is_alive() for t in threads)
        exited = server.process.poll()
        breakdown = rss_breakdown(pid) if exited is None else []
        try:
            stats = None if plain else httpx.get(f"{server.url}/checkpoints/stats", timeout=args.hang_seconds).json()
            after = httpx.get(f"{server.url}/v1/models", timeout=args.hang_seconds).status_code
        except httpx.HTTPError as exc:
            stats, after = None, f"{type(exc).__name__}: {exc}"
        log_tail = "".join(server.log[-15:]) if exited is not None else ""
    ttft = sorted(soak.ttft)
    growth = [r - baseline - (h - host_baseline) for _, r, h in samples]
    figures: dict[str, Any] = {
        "requests_served": soak.served, "by_kind": soak.kinds, "hangs": soak.hangs + stuck,
        "server_errors_5xx": soak.server_errors, "wrong_answers": soak.wrong, "client_errors": soak.client_errors,
        "ttft_p50_s": statistics.median(ttft) if ttft else None,
        "ttft_p95_s": ttft[int(0.95 * (len(ttft) - 1))] if ttft else None,
        "rss_start_bytes": baseline, "rss_peak_bytes": max((r for _, r, _ in samples), default=baseline),
        "host_arrays_peak_bytes": max((h for _, _, h in samples), default=host_baseline),
        "growth_beyond_host_peak_bytes": max(growth, default=0),
        "server_answers_after": after,
        "server_exit_code": exited,
        "server_log_tail": log_tail,
        "rss_breakdown_end": breakdown,
    }
    if not plain:
        views = (stats or {}).get("models") or {}
        figures["plugin_state_peak_bytes"] = max((b for _, b in state), default=0)
        figures["final_stats"] = {name: {key: view.get(key) for key in (
            "resident_bytes", "cache_bytes", "slot_only_bytes", "pool_free_bytes", "cache_entries",
            "checkpoints_created", "cache_hits", "cache_evictions")} for name, view in views.items()}
    return {"figures": figures, "rss_series": samples, "growth_series": growth, "state_series": state,
            "host_baseline": host_baseline}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--model", default=None, help="GGUF to serve (default: the embedded Gemma-3-270M)")
    parser.add_argument("--budget", default="256MiB")
    parser.add_argument("--hang-seconds", type=float, default=120.0)
    parser.add_argument("--no-plain", action="store_true", help="skip the llama_cpp.server run side by side")
    parser.add_argument("--parallel", type=int, default=1,
                        help="ckpt-serve's slots (--parallel N); at N > 1 a greedy answer may differ from the same "
                        "server's earlier one at a near tie (batch numerics), which counts as a wrong answer")
    parser.add_argument("--draft-model", default=None,
                        help="ckpt-serve's --draft-model (a GGUF of the same vocabulary; with --parallel N each slot "
                             "drafts from its own sequence)")
    parser.add_argument("--out", type=pathlib.Path, default=None)
    parser.add_argument("--plot", type=pathlib.Path, default=None)
    parser.add_argument("--markdown", type=pathlib.Path, default=None,
                        help="write the docs section here (docs/bench-sections/50-soak.md)")
    parser.add_argument("--replot", type=pathlib.Path, default=None, help="only draw --plot from this --out file")
    args = parser.parse_args()
    if args.replot:
        plot(json.loads(args.replot.read_text()), args.plot)
        return
    if args.model is None:
        from ckpt_plugin.hosts.llama_cpp.serving.default_model import default_model_path

        args.model = str(default_model_path())
    budget = _parse(args.budget)
    # llama_cpp.server's default, which ckpt-serve turns off: both servers run under the same setting.
    common = ["--model", args.model, "--n_ctx", "4096", "--n_threads", "2", "--interrupt_requests", "true"]
    slots = tempfile.mkdtemp(prefix="soak-slots-")
    plugin = soak_server(common + ["--checkpoint-budget", args.budget, "--slot-save-path", slots,
                                   "--checkpoint-admin", "true", "--parallel", str(args.parallel),
                                   *(["--draft-model", args.draft_model] if args.draft_model else [])],
                          args, plain=False)
    plain = None if args.no_plain else soak_server(common, args, plain=True)
    ours = plugin["figures"]
    summary: dict[str, Any] = {"minutes": args.minutes, "clients": args.clients, "budget_bytes": budget,
                               "ckpt_serve": ours}
    # What the plugin adds to the host's memory: its run's growth beyond the host's arrays, minus the same growth of
    # the host alone under the same traffic (its heap and arenas grow too), and directly, the state bytes it holds.
    host_growth = plain["figures"]["growth_beyond_host_peak_bytes"] if plain else 0
    added = ours["growth_beyond_host_peak_bytes"] - host_growth
    summary.update(
        llama_cpp_server=plain["figures"] if plain else None,
        added_growth_peak_bytes=added,
        added_growth_over_budget=added / budget,
        plugin_state_over_budget=ours["plugin_state_peak_bytes"] / budget,
        goal_budget_plus_10pct_met=added <= 1.1 * budget and ours["plugin_state_peak_bytes"] <= 1.1 * budget,
    )
    print(json.dumps(summary, indent=2))
    if args.out:
        series = {"ckpt_serve": {k: plugin[k] for k in ("rss_series", "state_series")},
                  "llama_cpp_server": {"rss_series": plain["rss_series"]} if plain else None}
        args.out.write_text(json.dumps({**summary, "series": series}, indent=1))
    if args.markdown:
        args.markdown.write_text(markdown(summary, args))
    if args.plot:
        plot({**summary, "series": {"ckpt_serve": plugin, "llama_cpp_server": plain}}, args.plot)


def markdown(summary: dict[str, Any], args: argparse.Namespace) -> str:
    """The soak's section of docs/benchmarks.md."""
    ours, alone = summary["ckpt_serve"], summary["llama_cpp_server"] or {}
    mib = 2**20

    def kinds(figures: dict[str, Any]) -> str:
        return ", ".join(f"{n:,} {k}" for k, n in sorted(figures.get("by_kind", {}).items()))

    def row(name: str, key: str, fmt: Any = "{:,}".format, goal: str = "") -> str:
        values = [fmt(f[key]) if f.get(key) is not None else "-" for f in (ours, alone)]
        return f"| {name} | {values[0]} | {values[1]} | {goal} |"

    seconds = "{:.2f} s".format
    rows = [
        "| figure | ckpt-serve | llama_cpp.server alone | goal |",
        "| --- | --- | --- | --- |",
        f"| requests served | {ours['requests_served']:,} ({kinds(ours)}) | "
        f"{alone.get('requests_served', 0):,} ({kinds(alone)}) | |",
        row("hangs (no answer within the hang bound)", "hangs", goal="0"),
        row("5xx", "server_errors_5xx", goal="0"),
        row("wrong answers", "wrong_answers", goal="0"),
        row("client-side errors", "client_errors"),
        row("TTFT p50", "ttft_p50_s", seconds),
        row("TTFT p95", "ttft_p95_s", seconds),
        row("RSS at start (warmed up)", "rss_start_bytes", lambda b: f"{b / mib:,.0f} MiB"),
        row("RSS peak", "rss_peak_bytes", lambda b: f"{b / mib:,.0f} MiB"),
        row("RSS growth beyond the host arrays, peak", "growth_beyond_host_peak_bytes",
            lambda b: f"{b / mib:,.0f} MiB"),
        f"| plugin state bytes, peak (its stats) | {ours['plugin_state_peak_bytes'] / mib:,.0f} MiB "
        f"({summary['plugin_state_over_budget']:.2f}x the budget) | | <= 1.1x |",
        f"| RSS growth the plugin adds (ckpt-serve's growth beyond host arrays minus the host's) | "
        f"{summary['added_growth_peak_bytes'] / mib:,.0f} MiB ({summary['added_growth_over_budget']:.2f}x the budget) "
        f"| | <= 1.1x |",
    ]
    return "\n".join([
        f"## Soak: {args.clients} concurrent clients for {args.minutes:g} minutes (`bench/soak.py`)",
        "",
        f"`python bench/soak.py --minutes {args.minutes:g} --clients {args.clients} --budget {args.budget} "
        "--out docs/soak.json --plot docs/soak-rss.png --markdown docs/bench-sections/50-soak.md`: ckpt-serve on the "
        "embedded Gemma-3-270M (n_ctx 4096, llama_cpp.server's defaults: `interrupt_requests` on, `logits_all` on), "
        "then llama_cpp.server alone under the same mix, one after the other in one run. Each client mixes "
        "multi-turn chats and branches (streamed), 20% streams dropped after 1 to 5 chunks, 5% malformed bodies "
        "(bad JSON, arrays, schema errors, 5,000-deep nesting, and for ckpt-serve an unparsable grammar, which "
        "kills llama_cpp.server alone with SIGSEGV) and slot saves/restores (ckpt-serve only). Streams that ran to "
        "their finish are compared with the answer the same request got earlier. "
        f"Goal met: {'yes' if summary['goal_budget_plus_10pct_met'] else 'no'}.",
        "",
        *rows,
        "",
        "The series are in `docs/soak.json`, plotted in `docs/soak-rss.png`.",
        "",
    ])


def plot(result: dict[str, Any], path: pathlib.Path) -> None:
    """Draw RSS growth, growth beyond the host arrays and the plugin's state bytes of both runs against the budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budget = result["budget_bytes"]
    fig, ax = plt.subplots(figsize=(8, 4))
    mib = 2**20
    series = result["series"]
    for label, key in (("ckpt-serve", "ckpt_serve"), ("llama_cpp.server alone", "llama_cpp_server")):
        run = series.get(key)
        if not run:
            continue
        samples = run["rss_series"]
        rss0, host0 = samples[0][1], samples[0][2]
        seconds = [t for t, _, _ in samples]
        ax.plot(seconds, [(r - rss0) / mib for _, r, _ in samples], label=f"{label}: RSS growth")
        ax.plot(seconds, [((r - rss0) - (h - host0)) / mib for _, r, h in samples],
                label=f"{label}: growth beyond host arrays")
    state = series["ckpt_serve"]["state_series"]
    ax.plot([t for t, _ in state], [b / mib for _, b in state], label="plugin state bytes (its stats)")
    ax.axhline(budget / mib, color="red", linestyle="--", label="checkpoint budget")
    ax.axhline(1.1 * budget / mib, color="red", linestyle=":", label="budget + 10%")
    ax.set_xlabel("seconds")
    ax.set_ylabel("MiB")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)


def _parse(size: str) -> int:
    from ckpt_plugin.core.config import parse_size

    return parse_size(size)


if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    main()
