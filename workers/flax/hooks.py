"""Hooks of a user's Flax model: module paths with a point, expanded against the model.

A hook is `<module path>:<point>`, e.g. `blocks.3:output`, `blocks.3.mlp:output`,
`blocks.3.attn:input`. A path component may be `*` (every existing entry there) or an
inclusive index range `0-3`, as in actx's own `layers.0-3.resid_post`. Points: `output`
(what the submodule's call returns) and `input` (its first positional argument). Paths
that do not exist are refused with the nearest ones that do. Needs no JAX.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from typing import Iterable, Sequence

POINTS = ("input", "output")
_RANGE = re.compile(r"^(\d+)-(\d+)$")


@dataclasses.dataclass(frozen=True)
class FlaxHook:
    """One captured array: the submodule at `path` ("blocks.3.mlp") and its `point`."""

    path: str
    point: str

    @property
    def name(self) -> str:
        """The stored array's name (activations/<name>)."""
        return f"{self.path}:{self.point}"


def parse_hooks(text: str | Sequence[str], module_paths: Iterable[str]) -> tuple[FlaxHook, ...]:
    """Hooks named by `text` ("blocks.*:output,blocks.0-1.attn:input"), sorted by name.

    module_paths: the model's submodule paths ("blocks.0", "blocks.0.mlp", ...).
    Raises ValueError naming the hook and the nearest existing paths.
    """
    paths = sorted(set(module_paths) - {""})
    items = text.split(",") if isinstance(text, str) else list(text)
    hooks: dict[str, FlaxHook] = {}
    for raw in items:
        item = raw.strip()
        if not item:
            continue
        pattern, sep, point = item.rpartition(":")
        if not sep or not pattern:
            raise ValueError(f"hook {item!r}: write <module path>:<point>, e.g. "
                             f"{_example(paths)}; points: {', '.join(POINTS)}")
        if point not in POINTS:
            close = difflib.get_close_matches(point, POINTS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"hook {item!r}: unknown point {point!r}{hint}; points: "
                             f"{', '.join(POINTS)}")
        for path in _expand(pattern, paths, item):
            hook = FlaxHook(path, point)
            hooks[hook.name] = hook
    if not hooks:
        raise ValueError("no hooks given; name module paths with a point, e.g. "
                         f"{_example(paths)}")
    return tuple(hooks[name] for name in sorted(hooks))


def _expand(pattern: str, paths: Sequence[str], item: str) -> list[str]:
    """The existing paths `pattern` names; every path a literal or range names must exist."""
    parts = pattern.split(".")
    found = [p for p in paths if len(p.split(".")) == len(parts)
             and all(_matches(want, have) for want, have in zip(parts, p.split(".")))]
    # Every index of a range must exist, as a layer range beyond the model is refused.
    concrete = [""]
    for part in parts:
        if part == "*":
            concrete = None
            break
        match = _RANGE.match(part)
        values = [str(i) for i in range(int(match[1]), int(match[2]) + 1)] if match else [part]
        if match and not values:
            raise ValueError(f"hook {item!r}: empty range {part!r}")
        concrete = [f"{c}.{v}" if c else v for c in concrete for v in values]
    missing = [] if concrete is None else sorted(set(concrete) - set(found))
    if missing or not found:
        shown = missing[0] if missing else pattern
        raise ValueError(f"hook {item!r}: the model has no submodule {shown!r}"
                         f"{_nearest(shown, paths)}")
    return found


def _matches(want: str, have: str) -> bool:
    if want == "*":
        return True
    match = _RANGE.match(want)
    if match:
        return have.isdigit() and int(match[1]) <= int(have) <= int(match[2])
    return want == have


def _nearest(path: str, paths: Sequence[str]) -> str:
    """' (nearest existing: a, b, c)', by similarity, or its parent's children."""
    close = difflib.get_close_matches(path, paths, n=3, cutoff=0.5)
    if not close:
        parent = path.rpartition(".")[0]
        close = [p for p in paths if p.rpartition(".")[0] == parent][:3]
    if not close:
        close = [p for p in paths if "." not in p][:3]
    return f" (nearest existing: {', '.join(close)})" if close else ""


def _example(paths: Sequence[str]) -> str:
    return f"{paths[0]}:output" if paths else "blocks.0:output"
