"""The decoder's frozen configuration: the shapes and options one dataclass holds for every
supported family.

It is read from an HF `config.json` by the families (`workers.model.families.config_from_hf`:
the family found by architecture reads its own fields, and anything a checkpoint asks for
that is not implemented is refused there, naming the field, before any weight is read).
This module knows no family: the families import it, never the other way round.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np


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
    attention_factor: cos and sin are multiplied by it ("longrope", "yarn"; 1.0
      elsewhere).
    beta_fast, beta_slow, truncate: "yarn"'s ramp between the frequencies kept
      (extrapolated) and those divided by `factor` (interpolated), over the pretraining
      context original_max_position_embeddings (HF's `_compute_yarn_parameters`).
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
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True

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
        if self.rope_type == "yarn":
            return self._yarn_inv_freq(dim, exponent)
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

    def _yarn_inv_freq(self, dim: int, exponent: np.ndarray) -> np.ndarray:
        """HF's yarn frequencies, in float32 as torch computes them: each frequency
        between its extrapolated value and its value divided by `factor`, by a linear ramp
        over the dims whose wavelengths turn between beta_fast and beta_slow times within
        the original context."""
        def correction_dim(rotations: float) -> float:
            return (dim * math.log(self.original_max_position_embeddings
                                   / (rotations * 2 * math.pi))) / (2 * math.log(self.theta))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # HF: prevents a division by zero
        pos_freqs = np.float32(self.theta) ** exponent
        extrapolated = np.float32(1.0) / pos_freqs
        interpolated = np.float32(1.0) / (np.float32(self.factor) * pos_freqs)
        ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low))
                       / np.float32(high - low), 0, 1).astype(np.float32)
        keep = np.float32(1) - ramp
        return (interpolated * (np.float32(1) - keep) + extrapolated * keep).astype(np.float64)


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
    rms_norm_eps: the norms' epsilon (RMSNorm, or LayerNorm where `layer_norm`).
    rope: rotary embedding frequencies.
    qkv_bias: q/k/v projections have biases (Qwen2).
    tie_word_embeddings: the LM head reuses the embedding (only matters when loading:
      the LM head is never computed).
    sliding_windows: per layer, the attention window in tokens, or None for full causal.
    max_position_embeddings: the longest context the checkpoint declares (0: not given).
    gemma_norms: Gemma's RMSNorm, (1 + w) applied in float32, and its post-attention,
      pre- and post-MLP norms; embeddings scaled by sqrt(hidden_size).
    qk_norm: RMSNorm over each head's queries and keys before RoPE (Qwen3, Gemma 3).
    mlp_activation: "silu" (SwiGLU), "gelu_tanh" (GeGLU, Gemma; GPT-2's gelu_new) or
      "gelu" (exact, erf: GPT-NeoX's default).
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
      and gpt-oss's norms, all of them); else it casts, then multiplies in the input dtype.
    num_experts: experts per layer of a mixture of experts (0: a dense MLP).
    experts_per_token: k, the experts each token is routed to.
    moe_intermediate_size: each expert's MLP width.
    norm_topk_prob: the k chosen softmax weights are renormalised to sum to 1.
    router_weights_fp32: the chosen weights stay float32 (Mixtral); else they are cast
      to the compute dtype before they scale the experts (Qwen3-MoE, OLMoE).
    moe_layers: per layer, whether its MLP is the mixture of experts (the others a dense
      MLP of intermediate_size: Qwen's mlp_only_layers and decoder_sparse_step); ():
      every layer is, where num_experts > 0.
    attention_sinks: each head has a learned logit (`sinks_ln`) in its softmax, a key
      with no value: it takes a share of the attention from every key (gpt-oss).
    softmax_after_topk: the router picks the k largest logits and its weights are their
      softmax (gpt-oss); else the k largest of the softmax over all experts.
    swiglu_limit, swiglu_alpha: the experts' gated unit is gpt-oss's clamped SwiGLU,
      (clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit);
      None: activation(gate) * up.
    mxfp4_experts: the checkpoint stores the experts' projections as MXFP4 blocks and
      scales (`*_blocks`, `*_scales`), dequantised to the compute dtype at load.
    shared_expert_size: the width of a shared expert every token also runs, scaled by
      sigmoid(x @ shared_expert_gate) and added to the routed experts' sum (Qwen2-MoE);
      0: none.
    layer_norm: every norm is a LayerNorm with a bias (GPT-2, GPT-NeoX), not an RMSNorm.
    learned_positions: a learned absolute position embedding ([max_position_embeddings,
      d], indexed by each token's position in its document) is added to the token
      embedding, and no RoPE is applied (GPT-2).
    parallel_residual: x + attn(norm1(x)) + mlp(norm2(x)): both branches read the
      block's input, so there is no resid_mid (GPT-NeoX's use_parallel_residual).
    gated_mlp: the MLP is gate/up/down (SwiGLU, GeGLU); False: up, activation, down
      (GPT-2, GPT-NeoX).
    o_bias: the attention output projection has a bias.
    mlp_bias: the MLP projections have biases.
    inverse_layer_scale: attention logits of layer i are further divided by i + 1
      (GPT-2's scale_attn_by_inverse_layer_idx).
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
    layer_norm: bool = False
    learned_positions: bool = False
    parallel_residual: bool = False
    gated_mlp: bool = True
    o_bias: bool = False
    mlp_bias: bool = False
    inverse_layer_scale: bool = False
    moe_layers: tuple[bool, ...] = ()
    shared_expert_size: int = 0
    attention_sinks: bool = False
    softmax_after_topk: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    mxfp4_experts: bool = False

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}")
        if self.sliding_windows and len(self.sliding_windows) != self.num_layers:
            raise ValueError(f"{len(self.sliding_windows)} sliding windows for "
                             f"{self.num_layers} layers")
        if self.learned_positions and self.max_position_embeddings < 1:
            raise ValueError("learned position embeddings need max_position_embeddings")
        if self.moe_layers and len(self.moe_layers) != self.num_layers:
            raise ValueError(f"{len(self.moe_layers)} mixture flags for "
                             f"{self.num_layers} layers")
        if self.num_experts and not 0 < self.experts_per_token <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.experts_per_token} must be between 1 "
                             f"and the {self.num_experts} experts")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def moe_per_layer(self) -> tuple[bool, ...]:
        """Per layer, whether its MLP is the mixture of experts."""
        return self.moe_layers or (self.num_experts > 0,) * self.num_layers

    @property
    def router_layers(self) -> tuple[int, ...]:
        """The layers that have a router (and so router_logits, expert_ids and
        expert_weights)."""
        return tuple(i for i, moe in enumerate(self.moe_per_layer) if moe)

    @property
    def mixed_mlps(self) -> bool:
        """A mixture of experts some (or all) of whose layers have a dense MLP instead."""
        return self.num_experts > 0 and not all(self.moe_per_layer)

    @property
    def window_per_layer(self) -> tuple[int | None, ...]:
        return self.sliding_windows or (None,) * self.num_layers

    @property
    def local_rope_per_layer(self) -> tuple[bool, ...]:
        """Per layer, whether it takes `local_rope` (a local layer of Gemma 3)."""
        if self.local_rope is None:
            return (False,) * self.num_layers
        return self.local_layers
