"""The configuration reference, generated from the config's own dataclasses.

A submit config (deploy.config.SubmitConfig) and a run spec (schemas.runspec.RunSpec) are
trees of frozen dataclasses that schemas.config builds from YAML, refusing any key it does
not know. This module walks such a tree the way that parser does (type hints, fields,
defaults) and writes one Markdown table per table of the config: every key with its type,
default, allowed values and meaning. The meaning is the class docstring's entry for the
field (`name: meaning`, continued on lines indented further; `a / b: meaning` names
several), so the reference changes when the code does. docs/configuration.md is this
module's output for SubmitConfig (tests/test_docs_config_reference.py holds them equal):

    python3 -m actx.schemas.config_reference actx.deploy.config:SubmitConfig docs/configuration.md

The class is named as text and imported by name, so schemas imports nothing above it.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
import sys
import types
import typing
from typing import Any, Iterator

REGENERATE = ("python3 -m actx.schemas.config_reference actx.deploy.config:SubmitConfig "
              "docs/configuration.md")

# Fields whose docstring has no entry for them: their meaning here. Keyed "Class.field".
_MEANINGS = {
    "RunSpec.model": "the model whose activations are stored (the table below)",
    "RunSpec.tokenizer": "the tokenizer that makes the tokens (the table below)",
    "RunSpec.sources": "the input datasets, a list of tables (below); at least one",
    "RunSpec.packing": "how documents become rows (below)",
    "RunSpec.capture": "which activations are stored (below)",
    "RunSpec.layout": "how the arrays are stored (below)",
    "RunSpec.name": "the run's name, shown by status and recorded in run.json",
    "RunSpec.tokenizer_identity": "written by prepare into run.json (the tokenizer's "
                                  "fingerprint and parts), never by hand",
    "ModelSpec.path": "an HF checkpoint directory (config.json + *.safetensors), local or "
                      "gs://; relative to the config file",
    "ModelSpec.dtype": "the compute dtype of the forward pass",
    "TokenizerSpec.path": "a directory with tokenizer.json (an HF checkpoint directory "
                          "will do), local or gs://; relative to the config file",
    "SubmitConfig.spec": "the run spec (the `spec.*` tables below)",
    "SubmitConfig.target": "where and how it runs (the `target.*` tables below)",
    "TargetConfig.tpu": "the TPU slice of kind tpu-vm (below)",
    "TargetConfig.dataflow": "Dataflow's settings, for prepare or extraction there (below)",
    "DataflowConfig.project": "the Google Cloud project of the Dataflow job",
    "DataflowConfig.region": "the Dataflow region, e.g. us-central1",
    "DataflowConfig.max_num_workers": "Dataflow's --max_num_workers (0: Dataflow's default)",
    "DataflowConfig.machine_type": "the prepare workers' machine type (\"\": Dataflow's "
                                   "default)",
    "DataflowConfig.service_account_email": "the workers' service account (\"\": the "
                                            "project's default)",
    "DataflowConfig.subnetwork": "the workers' subnetwork (\"\": the default network)",
}
# Tables a user never writes: listed as one key, not walked.
RECORDED = {"RunSpec.tokenizer_identity"}
# Defaults that __post_init__ resolves: what a config that leaves the key out gets.
_RESOLVED_DEFAULTS = {"PackingSpec.max_context": "`4096`, or `seq_len` if longer"}
# Docstrings name README's sections; those sections are pages of docs/ now.
_MOVED = {
    'README, "What each token sees"': '[run-directory.md](run-directory.md#what-each-token-sees)',
    'README, "Your own Flax model"': '[flax.md](flax.md)',
    'README, "Extraction API"': '[models.md](models.md#extraction-api-python)',
    'README, "Several models on one token store"': '[several-models.md](several-models.md)',
}


@dataclasses.dataclass(frozen=True)
class Key:
    """One key of the reference."""

    path: str        # dotted, `[]` for an item of a list, `<name>` for a key of a map
    type: str
    default: str
    allowed: str
    meaning: str
    table: str       # the table it belongs to (the path of its parent)


def docstring_entries(cls: type) -> dict[str, str]:
    """`field: meaning` entries of a class's docstring and its bases' (a subclass's own
    entry wins), each meaning joined into one line."""
    entries: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        doc = inspect.cleandoc(klass.__dict__.get("__doc__") or "")
        current: list[str] | None = None
        for line in doc.splitlines():
            m = re.match(r"^([a-z_][a-z0-9_]*(?: / [a-z_][a-z0-9_]*)*): (.*)$", line)
            if m:
                current = [m.group(2).strip()]
                for name in m.group(1).split(" / "):
                    entries[name] = current  # shared list: continuations reach every name
            elif current is not None and line.startswith("  ") and line.strip():
                current.append(line.strip())
            else:
                current = None
    return {name: " ".join(parts) for name, parts in entries.items()}


def _optional(tp: Any) -> tuple[Any, bool]:
    """(the type without None, whether None is allowed)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) < len(typing.get_args(tp)):
            return (args[0] if len(args) == 1 else typing.Union[tuple(args)]), True
    return tp, False


def type_name(tp: Any) -> str:
    """A type as a YAML user reads it."""
    tp, nullable = _optional(tp)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        name = "one of the allowed values"
    elif origin in (typing.Union, types.UnionType):
        name = " or ".join(type_name(a) for a in args)
    elif dataclasses.is_dataclass(tp):
        name = "table"
    elif origin in (tuple, list):
        item = args[0] if args else Any
        name = "list of tables" if dataclasses.is_dataclass(item) else \
            f"list of {type_name(item)}"
    elif origin is dict:
        name = "tables by name" if args and dataclasses.is_dataclass(args[1]) else \
            f"table of {type_name(args[1])}" if args else "table"
    else:
        name = {bool: "true or false", int: "integer", float: "number",
                str: "string"}.get(tp, getattr(tp, "__name__", str(tp)))
    return f"{name} or null" if nullable else name


def _yaml(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '""' if value == "" else value
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_yaml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_yaml(v)}" for k, v in value.items()) + "}"
    return str(value)


def default_text(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return "required"
    return "(the table below)" if dataclasses.is_dataclass(value) else f"`{_yaml(value)}`"


def allowed_text(tp: Any) -> str:
    tp, nullable = _optional(tp)
    values = list(typing.get_args(tp)) if typing.get_origin(tp) is typing.Literal else []
    return ", ".join(f"`{_yaml(v)}`" for v in values + ([None] if nullable and values else []))


def _nested(tp: Any) -> tuple[type | None, str]:
    """The dataclass a key's value holds, and the suffix its keys take ("", "[]", ".<name>")."""
    tp, _ = _optional(tp)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return tp, ""
    if origin in (tuple, list) and args and dataclasses.is_dataclass(args[0]):
        return args[0], "[]"
    if origin is dict and args and dataclasses.is_dataclass(args[1]):
        return args[1], ".<name>"
    return None, ""


def keys(cls: type, prefix: str = "") -> Iterator[Key]:
    """Every key the parser accepts under `cls`, depth first, in field order."""
    hints = typing.get_type_hints(cls)
    docs = docstring_entries(cls)
    for field in dataclasses.fields(cls):
        if not field.init:
            continue
        tp = hints[field.name]
        path = f"{prefix}{field.name}"
        qualified = f"{cls.__name__}.{field.name}"
        nested, suffix = _nested(tp)
        meaning = docs.get(field.name) or _MEANINGS.get(qualified, "")
        if nested is not None and not meaning:
            meaning = inspect.cleandoc(nested.__doc__ or "").split("\n\n")[0]
            meaning = " ".join(meaning.split())
        default = _RESOLVED_DEFAULTS.get(qualified) or default_text(field)
        yield Key(path=f"{path}{suffix}", type=type_name(tp), default=default,
                  allowed=allowed_text(tp), meaning=meaning, table=prefix.rstrip("."))
        if nested is not None and qualified not in RECORDED:
            yield from keys(nested, f"{path}{suffix}.")


def _cell(text: str) -> str:
    for old, new in _MOVED.items():
        text = text.replace(old, new)
    return text.replace("|", "\\|").replace("\n", " ")


def render(cls: type) -> str:
    """The reference of `cls` as Markdown: an introduction, then one table per table."""
    out = [
        "# Configuration reference",
        "",
        f"<!-- Generated from {cls.__module__}.{cls.__name__} by schemas/config_reference.py;"
        f" do not edit. Regenerate: {REGENERATE} -->",
        "",
        "Every key a config file (`actx submit CONFIG`, YAML, TOML or JSON) may hold, with "
        "its type, its default (`required`: no default), the values it allows where it "
        "allows only some, and what it means. A key not listed here is refused, naming the "
        "key and the file, before any work; so is a value of the wrong type. `--set "
        "key.sub=VALUE` sets one key on the command line (`VALUE` read as YAML). Relative "
        "local paths (`run`, and under `spec` the sources, model and tokenizer) are taken "
        "from the config file's directory. `{cache}` in a string is the actx cache directory. "
        "`sources[]` is an item of the list `sources`; `extractions.<name>` a table under "
        "a name of your choice. A `spec` alone (`actx prepare --spec FILE`) takes the "
        "`spec.*` keys without their `spec.` prefix.",
        "",
    ]
    tables: dict[str, list[Key]] = {}
    for key in keys(cls):
        tables.setdefault(key.table, []).append(key)
    for table, rows in tables.items():
        out += [f"## `{table}`" if table else "## top level", ""]
        out += ["| key | type | default | allowed | meaning |", "| --- | --- | --- | --- | --- |"]
        out += [f"| `{k.path}` | {_cell(k.type)} | {_cell(k.default)} | {_cell(k.allowed)} | "
                f"{_cell(k.meaning)} |" for k in rows]
        out.append("")
    return "\n".join(out)


def load_class(name: str) -> type:
    """`package.module:Class` -> the class."""
    module, _, attr = name.partition(":")
    return getattr(importlib.import_module(module), attr)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) not in (1, 2):
        print(f"usage: {REGENERATE}", file=sys.stderr)
        return 2
    text = render(load_class(argv[0]))
    if len(argv) == 2:
        with open(argv[1], "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
