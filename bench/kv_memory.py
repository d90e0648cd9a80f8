"""What is resident with ``ParallelLlama(llama, 4)`` on Gemma-3-270M, a KV stream per slot or one pool of cells.

Each configuration runs in a process of its own, which reports its resident memory (``VmRSS``) after each step:
the interpreter and libraries; the host's ``Llama`` (the weights, mapped, and the host's own context, which the
slots do not use); the parallel context (KV cells, output buffer; the compute buffer is reserved, resident as
steps touch it); four concurrent prompts of about 1,000 tokens (compute buffer pages, the slots' logits rows and
the checkpoints they take); with the bytes of states (checkpoints, entries) the engine holds at the end.

Also, per layout, four requests arriving together with one new ~440-token prefix (prefixes in flight): the prompt
tokens evaluated in all, the waits, and how the waiters got the prefix (cache hits, shared cells).

Run: ``.venv/bin/python bench/kv_memory.py`` (about two minutes); ``--markdown OUT``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import threading
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from _common import gemma_path, markdown_table  # noqa: E402

CONFIGS = (("streams", 4096), ("unified", 16384), ("unified", 4096))
"""A stream of 4,096 cells per slot (the default); one pool of the same 16,384 cells; one pool of 4,096 cells
(llama-server's ``-c 4096 -np 4 -kvu``)."""


def _rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    return 0.0


def measure(layout: str, n_ctx: int) -> dict[str, Any]:
    """The resident memory after each step, in this process (run it in a fresh one)."""
    from llama_cpp import Llama

    from ckpt_plugin.hosts.llama_cpp.parallel.parallel_llama import ParallelLlama

    steps = {"python": _rss_mib()}
    llama = Llama(str(gemma_path()), n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=2, flash_attn=True,
                  swa_full=False, verbose=False)
    steps["host Llama"] = _rss_mib()
    parallel = ParallelLlama(llama, 4, unified=layout == "unified", load_entrypoints=False)
    steps["parallel context"] = _rss_mib()
    text = " ".join(["the cat sat on the mat and looked at the dog"] * 90)
    views = [parallel.view() for _ in range(4)]
    threads = [threading.Thread(target=lambda i=i: views[i].create_completion(f"{i} {text}", max_tokens=8,
                                                                               temperature=0.0)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    steps["4 prompts"] = _rss_mib()
    states = parallel.manager.stats()["resident_bytes"] / 2**20
    counters = parallel.manager.counters
    before = counters.prompt_tokens - counters.tokens_reused
    tools = " ".join(f"Tool {i}: fetch the weather for a city and return it as JSON with fields temp, wind."
                     for i in range(20))
    threads = [threading.Thread(target=lambda i=i: views[i].create_completion(f"{tools} User {i}: what now?",
                                                                               max_tokens=4, temperature=0.0))
               for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    flight = {"prompt": len(llama.tokenize(f"{tools} User 0: what now?".encode())),
              "evaluated": counters.prompt_tokens - counters.tokens_reused - before, "waits": counters.prefix_waits,
              "hits": counters.cache_hits, "shares": counters.kv_shares}
    parallel.close()
    return {"steps": steps, "states": states, "flight": flight}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--one", nargs=2, metavar=("LAYOUT", "N_CTX"), help=argparse.SUPPRESS)
    parser.add_argument("--markdown", type=pathlib.Path)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(measure(args.one[0], int(args.one[1]))))
        return
    rows, flights = [], []
    for layout, n_ctx in CONFIGS:
        out = subprocess.run([sys.executable, __file__, "--one", layout, str(n_ctx)], capture_output=True, text=True,
                             check=True).stdout
        result = json.loads(out.strip().splitlines()[-1])
        steps = list(result["steps"].values())
        label = f"--parallel 4 --n_ctx {n_ctx}" + (" --kv-unified true" if layout == "unified" else "")
        rows.append([label, *(f"+{b - a:.0f}" for a, b in zip(steps, steps[1:])), f"{steps[-1]:.0f}",
                     f"{result['states']:.0f}"])
        flight = result["flight"]
        flights.append([label, f"4 x {flight['prompt']}", flight["evaluated"], flight["waits"], flight["hits"],
                        flight["shares"]])
    text = markdown_table(["configuration", "host Llama (MiB)", "parallel context", "4 prompts of ~1,000 tokens",
                           "resident at the end", "of which states held"], rows)
    text += "\n\n" + markdown_table(["configuration", "prompt tokens", "evaluated", "waits", "cache hits",
                                      "shared cells"], flights)
    print(text)
    if args.markdown:
        args.markdown.write_text(text + "\n")


if __name__ == "__main__":
    main()
