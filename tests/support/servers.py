"""Real HTTP servers for tests: ckpt-serve or plain llama_cpp.server as subprocesses on 127.0.0.1.

Starting and stopping them is :mod:`ckpt_plugin.testing.servers`'s (the benchmarks use it too); here are the
clients the tests talk to them with.
"""

from __future__ import annotations

from typing import Any

import httpx

from ckpt_plugin.testing.ports import free_port
from ckpt_plugin.testing.servers import Server, model_args, run_server, serving

__all__ = ["Server", "client", "drop_stream", "free_port", "model_args", "run_server", "serving"]


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
