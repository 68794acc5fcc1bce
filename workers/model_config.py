"""The decoder's frozen configuration, read from an HF `config.json`.

One dataclass covers every supported family; what differs between families is data in
`workers.families` (one module per family: the config fields it reads, its tensors, its
block). `ModelConfig.from_hf` finds the family by architecture, reads the shape fields
common to all, and lets the family read its own options; anything a checkpoint asks for
that is not implemented is refused here, naming the field, before any weight is read.
The helpers below (RoPE, sliding windows, experts) are what family modules read with.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import numpy as np

_SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding frequencies.

    theta: base wavelength (HF `rope_theta`).
    rope_type: "default", "linear", "llama3" or "longrope" (Phi-3).
    factor: frequency divisor for "linear" and "llama3".
    low_freq_factor, high_freq_factor, original_max_position_embeddings: "llama3"; the
      last also "longrope" (documents longer than it take the long factors).
    partial_rotary_factor: the fraction of each head's dims that rotate (the first ones).
    short_factor, long_factor: "longrope" only, per frequency.
    attention_factor: cos and sin are multiplied by it ("longrope"; 1.0 elsewhere).
    """

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    partial_rotary_factor: float = 1.0
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0

    def rotary_dim(self, head_dim: int) -> int:
        """How many of a head's dims rotate (HF: int(head_dim * partial_rotary_factor))."""
        return int(head_dim * self.partial_rotary_factor)

    @property
    def has_long_factors(self) -> bool:
        """Whether a document's length changes its frequencies (longrope whose long
        factors differ from its short ones)."""
        return self.rope_type == "longrope" and self.long_factor != self.short_factor

    def inv_freq(self, head_dim: int, long: bool = False) -> np.ndarray:
        """Inverse frequencies [rotary_dim // 2] in float64, as HF computes them;
        long: longrope's long factors (documents beyond original_max_position_embeddings)."""
        dim = self.rotary_dim(head_dim)
        # float32 exponent like HF (torch.arange(...).float() / dim), then float64 maths.
        exponent = (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim)
        if self.rope_type == "longrope":
            # HF: 1 / (ext_factors * base ** exponent), all in float32.
            ext = np.asarray(self.long_factor if long else self.short_factor, np.float32)
            base = np.float32(self.theta) ** exponent
            return (np.float32(1.0) / (ext * base)).astype(np.float64)
        inv_freq = 1.0 / (self.theta ** exponent.astype(np.float64))
        if self.rope_type == "linear":
            return inv_freq / self.factor
        if self.rope_type != "llama3":
            return inv_freq
        old_context = self.original_max_position_embeddings
        low_freq_wavelen = old_context / self.low_freq_factor
        high_freq_wavelen = old_context / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_freq_wavelen, inv_freq / self.factor, inv_freq)
        smooth = ((old_context / wavelen - self.low_freq_factor)
                  / (self.high_freq_factor - self.low_freq_factor))
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return np.where(is_medium, smoothed, scaled)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shapes and options of a supported decoder.

    architecture: HF `architectures[0]`, e.g. "Qwen2ForCausalLM".
    num_layers: decoder blocks (HF `num_hidden_layers`).
    hidden_size: residual width d.
    vocab_size: rows of the embedding table.
    num_heads, num_kv_heads, head_dim: attention heads n, key/value heads k (GQA when
      k < n) and per-head width h.
    intermediate_size: MLP width f.
    rms_norm_eps: RMSNorm epsilon.
    rope: rotary embedding frequencies.
    qkv_bias: q/k/v projections have biases (Qwen2).
    tie_word_embeddings: the LM head reuses the embedding (only matters when loading:
      the LM head is never computed).
    sliding_windows: per layer, the attention window in tokens, or None for full causal.
    max_position_embeddings: the longest context the checkpoint declares (0: not given).
    gemma_norms: Gemma's RMSNorm, (1 + w) applied in float32, and its post-attention,
      pre- and post-MLP norms; embeddings scaled by sqrt(hidden_size).
    qk_norm: RMSNorm over each head's queries and keys before RoPE (Qwen3, Gemma 3).
    mlp_activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, Gemma).
    query_scale: the attention logits' scale (Gemma: query_pre_attn_scalar ** -0.5);
      None: head_dim ** -0.5.
    attn_logit_softcap: logits -> cap * tanh(logits / cap) (Gemma 2); None: none.
    local_rope: the RoPE of the local layers where it differs from `rope` (Gemma 3's
      local base); None: every layer uses `rope`.
    local_layers: per layer, whether it is a local ("sliding_attention") layer that takes
      `local_rope`; () where `local_rope` is None.
    qk_norm_full: RMSNorm over the whole q and k projections (all heads together) before
      RoPE (OLMo 2, OLMoE).
    input_norms: RMSNorm before attention and before the MLP (False: OLMo 2).
    post_norms: RMSNorm after attention and after the MLP (OLMo 2; Gemma's are implied
      by gemma_norms).
    norm_scale_fp32: RMSNorm multiplies by its weight in float32 and casts last (OLMo 2's
      norms); else it casts, then multiplies in the input dtype.
    num_experts: experts per layer of a mixture of experts (0: a dense MLP).
    experts_per_token: k, the experts each token is routed to.
    moe_intermediate_size: each expert's MLP width.
    norm_topk_prob: the k chosen softmax weights are renormalised to sum to 1.
    router_weights_fp32: the chosen weights stay float32 (Mixtral); else they are cast
      to the compute dtype before they scale the experts (Qwen3-MoE, OLMoE).
    """

    architecture: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    qkv_bias: bool = False
    tie_word_embeddings: bool = False
    sliding_windows: tuple[int | None, ...] = ()
    max_position_embeddings: int = 0
    gemma_norms: bool = False
    qk_norm: bool = False
    mlp_activation: str = "silu"
    query_scale: float | None = None
    attn_logit_softcap: float | None = None
    local_rope: RopeConfig | None = None
    local_layers: tuple[bool, ...] = ()
    qk_norm_full: bool = False
    input_norms: bool = True
    post_norms: bool = False
    norm_scale_fp32: bool = False
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    router_weights_fp32: bool = False

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}")
        if self.sliding_windows and len(self.sliding_windows) != self.num_layers:
            raise ValueError(f"{len(self.sliding_windows)} sliding windows for "
                             f"{self.num_layers} layers")
        if self.num_experts and not 0 < self.experts_per_token <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.experts_per_token} must be between 1 "
                             f"and the {self.num_experts} experts")

    @property
    def family(self):
        """This model's `workers.families.Family`."""
        from actx.workers import families

        return families.for_architecture(self.architecture)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def layer_points(self) -> tuple[str, ...]:
        """The per-layer hook points this model has."""
        return self.family.hook_points(self)

    @property
    def window_per_layer(self) -> tuple[int | None, ...]:
        return self.sliding_windows or (None,) * self.num_layers

    @property
    def local_rope_per_layer(self) -> tuple[bool, ...]:
        """Per layer, whether it takes `local_rope` (a local layer of Gemma 3)."""
        if self.local_rope is None:
            return (False,) * self.num_layers
        return self.local_layers

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any], source: str = "config.json") -> "ModelConfig":
        """Reads an HF config dict; raises ValueError naming any unsupported field."""
        from actx.workers import families

        architectures = hf.get("architectures") or []
        if len(architectures) != 1 or architectures[0] not in families.SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"{source}: unsupported architectures={architectures!r}; supported: "
                f"{', '.join(families.SUPPORTED_ARCHITECTURES)}")
        arch = architectures[0]
        family = families.for_architecture(arch)
        if arch in family.text_tower:
            # The language model's own config; the vision tower is never read.
            if not isinstance(hf.get("text_config"), Mapping):
                raise ValueError(f"{source}: {arch} without a text_config")
            hf = hf["text_config"]
            source = f"{source} (text_config)"
            arch = family.text_tower[arch]

        def refuse(field: str, value: Any, why: str = "") -> ValueError:
            return ValueError(f"{source}: unsupported option {field}={value!r} for {arch}"
                              + (f" ({why})" if why else ""))

        num_heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        num_layers = int(hf["num_hidden_layers"])
        head_dim = int(hf.get("head_dim") or hidden // num_heads)
        options = dict(family.options(hf, arch, refuse, num_layers, head_dim))
        rope = options.pop("rope", None) or rope_from_hf(hf, refuse)
        tie_default = options.pop("tie_default", False)
        return cls(
            architecture=arch,
            num_layers=num_layers,
            hidden_size=hidden,
            vocab_size=int(hf["vocab_size"]),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            intermediate_size=int(hf["intermediate_size"]),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope=rope,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", tie_default)),
            max_position_embeddings=int(hf.get("max_position_embeddings") or 0),
            **options,
        )


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
    """The global layers' RoPE, and Gemma 3's local layers' own (None elsewhere)."""
    if arch != "Gemma3ForCausalLM":
        return rope_from_hf(hf, refuse), None
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        # transformers 5: one RoPE per layer type.
        full = {**hf, "rope_parameters": params.get("full_attention") or {},
                "rope_scaling": None}
        local = {**hf, "rope_parameters": params.get("sliding_attention") or {},
                 "rope_scaling": None}
        return rope_from_hf(full, refuse), rope_from_hf(local, refuse)
    # 4.x: rope_theta / rope_scaling for the global layers, rope_local_base_freq local.
    global_rope = rope_from_hf({**hf, "rope_theta": hf.get("rope_theta", 1_000_000.0)},
                                refuse)
    local_theta = float(hf.get("rope_local_base_freq", 10_000.0))
    return global_rope, RopeConfig(theta=local_theta)


def rope_from_hf(hf: Mapping[str, Any], refuse, *, partial_allowed: bool = False,
                 longrope: bool = False, aliases: Mapping[str, str] | None = None
                 ) -> RopeConfig:
    """The RoPE of a config. transformers 5 writes `rope_parameters` (with rope_theta
    inside); 4.x wrote top-level `rope_theta` and an optional `rope_scaling`.
    partial_allowed: the family rotates part of each head where asked (Phi-3); longrope:
    it reads "longrope"; aliases: other names the family's config gives a rope type."""
    params = dict(hf.get("rope_parameters") or {})
    field = "rope_parameters"
    if not params and hf.get("rope_scaling"):
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
    return RopeConfig(
        theta=theta, rope_type="llama3", factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings",
                       hf.get("max_position_embeddings", 8192))),
        partial_rotary_factor=partial)


def _longrope(hf, params, theta: float, partial: float, field: str, refuse) -> RopeConfig:
    """HF's `_compute_longrope_parameters`: the factor defaults to max / original
    positions, the attention factor to sqrt(1 + ln(factor) / ln(original))."""
    original = params.get("original_max_position_embeddings",
                          hf.get("original_max_position_embeddings"))
    if original is None:
        raise refuse(f"{field}.original_max_position_embeddings", None,
                     "longrope needs the pretraining context")
    original = int(original)
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
