"""Command-line flags derived from a frozen dataclass: its one definition gives the
argparse flags, their help (from the class docstring), the parsed object, and the argv that
a launcher passes to another process. A config table and the flags cannot disagree.

Flag names are the field names with dashes (`batch_size` → `--batch-size`); a bool is
`--x` / `--no-x`; `tuple[int, ...]` is a comma list (`--only 3,7,9`); `X | None` takes no
flag when None.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import re
import typing
from typing import Any, TypeVar

T = TypeVar("T")


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


@functools.lru_cache(maxsize=None)
def field_docs(cls: type) -> dict[str, str]:
    """Per-field help from the class docstring: lines `name: text` or `a / b: text`, with
    indented continuation lines, searched along the class's bases (first wins)."""
    docs: dict[str, str] = {}
    for klass in cls.__mro__:
        for name, text in _docstring_fields(klass.__doc__ or "").items():
            docs.setdefault(name, text)
    return docs


def _docstring_fields(doc: str) -> dict[str, str]:
    found: dict[str, str] = {}
    names: list[str] = []
    indent = 0
    for line in doc.splitlines():
        m = re.match(r"^(\s*)([a-z_][a-z0-9_]*(?:\s*/\s*[a-z_][a-z0-9_]*)*):\s+(\S.*)$", line)
        if m:
            indent = len(m.group(1))
            names = [n.strip() for n in m.group(2).split("/")]
            for n in names:
                found[n] = m.group(3).strip()
        elif names and line.strip() and len(line) - len(line.lstrip()) > indent:
            for n in names:
                found[n] = f"{found[n]} {line.strip()}"
        else:
            names = []
    return found


def _base_type(tp: Any) -> tuple[Any, bool]:
    """(the type without `| None`, whether None is allowed)."""
    args = typing.get_args(tp)
    if args and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return rest[0], True
    return tp, False


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")


@functools.lru_cache(maxsize=None)
def _fields(cls: type) -> tuple[tuple[dataclasses.Field, Any, bool], ...]:
    hints = typing.get_type_hints(cls)
    return tuple((f, *_base_type(hints[f.name])) for f in dataclasses.fields(cls) if f.init)


def _default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


def add_arguments(parser: argparse.ArgumentParser | Any, cls: type,
                  exclude: tuple[str, ...] = ()) -> None:
    """One flag per field of `cls` (except `exclude`), with the field's default and help."""
    docs = field_docs(cls)
    for field, tp, _ in _fields(cls):
        if field.name in exclude:
            continue
        default = _default(field)
        kwargs: dict[str, Any] = {"dest": field.name, "help": docs.get(field.name)}
        if default is dataclasses.MISSING:
            kwargs["required"] = True
        else:
            kwargs["default"] = default
        if tp is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(tp) is tuple:
            kwargs.update(type=_int_list, metavar="N,N,...")
        elif typing.get_origin(tp) is typing.Literal:
            kwargs["choices"] = typing.get_args(tp)
        else:
            kwargs["type"] = tp
        parser.add_argument(flag_name(field.name), **kwargs)


def from_namespace(cls: type[T], args: argparse.Namespace, **extra: Any) -> T:
    """`cls` built from the parsed flags of `add_arguments` (plus `extra` fields)."""
    values = {f.name: getattr(args, f.name) for f, _, _ in _fields(cls) if hasattr(args, f.name)}
    return cls(**{**values, **extra})


def _text(value: Any) -> str:
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value)
    if isinstance(value, float):
        return f"{value:g}" if float(f"{value:g}") == value else repr(value)
    return str(value)


def to_argv(obj: Any, exclude: tuple[str, ...] = ()) -> list[str]:
    """The flags that make `add_arguments`' parser rebuild `obj`: every field that is not
    None, in field order. Defaults are spelled out too, so what a launcher prints is what
    runs, whatever the defaults of the actx installed where it runs."""
    argv: list[str] = []
    for field, tp, _ in _fields(type(obj)):
        if field.name in exclude:
            continue
        value = getattr(obj, field.name)
        if value is None:
            continue
        if tp is bool:
            argv.append(flag_name(field.name) if value else "--no-" + field.name.replace("_", "-"))
        else:
            argv += [flag_name(field.name), _text(value)]
    return argv


TARGET_OVERRIDE = "(default: the config's value)"


def add_override_arguments(parser: argparse.ArgumentParser | Any, cls: type,
                           names: tuple[str, ...]) -> None:
    """Flags for fields `names` of `cls` that default to None, meaning "keep the config's
    value": a command line overriding a config table, with the table's help and types."""
    docs = field_docs(cls)
    by_name = {f.name: (f, tp) for f, tp, _ in _fields(cls)}
    for name in names:
        field, tp = by_name[name]
        kwargs: dict[str, Any] = {"dest": name, "default": None,
                                  "help": f"{docs.get(name, '')} {TARGET_OVERRIDE}".strip()}
        if tp is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(tp) is typing.Literal:
            kwargs["choices"] = typing.get_args(tp)
        else:
            kwargs["type"] = tp
        parser.add_argument(flag_name(name), **kwargs)


def overrides(args: argparse.Namespace, names: tuple[str, ...]) -> dict[str, Any]:
    """The fields among `names` that were given on the command line."""
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}
