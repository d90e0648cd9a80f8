"""vllm-router (the ``vllm-router`` package: a Rust router in a wheel) in front of ckpt-serve replicas, for tests and
benchmarks: found beside this interpreter or on ``PATH``, started on a free port, ready once it answers ``/health``
(which it answers only after every worker does)."""

from __future__ import annotations

import contextlib
import pathlib
import re
import shutil
import sys
from typing import Iterator, Sequence

from ckpt_plugin.testing.ports import free_port
from ckpt_plugin.testing.servers import http_ready, serving

__all__ = ["Router", "router_binary", "run_router"]


def router_binary() -> str | None:
    """The ``vllm-router`` command of this interpreter's environment (else of ``PATH``), or ``None``."""
    beside = pathlib.Path(sys.executable).parent / "vllm-router"
    return str(beside) if beside.exists() else shutil.which("vllm-router")


class Router:
    """A running vllm-router: its URL and its output lines (ANSI colours removed by :meth:`text`)."""

    def __init__(self, url: str, log: list[str]) -> None:
        self.url = url
        self.log = log

    def text(self) -> str:
        return re.sub(r"\x1b\[[0-9;]*m", "", "".join(self.log))


@contextlib.contextmanager
def run_router(workers: Sequence[str], policy: str, *extra: str, binary: str | None = None,
               timeout: float = 60.0) -> Iterator[Router]:
    """Start vllm-router with ``--policy policy`` in front of ``workers`` (their URLs) on a free port, with debug
    logging (its routing decisions are logged there) and ``extra`` flags.

    :raises RuntimeError: vllm-router is not installed, exited, or was not ready within ``timeout``.
    """
    command = binary or router_binary()
    if command is None:
        raise RuntimeError("vllm-router is not installed: pip install vllm-router==0.1.17")
    port = free_port()
    args = [command, "--worker-urls", *workers, "--policy", policy, "--host", "127.0.0.1", "--port", str(port),
            "--log-level", "debug", *extra]
    url = f"http://127.0.0.1:{port}"
    with serving(args, http_ready(f"{url}/health"), name="vllm-router", timeout=timeout) as (_, log):
        yield Router(url, log)
