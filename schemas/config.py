"""Typed configuration: frozen dataclasses built from dicts with errors that name the key.

Every config in actx (run spec, submit config) is a tree of frozen dataclasses. This module
builds them from parsed YAML/TOML/JSON, refusing unknown keys and wrong types with the
dotted key and the file, so a user knows what to fix and where.

A manifest holds one Partition per partition (150k at pod scale), so `from_dict` first
tries a converter compiled once per type that only checks; anything it does not accept
as-is goes through the slow path, which makes the error message.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import types
import typing
from typing import Any, Callable, TypeVar

T = TypeVar("T")
from actx.schemas import errors


class ConfigError(errors.UserError, ValueError):
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
        real = [a for a in args if a is not type(None)]
        if len(real) == 1 and len(errors) == 1:  # Optional[X]: X's own error says more
            raise ConfigError(errors[0])
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
        if _fixed_tuple(origin, args):
            if len(value) != len(args):
                raise ConfigError(f"{where}: expected a list of {len(args)} values, got {value!r}")
            return tuple(_convert(v, t, f"{where}[{i}]")
                         for i, (v, t) in enumerate(zip(value, args)))
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
            # A YAML list of hooks is the likeliest: said how they are written.
            hint = (f"; write them comma-separated in one string: "
                    f"{','.join(value)!r}" if where.endswith("hooks") and isinstance(value, list)
                    and value and all(isinstance(v, str) for v in value) else "")
            raise ConfigError(f"{where}: expected a string, got {type(value).__name__} "
                              f"{value!r}{hint}")
        return value
    return value


def _fixed_tuple(origin: Any, args: tuple) -> bool:
    """tuple[X, Y] (one type per position), as opposed to tuple[X, ...]."""
    return origin is tuple and len(args) > 1 and args[-1] is not Ellipsis


@functools.lru_cache(maxsize=None)
def _class_fields(cls: type) -> tuple[dict, dict]:
    """(type hints, init fields) of a dataclass; get_type_hints compiles every annotation,
    so it runs once per class, not once per object."""
    return (typing.get_type_hints(cls),
            {f.name: f for f in dataclasses.fields(cls) if f.init})


class _Slow(Exception):
    """The fast path cannot accept a value as it is: the slow path converts it or says why."""


def _identity(value: Any) -> Any:
    return value


def _exact(tp: type) -> Callable[[Any], Any]:
    def check(value):
        if type(value) is not tp:
            raise _Slow
        return value
    return check


def _fast(tp: Any) -> Callable[[Any], Any] | None:
    """A converter equal to `_convert` on what it accepts (it raises _Slow on the rest), or
    None where the type is not covered."""
    try:
        return _fast_cached(tp)
    except TypeError:  # an unhashable type argument
        return None


@functools.lru_cache(maxsize=None)
def _fast_cached(tp: Any) -> Callable[[Any], Any] | None:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return _identity
    if tp in (int, str, bool):
        return _exact(tp)
    if tp is float:
        def number(value):
            if type(value) is float:
                return value
            if type(value) is int:
                return float(value)
            raise _Slow
        return number
    if origin in (typing.Union, types.UnionType):
        options = [_fast(a) for a in args if a is not type(None)]
        if None in options:
            return None
        nullable = type(None) in args

        def union(value):
            if value is None and nullable:
                return None
            for option in options:
                try:
                    return option(value)
                except _Slow:
                    pass
            raise _Slow
        return union
    if origin is typing.Literal:
        def literal(value):
            if value not in args:
                raise _Slow
            return value
        return literal
    if dataclasses.is_dataclass(tp):
        return _fast_dataclass(tp)
    if origin in (tuple, list) and not _fixed_tuple(origin, args):
        item = _fast(args[0]) if args else _identity
        if item is None:
            return None
        make = tuple if origin is tuple else list

        def sequence(value):
            if type(value) is not list and type(value) is not tuple:
                raise _Slow
            return make(value) if item is _identity else make(map(item, value))
        return sequence
    if origin is tuple:
        items = [_fast(a) for a in args]
        if None in items:
            return None

        if len(items) == 2:  # pairs, e.g. a heartbeat's (time, tokens) history
            first, second = items

            def pair(value):
                if (type(value) is not list and type(value) is not tuple) or len(value) != 2:
                    raise _Slow
                return first(value[0]), second(value[1])
            return pair

        def fixed(value):
            if (type(value) is not list and type(value) is not tuple) or len(value) != len(items):
                raise _Slow
            return tuple(f(v) for f, v in zip(items, value))
        return fixed
    if origin is dict:
        value_conv = _fast(args[1]) if args else _identity
        if value_conv is None:
            return None

        def mapping(value):
            if type(value) is not dict:
                raise _Slow
            return {k: value_conv(v) for k, v in value.items()}
        return mapping
    if origin is None and not isinstance(tp, type):
        return None  # a typing construct the fast path does not know
    return _identity  # what `_convert` passes through unchanged


def _fast_dataclass(cls: type) -> Callable[[Any], Any] | None:
    hints, fields = _class_fields(cls)
    names = frozenset(fields)
    required = frozenset(n for n, f in fields.items() if f.default is dataclasses.MISSING
                         and f.default_factory is dataclasses.MISSING)
    convs = {}
    for name in fields:
        conv = _fast(hints[name])
        if conv is None:
            return None
        convs[name] = conv

    def build(value):
        if isinstance(value, cls):
            return value
        if type(value) is not dict or not value.keys() <= names or not required <= value.keys():
            raise _Slow
        try:
            return cls(**{k: convs[k](v) for k, v in value.items()})
        except (ValueError, TypeError):
            raise _Slow from None  # __post_init__ refused it: the slow path says where
    return build


def from_dict(cls: type[T], data: dict, where: str = "") -> T:
    """Builds dataclass `cls` from `data`, refusing unknown keys and wrong types.

    `where` prefixes error messages: a dotted key path, or a file followed by ": " at the
    top level (e.g. "run.yaml: ", giving "run.yaml: packing.seq_len: ...").
    """
    fast = _fast(cls)
    if fast is not None:
        try:
            return fast(data)
        except _Slow:
            pass
    hints, fields = _class_fields(cls)
    unknown = sorted(set(data) - set(fields))
    prefix = where if (not where or where.endswith(": ")) else f"{where}."
    # Every key's problem at once, each on a line of its own (a config with two typos is
    # not refused twice, one run each); one problem raises as it was raised.
    problems: list[ConfigError] = []
    for key in unknown:
        import difflib

        hint = ""
        close = difflib.get_close_matches(key, list(fields), n=1)
        if close:
            hint = f" (did you mean {close[0]!r}?)"
        problems.append(ConfigError(f"{prefix}{key}: unknown key{hint}; "
                                    f"known keys here: {', '.join(sorted(fields))}"))
    kwargs = {}
    for name, field in fields.items():
        if name in data:
            try:
                kwargs[name] = _convert(data[name], hints[name], f"{prefix}{name}")
            except ConfigError as e:
                problems.append(e)
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            problems.append(ConfigError(f"{prefix}{name}: required key is missing"))
    if len(problems) == 1:
        raise problems[0]
    if problems:
        raise ConfigError("\n".join(str(e) for e in problems))
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{where.rstrip(': ') or cls.__name__}: {e}") from e


def from_columns(cls: type[T], columns: Any, where: str) -> tuple[T, ...]:
    """Objects of dataclass `cls` from a table of columns ({field: [value per object]}), a
    compact form for many flat objects: a missing column takes the field's default."""
    cols = list(checked_columns(cls, columns, where).values())
    try:
        return tuple(map(cls, *cols)) if cols else ()
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{where}: {e}") from e


def checked_columns(cls: type, columns: Any, where: str) -> dict[str, list]:
    """`columns` checked and converted as `from_columns` reads them, without building the
    objects: {field: values}, every field of `cls` in its order (defaults filled in)."""
    hints, fields = _class_fields(cls)
    if type(columns) is not dict:
        raise ConfigError(f"{where}: expected a table of columns "
                          f"({', '.join(fields)}), got {type(columns).__name__}")
    unknown = sorted(set(columns) - set(fields))
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]}: unknown column; known columns: "
                          f"{', '.join(fields)}")
    lengths = {name: len(col) if type(col) is list else -1 for name, col in columns.items()}
    n = max(lengths.values(), default=0)
    for name, length in lengths.items():
        if length != n:
            raise ConfigError(f"{where}.{name}: expected a list of {n} values (the length of "
                              f"the longest column), got {columns[name]!r:.80}")
    cols = {}
    for name, field in fields.items():
        col = columns.get(name)
        if col is None:
            if field.default is dataclasses.MISSING:
                raise ConfigError(f"{where}.{name}: required column is missing")
            col = [field.default] * n
        elif hints[name] is int and set(map(type, col)) <= {int}:
            pass  # the common case, checked at C speed (bool is not int here)
        else:
            conv = _fast(hints[name])
            try:
                col = list(map(conv, col)) if conv is not None else None
            except _Slow:
                col = None
            if col is None:
                col = [_convert(v, hints[name], f"{where}.{name}[{i}]")
                       for i, v in enumerate(columns[name])]
        cols[name] = col
    return cols


def to_columns(objs: "tuple | list", cls: type) -> dict[str, list]:
    """The column table of `objs` (see `from_columns`)."""
    names = [f.name for f in dataclasses.fields(cls)]
    return {name: [to_dict(getattr(o, name)) for o in objs] for name in names}


def to_dict(obj: Any) -> Any:
    """Plain JSON-able form of a config tree (tuples become lists)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def _without_duplicates(pairs: list) -> dict:
    """A JSON object, refused where a key is given twice (the last would win unseen)."""
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise ValueError(f"key {key!r} is given twice in one object; keep one")
        seen[key] = value
    return seen


def _yaml_loader():
    """yaml's SafeLoader, refusing a key given twice in one mapping (yaml keeps the last
    in silence: a second `capture:` block would drop the first), naming its line."""
    import yaml

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # `<<: *anchor`: its keys may be given again, and win
                key = self.construct_object(key_node, deep=True)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        "while reading a mapping", node.start_mark,
                        f"found key {key!r} a second time; keep one", key_node.start_mark)
                seen.add(key)
            return super().construct_mapping(node, deep)

    return Loader


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
            data = json.loads(raw, object_pairs_hook=_without_duplicates)
        else:
            import yaml

            data = yaml.load(raw, Loader=_yaml_loader())
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
            raise ConfigError(f"{where} {item!r}: expected KEY=VALUE, e.g. "
                              f"spec.packing.seq_len=512")
        key, value = item.split("=", 1)
        node = out
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{where} {item!r}: {part} is not a table")
        node[parts[-1]] = yaml.safe_load(value)
    return out
