"""The text of `actx status --json`: json.dumps(indent=1, sort_keys=True)'s form, written
without its pure-Python encoder where that costs.

With `indent`, Python's json module encodes every value in Python (`_iterencode_dict`):
0.84 s for the 150k entries of a pod run's partition map. Here each top-level value is
encoded on its own (small ones by json.dumps, which is what they always were) and the
partition map by `PartitionStates.json_text`; the document parses to the same object as
before, and reads the same, one key a line.
"""

from __future__ import annotations

import json


class Encoded:
    """A value whose JSON text is made by `text(indent)` (indent: the entries' prefix)."""

    __slots__ = ("text",)

    def __init__(self, text):
        self.text = text


def dumps(obj, level: int = 0) -> str:
    """json.dumps(obj, indent=1, sort_keys=True) for JSON-able `obj`, with `Encoded`
    values anywhere in it. A container that holds only scalars and empty containers (a
    host's entry, the map's lines) is encoded whole by json's C encoder, its items
    separated by a newline and the indent (`_flat`); the frame around the others is built
    here, about twice as fast as the json module's generator-based one."""
    if isinstance(obj, Encoded):
        return obj.text(" " * (level + 1))
    if isinstance(obj, dict):
        if not obj:
            return "{}"
        pad = " " * (level + 1)
        if all(map(_is_leaf, obj.values())):
            return _flat(obj, pad, level)
        items = [f"{pad}{_scalar(str(k))}: {dumps(v, level + 1)}"
                 for k, v in sorted(obj.items())]
        return "{\n" + ",\n".join(items) + "\n" + " " * level + "}"
    if isinstance(obj, (list, tuple)):
        if not obj:
            return "[]"
        pad = " " * (level + 1)
        if all(map(_is_leaf, obj)):
            return _flat(obj, pad, level)
        items = [pad + dumps(v, level + 1) for v in obj]
        return "[\n" + ",\n".join(items) + "\n" + " " * level + "]"
    return _scalar(obj)


_scalar = json.dumps  # a str, number, bool or None: json.dumps's C path


def _is_leaf(value) -> bool:
    """A value json.dumps(indent=1) writes on one line: a scalar, or an empty container."""
    if isinstance(value, (dict, list, tuple)):
        return not value
    return not isinstance(value, Encoded)


def _flat(obj, pad: str, level: int) -> str:
    # The C encoder takes no indent but any separator: ",\n" + pad between items gives
    # indent's layout inside the brackets (a string's own newlines are escaped, so the
    # separator is the only one); the first and last line breaks are added around it.
    text = json.dumps(obj, sort_keys=True, separators=(",\n" + pad, ": "))
    return text[0] + "\n" + pad + text[1:-1] + "\n" + " " * level + text[-1]
