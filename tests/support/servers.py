"""Real HTTP servers for tests: ckpt-serve or plain llama_cpp.server as subprocesses on 127.0.0.1."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Iterator

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Server:
    def __init__(self, process: subprocess.Popen, port: int, log: list[str]) -> None:
        self.process = process
        self.port = port
        self.log = log
        self.url = f"http://127.0.0.1:{port}"
        self.metrics_key: str | None = None  # the operator key, where tenants are on and /metrics needs it

    def post(self, path: str, **kwargs: Any) -> httpx.Response:
        """``POST`` to ``path`` on this server."""
        return httpx.post(f"{self.url}{path}", timeout=120, **kwargs)

    def metric(self, name: str, api_key: str | None = None) -> float:
        api_key = api_key or self.metrics_key
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        text = httpx.get(f"{self.url}/metrics", headers=headers, timeout=10).text
        total = 0.0
        for line in text.splitlines():
            if line.startswith(f"ckpt_{name}"):
                total += float(line.rsplit(" ", 1)[1])
        return total


@contextlib.contextmanager
def serving(
    command: list[str], ready: Callable[[], bool], env: dict[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None, timeout: float = 120.0,
) -> Iterator[tuple[subprocess.Popen, list[str]]]:
    """Run ``command`` until ``ready()`` is true; yield it and its output lines so far; SIGTERM it at the end."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, **(env or {})}, cwd=cwd)
    log: list[str] = []
    reader = threading.Thread(target=lambda: log.extend(process.stdout), daemon=True)  # type: ignore[arg-type]
    reader.start()
    try:
        deadline = time.monotonic() + timeout
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"server exited with {process.returncode}:\n{''.join(log)}")
            try:
                if ready():
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"server did not start:\n{''.join(log)}")
            time.sleep(0.2)
        yield process, log
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
        reader.join(timeout=5)


@contextlib.contextmanager
def run_server(args: list[str], plain: bool = False, env: dict[str, str] | None = None,
               timeout: float = 120.0) -> Iterator[Server]:
    """Start ``ckpt-serve`` (or ``python -m llama_cpp.server`` if ``plain``) and wait until it answers."""
    port = free_port()
    module = "llama_cpp.server" if plain else "ckpt_plugin_integrations.llama_cpp_server"
    if plain and "--flash_attn" not in args and "--config_file" not in args:
        args = [*args, "--flash_attn", "true"]  # ckpt-serve's default: the answers compared are computed alike
    command = [sys.executable, "-m", module, "--host", "127.0.0.1", "--port", str(port), "--verbose", "false",
               *args]

    def ready() -> bool:
        return httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code in (200, 401)

    with serving(command, ready, env, timeout=timeout) as (process, log):
        yield Server(process, port, log)


def client(server: Server, api_key: str = "none", timeout: float = 300.0) -> Any:
    """An ``openai.OpenAI`` client of ``server``'s ``/v1`` that never retries (a failure shows at once)."""
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=api_key, max_retries=0, timeout=timeout)


def drop_stream(server: Server, messages: list[dict[str, str]], n_lines: int, *, max_tokens: int,
                timeout: float) -> None:
    """Start a streamed chat completion and leave after ``n_lines`` lines: the connection closes mid-stream."""
    body = {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=timeout) as response:
        for i, _ in enumerate(response.iter_lines()):
            if i >= n_lines:
                break  # leaving the block closes the connection


def model_args(path: Any, **extra: Any) -> list[str]:
    options = {"n_ctx": 2048, "n_batch": 64, "n_ubatch": 64, "n_threads": 2, "seed": 0, **extra}
    args = ["--model", str(path)]
    for key, value in options.items():
        args += [f"--{key}", str(value)]
    return args
