"""Typed configuration: frozen dataclasses built from dicts with errors that name the key.

Every config in actx (run spec, submit config) is a tree of frozen dataclasses. This module
builds them from parsed YAML/TOML/JSON, refusing unknown keys and wrong types with the
dotted key and the file, so a user knows what to fix and where.
"""

from __future__ import annotations

import dataclasses
import json
import os
import types
import typing
from typing import Any, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration value is missing, unknown or of the wrong type."""


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _convert(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{where}: expected {' or '.join(_type_name(a) for a in args)}, "
                          f"got {type(value).__name__} {value!r}")
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(f"{where}: expected one of {list(args)}, got {value!r}")
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a table of {tp.__name__} fields, got {value!r}")
        return from_dict(tp, value, where)
    if origin in (tuple, list):
        if isinstance(value, str) or not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {type(value).__name__} {value!r}")
        item_tp = args[0] if args else Any
        items = [_convert(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a table, got {type(value).__name__}")
        key_tp, val_tp = args if args else (Any, Any)
        return {k: _convert(v, val_tp, f"{where}.{k}") for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {type(value).__name__} {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {type(value).__name__} {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {type(value).__name__} {value!r}")
        return value
    return value


def from_dict(cls: type[T], data: dict, where: str = "") -> T:
    """Builds dataclass `cls` from `data`, refusing unknown keys and wrong types.

    `where` prefixes error messages: a dotted key path, or a file followed by ": " at the
    top level (e.g. "run.yaml: ", giving "run.yaml: packing.seq_len: ...").
    """
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    prefix = where if (not where or where.endswith(": ")) else f"{where}."
    if unknown:
        import difflib

        hint = ""
        close = difflib.get_close_matches(unknown[0], list(fields), n=1)
        if close:
            hint = f" (did you mean {close[0]!r}?)"
        raise ConfigError(f"{prefix}{unknown[0]}: unknown key{hint}; "
                          f"known keys here: {', '.join(sorted(fields))}")
    kwargs = {}
    for name, field in fields.items():
        if name in data:
            kwargs[name] = _convert(data[name], hints[name], f"{prefix}{name}")
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{prefix}{name}: required key is missing")
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{where.rstrip(': ') or cls.__name__}: {e}") from e


def to_dict(obj: Any) -> Any:
    """Plain JSON-able form of a config tree (tuples become lists)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def load_file(path: str | os.PathLike) -> dict:
    """Parses a YAML, TOML or JSON file into a dict, with the file named in errors."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise ConfigError(f"{path}: config file not found")
    with open(path, "rb") as f:
        raw = f.read()
    try:
        if path.endswith(".toml"):
            import tomllib

            data = tomllib.loads(raw.decode())
        elif path.endswith(".json"):
            data = json.loads(raw)
        else:
            import yaml

            data = yaml.safe_load(raw)
    except Exception as e:  # the parsers raise many types; all mean "not parseable"
        raise ConfigError(f"{path}: cannot parse config: {e}") from e
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a table of keys")
    return data


def apply_overrides(data: dict, overrides: list[str], where: str = "--set") -> dict:
    """Applies `a.b.c=value` overrides (value parsed as YAML) to a nested dict copy."""
    import copy

    import yaml

    out = copy.deepcopy(data)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"{where} {item!r}: expected KEY=VALUE, e.g. packing.seq_len=512")
        key, value = item.split("=", 1)
        node = out
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{where} {item!r}: {part} is not a table")
        node[parts[-1]] = yaml.safe_load(value)
    return out
