"""What family modules read an HF `config.json` with: RoPE (in each form transformers
writes it), sliding windows by layer type, and a mixture of experts' fields. Each helper
takes the family's `refuse(field, value, why)`, so an unsupported value is refused naming
its field."""

from __future__ import annotations

import math
from typing import Any, Mapping

from actx.workers.model.config import RopeConfig

_SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")

def moe_fields(hf: Mapping[str, Any], refuse, *, experts_field: str, width_field: str,
               norm_topk_prob: bool, router_weights_fp32: bool = False) -> dict[str, Any]:
    """The ModelConfig fields of a mixture of experts, from the family's field names
    (transformers 5 writes `num_local_experts` where the published configs say
    `num_experts`: either is read)."""
    if experts_field not in hf and "num_local_experts" in hf:
        experts_field = "num_local_experts"
    experts = int(hf.get(experts_field) or 0)
    k = int(hf.get("num_experts_per_tok") or 0)
    if experts < 1:
        raise refuse(experts_field, hf.get(experts_field), "a mixture of experts needs >= 1")
    if not 0 < k <= experts:
        raise refuse("num_experts_per_tok", hf.get("num_experts_per_tok"),
                     f"must be between 1 and {experts_field}={experts}")
    return {"num_experts": experts, "experts_per_token": k,
            "moe_intermediate_size": int(hf[width_field]), "norm_topk_prob": norm_topk_prob,
            "router_weights_fp32": router_weights_fp32}


def gemma_ropes_from_hf(hf: Mapping[str, Any], arch: str, refuse
                        ) -> tuple[RopeConfig, RopeConfig | None]:
    """The global layers' RoPE, and Gemma 3's local layers' own (None elsewhere).
    Gemma3TextConfig keeps one RoPE per layer type: a type's missing rope_theta is the
    config's rope_theta (else 1e6) for the global layers and rope_local_base_freq (else
    1e4) for the local ones; a 4.x `rope_scaling` scales the global layers only; RoPE
    being per layer type, a top-level original_max_position_embeddings is not read; and
    YaRN's `truncate` is read where transformers 5.25 reads it, from the top level of
    rope_parameters (`_compute_yarn_parameters`: `config.rope_parameters.get("truncate",
    True)`, which for Gemma 3 is the dict of layer types): a layer type's own `truncate`
    is not read, so YaRN truncates there."""
    if arch != "Gemma3ForCausalLM":
        return rope_from_hf(hf, refuse), None
    params = hf.get("rope_parameters") or {}
    nested = "full_attention" in params or "sliding_attention" in params
    full = dict((params.get("full_attention") if nested else None) or {"rope_type": "default"})
    local = dict((params.get("sliding_attention") if nested else None)
                 or {"rope_type": "default"})
    if hf.get("rope_scaling"):
        full.update(hf["rope_scaling"])
    full.setdefault("rope_theta", hf.get("rope_theta", 1_000_000.0))
    local.setdefault("rope_theta", hf.get("rope_local_base_freq", 10_000.0))

    truncate = params.get("truncate", True)

    def one(type_params):
        return rope_from_hf({**hf, "rope_parameters": {**type_params, "truncate": truncate},
                             "rope_scaling": None,
                             "original_max_position_embeddings": None}, refuse)

    return one(full), one(local)


def rope_from_hf(hf: Mapping[str, Any], refuse, *, partial_allowed: bool = False,
                 longrope: bool = False, aliases: Mapping[str, str] | None = None
                 ) -> RopeConfig:
    """The RoPE of a config. transformers 5 writes `rope_parameters` (with rope_theta
    inside); 4.x wrote top-level `rope_theta` and an optional `rope_scaling`.
    partial_allowed: the family rotates part of each head where asked (Phi-3); longrope:
    it reads "longrope"; aliases: other names the family's config gives a rope type."""
    # HF's convert_rope_params_to_dict: a 4.x `rope_scaling` wins over `rope_parameters`.
    params = dict(hf.get("rope_parameters") or {})
    field = "rope_parameters"
    if hf.get("rope_scaling"):
        params, field = dict(hf["rope_scaling"]), "rope_scaling"
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    rope_type = (aliases or {}).get(rope_type, rope_type)
    supported = _SUPPORTED_ROPE_TYPES + (("longrope",) if longrope else ())
    if rope_type not in supported:
        raise refuse(f"{field}.rope_type", rope_type, f"supported: {', '.join(supported)}")
    partial = float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
                    or 1.0)
    if partial != 1.0 and not partial_allowed:
        raise refuse("partial_rotary_factor", partial)
    if rope_type == "default":
        return RopeConfig(theta=theta, partial_rotary_factor=partial)
    if rope_type == "linear":
        return RopeConfig(theta=theta, rope_type="linear", factor=float(params["factor"]),
                          partial_rotary_factor=partial)
    if rope_type == "longrope":
        return _longrope(hf, params, theta, partial, field, refuse)
    if rope_type == "yarn":
        return _yarn(hf, params, theta, partial, field, refuse)
    original = original_context(hf, params)
    if original is None:
        raise refuse(f"{field}.original_max_position_embeddings", None,
                     "llama3 needs the pretraining context")
    return RopeConfig(
        theta=theta, rope_type="llama3", factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=original, partial_rotary_factor=partial)


def original_context(hf: Mapping[str, Any], params: Mapping[str, Any]) -> int | None:
    """The pretraining context of llama3, yarn and longrope RoPE, as HF's
    `standardize_rope_params` picks it: the config's top-level
    original_max_position_embeddings where it has one (Phi-3's class gives it a default,
    4096), else the rope parameters' own, else max_position_embeddings. (RoPE given per
    layer type, Gemma 3's, ignores the top-level field: its reader passes it as None.)"""
    value = hf.get("original_max_position_embeddings")
    if value is None:
        value = params.get("original_max_position_embeddings", hf.get("max_position_embeddings"))
    return None if value is None else int(value)


def _longrope(hf, params, theta: float, partial: float, field: str, refuse) -> RopeConfig:
    """HF's `_compute_longrope_parameters`: the factor defaults to max / original
    positions, the attention factor to sqrt(1 + ln(factor) / ln(original))."""
    original = original_context(hf, params)
    if original is None:
        raise refuse(f"{field}.original_max_position_embeddings", None,
                     "longrope needs the pretraining context")
    head_dim = int(hf.get("head_dim") or int(hf["hidden_size"]) // int(hf["num_attention_heads"]))
    half = int(head_dim * partial) // 2
    factors = {}
    for name in ("short_factor", "long_factor"):
        values = params.get(name)
        if not isinstance(values, (list, tuple)) or len(values) != half:
            raise refuse(f"{field}.{name}", values, f"longrope needs {half} numbers")
        factors[name] = tuple(float(v) for v in values)
    factor = params.get("factor")
    if factor is None:
        factor = int(hf.get("max_position_embeddings") or original) / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = (1.0 if factor <= 1.0
                            else math.sqrt(1 + math.log(factor) / math.log(original)))
    return RopeConfig(theta=theta, rope_type="longrope", factor=float(factor),
                      original_max_position_embeddings=original,
                      partial_rotary_factor=partial, attention_factor=float(attention_factor),
                      **factors)


def _yarn(hf, params, theta: float, partial: float, field: str, refuse) -> RopeConfig:
    """HF's `_compute_yarn_parameters`: the pretraining context as `original_context`
    picks it; the factor defaults to max / original positions; the attention factor to mscale's ratio where mscale and
    mscale_all_dim are given, else 0.1 ln(factor) + 1 (1 at factor <= 1); beta_fast 32,
    beta_slow 1; truncate true unless the config says otherwise."""
    original = original_context(hf, params)
    if original is None:
        raise refuse(f"{field}.original_max_position_embeddings", None,
                     "yarn needs the pretraining context")
    factor = params.get("factor")
    if factor is None:
        factor = int(hf.get("max_position_embeddings") or original) / original
    factor = float(factor)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = (mscale(factor, m) / mscale(factor, m_all) if m and m_all
                            else mscale(factor))
    return RopeConfig(theta=theta, rope_type="yarn", factor=factor,
                      original_max_position_embeddings=original,
                      partial_rotary_factor=partial,
                      attention_factor=float(attention_factor),
                      beta_fast=float(params.get("beta_fast") or 32),
                      beta_slow=float(params.get("beta_slow") or 1),
                      truncate=bool(params.get("truncate", True)))


def gemma_layer_types(hf: Mapping[str, Any], arch: str, num_layers: int) -> list[str]:
    """Gemma 2: every other layer local (even indices); Gemma 3: every
    `sliding_window_pattern`-th layer global; transformers 5 writes `layer_types`."""
    if hf.get("layer_types") is not None:
        return list(hf["layer_types"])
    pattern = 2 if arch == "Gemma2ForCausalLM" else int(hf.get("sliding_window_pattern", 6))
    return ["sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(num_layers)]


def windows_by_type(layer_types, window, num_layers: int, refuse) -> tuple[int | None, ...]:
    if len(layer_types) != num_layers:
        raise refuse("layer_types", layer_types, f"expected {num_layers} entries")
    windows = []
    for i, kind in enumerate(layer_types):
        if kind == "full_attention" or window is None:
            windows.append(None)
        elif kind == "sliding_attention":
            windows.append(int(window))
        else:
            raise refuse(f"layer_types[{i}]", kind)
    return tuple(windows)
