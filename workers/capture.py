"""Which activations a step captures: hook names, their parsing and validation.

A `CaptureSpec` names hook points (`resid_post`, `embed`, ...) and the layers they apply
to; `CaptureSpec.parse` also reads the run spec's text form
("layers.0-3.resid_post,layers.5.attn_out,final_norm"), keeping per-point layer sets.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from typing import Sequence, Union

LAYER_POINTS = ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out")
GLOBAL_POINTS = ("embed", "final_norm")
DTYPES = ("float32", "bfloat16", "float16")

LayerSel = Union[str, tuple[int, ...]]  # "all" or explicit layer indices

_LAYER_HOOK = re.compile(r"^layers\.(\*|\d+(?:-\d+)?)\.([A-Za-z_]+)$")


@dataclasses.dataclass(frozen=True)
class CaptureSpec:
    """Activations to capture.

    hooks: point names; per-layer points (`resid_pre`, `resid_mid`, `resid_post`,
      `attn_out`, `mlp_out`) apply to every layer in `layers`; `embed` and `final_norm`
      are global.
    layers: "all" or layer indices, for the per-layer points in `hooks`.
    dtype: dtype of the captured arrays ("float32", "bfloat16" or "float16").
    extra: explicit (point, layers) pairs for points whose layer set differs from
      `layers` (what `parse` produces for "layers.0-3.resid_post,layers.5.attn_out").
    """

    hooks: tuple[str, ...] = ("resid_post",)
    layers: LayerSel = "all"
    dtype: str = "float32"
    extra: tuple[tuple[str, LayerSel], ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "hooks", tuple(self.hooks))
        object.__setattr__(self, "layers", _norm_layers(self.layers))
        object.__setattr__(self, "extra",
                           tuple((p, _norm_layers(l)) for p, l in self.extra))
        valid = LAYER_POINTS + GLOBAL_POINTS
        for point in self.hooks + tuple(p for p, _ in self.extra):
            if point not in valid:
                raise ValueError(f"unknown hook point {point!r}{_suggest(point, valid)}; "
                                 f"valid points: {', '.join(valid)}")
        for point, _ in self.extra:
            if point in GLOBAL_POINTS:
                raise ValueError(f"{point!r} is global: it takes no layer index")
        if self.dtype not in DTYPES:
            raise ValueError(f"capture dtype {self.dtype!r} not one of {', '.join(DTYPES)}")

    @classmethod
    def parse(cls, text: str | Sequence[str], dtype: str = "float32") -> "CaptureSpec":
        """Parses "layers.0-3.resid_post,layers.5.attn_out,layers.*.mlp_out,final_norm".

        Layer forms: an index (5), an inclusive range (0-3) or every layer (*).
        """
        items = text.split(",") if isinstance(text, str) else list(text)
        globals_: list[str] = []
        per_point: dict[str, list] = {}
        for raw in items:
            item = raw.strip()
            if not item:
                continue
            if item in GLOBAL_POINTS:
                globals_.append(item)
                continue
            match = _LAYER_HOOK.match(item)
            if not match:
                examples = ["layers.0.resid_post", "layers.0-3.resid_post",
                            "layers.*.resid_post", *GLOBAL_POINTS]
                raise ValueError(f"cannot parse hook {item!r}{_suggest(item, examples)}; "
                                 "use layers.<i>.<point>, layers.<i>-<j>.<point>, "
                                 "layers.*.<point>, embed or final_norm")
            sel, point = match.groups()
            if point not in LAYER_POINTS:
                raise ValueError(f"unknown hook point {point!r} in {item!r}"
                                 f"{_suggest(point, LAYER_POINTS)}; valid per-layer points: "
                                 f"{', '.join(LAYER_POINTS)}")
            per_point.setdefault(point, []).append(sel)
        extra: list[tuple[str, LayerSel]] = []
        for point, sels in per_point.items():
            if "*" in sels:
                extra.append((point, "all"))
                continue
            layers: set[int] = set()
            for sel in sels:
                lo, _, hi = sel.partition("-")
                if hi and int(hi) < int(lo):
                    raise ValueError(f"empty layer range {sel!r} in layers.{sel}.{point}")
                layers.update(range(int(lo), int(hi or lo) + 1))
            extra.append((point, tuple(sorted(layers))))
        if not globals_ and not per_point:
            raise ValueError(f"no hooks given ({text!r}); name at least one, e.g. "
                             f"layers.*.resid_post or layers.0-3.resid_post,final_norm")
        # Global points go in `hooks`; per-layer points keep their own layer sets.
        return cls(hooks=tuple(dict.fromkeys(globals_)), layers=(), dtype=dtype,
                   extra=tuple(extra))

    def point_layers(self, num_layers: int) -> dict[str, tuple[int, ...]]:
        """Per-layer point -> sorted layer indices, validated against `num_layers`."""
        out: dict[str, set[int]] = {}
        pairs = [(p, self.layers) for p in self.hooks if p in LAYER_POINTS] + list(self.extra)
        for point, sel in pairs:
            layers = range(num_layers) if sel == "all" else sel
            for layer in layers:
                if not 0 <= layer < num_layers:
                    raise ValueError(
                        f"hook layers.{layer}.{point}: layer index {layer} out of range; "
                        f"the model has {num_layers} layers (0..{num_layers - 1})")
            out.setdefault(point, set()).update(layers)
        return {p: tuple(sorted(out[p])) for p in LAYER_POINTS if out.get(p)}

    def global_points(self) -> tuple[str, ...]:
        return tuple(p for p in GLOBAL_POINTS if p in self.hooks)

    def hook_names(self, num_layers: int) -> list[str]:
        """Sorted full hook names, e.g. ["embed", "final_norm", "layers.0.resid_post"]."""
        names = list(self.global_points())
        for point, layers in self.point_layers(num_layers).items():
            names += [f"layers.{i}.{point}" for i in layers]
        return sorted(names)

    def validate(self, config) -> None:
        """Raises ValueError if a layer index is out of range for `config.num_layers`."""
        self.point_layers(config.num_layers)


def _norm_layers(layers) -> LayerSel:
    if isinstance(layers, str):
        if layers != "all":
            raise ValueError(f"layers must be 'all' or a list of indices, got {layers!r}")
        return layers
    return tuple(sorted({int(i) for i in layers}))


def _suggest(word: str, valid: Sequence[str]) -> str:
    close = difflib.get_close_matches(word, valid, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
