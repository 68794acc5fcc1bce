"""GPT-2 (`GPT2LMHeadModel`): learned absolute position embeddings added to the token
embeddings, LayerNorm with a bias before attention and before the MLP, a plain (ungated)
MLP, biases on every projection, tied embeddings. HF's Conv1D stores each projection as
[in, out] (the transpose of nn.Linear), and `c_attn` holds q, k, v as column blocks: both
are undone at load. Position embeddings end at `n_positions`: a token's position in its
document must be below it (the pre-flight refuses rows longer than it and documents
continued across rows)."""

from __future__ import annotations

from actx.workers.model.families import base

# HF activation name -> ours. gelu_new is the tanh approximation (as gelu_pytorch_tanh).
_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu",
                "silu": "silu"}


def _options(hf, arch, refuse, num_layers, head_dim) -> dict:
    act = hf.get("activation_function") or "gelu_new"
    if act not in _ACTIVATIONS:
        raise refuse("activation_function", act,
                      f"implemented: {', '.join(_ACTIVATIONS)}")
    if hf.get("add_cross_attention"):
        raise refuse("add_cross_attention", True, "an encoder-decoder's cross-attention "
                                                   "is not implemented")
    hidden = int(hf["hidden_size"])
    inner = hf.get("n_inner")
    scale = float(head_dim) ** -0.5 if hf.get("scale_attn_weights", True) else 1.0
    # reorder_and_upcast_attn asks for the logits and softmax in float32: actx's attention
    # always computes them so, whatever the flag says.
    return {"layer_norm": True, "learned_positions": True, "gated_mlp": False,
            "qkv_bias": True, "o_bias": True, "mlp_bias": True,
            "mlp_activation": _ACTIVATIONS[act], "query_scale": scale,
            "inverse_layer_scale": bool(hf.get("scale_attn_by_inverse_layer_idx", False)),
            "intermediate_size": int(inner) if inner else 4 * hidden,
            "rms_norm_eps": float(hf.get("layer_norm_epsilon", 1e-5)),
            "sliding_windows": (None,) * num_layers, "tie_default": True}


def _columns(lo: int, hi: int, *shape: int):
    """Columns lo:hi of a Conv1D weight [in, out] (rows of its bias), reshaped."""
    return lambda w: w[..., lo:hi].reshape(*shape)


def _tensors(cfg) -> dict[str, base.LayerTensor]:
    d, n, h, f = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.intermediate_size
    e = n * h  # GPT-2's q, k and v are each d wide (n * h == d)
    table = {
        "attn_norm_ld": base.LayerTensor("ln_1.weight", (d,), ("embed",)),
        "attn_norm_bias_ld": base.LayerTensor("ln_1.bias", (d,), ("embed",)),
        "mlp_norm_ld": base.LayerTensor("ln_2.weight", (d,), ("embed",)),
        "mlp_norm_bias_ld": base.LayerTensor("ln_2.bias", (d,), ("embed",)),
        "o_weight_lnhd": base.LayerTensor("attn.c_proj.weight", (e, d),
                                          ("heads", "head_dim", "embed"),
                                          lambda w: w.reshape(n, h, d)),
        "o_bias_ld": base.LayerTensor("attn.c_proj.bias", (d,), ("embed",)),
        "up_weight_ldf": base.LayerTensor("mlp.c_fc.weight", (d, f), ("embed", "mlp")),
        "up_bias_lf": base.LayerTensor("mlp.c_fc.bias", (f,), ("mlp",)),
        "down_weight_lfd": base.LayerTensor("mlp.c_proj.weight", (f, d), ("mlp", "embed")),
        "down_bias_ld": base.LayerTensor("mlp.c_proj.bias", (d,), ("embed",)),
    }
    for j, (ours, heads_axis) in enumerate((("q", "heads"), ("k", "kv_heads"),
                                            ("v", "kv_heads"))):
        letter = "n" if ours == "q" else "k"
        table[f"{ours}_weight_ld{letter}h"] = base.LayerTensor(
            "attn.c_attn.weight", (d, 3 * e), ("embed", heads_axis, "head_dim"),
            _columns(j * e, (j + 1) * e, d, n, h))
        table[f"{ours}_bias_l{letter}h"] = base.LayerTensor(
            "attn.c_attn.bias", (3 * e,), (heads_axis, "head_dim"),
            _columns(j * e, (j + 1) * e, n, h))
    return table


def _top(cfg) -> dict[str, base.LayerTensor]:
    d = cfg.hidden_size
    return {"embed_vd": base.LayerTensor("wte.weight", (cfg.vocab_size, d),
                                         base.TOP_PARAM_AXES["embed_vd"]),
            "pos_embed_pd": base.LayerTensor("wpe.weight", (cfg.max_position_embeddings, d),
                                             (None, "embed")),
            "final_norm_d": base.LayerTensor("ln_f.weight", (d,), ("embed",)),
            "final_norm_bias_d": base.LayerTensor("ln_f.bias", (d,), ("embed",))}


GPT2 = base.Family(
    name="gpt2", architectures=("GPT2LMHeadModel",),
    reads=("n_embd", "n_layer", "n_head", "n_positions", "n_inner", "activation_function",
           "layer_norm_epsilon", "scale_attn_weights", "scale_attn_by_inverse_layer_idx",
           "reorder_and_upcast_attn", "add_cross_attention"),
    options=_options, layer_tensors=_tensors, top_tensors=_top,
    prefixes=("transformer.", ""), layers_at="h",
    hf_names={"hidden_size": "n_embd", "num_hidden_layers": "n_layer",
              "num_attention_heads": "n_head", "max_position_embeddings": "n_positions"},
    block=("x = wte[token] + wpe[position in its document]; x + attn(ln(x)); then "
           "+ mlp(ln(.)); LayerNorm with bias at layer_norm_epsilon; MLP c_fc, gelu_new "
           "(activation_function), c_proj; biases on every projection; logits scaled by "
           "head_dim ** -0.5 (scale_attn_weights) and 1 / (layer + 1) "
           "(scale_attn_by_inverse_layer_idx); Conv1D [in, out] weights transposed at load"),
    hook_notes={"embed": "the token embedding plus the position embedding (wte + wpe), "
                         "what block 0 reads: equal to layers.0.resid_pre"})
