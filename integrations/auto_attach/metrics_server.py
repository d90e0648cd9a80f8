"""A Prometheus endpoint for programs without an HTTP server of their own (``ckpt-run --metrics-port``).

It starts with the first attached ``Llama`` rather than at interpreter start, so that only processes that hold a
model open a port: a program's helper subprocesses do not, and in a server with several worker processes the first
worker that loads a model serves it (the others log a warning that the port is taken).
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Mapping

from prometheus_client import start_http_server

from ckpt_plugin import CheckpointManager
from ckpt_plugin.http.metrics import Metrics

log = logging.getLogger("ckpt_plugin.auto_attach")


class MetricsServer:
    """``prometheus_client``'s HTTP server over a registry holding the managers ``managers()`` returns.

    :param port: The port (0 picks a free one, see :attr:`port` once started).
    :param host: The address it listens on.
    :param managers: Returns the current managers by model label.
    """

    def __init__(self, port: int, host: str, managers: Callable[[], Mapping[str, CheckpointManager]]) -> None:
        self.host = host
        self.port = port
        self.metrics = Metrics(managers)
        self.started = False
        self._lock = threading.Lock()

    def watch(self, label: str, manager: CheckpointManager) -> None:
        """Record ``manager``'s restore latencies, and start serving if not yet started."""
        self.metrics.watch(label, manager)
        self.start()

    def start(self) -> None:
        """Serve ``/metrics`` from a daemon thread (once; a port already taken is logged, not raised)."""
        with self._lock:
            if self.started:
                return
            self.started = True
            try:
                server, _ = start_http_server(self.port, addr=self.host, registry=self.metrics.registry)
            except OSError as exc:
                log.warning("metrics endpoint not started on %s:%s: %s", self.host, self.port, exc)
                return
            self.port = int(server.server_address[1])
            log.info("serving metrics on http://%s:%s/metrics", self.host, self.port)
