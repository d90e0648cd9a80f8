"""``ckpt-serve``: ``python -m llama_cpp.server`` with checkpoints.

Takes every ``llama_cpp.server`` setting, spelled as it spells them (``--model``, ``--n_ctx``, ``--host``,
``--port``, ``--config_file``, environment variables such as ``MODEL`` or ``CONFIG_FILE``), plus the checkpoint
settings: ``--<setting>`` flags (``--cache-max-bytes``, as ckpt-run spells them; the former ``--checkpoint-*``
names still work), a ``checkpoints`` section in the JSON/YAML config file, or ``CKPT_*`` environment variables
(flags win over the file, the file over the environment). With no model, it serves the embedded default
(Gemma-3-270M).

This module only starts the server; each step before is its own module's: the flags (``flags.py``), the settings in
layers and ckpt-serve's defaults (``settings.py``, ``defaults.py``), the checks before any model loads
(``preflight.py``, ``model_checks.py``), and what is said once the models are loaded, or why they are not
(``startup.py``). Their public names are importable from here too, as they were when all of them lived here.
"""

from __future__ import annotations

import sys
from typing import Sequence

from ckpt_plugin.core.errors import ConfigError

from ckpt_plugin_integrations.cli_support import fail, known_variables, warn_unknown_variables
from ckpt_plugin_integrations.llama_cpp_server.defaults import (
    with_plugin_precedence,
    with_serve_defaults,
    with_serve_server_defaults,
)
from ckpt_plugin_integrations.llama_cpp_server.flags import (
    CHECKPOINT_ALIASES,
    DESCRIPTION,
    HOST_FLAG_NOTES,
    HOST_VALUE_TYPES,
    build_parser,
)
from ckpt_plugin_integrations.llama_cpp_server.model_checks import templateless_models
from ckpt_plugin_integrations.llama_cpp_server.preflight import check_port, check_settings, check_tls, server_address
from ckpt_plugin_integrations.llama_cpp_server.settings import LoadedSettings, load_settings, prepare_default_model
from ckpt_plugin_integrations.llama_cpp_server.startup import (
    DOWNLOAD_ERROR_MODULES,
    base_url,
    budget_source,
    check_budgets,
    load_failure,
    startup_line,
)

__all__ = [
    "CHECKPOINT_ALIASES",
    "DESCRIPTION",
    "DOWNLOAD_ERROR_MODULES",
    "HOST_FLAG_NOTES",
    "HOST_VALUE_TYPES",
    "ConfigError",
    "LoadedSettings",
    "build_parser",
    "check_port",
    "check_settings",
    "check_tls",
    "known_variables",
    "load_settings",
    "main",
    "prepare_default_model",
    "with_plugin_precedence",
    "with_serve_defaults",
    "with_serve_server_defaults",
]

PROG = "ckpt-serve"


def main(argv: Sequence[str] | None = None) -> None:
    """Run ckpt-serve: check the arguments, load the models, say what is served, serve until SIGTERM or Ctrl-C.

    Every refusal the user can act on is one line on stderr and exit status 2; any other failure keeps its traceback.
    """
    warn_unknown_variables(PROG)
    try:
        loaded = check_settings(argv)
        # Last: the only step that writes (270 MB, the first time), once nothing can refuse the arguments.
        prepare_default_model(loaded)
    except ConfigError as exc:
        fail(PROG, str(exc))
    server, models, checkpoints = loaded.server, loaded.models, loaded.checkpoints
    host, port = server_address(server)
    for line in templateless_models(loaded.named_models):
        print(f"{PROG}: {line}", file=sys.stderr)
    import uvicorn

    from ckpt_plugin_integrations.auto_attach import uninstall as stop_auto_attach

    from ckpt_plugin_integrations.llama_cpp_server.app import create_app

    # ckpt-serve attaches its models itself (with shared caches per alias): under ckpt-run or CKPT_AUTO_ATTACH=1
    # the models must not be attached a first time as they are created.
    stop_auto_attach()

    try:
        app = create_app(server, models, checkpoints)
    except ConfigError as exc:
        fail(PROG, str(exc))
    except Exception as exc:  # noqa: BLE001 - what the user can fix is one line; anything else propagates
        failed = load_failure(models, exc)
        if failed:
            fail(PROG, failed)
        raise
    proxy = app.state.llama_proxy
    try:
        check_budgets(proxy.managers, proxy.entry_floors, budget_source(loaded))
    except ConfigError as exc:
        fail(PROG, str(exc))
    print(startup_line(base_url(host, port, server.ssl_certfile is not None), models, dict(proxy.managers),
                       checkpoints, app.state.kv_events), file=sys.stderr, flush=True)
    # sse-starlette ends every stream at once on SIGTERM; streams in flight get shutdown_timeout to finish instead
    # (uvicorn's graceful shutdown cancels what is left after it).
    from sse_starlette.sse import AppStatus

    AppStatus.disable_automatic_graceful_drain()
    uvicorn.run(
        app,
        host=host,
        port=port,
        ssl_keyfile=server.ssl_keyfile,
        ssl_certfile=server.ssl_certfile,
        # Streams in flight get this long to finish on SIGTERM; the lifespan shutdown then parks the slot.
        timeout_graceful_shutdown=checkpoints.shutdown_timeout,
    )


if __name__ == "__main__":
    main()
