"""Servers as subprocesses for tests and benchmarks: start a command, poll until it answers, stop it at the end.

:func:`serving` runs any command until a readiness check passes, keeping its output lines; :func:`run_server` starts
``ckpt-serve`` (or plain ``llama_cpp.server``) on a free port of 127.0.0.1 with it, and yields a :class:`Server`.
Nothing here imports pytest, so the benchmarks use the same helpers as the tests.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from typing import Any, Callable, Iterator

import httpx

from ckpt_plugin.testing.ports import free_port
from ckpt_plugin.testing.waiting import wait_until

__all__ = ["Server", "http_ready", "model_args", "run_server", "serving"]


def http_ready(url: str, statuses: tuple[int, ...] = (200,), timeout: float = 2.0) -> Callable[[], bool]:
    """A readiness check for :func:`serving`: ``GET url`` answers with one of ``statuses``."""

    def ready() -> bool:
        return httpx.get(url, timeout=timeout).status_code in statuses

    return ready


@contextlib.contextmanager
def serving(
    command: list[str], ready: Callable[[], bool], env: dict[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None, timeout: float = 120.0, *, name: str = "server",
    log_tail: int | None = None, stop_timeout: float = 20.0,
) -> Iterator[tuple[subprocess.Popen[str], list[str]]]:
    """Run ``command`` until ``ready()`` is true; yield it and its output lines (a list that keeps growing while it
    runs); ``SIGTERM`` it at the end (``SIGKILL`` after ``stop_timeout`` seconds).

    :param ready: Called every 0.2 s; an :class:`OSError` or an ``httpx.HTTPError`` counts as "not yet".
    :param env: Variables added to this process's environment.
    :param timeout: Seconds the command may take to become ready (a bound against a hang, not a measure).
    :param name: What the errors call the command.
    :param log_tail: Lines of output the errors quote (all if ``None``).
    :raises RuntimeError: The command exited, or was not ready within ``timeout``.
    """
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               errors="replace", env={**os.environ, **(env or {})}, cwd=cwd)
    log: list[str] = []
    reader = threading.Thread(target=lambda: log.extend(process.stdout), daemon=True)  # type: ignore[arg-type]
    reader.start()

    def output() -> str:
        return "".join(log if log_tail is None else log[-log_tail:])

    def started() -> bool:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited with {process.returncode}:\n{output()}")
        return ready()

    try:
        try:
            wait_until(started, timeout, interval=0.2, ignore=(OSError, httpx.HTTPError))
        except TimeoutError:
            raise RuntimeError(f"{name} did not start:\n{output()}") from None
        yield process, log
    finally:
        process.terminate()
        try:
            process.wait(timeout=stop_timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        reader.join(timeout=5)


class Server:
    """A running HTTP server of :func:`run_server`: its process, port, URL and output lines."""

    def __init__(self, process: subprocess.Popen[str], port: int, log: list[str]) -> None:
        self.process = process
        self.port = port
        self.log = log
        self.url = f"http://127.0.0.1:{port}"
        self.metrics_key: str | None = None  # the operator key, where tenants are on and /metrics needs it

    def post(self, path: str, **kwargs: Any) -> httpx.Response:
        """``POST`` to ``path`` on this server."""
        return httpx.post(f"{self.url}{path}", timeout=120, **kwargs)

    def metric(self, name: str, api_key: str | None = None) -> float:
        """The sum of the ``ckpt_<name>`` samples of ``/metrics`` (every label set together)."""
        api_key = api_key or self.metrics_key
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        text = httpx.get(f"{self.url}/metrics", headers=headers, timeout=10).text
        total = 0.0
        for line in text.splitlines():
            if line.startswith(f"ckpt_{name}"):
                total += float(line.rsplit(" ", 1)[1])
        return total


@contextlib.contextmanager
def run_server(args: list[str], plain: bool = False, env: dict[str, str] | None = None,
               timeout: float = 120.0) -> Iterator[Server]:
    """Start ``ckpt-serve`` (or ``python -m llama_cpp.server`` if ``plain``) with ``args`` on a free port and wait
    until it answers ``/v1/models``."""
    port = free_port()
    module = "llama_cpp.server" if plain else "ckpt_plugin_integrations.llama_cpp_server"
    if plain and "--flash_attn" not in args and "--config_file" not in args:
        args = [*args, "--flash_attn", "true"]  # ckpt-serve's default: the answers compared are computed alike
    command = [sys.executable, "-m", module, "--host", "127.0.0.1", "--port", str(port), "--verbose", "false",
               *args]
    ready = http_ready(f"http://127.0.0.1:{port}/v1/models", statuses=(200, 401))
    with serving(command, ready, env, timeout=timeout) as (process, log):
        yield Server(process, port, log)


def model_args(path: Any, **extra: Any) -> list[str]:
    """Server flags for the model at ``path``: a small context and batch, 2 threads, seed 0, and ``extra``
    (``n_ctx=4096`` becomes ``--n_ctx 4096``)."""
    options = {"n_ctx": 2048, "n_batch": 64, "n_ubatch": 64, "n_threads": 2, "seed": 0, **extra}
    args = ["--model", str(path)]
    for key, value in options.items():
        args += [f"--{key}", str(value)]
    return args
