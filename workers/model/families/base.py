"""What a model family is, as data: the `Family` and `LayerTensor` records every family
module fills in, and the building blocks the Llama-shaped families share.

A family says which HF architectures and config fields it reads (`options` turns them into
`ModelConfig` fields), how each HF tensor of a layer becomes one of our parameters
(`layer_tensors`: name, shape, layout change, a part of a fused tensor, a stack of experts),
each parameter's logical (sharding) axes, what its blocks compute (`block`) and which
hook points it has. The config reader (`families.config_from_hf`), the pre-flight's checkpoint check
(`checkpoint_check`) and the loader (`checkpoint`) read only these records. No JAX here.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

from actx.workers.model import mxfp4

# Our parameter names carry the shape letters: v vocab, d hidden, l layers, n heads,
# k kv heads, h head dim, f MLP width, e experts.
TOP_PARAM_AXES: dict[str, tuple[str, ...]] = {
    "embed_vd": ("vocab", "embed"),
    "final_norm_d": ("embed",),
}

# Where the decoder's tensors live: causal LMs under `model.`; Gemma 3's multimodal
# checkpoints under `model.language_model.` (transformers 5) or `language_model.model.`
# (the checkpoints as first published). A family may name its own (`Family.prefixes`).
DECODER_PREFIXES = ("model.", "model.language_model.", "language_model.model.")

# What each hook point is, for every family (`Family.hook_notes` adds a family's own).
HOOK_POINTS: dict[str, str] = {
    "embed": "the token embeddings as the first block reads them (Gemma: times "
             "sqrt(hidden))",
    "resid_pre": "the residual stream entering block i",
    "attn_out": "what attention adds to the residual stream (after a post-attention norm "
                "where the family has one)",
    "resid_mid": "resid_pre + attn_out (not in a parallel block, GPT-NeoX's "
                 "use_parallel_residual, where the MLP reads resid_pre: refused there)",
    "mlp_out": "what the MLP adds to the residual stream (after a post-MLP norm where the "
               "family has one; for a mixture of experts, the weighted sum of the chosen "
               "experts)",
    "resid_post": "resid_mid + mlp_out, the residual stream leaving block i",
    "final_norm": "the final norm of the last block's resid_post (what an LM head reads)",
}
MOE_HOOK_POINTS: dict[str, str] = {
    "router_logits": "the router's logits over all experts [rows, seq, n_experts], in the "
                     "compute dtype, before any softmax",
    "expert_ids": "the chosen experts [rows, seq, k] (int32), best first; exactly "
                  "equal weights in ascending expert id (torch.topk's tie order is its "
                  "sort's, not the ids')",
    "expert_weights": "the chosen experts' weights [rows, seq, k] after the family's "
                      "normalisation, in expert_ids' order",
}
DENSE_POINTS = ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out")
MOE_POINTS = tuple(MOE_HOOK_POINTS)


@dataclasses.dataclass(frozen=True)
class LayerTensor:
    """How one of our per-layer parameters is read from an HF checkpoint.

    hf: the HF tensor's name under `layers.{i}.`; "{e}" in it stands for the expert index
      when `experts` > 0.
    hf_shape: that HF tensor's shape (the whole fused tensor where `rows` takes a part).
    axes: our parameter's logical axes without the leading "layers" (workers.model.sharding).
    to_ours: HF layout -> ours, applied after `rows` (e.g. q_proj [n*h, d] -> [d, n, h]).
    rows: (lo, hi): this parameter is rows lo:hi of a fused HF tensor (Phi-3's qkv_proj
      and gate_up_proj); None: the whole tensor.
    experts: > 0: one HF tensor per expert, stacked into our leading "moe_experts" axis.
    layers: the layers whose checkpoint holds the tensor (a dense MLP's between sparse
      ones, Qwen's mlp_only_layers); the other layers hold zeros there, which they never
      read (the decoder runs each layer's own MLP form). None: every layer.
    mxfp4: the checkpoint stores the tensor as MXFP4 `{hf}_blocks` and `{hf}_scales`
      (gpt-oss's experts, `workers.model.mxfp4`), dequantised at load to `hf_shape`.
    packed_part: with mxfp4, selects this parameter's part of both blocks and scales
      (their rows are the unquantised tensor's last axis) before they are dequantised, so
      a fused tensor's part costs its own share only (gpt-oss's interleaved gate and up);
      `to_ours` then sees that part.
    """

    hf: str
    hf_shape: tuple[int, ...]
    axes: tuple[str, ...]
    to_ours: Callable = lambda w: w
    rows: tuple[int, int] | None = None
    experts: int = 0
    layers: tuple[int, ...] | None = None
    mxfp4: bool = False
    packed_part: Callable | None = None

    def stored(self) -> dict[str, tuple[int, ...]]:
        """{the HF tensor(s) under `layers.{i}.` the checkpoint holds: their shapes}."""
        if self.mxfp4:
            blocks, scales = mxfp4.packed_shapes(self.hf_shape)
            return {self.hf + mxfp4.BLOCKS_SUFFIX: blocks, self.hf + mxfp4.SCALES_SUFFIX: scales}
        return {name: self.hf_shape for name in self.hf_names()}

    def held_by(self, layer: int) -> bool:
        """Whether layer `layer`'s checkpoint holds this tensor."""
        return self.layers is None or layer in self.layers

    def hf_names(self) -> tuple[str, ...]:
        """The HF tensors (under `layers.{i}.`) this parameter is read from."""
        if self.experts:
            return tuple(self.hf.format(e=e) for e in range(self.experts))
        return (self.hf,)


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family: everything actx needs to know about it, in one place.

    name: the family's name in docs and errors ("llama", "phi3", ...).
    architectures: HF `architectures[0]` values it reads.
    reads: the config.json fields it reads beyond the common shape fields (hidden_size,
      num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim,
      intermediate_size, vocab_size, rms_norm_eps, max_position_embeddings,
      tie_word_embeddings, rope_theta / rope_parameters / rope_scaling).
    options: (hf config, architecture, refuse, num_layers, head_dim) -> the ModelConfig
      fields particular to the family; `refuse(field, value, why)` builds the error for a
      field it does not support.
    layer_tensors: ModelConfig -> {our layer parameter: LayerTensor}.
    block: what one block computes (norms, biases, activation), for docs.
    hook_notes: a family's own remarks on hook points, for docs.
    text_tower: {architecture: the architecture of its text tower} for multimodal
      checkpoints whose config nests the decoder in `text_config`.
    top_tensors: ModelConfig -> {our top-level parameter: LayerTensor} (names under the
      decoder prefix): embed_vd and final_norm_d always, and what else the family has
      (a final norm's bias, learned position embeddings).
    prefixes: where the checkpoint keeps the decoder, in the order they are tried.
    layers_at: the layers' list under the prefix ("layers", GPT-2's "h").
    hf_names: {common config field: this family's name for it} (GPT-2's n_embd, ...).
    lm_head: the untied LM head's tensor name (generation reads it).
    quantizations: the `quantization_config` methods whose checkpoints it reads (gpt-oss's
      mxfp4); a checkpoint quantised any other way is refused (`families.config_from_hf`).
    """

    name: str
    architectures: tuple[str, ...]
    reads: tuple[str, ...]
    options: Callable[..., dict[str, Any]]
    layer_tensors: Callable[[Any], dict[str, LayerTensor]]
    block: str
    hook_notes: Mapping[str, str] = dataclasses.field(default_factory=dict)
    text_tower: Mapping[str, str] = dataclasses.field(default_factory=dict)
    top_tensors: Callable[[Any], dict[str, LayerTensor]] = None  # type: ignore[assignment]
    prefixes: tuple[str, ...] = DECODER_PREFIXES
    layers_at: str = "layers"
    hf_names: Mapping[str, str] = dataclasses.field(default_factory=dict)
    lm_head: str = "lm_head.weight"
    quantizations: tuple[str, ...] = ()

    def __post_init__(self):
        if self.top_tensors is None:
            object.__setattr__(self, "top_tensors", llama_top_tensors)

    def hook_points(self, cfg=None) -> tuple[str, ...]:
        """The per-layer hook points of this family's models (`cfg`: of that model): no
        resid_mid in a parallel block (`missing_points` says why)."""
        moe = cfg is not None and getattr(cfg, "num_experts", 0) > 0
        dense = DENSE_POINTS
        if cfg is not None and getattr(cfg, "parallel_residual", False):
            dense = tuple(p for p in DENSE_POINTS if p != "resid_mid")
        return dense + (MOE_POINTS if moe else ())

    def missing_points(self, cfg) -> dict[str, str]:
        """{point: why this model has no such point} for the dense points it lacks."""
        if getattr(cfg, "parallel_residual", False):
            return {"resid_mid": "a parallel block (use_parallel_residual) adds attention "
                                 "and the MLP to its input together: the MLP reads "
                                 "resid_pre, and no residual stream lies between them"}
        return {}


def llama_top_tensors(cfg) -> dict[str, LayerTensor]:
    """The embedding and final norm as Llama-shaped checkpoints name them."""
    return {"embed_vd": LayerTensor("embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size),
                                    TOP_PARAM_AXES["embed_vd"]),
            "final_norm_d": LayerTensor("norm.weight", (cfg.hidden_size,),
                                        TOP_PARAM_AXES["final_norm_d"])}


# ---- building blocks of the Llama-shaped families ----------------------------------------

def attention_tensors(cfg, *, bias: bool = False, qk_norm: str | None = None,
                      fused_qkv: bool = False) -> dict[str, LayerTensor]:
    """q/k/v/o projections, as separate `self_attn.{q,k,v}_proj` or one fused
    `self_attn.qkv_proj` (q rows, then k, then v); `bias`: q/k/v biases (Qwen2);
    qk_norm: "head" (RMSNorm over each head: Qwen3, Gemma 3) or "full" (over the whole
    projection: OLMo 2, OLMoE)."""
    d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    table: dict[str, LayerTensor] = {}
    if fused_qkv:
        fused = ("self_attn.qkv_proj.weight", ((n + 2 * k) * h, d))
        q_rows, k_rows, v_rows = (0, n * h), (n * h, (n + k) * h), ((n + k) * h, (n + 2 * k) * h)
        q_src = k_src = v_src = fused
    else:
        q_src = ("self_attn.q_proj.weight", (n * h, d))
        k_src = ("self_attn.k_proj.weight", (k * h, d))
        v_src = ("self_attn.v_proj.weight", (k * h, d))
        q_rows = k_rows = v_rows = None
    table["q_weight_ldnh"] = LayerTensor(*q_src, ("embed", "heads", "head_dim"),
                                         lambda w: w.T.reshape(d, n, h), rows=q_rows)
    table["k_weight_ldkh"] = LayerTensor(*k_src, ("embed", "kv_heads", "head_dim"),
                                         lambda w: w.T.reshape(d, k, h), rows=k_rows)
    table["v_weight_ldkh"] = LayerTensor(*v_src, ("embed", "kv_heads", "head_dim"),
                                         lambda w: w.T.reshape(d, k, h), rows=v_rows)
    table["o_weight_lnhd"] = LayerTensor("self_attn.o_proj.weight", (d, n * h),
                                         ("heads", "head_dim", "embed"),
                                         lambda w: w.T.reshape(n, h, d))
    if bias:
        table["q_bias_lnh"] = LayerTensor("self_attn.q_proj.bias", (n * h,),
                                          ("heads", "head_dim"), lambda b: b.reshape(n, h))
        table["k_bias_lkh"] = LayerTensor("self_attn.k_proj.bias", (k * h,),
                                          ("kv_heads", "head_dim"), lambda b: b.reshape(k, h))
        table["v_bias_lkh"] = LayerTensor("self_attn.v_proj.bias", (k * h,),
                                          ("kv_heads", "head_dim"), lambda b: b.reshape(k, h))
    if qk_norm == "head":
        table["q_norm_lh"] = LayerTensor("self_attn.q_norm.weight", (h,), ("head_dim",))
        table["k_norm_lh"] = LayerTensor("self_attn.k_norm.weight", (h,), ("head_dim",))
    elif qk_norm == "full":
        table["q_norm_lnh"] = LayerTensor("self_attn.q_norm.weight", (n * h,),
                                          ("heads", "head_dim"), lambda w: w.reshape(n, h))
        table["k_norm_lkh"] = LayerTensor("self_attn.k_norm.weight", (k * h,),
                                          ("kv_heads", "head_dim"), lambda w: w.reshape(k, h))
    return table


def mlp_tensors(cfg, *, fused_gate_up: bool = False, layers: tuple[int, ...] | None = None
                ) -> dict[str, LayerTensor]:
    """The gated MLP: `mlp.{gate,up,down}_proj`, or `mlp.gate_up_proj` (gate rows, then
    up rows) with `mlp.down_proj`; `layers`: the layers that have it (None: all)."""
    d, f = cfg.hidden_size, cfg.intermediate_size
    if fused_gate_up:
        gate = LayerTensor("mlp.gate_up_proj.weight", (2 * f, d), ("embed", "mlp"),
                           lambda w: w.T, rows=(0, f))
        up = LayerTensor("mlp.gate_up_proj.weight", (2 * f, d), ("embed", "mlp"),
                         lambda w: w.T, rows=(f, 2 * f))
    else:
        gate = LayerTensor("mlp.gate_proj.weight", (f, d), ("embed", "mlp"), lambda w: w.T,
                           layers=layers)
        up = LayerTensor("mlp.up_proj.weight", (f, d), ("embed", "mlp"), lambda w: w.T,
                         layers=layers)
    return {"gate_weight_ldf": gate, "up_weight_ldf": up,
            "down_weight_lfd": LayerTensor("mlp.down_proj.weight", (d, f), ("mlp", "embed"),
                                           lambda w: w.T, layers=layers)}


def moe_layer_tensors(cfg, *, router: str, expert: str) -> dict[str, LayerTensor]:
    """The MLP tensors of a mixture whose layers may differ in their MLP (Qwen's
    mlp_only_layers, decoder_sparse_step): the experts on the sparse layers, a dense
    `mlp.{gate,up,down}_proj` on the others, and a shared expert (`mlp.shared_expert.*`,
    `mlp.shared_expert_gate`) where the config has one (Qwen2-MoE)."""
    sparse = cfg.router_layers
    dense = tuple(i for i in range(cfg.num_layers) if i not in sparse)
    table = expert_tensors(cfg, router=router, expert=expert,
                           layers=None if not dense else sparse)
    if dense:
        table.update(mlp_tensors(cfg, layers=dense))
    if cfg.shared_expert_size:
        d, s = cfg.hidden_size, cfg.shared_expert_size
        on = None if not dense else sparse
        shared = "mlp.shared_expert"
        table.update({
            "shared_gate_ldf": LayerTensor(f"{shared}.gate_proj.weight", (s, d),
                                           ("embed", "mlp"), lambda w: w.T, layers=on),
            "shared_up_ldf": LayerTensor(f"{shared}.up_proj.weight", (s, d),
                                         ("embed", "mlp"), lambda w: w.T, layers=on),
            "shared_down_lfd": LayerTensor(f"{shared}.down_proj.weight", (d, s),
                                           ("mlp", "embed"), lambda w: w.T, layers=on),
            "shared_expert_gate_ld": LayerTensor("mlp.shared_expert_gate.weight", (1, d),
                                                 ("embed",), lambda w: w[0], layers=on)})
    return table


def expert_tensors(cfg, *, router: str, expert: str,
                   names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
                   layers: tuple[int, ...] | None = None) -> dict[str, LayerTensor]:
    """A mixture of experts: the router `{router}.weight` [e, d] and one gated MLP per
    expert, `{expert}.{gate,up,down}.weight` with `{e}` the expert index in `expert`,
    stacked into [e, ...] parameters sharded over experts (expert parallelism) or, where
    the mesh axis does not divide the experts, over their width; `layers`: the layers
    that have them (None: all)."""
    d, e, f = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    gate, up, down = names
    return {
        "router_weight_led": LayerTensor(f"{router}.weight", (e, d), (None, "embed"),
                                         layers=layers),
        "expert_gate_ledf": LayerTensor(f"{expert}.{gate}.weight", (f, d),
                                        ("moe_experts", "embed", "moe_mlp"), lambda w: w.T,
                                        experts=e, layers=layers),
        "expert_up_ledf": LayerTensor(f"{expert}.{up}.weight", (f, d),
                                      ("moe_experts", "embed", "moe_mlp"), lambda w: w.T,
                                      experts=e, layers=layers),
        "expert_down_lefd": LayerTensor(f"{expert}.{down}.weight", (d, f),
                                        ("moe_experts", "moe_mlp", "embed"), lambda w: w.T,
                                        experts=e, layers=layers),
    }


def norm_tensors(cfg, *, pre: str | None = "post_attention_layernorm.weight",
                 input_norm: bool = True, post: bool = False,
                 post_attn: str = "post_attention_layernorm.weight"
                 ) -> dict[str, LayerTensor]:
    """The block's RMSNorm weights: before attention (`input_layernorm`, unless
    input_norm=False), before the MLP (`pre`, None for none), and, with `post`, after
    attention (`post_attn`) and after the MLP (`post_feedforward_layernorm`)."""
    d = cfg.hidden_size
    table = {}
    if input_norm:
        table["attn_norm_ld"] = LayerTensor("input_layernorm.weight", (d,), ("embed",))
    if pre is not None:
        table["mlp_norm_ld"] = LayerTensor(pre, (d,), ("embed",))
    if post:
        table["attn_post_norm_ld"] = LayerTensor(post_attn, (d,), ("embed",))
        table["mlp_post_norm_ld"] = LayerTensor("post_feedforward_layernorm.weight", (d,),
                                                ("embed",))
    return table


def refuse_activation(hf: Mapping[str, Any], refuse, allowed=("silu",),
                      field: str = "hidden_act", default: str = "silu") -> str:
    act = hf.get(field) or default
    if act not in allowed:
        raise refuse(field, act, f"only {', '.join(allowed)} is implemented")
    return act


# HF's names (ACT2FN) for the activations the decoder has (ModelConfig.mlp_activation).
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_new": "gelu_tanh",
               "gelu_pytorch_tanh": "gelu_tanh"}


def mlp_activation(hf: Mapping[str, Any], refuse, field: str = "hidden_act",
                   default: str = "silu") -> str:
    """The ModelConfig.mlp_activation of an HF activation name (a family whose MLPs and
    experts all take ACT2FN[hidden_act]); another name is refused."""
    act = hf.get(field) or default
    if act not in ACTIVATIONS:
        raise refuse(field, act, f"implemented: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[act]


def refuse_biases(hf: Mapping[str, Any], refuse, fields=("attention_bias", "mlp_bias")):
    for field in fields:
        if hf.get(field, False):
            raise refuse(field, hf[field], "biases on these projections are not implemented")
