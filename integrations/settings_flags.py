"""The checkpoint settings as command-line flags: one table for ``ckpt-serve`` and ``ckpt-run``.

Every field of a settings model becomes ``--<field-with-dashes>`` (``cache_max_bytes`` -> ``--cache-max-bytes``), with
the field's description as help (in plain text), its default (byte sizes in binary units) and a metavar from its type
(``SIZE``, ``N``, ``SECONDS``, ``PATH``, ``URL``, ``BOOL``, the choices of a ``Literal``). Both commands add their
checkpoint flags with :func:`add_settings_flags`, so they spell, type and document a setting the same way; a command
may add old names of a flag as hidden aliases.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import types
import typing
from typing import Any, Callable, Mapping

from pydantic import BaseModel, SecretStr

from ckpt_plugin.core.config import parse_size

__all__ = [
    "FlagSpec",
    "add_settings_flags",
    "flag_name",
    "flag_specs",
    "format_size",
    "given_flags",
    "parse_bool",
    "parse_size_arg",
]

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def parse_bool(text: str) -> bool:
    """``true``/``false`` (also ``1``/``0``, ``yes``/``no``, ``on``/``off``, any case) as a bool."""
    lowered = str(text).strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def parse_size_arg(text: str) -> int:
    """A byte size (``2GiB``, ``512MB``, a number of bytes) for argparse: :func:`ckpt_plugin.core.config.parse_size`."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def flag_name(field: str) -> str:
    """The flag of a settings field: ``cache_max_bytes`` -> ``--cache-max-bytes``."""
    return "--" + field.replace("_", "-")


def format_size(n: int) -> str:
    """Bytes in the largest binary unit that holds them exactly: ``2147483648`` -> ``2GiB``."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def plain_text(text: str) -> str:
    """``text`` without RST roles and Markdown/RST backticks (``:class:`~a.B``` -> ``B``, ````x```` -> ``x``)."""
    text = re.sub(r":[a-z:]+:`~?([^`]*)`", lambda m: m.group(1).rsplit(".", 1)[-1] if m.group(0).count("~") else
                  m.group(1), text)
    return text.replace("`", "")


@dataclasses.dataclass(frozen=True)
class FlagSpec:
    """How one settings field is given on the command line."""

    field: str
    flag: str
    convert: Callable[[str], Any]
    metavar: str
    choices: tuple[str, ...] | None
    default: str
    help: str


def _unwrap(annotation: Any) -> tuple[Any, bool]:
    """The annotation without ``None``, and whether ``None`` was allowed."""
    origin = typing.get_origin(annotation)
    if origin is typing.Union or isinstance(annotation, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return (args[0] if len(args) == 1 else annotation), len(args) != len(typing.get_args(annotation))
    return annotation, False


def _is_size(field: str, base: Any) -> bool:
    return base is int and field.endswith("_bytes")


def _kind(field: str, base: Any, description: str) -> tuple[Callable[[str], Any], str, tuple[str, ...] | None]:
    """The converter, metavar and choices of a field (the type reflection both commands use)."""
    if typing.get_origin(base) is typing.Literal:
        choices = tuple(str(a) for a in typing.get_args(base))
        return str, "{" + ",".join(choices) + "}", choices
    if base is bool:
        return parse_bool, "BOOL", None
    if _is_size(field, base):
        return parse_size_arg, "SIZE", None
    if field.endswith("_url"):
        return str, "URL", None
    if field.endswith(("_dir", "_path", "_file")) or description.startswith(("Directory", "GGUF", "Path")):
        return str, "PATH", None
    number = base if base in (int, float) else None
    if number is not None and (description.startswith("Seconds") or field.endswith(("_timeout", "_ttl", "_retry"))):
        return number, "SECONDS", None
    if base is int:
        return int, "N", None
    if base is float:
        return float, "NUMBER", None
    if base is SecretStr:
        return str, "KEY", None
    return str, "TEXT", None


def _default_text(field: str, base: Any, default: Any) -> str:
    if default is None:
        return "none"
    if isinstance(default, bool):
        return "true" if default else "false"
    if isinstance(default, int) and _is_size(field, base):
        return format_size(default)
    if isinstance(default, float):
        return f"{default:g}"
    if isinstance(default, SecretStr):
        return "set"
    return str(default)


def flag_specs(model: type[BaseModel]) -> list[FlagSpec]:
    """One :class:`FlagSpec` per field of ``model``, in the model's order."""
    specs = []
    for field, info in model.model_fields.items():
        base, _ = _unwrap(info.annotation)
        description = plain_text(info.description or "").strip()
        convert, metavar, choices = _kind(field, base, description)
        default = _default_text(field, base, info.get_default(call_default_factory=True))
        variable = f"CKPT_{field.upper()}"
        help_text = f"{description} (default: {default}; {variable})" if description else (
            f"(default: {default}; {variable})")
        specs.append(FlagSpec(field, flag_name(field), convert, metavar, choices, default, help_text))
    return specs


_GIVEN = "_settings_flags_given"


class _Store(argparse.Action):
    """Stores the value and remembers which option string gave it (see :func:`given_flags`)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)
        given = dict(getattr(namespace, _GIVEN, None) or {})
        given[self.dest] = option_string or self.option_strings[0]
        setattr(namespace, _GIVEN, given)


def given_flags(args: argparse.Namespace) -> dict[str, str]:
    """Which option string (canonical flag or alias) gave each destination, as the user typed it."""
    return dict(getattr(args, _GIVEN, None) or {})


def _keep_text(convert: Callable[[str], Any]) -> Callable[[str], str]:
    """``convert`` as a check: the value is refused as ``convert`` refuses it, but kept as the text given."""

    def check(text: str) -> str:
        convert(text)
        return text

    check.__name__ = getattr(convert, "__name__", "value")
    return check


def add_settings_flags(
    group: argparse.ArgumentParser | argparse._ArgumentGroup,
    model: type[BaseModel],
    *,
    dest_prefix: str = "ckpt_",
    aliases: Mapping[str, str] | None = None,
    keep_text: bool = False,
) -> list[FlagSpec]:
    """Add ``--<field>`` for every field of ``model`` to ``group``, and each alias (``{"--old-name": field}``) as a
    hidden option with the same destination (``dest_prefix + field``).

    :param keep_text: Store the text given (checked by the field's converter) instead of the converted value, for a
        command that passes values on as environment variables.
    :return: The flags added, in the model's order.
    """
    specs = flag_specs(model)
    fields = {spec.field: spec for spec in specs}
    for spec in specs:
        convert = _keep_text(spec.convert) if keep_text else spec.convert
        group.add_argument(spec.flag, dest=dest_prefix + spec.field, type=convert, metavar=spec.metavar,
                           choices=spec.choices, help=spec.help.replace("%", "%%"), default=None, action=_Store)
    for alias, field in (aliases or {}).items():
        if field not in fields:
            raise KeyError(f"alias {alias} names no field of {model.__name__}: {field}")
        if alias == fields[field].flag:
            continue
        spec = fields[field]
        convert = _keep_text(spec.convert) if keep_text else spec.convert
        group.add_argument(alias, dest=dest_prefix + field, type=convert, metavar=spec.metavar, choices=spec.choices,
                           help=argparse.SUPPRESS, default=None, action=_Store)
    return specs
