"""GuideLLM's own runs as the second opinion: ckpt-serve --parallel 4 against llama-server -np 4, same prompts.

``guidellm run`` (0.8.1, the vLLM project's benchmark client) against ``ckpt-serve --parallel 4`` and C++
``llama-server -np 4``, one server after the other, with the same synthetic prompts.

``bench/streaming.py`` drives GuideLLM's three workloads with a client of our own; here GuideLLM drives them. GuideLLM
needs a Hugging Face tokenizer to make its synthetic prompts; ``bash bench/guidellm_setup.sh`` installs it into a venv
of its own (``.cache/guidellm-venv``) and builds the tokenizer from the model's GGUF file
(``.cache/guidellm-tokenizer``, checked to split text exactly as llama.cpp does), so nothing is downloaded from the hub.

- ``shared``: concurrent profile, 4 streams, 24 requests, each a 1,000-token shared prefix (one prefix) plus 128
  tokens of its own, 32 out;
- ``turns``: concurrent profile, 4 streams, 12 requests: 3-turn conversations, a 600-token first turn then 100-token
  turns, each turn sent with the conversation so far (GuideLLM's ``turns``), 32 out;
- ``sync``: synchronous profile, 8 requests of 512 tokens, 32 out.

GuideLLM's synthetic data comes from a fixed seed (42) and the same tokenizer, so both servers get the same prompt
bytes (the script compares the first-turn prompts of the two servers' runs; later turns carry each server's own
replies). Requests go to ``/v1/completions`` (the same bytes reach both models, no chat template); GuideLLM asks for
exactly 32 tokens with ``max_tokens`` and ``ignore_eos``, sampled with each server's defaults. Both servers: flash
attention, ``n_batch`` 512, 2 threads, a 4,096-token context per slot (``bench/streaming.py``'s flags); GuideLLM runs
with one worker process (``GUIDELLM__MAX_WORKER_PROCESSES=1``, asyncio streams) and its data loader prefetching 64
prompts instead of 4,096 (synthesizing those took most of a core during the runs), to take less of the two cores.
GuideLLM's figures: TTFT (median, p95 over requests), inter-token latency (per request: the time from the first
token to the last over the tokens after the first; median over requests), output tokens/s (the server's output
rate over the run, mean).

``python bench/guidellm_runs.py`` (``--quick``: fewer requests; ``--max-requests N``: ``shared`` and ``sync`` N
requests each, a smoke run, whose figures get no goals (``turns`` stays 4 conversations: GuideLLM counts turns);
``--rounds``; ``--out DIR``: keep GuideLLM's scenarios, logs and reports there; ``--markdown PATH``:
docs/bench-sections/51-guidellm.md). Needs ``bash bench/guidellm_setup.sh`` once, and for the ratios
``bash bench/build_llama_server.sh`` (``llama-server`` on ``PATH``, else the one it built).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import pathlib
import resource
import shutil
import statistics
import subprocess
import sys
import time
from typing import Any

from _common import Report, cli, emit, fmt_ratio, gemma_path
from chat_servers import ROOT, start
from streaming import SLOTS, servers, side_by_side, stream, words

VENV = ROOT / ".cache" / "guidellm-venv"
TOKENIZER = ROOT / ".cache" / "guidellm-tokenizer"
BUILT_LLAMA_SERVER = ROOT / ".cache" / "llama-server" / "out" / "bin" / "llama-server"
MODEL_NAME = "gemma-3-270m"  # the same ``model`` in every request body; both servers serve their one model
SEED = 42
PREFETCH = 64
MAX_TOKENS = 32

# name: (GuideLLM synthetic_text data, profile, requests, requests with --quick)
WORKLOADS: dict[str, tuple[dict[str, Any], dict[str, Any], int, int]] = {
    "shared": ({"prompt_tokens": 128, "output_tokens": MAX_TOKENS, "prefix_tokens": 1000, "prefix_count": 1},
               {"kind": "concurrent", "streams": SLOTS}, 24, 12),
    "turns": ({"first_prompt_tokens": 600, "prompt_tokens": 100, "output_tokens": MAX_TOKENS, "turns": 3},
              {"kind": "concurrent", "streams": SLOTS}, 12, 12),
    "sync": ({"prompt_tokens": 512, "output_tokens": MAX_TOKENS}, {"kind": "synchronous"}, 8, 4),
}


def request_count(name: str, quick: bool, smoke: int | None) -> int:
    data, _, full, fewer = WORKLOADS[name]
    if data.get("turns", 1) > 1:
        # Whole conversations: GuideLLM's max_requests counts turns and stops opening conversations once the turns it
        # has queued reach it, so fewer would run fewer conversations at once (4 requests: 2 conversations).
        return full
    return smoke or (fewer if quick else full)


# ---------------------------------------------------------------------------------------------------------------------
# the tokenizer GuideLLM uses, against llama.cpp's

CHECK_TEXTS = [
    "Hello world, river mountain quiet",
    "  leading spaces,\ttabs\tand\n\nnewlines\n",
    "Numbers: 3.14159, 2,718,281, 1e-9 and 0x7fff; dates 2024-05-01.",
    "def f(x):\n    return {'a': [1, 2, 3]}  # code\n",
    "Unicode: café, naïve, Straße, 東京, Москва, emoji 🙂🚀, math ∑∫√",
    "UPPER lower MiXeD CamelCase snake_case kebab-case",
    "1 0 m0 Finish medical want almost. Party work day first.",
]

_HF_TOKENIZE = r"""
import json, sys
from faker import Faker
from transformers import AutoTokenizer
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
texts = json.loads(sys.stdin.read())
faker = Faker()
faker.seed_instance(42)
for n in (128, 512, 1000):  # GuideLLM's synthetic prompts: faker text cut to n tokens and decoded
    ids = tokenizer.encode(faker.text(max_nb_chars=n * 8))
    texts.append(tokenizer.decode(ids[:n], skip_special_tokens=True))
print(json.dumps({"texts": texts, "ids": [tokenizer.encode(text) for text in texts]}))
"""


def guidellm_python() -> pathlib.Path:
    python = VENV / "bin" / "python"
    if not python.exists() or not (TOKENIZER / "tokenizer.json").exists():
        raise SystemExit("GuideLLM is not set up: run `bash bench/guidellm_setup.sh` first")
    return python


def check_tokenizer() -> int:
    """Tokenize some texts (and GuideLLM-style synthetic prompts) with the tokenizer GuideLLM gets and with llama.cpp
    (``vocab_only``); the number of texts, all equal, or SystemExit naming the first that differs."""
    from llama_cpp import Llama

    done = subprocess.run([str(guidellm_python()), "-c", _HF_TOKENIZE, str(TOKENIZER)], input=json.dumps(CHECK_TEXTS),
                          capture_output=True, text=True, env={**os.environ, **offline_env()}, check=True)
    hf = json.loads(done.stdout.strip().splitlines()[-1])
    vocab = Llama(model_path=gemma_path(), vocab_only=True, verbose=False)
    for text, ids in zip(hf["texts"], hf["ids"], strict=True):
        ours = vocab.tokenize(text.encode(), add_bos=True, special=False)
        if ours != ids:
            at = next((i for i, (a, b) in enumerate(zip(ours, ids)) if a != b), min(len(ours), len(ids)))
            raise SystemExit(f"tokenizer differs from llama.cpp on {text[:60]!r}: at token {at}, "
                             f"llama.cpp {ours[at:at + 5]}, HF {ids[at:at + 5]}")
    return len(hf["texts"])


def offline_env() -> dict[str, str]:
    return {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "GUIDELLM__MAX_WORKER_PROCESSES": "1"}


# ---------------------------------------------------------------------------------------------------------------------
# one GuideLLM run


def scenario(url: str, name: str, requests: int, output: pathlib.Path) -> dict[str, Any]:
    data, profile, _, _ = WORKLOADS[name]
    return {"metadata": {"name": f"ckpt-plugin-{name}"}, "spec": {
        "backend": {"kind": "openai_http", "target": url, "model": MODEL_NAME, "request_format": "/v1/completions",
                    "timeout": 600.0, "api_routes": {"/health": "v1/models"}},  # ckpt-serve has no /health
        "profile": profile,
        "tokenizer": {"kind": "hf_auto", "model": str(TOKENIZER)},
        "data": [{"kind": "synthetic_text", **data}],
        # GuideLLM's default prefetch_factor (4,096) has its data loader synthesize 4,096 prompts (6 ms of CPU each
        # here) while the requests run; 64 covers every run's requests (conversations) before the first is sent.
        "data_loader": {"kind": "pytorch", "prefetch_factor": PREFETCH},
        "constraints": [{"kind": "max_requests", "count": requests}],
        "seed": {"kind": "static", "value": SEED},
        "outputs": [{"kind": "json", "path": str(output)}],
    }}


def run_guidellm(url: str, name: str, requests: int, directory: pathlib.Path) -> dict[str, Any]:
    """``guidellm run`` of workload ``name`` against ``url``; its JSON report (kept in ``directory``)."""
    directory.mkdir(parents=True, exist_ok=True)
    output = directory / "report.json"
    (directory / "scenario.json").write_text(json.dumps(scenario(url, name, requests, output), indent=1))
    command = [str(VENV / "bin" / "guidellm"), "run", "--scenario", "scenario.json", "--disable-progress"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(directory / "console.log", "w") as log:
        done = subprocess.run(command, cwd=directory, stdout=log, stderr=subprocess.STDOUT,
                              env={**os.environ, **offline_env()}, timeout=1800)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # the server is still running: only GuideLLM was reaped
    if done.returncode != 0 or not output.exists():
        tail = "".join((directory / "console.log").read_text(errors="replace").splitlines(True)[-40:])
        raise RuntimeError(f"guidellm exited with {done.returncode} ({directory}):\n{tail}")
    report = json.loads(output.read_text())
    report["client_cpu"] = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return report


def figures(report: dict[str, Any]) -> dict[str, float]:
    """TTFT median / p95, inter-token latency median (seconds), output tokens/s, and the request counts."""
    metrics = report["benchmarks"][0]["metrics"]

    def ok(key: str) -> dict[str, Any]:
        return metrics[key]["successful"]

    totals = metrics["request_totals"]
    benchmark = report["benchmarks"][0]
    return {"duration": benchmark["duration"], "client_cpu": report.get("client_cpu", math.nan),
            "ttft_median": ok("time_to_first_token_ms")["median"] / 1000,
            "ttft_p95": ok("time_to_first_token_ms")["percentiles"]["p95"] / 1000,
            "itl_median": ok("inter_token_latency_ms")["median"] / 1000,
            "output_tps": metrics["output_tokens_per_second"]["total"]["mean"],
            "output_tokens_median": ok("output_token_count")["median"],
            "requests": totals["successful"], "errored": totals["errored"], "incomplete": totals["incomplete"]}


def first_turn_prompts(report: dict[str, Any]) -> set[str]:
    """Digests of the prompts of the report's requests that carry no history (GuideLLM's own synthetic text)."""
    out = set()
    for request in report["benchmarks"][0]["requests"]["successful"]:
        if (request.get("info") or {}).get("history_len", 0) == 0:
            body = json.loads(request["request_args"])["body"]
            out.add(hashlib.sha256(body["prompt"].encode()).hexdigest())
    return out


# ---------------------------------------------------------------------------------------------------------------------


def llama_server_path(given: str | None) -> str | None:
    if given:
        return given
    found = shutil.which("llama-server")
    return found or (str(BUILT_LLAMA_SERVER) if BUILT_LLAMA_SERVER.exists() else None)


@contextlib.contextmanager
def on_path(binary: str | None):
    """``bench/streaming.py``'s servers pick ``llama-server`` from ``PATH``: put ``binary``'s directory first."""
    before = os.environ.get("PATH", "")
    if binary:
        os.environ["PATH"] = f"{pathlib.Path(binary).resolve().parent}{os.pathsep}{before}"
    try:
        yield
    finally:
        os.environ["PATH"] = before


def main() -> None:
    parser = cli(__doc__, quick_help="fewer requests")
    parser.add_argument("--markdown", type=pathlib.Path,
                        help="also write the report as a section of docs/benchmarks.md")
    parser.add_argument("--rounds", type=int, default=1, help="rounds, each server in turn (default 1)")
    parser.add_argument("--max-requests", type=int,
                        help="shared and sync runs this many requests (a smoke run: no goals)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated, of " + ", ".join(WORKLOADS))
    parser.add_argument("--servers", default="ours,ls", help="comma-separated: ours (ckpt-serve), ls (llama-server)")
    parser.add_argument("--llama-server", help="the llama-server executable (default: PATH, else the one "
                                               "bench/build_llama_server.sh built)")
    parser.add_argument("--out", type=pathlib.Path, help="keep GuideLLM's scenarios, logs and JSON reports here "
                                                         "(default: .cache/guidellm-runs/<time>)")
    parser.add_argument("--check-tokenizer", action="store_true", help="only check the tokenizer against llama.cpp")
    args = parser.parse_args()

    checked = check_tokenizer()
    print(f"tokenizer {TOKENIZER.relative_to(ROOT)}: {checked} texts tokenized as llama.cpp does", flush=True)
    if args.check_tokenizer:
        return
    names = [name for name in args.workloads.split(",") if name]
    unknown = set(names) - set(WORKLOADS)
    if unknown:
        parser.error(f"unknown workloads: {', '.join(sorted(unknown))}")
    model = gemma_path()
    binary = llama_server_path(args.llama_server)
    with on_path(binary):
        configs = [config for config in servers(model) if config.key in args.servers.split(",")]
    out = (args.out or ROOT / ".cache" / "guidellm-runs" / time.strftime("%Y%m%d-%H%M%S")).resolve()
    requests = {name: request_count(name, args.quick, args.max_requests) for name in names}
    rounds: dict[str, dict[str, list[dict[str, float]]]] = {}
    prompts: dict[str, dict[str, set[str]]] = {}
    started = time.perf_counter()
    for round_index in range(args.rounds):
        for config in configs:
            with start(config) as server:
                stream(server.url, "Warm up: " + words(7, 64))  # loads what a first request loads
                for name in names:
                    report = run_guidellm(server.url, name, requests[name], out / f"r{round_index}-{config.key}-{name}")
                    result = figures(report)
                    rounds.setdefault(name, {}).setdefault(config.key, []).append(result)
                    prompts.setdefault(name, {}).setdefault(config.key, set()).update(first_turn_prompts(report))
                    print(f"round {round_index}", name, config.label,
                          json.dumps({k: round(v, 4) for k, v in result.items()}), flush=True)
                server.settle()
                (out / f"r{round_index}-{config.key}-server.log").write_text("".join(server.lines))
    print(f"GuideLLM runs in {out} ({time.perf_counter() - started:.0f} s)", flush=True)

    results = {name: {key: {metric: statistics.median(r[metric] for r in runs) for metric in runs[0]}
                      for key, runs in by_server.items()} for name, by_server in rounds.items()}
    smoke = args.max_requests is not None
    report = Report("GuideLLM's runs: ckpt-serve against llama-server (`bench/guidellm_runs.py`)")
    report.text(__doc__.split("\n\n", 1)[1].split("``python bench/guidellm_runs.py``")[0])
    rows, goal_rows, same, completed = [], [], [], []
    for name, by_server in results.items():
        ours, theirs = by_server.get("ours"), by_server.get("ls")
        if ours is None:
            continue
        if theirs:
            a, b = prompts[name]["ours"], prompts[name]["ls"]
            same.append(f"{name} {len(a & b)}/{len(a | b)}")
        table, goals = side_by_side(name, ours, theirs)
        rows += table
        for label, ratio, goal in goals:
            figure = f"GuideLLM {name}: {label}, ckpt-serve / llama-server"
            report.figure(figure, fmt_ratio(ratio), "" if smoke else goal)
            goal_rows.append([figure, fmt_ratio(ratio), goal])
        completed.append(f"{name} " + "; ".join(f"{r['requests']:.0f}" for r in by_server.values()))
        counts = "; ".join(f"{key}: {r['requests']:.0f} requests ({r['errored']:.0f} errored, {r['incomplete']:.0f} "
                           f"incomplete), median {r['output_tokens_median']:.0f} tokens out"
                           for key, r in by_server.items())
        print(f"{name}: {counts}", flush=True)
    report.table(["workload", "figure", f"ckpt-serve --parallel {SLOTS}", f"llama-server -np {SLOTS}", "ratio"], rows)
    if goal_rows and not smoke:
        report.table(["figure", "measured", "goal"], goal_rows)
    if same:
        report.text("First-turn prompts the same on both servers: " + ", ".join(same) + ".")
    report.text("Requests completed (" + "; ".join(c.label for c in configs) + "): " + ", ".join(completed) + ".")
    runs = [r for by_server in rounds.values() for runs_of in by_server.values() for r in runs_of]
    report.text(f"GuideLLM's own process took {sum(r['client_cpu'] for r in runs):.0f} s of CPU over "
                f"{len(runs)} runs whose measured parts lasted {sum(r['duration'] for r in runs):.0f} s (its start, "
                f"prompt synthesis and reports included).")
    emit(report, args.json)
    if args.markdown is not None:
        args.markdown.write_text(report.markdown())


if __name__ == "__main__":
    sys.exit(main())
