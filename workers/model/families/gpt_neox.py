"""GPT-NeoX and Pythia (`GPTNeoXForCausalLM`): LayerNorm with a bias, biases on every
projection (q/k/v and the output one only where `attention_bias`), a plain (ungated) MLP,
an untied LM head (`embed_out`, never read for activations), and RoPE over the first
`rotary_pct` of each head's dims (HF's rotate-half within those dims, the rest pass).
`query_key_value` holds, for each head in turn, its q, k and v rows ([n_heads, 3,
head_dim] along the output): split at load. With `use_parallel_residual` (Pythia's) a
block is x + attn(ln1(x)) + mlp(ln2(x)): both branches read the block's input, so the
block has no resid_mid; without it, x + attn(ln1(x)), then + mlp(ln2(.))."""

from __future__ import annotations

from actx.workers.model.families import base, hf_fields

_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
                "silu": "silu"}


def _rope(hf, refuse):
    """4.x configs (Pythia's) say rotary_pct and rotary_emb_base; transformers 5 writes
    rope_parameters, whose missing partial_rotary_factor HF takes from rotary_pct (0.25
    by default), as it does here; a 4.x rope_scaling wins over rope_parameters, as in HF."""
    params = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    params.setdefault("rope_theta", float(hf.get("rotary_emb_base", 10000.0)))
    params.setdefault("partial_rotary_factor", float(hf.get("rotary_pct", 0.25)))
    return hf_fields.rope_from_hf({**hf, "rope_parameters": params, "rope_scaling": None},
                                  refuse, partial_allowed=True)


def _options(hf, arch, refuse, num_layers, head_dim) -> dict:
    act = hf.get("hidden_act") or "gelu"
    if act not in _ACTIVATIONS:
        raise refuse("hidden_act", act, f"implemented: {', '.join(_ACTIVATIONS)}")
    bias = bool(hf.get("attention_bias", True))
    hidden, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    if hf.get("head_dim") and int(hf["head_dim"]) != hidden // heads:
        # HF's attention splits heads of hidden / heads, but its rotary table is built
        # over int(head_dim * rotary_pct) dims of the config's head_dim: another model.
        raise refuse("head_dim", hf["head_dim"],
                     f"GPT-NeoX's heads are hidden_size / num_attention_heads = "
                     f"{hidden // heads} wide; HF builds its rotary table from head_dim "
                     f"nonetheless; remove head_dim from config.json or set it to "
                     f"{hidden // heads}")
    return {"layer_norm": True, "gated_mlp": False, "qkv_bias": bias, "o_bias": bias,
            "mlp_bias": True, "mlp_activation": _ACTIVATIONS[act],
            "parallel_residual": bool(hf.get("use_parallel_residual", True)),
            "rms_norm_eps": float(hf.get("layer_norm_eps", 1e-5)),
            # HF's head size is hidden / heads (another head_dim is refused above).
            "head_dim": hidden // heads, "num_kv_heads": heads,
            "rope": _rope(hf, refuse), "sliding_windows": (None,) * num_layers}


def _interleaved(part: int, n: int, h: int, d: int | None):
    """Part (0 q, 1 k, 2 v) of query_key_value's [n * 3 * h, d] weight (d None: its bias)
    in our layout: [d, n, h] (bias [n, h])."""
    if d is None:
        return lambda b: b.reshape(n, 3, h)[:, part]
    return lambda w: w.reshape(n, 3, h, d)[:, part].transpose(2, 0, 1)


def _tensors(cfg) -> dict[str, base.LayerTensor]:
    d, n, h, f = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.intermediate_size
    qkv = "attention.query_key_value"
    table = {
        "attn_norm_ld": base.LayerTensor("input_layernorm.weight", (d,), ("embed",)),
        "attn_norm_bias_ld": base.LayerTensor("input_layernorm.bias", (d,), ("embed",)),
        "mlp_norm_ld": base.LayerTensor("post_attention_layernorm.weight", (d,), ("embed",)),
        "mlp_norm_bias_ld": base.LayerTensor("post_attention_layernorm.bias", (d,),
                                             ("embed",)),
        "o_weight_lnhd": base.LayerTensor("attention.dense.weight", (d, n * h),
                                          ("heads", "head_dim", "embed"),
                                          lambda w: w.T.reshape(n, h, d)),
        "up_weight_ldf": base.LayerTensor("mlp.dense_h_to_4h.weight", (f, d),
                                          ("embed", "mlp"), lambda w: w.T),
        "up_bias_lf": base.LayerTensor("mlp.dense_h_to_4h.bias", (f,), ("mlp",)),
        "down_weight_lfd": base.LayerTensor("mlp.dense_4h_to_h.weight", (d, f),
                                            ("mlp", "embed"), lambda w: w.T),
        "down_bias_ld": base.LayerTensor("mlp.dense_4h_to_h.bias", (d,), ("embed",)),
    }
    for part, (ours, letter, axis) in enumerate((("q", "n", "heads"), ("k", "k", "kv_heads"),
                                                 ("v", "k", "kv_heads"))):
        table[f"{ours}_weight_ld{letter}h"] = base.LayerTensor(
            f"{qkv}.weight", (3 * n * h, d), ("embed", axis, "head_dim"),
            _interleaved(part, n, h, d))
        if cfg.qkv_bias:
            table[f"{ours}_bias_l{letter}h"] = base.LayerTensor(
                f"{qkv}.bias", (3 * n * h,), (axis, "head_dim"), _interleaved(part, n, h, None))
    if cfg.o_bias:
        table["o_bias_ld"] = base.LayerTensor("attention.dense.bias", (d,), ("embed",))
    return table


def _top(cfg) -> dict[str, base.LayerTensor]:
    d = cfg.hidden_size
    return {"embed_vd": base.LayerTensor("embed_in.weight", (cfg.vocab_size, d),
                                         base.TOP_PARAM_AXES["embed_vd"]),
            "final_norm_d": base.LayerTensor("final_layer_norm.weight", (d,), ("embed",)),
            "final_norm_bias_d": base.LayerTensor("final_layer_norm.bias", (d,),
                                                  ("embed",))}


GPT_NEOX = base.Family(
    name="gpt_neox", architectures=("GPTNeoXForCausalLM",),
    reads=("layer_norm_eps", "hidden_act", "use_parallel_residual", "attention_bias",
           "rotary_pct", "rotary_emb_base",
           "head_dim (hidden_size / num_attention_heads only)",
           "rope_parameters/rope_scaling: rope_theta partial_rotary_factor"),
    options=_options, layer_tensors=_tensors, top_tensors=_top,
    prefixes=("gpt_neox.", ""), lm_head="embed_out.weight",
    block=("parallel (use_parallel_residual, Pythia's): x + attn(ln1(x)) + mlp(ln2(x)); "
           "sequential: x + attn(ln1(x)), then + mlp(ln2(.)); LayerNorm with bias at "
           "layer_norm_eps; RoPE over the first rotary_pct of each head; fused "
           "query_key_value [heads, 3, head_dim] split at load; MLP dense_h_to_4h, gelu "
           "(hidden_act), dense_4h_to_h; biases on every projection"),
    hook_notes={"resid_mid": "does not exist in a parallel block (use_parallel_residual: "
                             "the MLP reads resid_pre): refused by name there; "
                             "resid_post = resid_pre + attn_out + mlp_out"})
