"""TransformerLens hook names, accepted where actx hooks are named (a run's
`capture.hooks`, `CaptureSpec.parse`, the reader's hook arguments), as aliases of the actx
hooks whose values they equal; the run stores actx's names.

A TransformerLens name maps to an actx hook only where TransformerLens's value is exactly
actx's (HF's). TransformerLens's `from_pretrained` processes the weights by default, and
that changes some values:
- `fold_ln` folds each norm's weight (and bias) into the layer after it, so a
  `*.hook_normalized` is the normalised stream without the norm's weight: never actx's
  `final_norm`, which applies it.
- `center_writing_weights` (LayerNorm models only: GPT-2, GPT-NeoX/Pythia) centres every
  weight that writes to the residual stream, so there `hook_resid_*`, `hook_attn_out`,
  `hook_mlp_out` and `hook_embed` are actx's values minus their mean over the hidden
  dimension. RMSNorm models are not centred, and their values are HF's.
- GPT-2's `hook_embed` is the token embedding alone (`hook_pos_embed` the positions'),
  where actx's `embed` is what block 0 reads, their sum.
Some of TransformerLens's models compute otherwise than HF's (OTHER_MODEL), or do for
some checkpoints of an architecture (`model_difference`): every value past the embedding
differs there. The workers record the latter in activations/actx.json
(`transformer_lens_differs`), so the reader refuses by the run's model, not its family.
Such names are refused by name, with the reason, never approximated. No JAX here.
"""

from __future__ import annotations

import re

# TransformerLens per-block hook -> the actx point of equal value.
LAYER_POINTS = {"hook_resid_pre": "resid_pre", "hook_resid_mid": "resid_mid",
                "hook_resid_post": "resid_post", "hook_attn_out": "attn_out",
                "hook_mlp_out": "mlp_out"}
GLOBAL_POINTS = {"hook_embed": "embed"}
# The architectures whose norms are LayerNorms (TransformerLens centres their residual
# stream) and whose positions are learned (tests/test_hook_aliases.py checks both
# against the families' configs).
LAYER_NORM_ARCHITECTURES = frozenset({"GPT2LMHeadModel", "GPTNeoXForCausalLM"})
LEARNED_POSITION_ARCHITECTURES = frozenset({"GPT2LMHeadModel"})
# Architectures whose TransformerLens model is not HF's computation, and how (read from
# TransformerLens's weight conversions: what it leaves out of the HF checkpoint).
OTHER_MODEL = {
    "GptOssForCausalLM": "TransformerLens's gpt-oss leaves out the attention sinks (its "
                         "weight conversion, pretrained/weight_conversions/openai.py, maps "
                         "no self_attn.sinks), so its attention, and every value after it, "
                         "is not HF's; actx's are HF's",
}

_BLOCK = re.compile(r"^blocks\.(\*|\d+(?:-\d+)?)\.(.+)$")
# TransformerLens names with no actx hook of equal value, and why (refused by name).
NEVER = {
    "ln_final.hook_normalized": "TransformerLens folds the final LayerNorm's weight and "
                                "bias into the unembedding (fold_ln), so its "
                                "hook_normalized lacks them; actx's final_norm applies them",
    "ln_final.hook_scale": "the norm's scale alone has no actx hook",
    "hook_pos_embed": "actx stores the position embedding only added to the token "
                      "embedding (embed = hook_embed + hook_pos_embed)",
}
_CENTRED = ("TransformerLens's from_pretrained centres the weights that write to the "
            "residual stream of a LayerNorm model (center_writing_weights=True), so there "
            "its {tl} is actx's {actx} minus its mean over the hidden dimension; ask for "
            "{actx} (TransformerLens's from_pretrained_no_processing values) and subtract "
            "the mean where your SAE was trained on the centred stream")


def model_difference(architecture: str | None, rope_type: str = "default",
                     partial_rotary_factor: float = 1.0) -> str | None:
    """Why TransformerLens's model of this checkpoint computes otherwise than HF's, where
    only some checkpoints of the architecture differ; None where it does not (as far as
    TransformerLens's own conversion shows: its Phi-3 config rotates every dim of a head
    at rope_theta and reads no rope_scaling)."""
    if architecture != "Phi3ForCausalLM":
        return None
    if partial_rotary_factor != 1.0:
        return (f"TransformerLens's Phi-3 rotates every dim of a head; this model rotates "
                f"{partial_rotary_factor:g} of them (partial_rotary_factor)")
    if rope_type != "default":
        return (f"TransformerLens's Phi-3 reads no rope_scaling; this model's RoPE is "
                f"{rope_type!r}")
    return None


class HookAliasError(ValueError):
    """A TransformerLens hook name with no exactly equal actx hook."""


def is_transformer_lens(name: str) -> bool:
    """Whether `name` is written the TransformerLens way (blocks.L.hook_*, hook_*,
    ln_final.*)."""
    return name.startswith(("blocks.", "hook_", "ln_final."))


def to_actx(name: str, architecture: str | None = None, differs: str | None = None) -> str:
    """The actx name of TransformerLens hook `name` (a layer selector kept:
    blocks.0-3.hook_resid_pre -> layers.0-3.resid_pre). With `architecture` (HF's
    `architectures[0]`), also refuses what that model's values make unequal; `differs`:
    `model_difference`'s reason for this checkpoint. Raises HookAliasError naming the hook
    and why."""
    if name in NEVER:
        raise HookAliasError(f"TransformerLens hook {name!r} has no equal actx hook: "
                             f"{NEVER[name]}")
    match = _BLOCK.match(name)
    if match and match.group(2) in LAYER_POINTS:
        actx = f"layers.{match.group(1)}.{LAYER_POINTS[match.group(2)]}"
    elif name in GLOBAL_POINTS:
        actx = GLOBAL_POINTS[name]
    else:
        accepted = [f"blocks.<i>.{p}" for p in LAYER_POINTS] + list(GLOBAL_POINTS)
        raise HookAliasError(f"TransformerLens hook {name!r} has no equal actx hook; "
                             f"accepted TransformerLens names: {', '.join(accepted)}")
    if architecture is not None:
        check(name, actx, architecture, differs)
    return actx


def check(name: str, actx: str, architecture: str, differs: str | None = None) -> None:
    """Refuses TransformerLens hook `name` (alias of `actx`) where the model's values
    differ from TransformerLens's default ones (`differs`: this checkpoint's reason)."""
    if name == "hook_embed" and architecture in LEARNED_POSITION_ARCHITECTURES:
        raise HookAliasError(
            f"TransformerLens hook 'hook_embed' is not actx's embed for {architecture}: "
            f"it is the token embedding alone, where actx's embed adds the position "
            f"embedding (what block 0 reads)")
    if architecture in LAYER_NORM_ARCHITECTURES:
        raise HookAliasError(f"TransformerLens hook {name!r} is not actx's {actx} for "
                             f"{architecture}: " + _CENTRED.format(tl=name, actx=actx))
    why = OTHER_MODEL.get(architecture) or differs
    if why and actx != "embed":
        raise HookAliasError(f"TransformerLens hook {name!r} is not actx's {actx} for "
                             f"{architecture}: {why}; ask for {actx}")


def transformer_lens_name(actx: str, architecture: str | None,
                          differs: str | None = None) -> str | None:
    """The TransformerLens name of equal value for stored hook `actx`
    ("layers.8.resid_pre" -> "blocks.8.hook_resid_pre"), None where there is none (or
    the model's values differ). A run that does not record its architecture is of a family
    with RMSNorm (the only ones actx read before it recorded the architecture)."""
    if architecture in LAYER_NORM_ARCHITECTURES:
        return None
    for tl, point in GLOBAL_POINTS.items():
        if actx == point:
            return tl
    if architecture in OTHER_MODEL or differs:
        return None
    layer, _, point = actx.removeprefix("layers.").partition(".")
    if actx.startswith("layers.") and layer.isdigit():
        for tl, ours in LAYER_POINTS.items():
            if point == ours:
                return f"blocks.{layer}.{tl}"
    return None
