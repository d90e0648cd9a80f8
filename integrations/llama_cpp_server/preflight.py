"""ckpt-serve's checks before any model loads or any file is written: each failure is a
:class:`~ckpt_plugin.core.errors.ConfigError` naming the flag, variable or config key to change, which ``main`` prints
as one line on stderr with exit status 2.

The model files' own checks are ``model_checks.py``'s; here are the whole run's: :func:`check_settings` runs them all,
then the TLS files and the address to listen on, which uvicorn would otherwise refuse only after the models loaded.
"""

from __future__ import annotations

import errno
import os
import socket
import ssl
from typing import Sequence

from llama_cpp.server.settings import ServerSettings

from ckpt_plugin.core.errors import ConfigError

from ckpt_plugin_integrations.llama_cpp_server.model_checks import (
    check_chat_formats,
    check_directory,
    check_model_file,
    check_model_settings,
    check_parallel,
)
from ckpt_plugin_integrations.llama_cpp_server.settings import LoadedSettings, read_settings

__all__ = ["check_port", "check_settings", "check_tls", "server_address"]


def check_settings(argv: Sequence[str] | None = None) -> LoadedSettings:
    """Read the settings (:func:`~.settings.load_settings`) and check everything that can be checked without writing or loading
    anything: the model files, the chat formats, the combinations of settings, the address to listen on.

    The embedded default model is not assembled here (:func:`~.settings.prepare_default_model` does it after
    these checks).

    :raises ConfigError: Naming the flag, variable or config key to change.
    :raises SystemExit: With status 2, a flag or value the parser refuses (one line on stderr).
    """
    loaded = read_settings(argv)
    models, checkpoints = loaded.models, loaded.checkpoints
    for model, source in zip(models, loaded.model_sources):
        if model.hf_model_repo_id is None and not loaded.embedded:  # the embedded file is written afterwards
            check_model_file(model.model, source)
    if checkpoints.draft_model:
        check_model_file(checkpoints.draft_model, loaded.checkpoint_sources.get("draft_model", "draft_model"))
    indexes = range(len(models))
    check_chat_formats(models, [loaded.model_source(i, "chat_format") for i in indexes])
    check_model_settings(models, loaded.model_source)
    check_parallel(models, checkpoints.parallel, loaded.checkpoint_sources.get("parallel", "parallel"),
                   [loaded.model_source(i, "draft_model") for i in indexes], checkpoints.draft_model)
    for field in ("disk_dir", "slot_save_path"):
        path = getattr(checkpoints, field)
        if path is not None:
            check_directory(path, loaded.checkpoint_sources.get(field, field))
    check_tls(loaded)
    check_port(*server_address(loaded.server))
    return loaded


def check_tls(loaded: LoadedSettings) -> None:
    """Load the TLS certificate and key as uvicorn will (after the models, with a traceback if they are wrong).

    :raises ConfigError: A key without a certificate, or files that are missing or do not hold a matching pair.
    """
    server = loaded.server
    if server.ssl_keyfile is None and server.ssl_certfile is None:
        return
    if server.ssl_certfile is None:
        raise ConfigError(f"{loaded.server_source('ssl_keyfile')}: a private key needs its certificate "
                          "(ssl_certfile) too")
    for field in ("ssl_certfile", "ssl_keyfile"):
        path = getattr(server, field)
        if path is not None and not os.path.isfile(path):
            raise ConfigError(f"{loaded.server_source(field)}: no such file: {path}")
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(server.ssl_certfile, server.ssl_keyfile)
    except (ssl.SSLError, OSError) as exc:
        fields = " with ".join(loaded.server_source(f) for f in ("ssl_certfile", "ssl_keyfile")
                               if getattr(server, f) is not None)
        # OpenSSL's reasons ("PEM lib", "KEY_VALUES_MISMATCH") say little more than this.
        why = "not a PEM certificate and its matching private key" if isinstance(exc, ssl.SSLError) else \
            f"cannot be read: {exc.strerror or exc}"
        raise ConfigError(f"{fields}: {why}") from None


def check_port(host: str, port: int) -> None:
    """Bind ``host:port`` briefly, as uvicorn will, so that a port in use stops ckpt-serve before a model loads.

    :raises ConfigError: Saying why the address cannot be used.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: TIME_WAIT is no conflict
            sock.bind((host, port))
    except socket.gaierror as exc:
        raise ConfigError(f"--host: cannot listen on {host!r}: {exc.strerror or exc}") from None
    except OverflowError:
        raise ConfigError(f"--port: {port} is not a port number (0-65535)") from None
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(
                f"--port: {host}:{port} is already in use: stop what listens there or choose another --port"
            ) from None
        if exc.errno == errno.EACCES:
            raise ConfigError(
                f"--port: no permission to listen on {host}:{port} (ports below 1024 need privileges): "
                "choose another --port"
            ) from None
        raise ConfigError(f"--host/--port: cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def server_address(server: ServerSettings) -> tuple[str, int]:
    """The host and port uvicorn will listen on: ``HOST`` and ``PORT`` win over the settings, as in
    llama_cpp.server's own ``__main__``.

    :raises ConfigError: ``PORT`` is not a number.
    """
    host = os.getenv("HOST", server.host)
    try:
        return host, int(os.getenv("PORT", server.port))
    except ValueError:
        raise ConfigError(f"PORT: not a port number: {os.environ.get('PORT')!r}") from None

