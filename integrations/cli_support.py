"""What ``ckpt-serve`` and ``ckpt-run`` share on their command lines: a parser that refuses a bad flag in one line
(with the closest flag where one was misspelt), the one-line exit, and the warning for ``CKPT_*`` variables that
neither reads.

Both commands print every refusal as ``<prog>: <message>`` on stderr and exit with status 2 (argparse's own status
for a bad argument), so that a user sees the same kind of message whichever command refused them.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from typing import Any, NoReturn

from ckpt_plugin.core.config import ServeSettings, setting_variables, unknown_variables

from ckpt_plugin_integrations.auto_attach.settings import RunSettings

__all__ = ["FlagParser", "fail", "known_variables", "suggest_flag", "warn_unknown_variables"]


class FlagParser(argparse.ArgumentParser):
    """An argument parser that reports a bad argument in one line: argparse prints the usage first, and ckpt-serve's
    lists every flag of llama_cpp.server (dozens of lines), which buried the one that was wrong.

    :param help_hint: Appended to the pointer at ``--help`` after an unrecognized argument (ckpt-run's says where
        the command goes).
    """

    def __init__(self, *args: Any, help_hint: str = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.help_hint = help_hint

    def error(self, message: str) -> NoReturn:
        if message.startswith("argument "):
            message = message[len("argument "):]
        if message.startswith("unrecognized arguments: "):
            message += suggest_flag(message[len("unrecognized arguments: "):].split(), self)
            message += f" ({self.prog} --help lists the options{self.help_hint})"
        self.exit(2, f"{self.prog}: {message}\n")


def suggest_flag(words: list[str], parser: argparse.ArgumentParser) -> str:
    """``"; did you mean --flag?"`` for the first of ``words`` that is close to one of ``parser``'s flags, else
    ``""`` (a value or the command after a misspelt flag is no flag to correct)."""
    options = [o for action in parser._actions for o in action.option_strings if o.startswith("--")]
    for word in words:
        if not word.startswith("--"):
            continue
        close = difflib.get_close_matches(word.split("=", 1)[0], options, n=1, cutoff=0.7)
        if close:
            return f"; did you mean {close[0]}?"
    return ""


def fail(prog: str, message: str, status: int = 2) -> NoReturn:
    """Print ``<prog>: <message>`` on stderr and exit with ``status``."""
    print(f"{prog}: {message}", file=sys.stderr)
    sys.exit(status)


def known_variables() -> set[str]:
    """Every ``CKPT_*`` variable a process started by either command reads: the checkpoint settings of a server
    (those of a manager and more) and ckpt-run's. ckpt-run warns of no variable ckpt-serve reads, since the program
    it runs may be ckpt-serve, and ckpt-serve of none ckpt-run reads, since it may run under ckpt-run."""
    return setting_variables(ServeSettings, RunSettings)


def warn_unknown_variables(prog: str) -> None:
    """One ``<prog>: warning:`` line on stderr per ``CKPT_*`` variable of the environment that nothing reads (a
    misspelt setting would otherwise be ignored without a word)."""
    for warning in unknown_variables(os.environ, known_variables()):
        print(f"{prog}: warning: {warning}", file=sys.stderr)
