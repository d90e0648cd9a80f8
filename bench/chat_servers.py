"""Starting the servers the chat benchmarks compare: ``llama_cpp.server`` with and without its cache, ``ckpt-serve``,
C++ ``llama-server`` when one is on ``PATH``, each on a free port of 127.0.0.1, with their logs kept."""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

from ckpt_plugin.testing.ports import free_port
from ckpt_plugin.testing.servers import http_ready, serving

ROOT = pathlib.Path(__file__).resolve().parent.parent
N_CTX, N_BATCH, N_THREADS = 4096, 512, 2


@dataclass(frozen=True)
class Config:
    key: str
    label: str
    command: list[str]
    health: str = "/v1/models"
    ckpt: bool = False
    llama_server: bool = False


def configs(model: str) -> list[Config]:
    """(a)-(d) of the workload, plus (e)/(f): (a)/(c) with ``--logits_all false`` (``llama_cpp.server`` defaults to
    ``logits_all=True``: the 262,144-word output layer is computed and copied for every prompt token), and (g): (c)
    with states kept whole (``--page-positions 0``)."""
    python = sys.executable
    settings = ["--model", model, "--n_ctx", str(N_CTX), "--n_batch", str(N_BATCH), "--n_ubatch", str(N_BATCH),
                "--n_threads", str(N_THREADS), "--n_threads_batch", str(N_THREADS), "--seed", "0",
                "--verbose", "true"]
    plain = [python, "-m", "llama_cpp.server", *settings]
    ours = [python, "-m", "ckpt_plugin_integrations.llama_cpp_server", *settings, "--checkpoint-admin", "true"]
    out = [
        Config("a", "llama_cpp.server", plain),
        Config("b", "llama_cpp.server --cache true", [*plain, "--cache", "true"]),
        Config("c", "ckpt-serve", ours, ckpt=True),
    ]
    binary = shutil.which("llama-server")
    if binary:
        out.append(Config("d", "llama-server -np 1", [binary, "-m", model, "-c", str(N_CTX), "-b", str(N_BATCH),
                                                       "-ub", str(N_BATCH), "-t", str(N_THREADS), "-tb",
                                                       str(N_THREADS), "-np", "1", "--seed", "0"],
                          health="/health", llama_server=True))
    out += [
        Config("e", "llama_cpp.server --logits_all false", [*plain, "--logits_all", "false"]),
        Config("f", "ckpt-serve --logits_all false", [*ours, "--logits_all", "false"], ckpt=True),
        # states kept whole, as before pages: what pages cost or give, request by request (--groups cdg)
        Config("g", "ckpt-serve --page-positions 0", [*ours, "--page-positions", "0"], ckpt=True),
    ]
    return out


class Running:
    """A server subprocess, its port and its output lines (a list :func:`start`'s reader keeps filling)."""

    def __init__(self, config: Config, process: subprocess.Popen[str], port: int, lines: list[str]) -> None:
        self.config = config
        self.process = process
        self.url = f"http://127.0.0.1:{port}"
        self.lines = lines

    def proc_status(self) -> dict[str, int]:
        """``VmHWM`` / ``VmRSS`` of the server process in bytes."""
        out = {}
        with open(f"/proc/{self.process.pid}/status") as status:
            for line in status:
                key, _, value = line.partition(":")
                if key in ("VmHWM", "VmRSS"):
                    out[key] = int(value.split()[0]) * 1024
        return out

    def minor_faults(self) -> int:
        """Minor page faults of the server process so far (first touches of fresh pages)."""
        with open(f"/proc/{self.process.pid}/stat") as stat:
            return int(stat.read().rsplit(")", 1)[1].split()[7])

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
    """Start ``config``'s server on a free port and wait until its health route answers 200; stop it after."""
    port = free_port()
    command = [*config.command, "--host", "127.0.0.1", "--port", str(port)]
    ready = http_ready(f"http://127.0.0.1:{port}{config.health}")
    with serving(command, ready, {"PYTHONUNBUFFERED": "1"}, timeout=timeout, name=config.label, log_tail=40,
                 stop_timeout=30) as (process, lines):
        yield Running(config, process, port, lines)
