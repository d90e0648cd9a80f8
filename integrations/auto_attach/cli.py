"""``ckpt-run [options] [--] COMMAND [ARGS...]``: run a program with every ``llama_cpp.Llama`` it creates attached.

Like ``opentelemetry-instrument``, it changes nothing in the program: it turns its options into ``CKPT_*``
environment variables, puts a ``sitecustomize`` directory first on ``PYTHONPATH`` and replaces itself with the
command. Every Python process of the program (``uvicorn`` or ``gunicorn`` workers, ``python -m`` modules, scripts,
their children) inherits both and attaches its Llamas as they are created.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
from typing import Any, Sequence

from pydantic import ValidationError

from ckpt_plugin.core.config import CheckpointSettings
from ckpt_plugin.core.errors import ConfigError

# known_variables is imported from here too, as before it was shared with ckpt-serve.
from ckpt_plugin_integrations.cli_support import FlagParser, fail, known_variables, warn_unknown_variables  # noqa: F401
from ckpt_plugin_integrations.settings_flags import add_settings_flags, flag_name, plain_text
from ckpt_plugin_integrations.auto_attach.settings import RunSettings, check_llama_overrides, load_checkpoint_settings, load_run_settings, parse_override

BOOT_DIR = pathlib.Path(__file__).with_name("boot")
"""The directory holding the ``sitecustomize`` module that starts auto-attach."""

_RUN_FLAGS = {
    "--config": "config_file",
    "--metrics-port": "metrics_port",
    "--metrics-host": "metrics_host",
    "--log-level": "log_level",
}


def _env_name(field: str) -> str:
    return f"CKPT_{field.upper()}"


PROG = "ckpt-run"


def build_parser() -> argparse.ArgumentParser:
    # A misspelt option is often meant for the command: say where the command goes.
    parser = FlagParser(
        prog=PROG,
        help_hint="; the command goes after --",
        description=plain_text(__doc__.split("\n\n")[0].strip()) if __doc__ else None,
        epilog="Each option is also read from its CKPT_* variable (e.g. --cache-max-bytes from "
        "CKPT_CACHE_MAX_BYTES); an option wins over its variable, a variable over the --config file.",
    )
    run = parser.add_argument_group("ckpt-run")
    for flag, field in _RUN_FLAGS.items():
        run.add_argument(flag, dest=field, metavar=field.split("_")[-1].upper(),
                         help=f"{RunSettings.model_fields[field].description} ({_env_name(field)})")
    run.add_argument(
        "--stats-at-exit", action="store_const", const="1", dest="stats_at_exit",
        help=f"{RunSettings.model_fields['stats_at_exit'].description} ({_env_name('stats_at_exit')})",
    )
    run.add_argument(
        "--llama", action="append", default=[], metavar="NAME=VALUE", dest="llama",
        help="A llama_cpp.Llama constructor argument that replaces what the program passes, e.g. n_batch=512 or "
        "swa_full=false (repeatable; CKPT_LLAMA_OVERRIDES as a JSON object).",
    )
    checkpoints = parser.add_argument_group("checkpoint settings (ckpt_plugin.attach keywords)")
    # The values are checked here but passed on as given, as CKPT_* variables.
    add_settings_flags(checkpoints, CheckpointSettings, keep_text=True)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="The program to run, e.g. -- python app.py")
    return parser


def child_environment(args: argparse.Namespace, environ: dict[str, str]) -> dict[str, str]:
    """The environment the command runs in: ``environ`` with auto-attach on and the options as variables."""
    env = dict(environ)
    env["CKPT_AUTO_ATTACH"] = "1"
    for field in _RUN_FLAGS.values():
        value = getattr(args, field)
        if value is not None:
            env[_env_name(field)] = value
    if args.stats_at_exit is not None:
        env[_env_name("stats_at_exit")] = args.stats_at_exit
    if args.llama:
        inherited = _inherited_overrides(env)
        env["CKPT_LLAMA_OVERRIDES"] = json.dumps({**inherited, **dict(map(parse_override, args.llama))})
    for field in CheckpointSettings.model_fields:
        value = getattr(args, f"ckpt_{field}")
        if value is not None:
            env[_env_name(field)] = value
    paths = [str(BOOT_DIR), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def _inherited_overrides(env: dict[str, str]) -> dict[str, Any]:
    text = env.get("CKPT_LLAMA_OVERRIDES") or "{}"
    try:
        inherited = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"CKPT_LLAMA_OVERRIDES is not valid JSON ({exc.msg} at column {exc.colno}): "
                          'give a JSON object, e.g. {"n_batch": 512}') from None
    if not isinstance(inherited, dict):
        raise ConfigError('CKPT_LLAMA_OVERRIDES must be a JSON object, e.g. {"n_batch": 512}')
    return inherited


def labels(args: argparse.Namespace | None, environ: dict[str, str]) -> dict[str, str]:
    """How messages name each setting: its option where one was given, else its variable where it is set, else
    the config file's key."""
    given = {name.upper() for name in environ}
    config_file = (args.config_file if args is not None else None) or environ.get("CKPT_CONFIG_FILE")
    names: dict[str, str] = {}
    for field in CheckpointSettings.model_fields:
        if args is not None and getattr(args, f"ckpt_{field}", None) is not None:
            names[field] = flag_name(field)
        elif _env_name(field) in given:
            names[field] = _env_name(field)
        elif config_file:
            names[field] = f"config file {config_file}: {field}"
    for flag, field in _RUN_FLAGS.items():
        if args is not None and getattr(args, field, None) is not None:
            names[field] = flag
        else:
            names[field] = _env_name(field)
    names["llama_overrides"] = "CKPT_LLAMA_OVERRIDES"
    return names


def _override_labels(args: argparse.Namespace | None) -> dict[str, str]:
    names = {}
    for text in (args.llama if args is not None else []):
        name, _ = parse_override(text)
        names[name] = f"--llama {text}"
    return names


def validate(env: dict[str, str], args: argparse.Namespace | None = None) -> None:
    """Read the settings the command will read, so that a bad value stops ckpt-run instead of the program.

    :param args: ckpt-run's options, so that a message names the option that gave a bad value.
    :raises ConfigError: Naming the bad value.
    """
    names = labels(args, dict(os.environ))
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        run = load_run_settings(names)
        load_checkpoint_settings(run.config_file, names)
        if run.llama_overrides:
            from llama_cpp import Llama

            overrides = {name: f"CKPT_LLAMA_OVERRIDES {name}" for name in run.llama_overrides}
            check_llama_overrides(run.llama_overrides, Llama.__init__, {**overrides, **_override_labels(args)})
    finally:
        os.environ.clear()
        os.environ.update(saved)


_PYTHON_NAME = re.compile(r"python(\d+(\.\d+)?)?")
_OWN_NAMES = {"python", "python3", f"python{sys.version_info[0]}.{sys.version_info[1]}"}


def own_interpreter(command: list[str]) -> list[str]:
    """``command`` with a bare ``python`` (``python3``, ``python3.X`` of this version) replaced by ckpt-run's own
    interpreter: the one ckpt_plugin is installed in. A ckpt-run started by path from outside its environment
    (``.venv/bin/ckpt-run -- python app.py``) would otherwise start whichever ``python`` is first on ``PATH``, which
    attaches nothing and fails later with ``No module named 'llama_cpp'``."""
    if command and command[0] in _OWN_NAMES:
        return [sys.executable, *command[1:]]
    return command


def command_interpreter(program: str, path: str | None) -> str | None:
    """The Python interpreter ``program`` runs on: itself if it is one, else the interpreter of its ``#!`` line;
    ``None`` for anything else (a binary, a shell script, a program not found)."""
    found = shutil.which(program, path=path)
    if found is None:
        return None
    if _PYTHON_NAME.fullmatch(os.path.basename(found)):
        return found
    try:
        with open(found, "rb") as handle:
            first = handle.readline(512).decode("utf-8", "replace").strip()
    except OSError:
        return None
    if not first.startswith("#!"):
        return None
    words = first[2:].split()
    if words and os.path.basename(words[0]) == "env":
        words = [w for w in words[1:] if not w.startswith("-")]
        return command_interpreter(words[0], path) if words else None
    return words[0] if words and _PYTHON_NAME.fullmatch(os.path.basename(words[0])) else None


def check_interpreter(command: list[str], environ: dict[str, str]) -> None:
    """Stop with one line where the command's Python cannot import ckpt_plugin (nothing would be attached).

    :raises ConfigError: Naming the interpreter and what to do.
    """
    interpreter = command_interpreter(command[0], environ.get("PATH"))
    if interpreter is None or os.path.dirname(os.path.abspath(interpreter)) == os.path.dirname(sys.executable):
        return
    # What the boot sitecustomize imports, and llama_cpp, which the attacher needs.
    probe = ("import importlib.util, sys\n"
             "from ckpt_plugin_integrations.auto_attach.startup import start_quietly\n"
             "sys.exit(importlib.util.find_spec('llama_cpp') is None)")
    try:
        found = subprocess.run([interpreter, "-c", probe], env=environ, capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return  # the exec below says what is wrong with it
    if not found:
        via = "" if os.path.basename(command[0]) == os.path.basename(interpreter) else f" (through {command[0]})"
        raise ConfigError(f"{interpreter}{via} is a Python without ckpt_plugin, so nothing would be attached: run "
                          f"ckpt-run with that Python's environment, or the command with {sys.executable}")


def main(argv: Sequence[str] | None = None) -> None:
    warn_unknown_variables(PROG)
    parser = build_parser()
    args = parser.parse_args(argv)
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        parser.print_usage(sys.stderr)
        fail(PROG, "no command given (e.g. ckpt-run -- python app.py)")
    command = own_interpreter(command)
    try:
        env = child_environment(args, dict(os.environ))
        validate(env, args)
        check_interpreter(command, dict(os.environ))
    except (ConfigError, ValidationError, json.JSONDecodeError) as exc:
        fail(PROG, str(exc))
    try:
        os.execvpe(command[0], command, env)
    except OSError as exc:
        fail(PROG, f"cannot run {command[0]}: {exc.strerror or exc}", 127)


if __name__ == "__main__":
    main()
