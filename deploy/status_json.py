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
    values anywhere in it. Scalars are encoded by json.dumps (C); the indented frame is
    built here, about twice as fast as the json module's generator-based one."""
    if isinstance(obj, Encoded):
        return obj.text(" " * (level + 1))
    if isinstance(obj, dict):
        if not obj:
            return "{}"
        pad = " " * (level + 1)
        items = [f"{pad}{_scalar(str(k))}: {dumps(v, level + 1)}"
                 for k, v in sorted(obj.items())]
        return "{\n" + ",\n".join(items) + "\n" + " " * level + "}"
    if isinstance(obj, (list, tuple)):
        if not obj:
            return "[]"
        pad = " " * (level + 1)
        items = [pad + dumps(v, level + 1) for v in obj]
        return "[\n" + ",\n".join(items) + "\n" + " " * level + "]"
    return _scalar(obj)


_scalar = json.dumps  # a str, number, bool or None: json.dumps's C path
