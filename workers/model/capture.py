"""Which activations a step captures: hook names, their parsing and validation.

A `CaptureSpec` names hook points (`resid_post`, `embed`, ...) and the layers they apply
to; `CaptureSpec.parse` also reads the run spec's text form
("layers.0-3.resid_post,layers.5.attn_out,final_norm"), keeping per-point layer sets.
A mixture of experts adds the router's points (`router_logits`, `expert_ids`,
`expert_weights`; `experts` asks for both of the last two); `validate` refuses a point
the model does not have, listing those it has (workers.model.families).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from typing import Mapping, Sequence, Union

from actx.schemas import activations_info as info_lib
from actx.schemas import hook_aliases
from actx.workers.model import families

DENSE_POINTS = ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out")
# A mixture of experts' router (workers.model.families.base.MOE_HOOK_POINTS says what each is).
ROUTER_POINTS = info_lib.ROUTER_POINTS
LAYER_POINTS = DENSE_POINTS + ROUTER_POINTS
# Names a request may use for several points.
POINT_ALIASES = {"experts": ("expert_ids", "expert_weights")}
GLOBAL_POINTS = ("embed", "final_norm")
DTYPES = ("float32", "bfloat16", "float16", "float8_e4m3")

LayerSel = Union[str, tuple[int, ...]]  # "all" or explicit layer indices

_LAYER_HOOK = re.compile(r"^layers\.(\*|\d+(?:-\d+)?)\.([A-Za-z_]+)$")


@dataclasses.dataclass(frozen=True)
class CaptureSpec:
    """Activations to capture.

    hooks: point names; per-layer points (`resid_pre`, `resid_mid`, `resid_post`,
      `attn_out`, `mlp_out`) apply to every layer in `layers`; `embed` and `final_norm`
      are global.
    layers: "all" or layer indices, for the per-layer points in `hooks`.
    dtype: dtype of the captured arrays ("float32", "bfloat16", "float16", or
      "float8_e4m3": float8 values with one float32 scale per token, schemas.quantised).
    extra: explicit (point, layers) pairs for points whose layer set differs from
      `layers` (what `parse` produces for "layers.0-3.resid_post,layers.5.attn_out").
    transformer_lens: the TransformerLens names `parse` read (schemas.hook_aliases), as
      given: `validate` refuses those whose values differ on the model.
    """

    hooks: tuple[str, ...] = ("resid_post",)
    layers: LayerSel = "all"
    dtype: str = "float32"
    extra: tuple[tuple[str, LayerSel], ...] = ()
    transformer_lens: tuple[str, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "hooks", _expand(self.hooks))
        object.__setattr__(self, "layers", _norm_layers(self.layers))
        object.__setattr__(self, "extra", tuple(
            (q, _norm_layers(l)) for p, l in self.extra for q in POINT_ALIASES.get(p, (p,))))
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
        TransformerLens names are read as the actx hooks of equal value
        ("blocks.8.hook_resid_pre" is "layers.8.resid_pre"; schemas.hook_aliases).
        """
        items = text.split(",") if isinstance(text, str) else list(text)
        globals_: list[str] = []
        per_point: dict[str, list] = {}
        transformer_lens: list[str] = []
        for raw in items:
            item = raw.strip()
            if not item:
                continue
            if hook_aliases.is_transformer_lens(item):
                transformer_lens.append(item)
                try:
                    item = hook_aliases.to_actx(item)
                except hook_aliases.HookAliasError as e:
                    fix = hook_suggestion(item)
                    if fix is None:
                        raise
                    raise hook_aliases.HookAliasError(
                        f"{e} (did you mean {fix!r}?)") from None
            if item in GLOBAL_POINTS:
                globals_.append(item)
                continue
            match = _LAYER_HOOK.match(item)
            if not match:
                fix = hook_suggestion(item)
                hint = f" (did you mean {fix!r}?)" if fix else ""
                raise ValueError(f"cannot parse hook {item!r}{hint}; "
                                 "use layers.<i>.<point>, layers.<i>-<j>.<point>, "
                                 "layers.*.<point>, embed or final_norm")
            sel, point = match.groups()
            if point not in LAYER_POINTS and point not in POINT_ALIASES:
                fix = hook_suggestion(item)
                hint = (f" (did you mean {fix.rsplit('.', 1)[-1]!r}, as in {fix!r}?)"
                        if fix else "")
                raise ValueError(f"unknown hook point {point!r} in {item!r}"
                                 f"{hint}; valid per-layer points: "
                                 f"{', '.join(LAYER_POINTS)} (experts: expert_ids and "
                                 f"expert_weights, for a mixture of experts)")
            for each in POINT_ALIASES.get(point, (point,)):
                per_point.setdefault(each, []).append(sel)
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
                   extra=tuple(extra), transformer_lens=tuple(transformer_lens))

    def point_layers(self, num_layers: int, router_layers: Sequence[int] | None = None
                     ) -> dict[str, tuple[int, ...]]:
        """Per-layer point -> sorted layer indices, validated against `num_layers`.
        router_layers: the layers that have a router, where not all do (a mixture with
        dense layers between sparse ones, `ModelConfig.router_layers`): every layer of a
        router point means those."""
        out: dict[str, set[int]] = {}
        pairs = [(p, self.layers) for p in self.hooks if p in LAYER_POINTS] + list(self.extra)
        for point, sel in pairs:
            layers = range(num_layers) if sel == "all" else sel
            if sel == "all" and point in ROUTER_POINTS and router_layers is not None:
                layers = tuple(router_layers)
            for layer in layers:
                if not 0 <= layer < num_layers:
                    raise ValueError(
                        f"hook layers.{layer}.{point}: layer index {layer} out of range; "
                        f"the model has {num_layers} layers (0..{num_layers - 1})")
            out.setdefault(point, set()).update(layers)
        return {p: tuple(sorted(out[p])) for p in LAYER_POINTS if out.get(p)}

    def global_points(self) -> tuple[str, ...]:
        return tuple(p for p in GLOBAL_POINTS if p in self.hooks)

    def blocks_run(self, num_layers: int, router_layers: Sequence[int] | None = None) -> int:
        """Decoder blocks a forward runs for this capture (`blocks_run`)."""
        return blocks_run(self.point_layers(num_layers, router_layers), self.global_points(),
                          num_layers)

    def hook_names(self, num_layers: int, router_layers: Sequence[int] | None = None
                   ) -> list[str]:
        """Sorted full hook names, e.g. ["embed", "final_norm", "layers.0.resid_post"]."""
        names = list(self.global_points())
        for point, layers in self.point_layers(num_layers, router_layers).items():
            names += [f"layers.{i}.{point}" for i in layers]
        return sorted(names)

    def validate(self, config) -> None:
        """Raises ValueError if a layer index is out of range for `config.num_layers`, or
        a point is one the model does not have (a router point of a dense model), or a
        TransformerLens name whose value differs from actx's on this model."""
        for name in self.transformer_lens:
            hook_aliases.to_actx(name, getattr(config, "architecture", None),
                                 transformer_lens_difference(config))
        has = families.layer_points(config)
        routed = router_layers_of(config)
        point_layers = self.point_layers(config.num_layers, routed)
        asks_router = any(p in ROUTER_POINTS
                          for p in self.hooks + tuple(p for p, _ in self.extra))
        if routed == () and asks_router:
            raise ValueError(
                f"router hook points: every layer of {config.architecture} has a dense MLP "
                f"(mlp_only_layers, decoder_sparse_step), so no router; its per-layer "
                f"points: {', '.join(DENSE_POINTS)}")
        if routed is not None:
            asked = [(i, p) for p in ROUTER_POINTS for i in point_layers.get(p, ())
                     if i not in routed]
            if asked:
                dense = sorted({i for i, _ in asked})
                raise ValueError(
                    f"hook layers.{asked[0][0]}.{asked[0][1]}: layer(s) "
                    f"{', '.join(map(str, dense))} of {config.architecture} have a dense MLP "
                    f"(mlp_only_layers, decoder_sparse_step), no router; its sparse layers: "
                    f"{', '.join(map(str, routed))} (layers.*.experts takes just those)")
        missing = [p for p in point_layers if p not in has]
        why = families.missing_points(config)
        explained = [p for p in missing if p in why]
        if explained:
            raise ValueError(
                "; ".join(f"hook point {p}: {config.architecture} has no such point: "
                          f"{why[p]}" for p in explained)
                + f"; its per-layer points: {', '.join(has)}; global: "
                  f"{', '.join(GLOBAL_POINTS)}")
        if missing:
            dense = not set(has) & set(ROUTER_POINTS)
            raise ValueError(
                f"hook point(s) {', '.join(missing)}: "
                f"{getattr(config, 'architecture', 'the model')} has no such "
                f"point{' (it is not a mixture of experts)' if dense else ''}; its "
                f"per-layer points: {', '.join(has)}; global: {', '.join(GLOBAL_POINTS)}")


def transformer_lens_difference(config) -> str | None:
    """schemas.hook_aliases.model_difference for a model's config (None for a Flax
    model's, which has no RoPE settings here)."""
    rope = getattr(config, "rope", None)
    if rope is None:
        return None
    return hook_aliases.model_difference(getattr(config, "architecture", None),
                                         rope.rope_type, rope.partial_rotary_factor)


def router_layers_of(config) -> tuple[int, ...] | None:
    """The layers with a router where a mixture has dense layers between sparse ones
    (what `CaptureSpec.point_layers` takes); None where every layer is alike."""
    if not getattr(config, "mixed_mlps", False):
        return None
    return config.router_layers


def blocks_run(point_layers: Mapping[str, Sequence[int]], global_points: Sequence[str],
               num_layers: int) -> int:
    """How many decoder blocks a forward runs for these hooks: through the last hooked
    layer, every block for final_norm (it normalizes the last block's output), none for
    embed alone. The one rule for the workers' scan (workers.model.decoder) and for the FLOPs a
    dry run bounds (deploy.cost_bound, through workers.preflight.hook_shapes)."""
    if "final_norm" in global_points:
        return num_layers
    wanted = [i for layers in point_layers.values() for i in layers]
    return max(wanted) + 1 if wanted else 0


def point_width(config, point: str) -> int:
    """The last axis of a per-layer point's array: the hidden size, the experts
    (router_logits) or the experts per token (expert_ids, expert_weights)."""
    if point == "router_logits":
        return config.num_experts
    if point in ("expert_ids", "expert_weights"):
        return config.experts_per_token
    return config.hidden_size


def point_dtype(point: str, dtype: str) -> str:
    """A point's stored dtype: the capture dtype, int32 for expert ids."""
    return "int32" if point == "expert_ids" else dtype


def hook_widths(config, hook_names) -> dict[str, int]:
    """Hook name -> the last axis of its stored array (ActivationsInfo.hooks)."""
    return {name: point_width(config, name.rsplit(".", 1)[-1]) for name in hook_names}


def hook_dtypes(hook_names, dtype: str) -> dict[str, str] | None:
    """Hook name -> its stored dtype where that is not the capture dtype; None where
    every hook is (ActivationsInfo.hook_dtypes)."""
    other = {name: point_dtype(name.rsplit(".", 1)[-1], dtype) for name in hook_names}
    other = {name: d for name, d in other.items() if d != dtype}
    return other or None


def _expand(points) -> tuple[str, ...]:
    return tuple(q for p in points for q in POINT_ALIASES.get(p, (p,)))


def _norm_layers(layers) -> LayerSel:
    if isinstance(layers, str):
        if layers != "all":
            raise ValueError(f"layers must be 'all' or a list of indices, got {layers!r}")
        return layers
    return tuple(sorted({int(i) for i in layers}))


def _closest(word: str, valid: Sequence[str]) -> str | None:
    """The one name in `valid` close to `word` (a misspelling of it), None where none is,
    or where two are (a guess between two points would store the wrong one)."""
    close = difflib.get_close_matches(word, valid, n=2, cutoff=_CLOSE)
    if len(close) == 2 and (difflib.SequenceMatcher(None, word, close[1]).ratio()
                            > difflib.SequenceMatcher(None, word, close[0]).ratio() - 0.1):
        return None
    return close[0] if close else None


def _suggest(word: str, valid: Sequence[str]) -> str:
    close = _closest(word, valid)
    return f" (did you mean {close!r}?)" if close else ""


# How alike (difflib's ratio) a misspelling and the name it corrects must be: a typo
# ("resid_pots", "layer", "final_nrom"), not another name ("mlp_in" is not "mlp_out").
_CLOSE = 0.8
# A layer selector as the grammar writes it: an index, an inclusive range, every layer.
_SELECTOR = re.compile(r"^(\*|\d+(?:-\d+)?)$")
# TransformerLens names of other quantities, with no actx hook of equal value: never
# "corrected" into one that has (that would store something else).
_TL_OTHERS = frozenset({"hook_attn_in", "hook_q_input", "hook_k_input", "hook_v_input",
                        "hook_mlp_in", "hook_pos_embed", "hook_tokens"})


def hook_suggestion(name: str) -> str | None:
    """A correction of unparseable hook `name` that keeps what it selects: its layer
    index, range or `*` as typed, only its misspelt parts corrected (the `layers` /
    `blocks` prefix, the point); TransformerLens-style names stay TransformerLens-style.
    None where no such correction exists: a suggestion must never name other layers or
    another point than the one the user misspelt."""
    name = name.strip()
    if name in _TL_OTHERS or name in hook_aliases.NEVER:
        return None
    parts = name.split(".")
    if len(parts) == 1:  # a global point: embed, final_norm, hook_embed
        word = parts[0].lower()
        tl = word.startswith("hook_")
        point = _closest(word.removeprefix("hook_"), GLOBAL_POINTS)
        if point is None:
            return None
        if tl and f"hook_{point}" in hook_aliases.GLOBAL_POINTS:
            point = f"hook_{point}"
        return point if point != name else None
    sels = [i for i, part in enumerate(parts) if _SELECTOR.match(part)]
    if len(sels) != 1 or sels[0] != len(parts) - 2 or sels[0] == 0:
        return None  # no layer selector, several, or not just before the point
    sel, word = parts[-2], parts[-1].lower()
    # The prefix's last part ("layer", "model.layers", "block"); must be a misspelt
    # `layers` or `blocks`.
    prefix = _closest(parts[-3].lower(), ("layers", "blocks"))
    if prefix is None or (len(parts) > 3 and parts[-3].lower() not in ("layers", "blocks")):
        return None
    if word in _TL_OTHERS:
        return None
    point = _closest(word.removeprefix("hook_"), LAYER_POINTS + tuple(POINT_ALIASES))
    if point is None:
        return None
    lo, _, hi = sel.partition("-")
    if hi and int(hi) < int(lo):
        return None  # an empty range: no correction keeps it
    if prefix == "blocks" and f"hook_{point}" in hook_aliases.LAYER_POINTS:
        fix = f"blocks.{sel}.hook_{point}"
    else:
        fix = f"layers.{sel}.{point}"
    return fix if fix != name else None
