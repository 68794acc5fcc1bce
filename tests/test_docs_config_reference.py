"""docs/configuration.md is the configuration reference generated from the config's own
dataclasses (schemas/config_reference.py): every key the parser accepts is in it, with a
meaning, and its types, defaults and allowed values are what the parser does."""

from __future__ import annotations

import dataclasses
import pathlib
import re
import typing

import pytest
import yaml

from actx.deploy import config as deploy_config
from actx.schemas import config as config_lib
from actx.schemas import config_reference

REPO = pathlib.Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "configuration.md"


def _accepted_keys(cls: type, prefix: str = "") -> set[str]:
    """Every dotted key config_lib.from_dict accepts under `cls`, walked here from the
    dataclasses' fields and hints (not through the generator)."""
    found = set()
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if not field.init:
            continue
        tp = hints[field.name]
        if typing.get_origin(tp) in (typing.Union, __import__("types").UnionType):
            tp = next(a for a in typing.get_args(tp) if a is not type(None))
        origin, args = typing.get_origin(tp), typing.get_args(tp)
        key = f"{prefix}{field.name}"
        nested = None
        if dataclasses.is_dataclass(tp):
            nested = tp
        elif origin in (tuple, list) and args and dataclasses.is_dataclass(args[0]):
            key, nested = f"{key}[]", args[0]
        elif origin is dict and args and dataclasses.is_dataclass(args[1]):
            key, nested = f"{key}.<name>", args[1]
        found.add(key)
        if nested is not None and f"{cls.__name__}.{field.name}" not in \
                config_reference.RECORDED:
            found |= _accepted_keys(nested, f"{key}.")
    return found


def _rows() -> dict[str, list[str]]:
    """The page's table rows: key -> [type, default, allowed, meaning]."""
    rows = {}
    for line in PAGE.read_text().splitlines():
        m = re.match(r"^\| `([^`]+)` \| (.*) \|$", line)
        if m:
            rows[m.group(1)] = [c.strip() for c in re.split(r"(?<!\\)\|", m.group(2))]
    return rows


def test_the_page_is_the_generators_output():
    want = config_reference.render(deploy_config.SubmitConfig)
    assert PAGE.read_text() == want, (
        f"docs/configuration.md is out of date with the config's dataclasses; regenerate it: "
        f"{config_reference.REGENERATE}")


def test_every_key_the_parser_accepts_is_in_the_reference_with_a_meaning():
    rows = _rows()
    accepted = _accepted_keys(deploy_config.SubmitConfig)
    assert len(accepted) > 80
    missing = sorted(accepted - set(rows))
    assert not missing, (f"keys the config accepts but docs/configuration.md lacks: {missing}; "
                         f"regenerate it: {config_reference.REGENERATE}")
    assert not sorted(set(rows) - accepted), "the reference lists keys the parser refuses"
    empty = sorted(key for key, cells in rows.items() if len(cells[3]) < 8)
    assert not empty, f"keys without a meaning (add it to the class docstring): {empty}"


def _demo(tmp_path, **sets) -> deploy_config.SubmitConfig:
    data = config_lib.load_file(deploy_config.DEMO_CONFIG)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    return deploy_config.load_submit_config(
        str(path), [f"{key}={value}" for key, value in sets.items()])


def test_allowed_values_and_defaults_are_what_the_parser_does(tmp_path):
    """Each key with allowed values refuses a value outside them, naming them; and every
    default the page gives for the target and the spec's tables is what a config that
    leaves the key out gets."""
    rows = _rows()
    literal = {k: c for k, c in rows.items() if c[2] and "[]" not in k and "<name>" not in k}
    assert {"spec.packing.mode", "spec.capture.dtype", "target.kind"} <= set(literal)
    for key, (_, _, allowed, _) in literal.items():
        values = re.findall(r"`([^`]+)`", allowed)
        with pytest.raises(config_lib.ConfigError, match=re.escape(key.split(".")[-1])) as e:
            _demo(tmp_path, **{key: "no-such-value"})
        for value in values:
            if value != "null":
                assert repr(value) in str(e.value), (key, value, str(e.value))

    # Defaults: a minimal config (no target, no packing/capture/layout) gets the page's.
    minimal = tmp_path / "m.yaml"
    minimal.write_text(yaml.safe_dump({"run": "r", "spec": {
        "model": {"path": "m"}, "tokenizer": {"path": "t"},
        "sources": [{"kind": "text", "paths": ["d.jsonl"]}]}}))
    config = deploy_config.load_submit_config(str(minimal))
    given = {"run", "spec.model.path", "spec.tokenizer.path"}
    checked = 0
    for key, (_, default, _, _) in rows.items():
        if "[]" in key or "<name>" in key or not default.startswith("`") or key in given:
            continue
        node = config
        parts = key.split(".")
        for i, part in enumerate(parts):
            parent, node = node, getattr(node, part)
            if node is None and i + 1 < len(parts):
                # A table absent by default (spec.generate): its keys' defaults are those
                # it gets when given empty.
                hint = typing.get_type_hints(type(parent))[part]
                node = next(a for a in typing.get_args(hint) if dataclasses.is_dataclass(a))()
        if key == "spec.packing.max_context":  # resolved from seq_len (1024 here)
            assert node == max(4096, config.spec.packing.seq_len), default
            checked += 1
            continue
        value = yaml.safe_load(default.strip("`")) if default != '`""`' else ""
        if isinstance(node, tuple):
            node = list(node)
        assert node == value, (key, node, default)
        checked += 1
    assert checked > 50
