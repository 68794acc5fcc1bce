"""Tiny random HF checkpoints made with transformers' own classes, for tests.

`make_tiny_checkpoint(path, arch)` writes config.json + safetensors with
`save_pretrained`, exactly as a real checkpoint looks; `load_hf_model(path)` reloads it
as the PyTorch float32 reference (eager attention). Stable API: other tests reuse it.

Archs: "qwen2" (tied embeddings, q/k/v bias, GQA), "qwen2_untied" (has lm_head.weight),
"llama3" (llama3 rope scaling, rope_theta 500000), "mistral" (sliding_window=None unless
overridden), "qwen3" (q/k norms, head_dim 32 unlike hidden / heads), "gemma2" (local and
global layers, window 12, logit soft-capping, query_pre_attn_scalar 24), "gemma3" (q/k
norms, 4 layers with every 2nd global, local rope base 10000, global 1e6 with linear
scaling), "gemma3_mm" (Gemma3ForConditionalGeneration: the same text tower beside a tiny
vision tower), "phi3" (fused qkv_proj and gate_up_proj, half the head dims rotate,
sliding_window=None unless overridden), "phi3_longrope" (longrope with distinct short and
long factors and an original context of 16 tokens, so documents of more than 16 tokens
take the long factors), "olmo2" (norms after attention and the MLP, q/k norms over the
whole projection), "qwen3_moe" (8 experts, top 2, renormalised), "olmoe" (8 experts, top
2, not renormalised), "mixtral" (4 experts, top 2); the three mixtures of experts have 2
layers, and their routers get random weights of std 0.5, so each token's choice is clear
(no near-ties from a tiny init).
"""

from __future__ import annotations

import os

ARCHS = ("qwen2", "qwen2_untied", "llama3", "mistral", "qwen3", "gemma2", "gemma3",
         "gemma3_mm", "phi3", "phi3_longrope", "olmo2", "qwen3_moe", "olmoe", "mixtral")
MOE_ARCHS = ("qwen3_moe", "olmoe", "mixtral")
# Families with their own tensor names and norms (tests/test_families_gpt.py): "gpt2"
# (learned positions, Conv1D, 64 positions), "gpt_neox" (Pythia: parallel residual,
# rotary_pct 0.25, fused interleaved query_key_value, untied embed_out).
GPT_ARCHS = ("gpt2", "gpt_neox")
# Mixture layouts (tests/test_moe_layouts.py): "qwen2_moe" (Qwen2-MoE: 8 experts, top 2,
# a shared expert of 48 behind its sigmoid gate, layer 1 a dense MLP of 96 by
# mlp_only_layers), "qwen3_moe_mixed" (Qwen3-MoE, 4 layers, decoder_sparse_step 2 and
# mlp_only_layers [3]: only layer 1 sparse, dense MLPs of 96 elsewhere).
MOE_LAYOUT_ARCHS = ("qwen2_moe", "qwen3_moe_mixed")
# "gpt_oss" (tests/test_families_gpt_oss.py): 3 layers (0 and 2 slide, window 6), sinks
# of std 1, YaRN factor 4 over an original context of 256 (its ramp over the first 3 of
# 8 frequencies), 8 experts of 32, top 2, random
# biases, experts' weights of std 0.2 and swiglu_limit 1.0 so the clamps bite.
OSS_ARCHS = ("gpt_oss",)
# Architectures whose layers differ in their windows: HF takes one mask per layer type.
PER_LAYER_TYPE_MASKS = ("gemma2", "gemma3", "gemma3_mm")

# Tiny defaults: hidden 64, 3 layers, 4 heads of 16, 2 kv heads, vocab 512.
_COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
               max_position_embeddings=4096, rms_norm_eps=1e-6)


def tiny_config(arch: str = "qwen2", **overrides):
    """The transformers config object for `arch`, with `overrides` applied."""
    import transformers

    known = ARCHS + GPT_ARCHS + MOE_LAYOUT_ARCHS + OSS_ARCHS
    if arch not in known:
        raise ValueError(f"unknown arch {arch!r}; one of {known}")
    if arch == "gpt2":
        kwargs = dict(n_embd=64, n_layer=3, n_head=4, n_positions=64, vocab_size=512,
                      layer_norm_epsilon=1e-5, bos_token_id=1, eos_token_id=2)
        kwargs.update(overrides)
        return transformers.GPT2Config(**kwargs)
    if arch == "gpt_neox":
        kwargs = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, vocab_size=512, max_position_embeddings=4096,
                      layer_norm_eps=1e-5, rotary_pct=0.25, rotary_emb_base=10000,
                      use_parallel_residual=True, tie_word_embeddings=False)
        kwargs.update(overrides)
        return transformers.GPTNeoXConfig(**kwargs)
    kwargs = dict(_COMMON)
    if arch in ("qwen2", "qwen2_untied"):
        kwargs.update(tie_word_embeddings=arch == "qwen2", rope_theta=10000.0)
        cls = transformers.Qwen2Config
    elif arch == "llama3":
        kwargs.update(
            tie_word_embeddings=False, rope_theta=500000.0,
            # Small original context so all three llama3 frequency bands occur at h=16.
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
        cls = transformers.LlamaConfig
    elif arch == "mistral":
        kwargs.update(tie_word_embeddings=False, sliding_window=None, rope_theta=10000.0)
        cls = transformers.MistralConfig
    elif arch == "qwen3":
        kwargs.update(tie_word_embeddings=True, rope_theta=10000.0, head_dim=32)
        cls = transformers.Qwen3Config
    elif arch in ("phi3", "phi3_longrope"):
        kwargs.update(tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
                      eos_token_id=2, sliding_window=None)
        rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
        if arch == "phi3_longrope":
            # 4 frequencies (half of the 8 rotary dims); distinct short and long factors.
            rope = {"rope_type": "longrope", "rope_theta": 10000.0,
                    "partial_rotary_factor": 0.5, "short_factor": [1.0, 1.5, 2.0, 3.0],
                    "long_factor": [2.0, 4.0, 8.0, 16.0],
                    "original_max_position_embeddings": 16}
            kwargs.update(original_max_position_embeddings=16)
        kwargs.update(rope_parameters=rope)
        cls = transformers.Phi3Config
    elif arch == "olmo2":
        kwargs.update(tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
                      eos_token_id=2, rope_theta=10000.0)
        cls = transformers.Olmo2Config
    elif arch == "qwen3_moe":
        kwargs.update(tie_word_embeddings=False, rope_theta=10000.0, head_dim=32,
                      num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      norm_topk_prob=True,
                      num_hidden_layers=2)
        cls = transformers.Qwen3MoeConfig
    elif arch == "qwen3_moe_mixed":
        kwargs.update(tie_word_embeddings=False, rope_theta=10000.0, head_dim=32,
                      num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      intermediate_size=96, norm_topk_prob=True, num_hidden_layers=4,
                      decoder_sparse_step=2, mlp_only_layers=[3])
        cls = transformers.Qwen3MoeConfig
    elif arch == "qwen2_moe":
        kwargs.update(tie_word_embeddings=False, rope_theta=10000.0, num_experts=8,
                      num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, intermediate_size=96,
                      norm_topk_prob=False, num_hidden_layers=3, mlp_only_layers=[1])
        cls = transformers.Qwen2MoeConfig
    elif arch == "gpt_oss":
        kwargs.update(tie_word_embeddings=False, head_dim=16, sliding_window=6,
                      num_local_experts=8, num_experts_per_tok=2, intermediate_size=32,
                      swiglu_limit=1.0, rms_norm_eps=1e-5,
                      rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0,
                                       "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                       "truncate": False,
                                       "original_max_position_embeddings": 256})
        cls = transformers.GptOssConfig
    elif arch == "olmoe":
        kwargs.update(tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
                      eos_token_id=2, rope_theta=10000.0, num_experts=8,
                      num_experts_per_tok=2, intermediate_size=32, norm_topk_prob=False,
                      num_hidden_layers=2)
        cls = transformers.OlmoeConfig
    elif arch == "mixtral":
        kwargs.update(tie_word_embeddings=False, rope_theta=10000.0, sliding_window=None,
                      num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
                      num_hidden_layers=2)
        cls = transformers.MixtralConfig
    elif arch == "gemma2":
        kwargs.update(head_dim=32, sliding_window=12, query_pre_attn_scalar=24,
                      attn_logit_softcapping=5.0, final_logit_softcapping=30.0,
                      hidden_activation="gelu_pytorch_tanh")
        cls = transformers.Gemma2Config
    else:
        kwargs.update(head_dim=32, sliding_window=12,
                      query_pre_attn_scalar=24, hidden_activation="gelu_pytorch_tanh",
                      layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                      rope_parameters={
                          "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                          "full_attention": {"rope_type": "linear", "factor": 8.0,
                                             "rope_theta": 1000000.0}})
        cls = transformers.Gemma3TextConfig
    kwargs.update(overrides)
    if arch == "gemma3_mm":
        vision = transformers.SiglipVisionConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            image_size=28, patch_size=14)
        return transformers.Gemma3Config(text_config=cls(**kwargs).to_dict(),
                                         vision_config=vision.to_dict(), mm_tokens_per_image=4)
    return cls(**kwargs)


def make_tiny_checkpoint(path: str | os.PathLike, arch: str = "qwen2", seed: int = 0,
                         dtype: str = "float32", max_shard_size: str | None = None,
                         **overrides) -> str:
    """Writes a random-init HF checkpoint of `arch` into directory `path`; returns path.

    seed: torch seed for the random weights. dtype: "float32" or "bfloat16" on disk.
    max_shard_size: e.g. "100KB" to get a sharded checkpoint with an index json.
    overrides: any config field, e.g. num_hidden_layers=2, sliding_window=8.
    """
    import torch
    import transformers

    config = tiny_config(arch, **overrides)
    torch.manual_seed(seed)
    auto = (transformers.Gemma3ForConditionalGeneration if arch == "gemma3_mm"
            else transformers.AutoModelForCausalLM)
    model = auto.from_config(config, dtype=torch.float32, attn_implementation="eager") \
        if arch != "gemma3_mm" else auto._from_config(config, dtype=torch.float32,
                                                      attn_implementation="eager")
    # Gemma's norms scale by (1 + w) and start at w = 0; the others scale by w from 1.
    norm_center = 0.0 if arch.startswith("gemma") else 1.0
    with torch.no_grad():
        # Random (not init-default) norm weights around the init, so a missed norm scale
        # (or a missed Gemma "+1") shows up.
        for name, param in model.named_parameters():
            if "norm" in name or name.split(".")[-2].startswith(("ln_", "ln")):
                # LayerNorm biases too: around 0, so a missed bias shows up.
                center = 0.0 if name.endswith(".bias") else norm_center
                param.copy_(center + 0.1 * torch.randn_like(param))
            elif arch in GPT_ARCHS and name.endswith(".bias"):
                param.copy_(0.1 * torch.randn_like(param))  # HF inits biases at 0
            elif arch == "gpt2" and name.endswith("wpe.weight"):
                # Position embeddings as large as the token ones, so a wrong position
                # (or none) shows up.
                param.copy_(0.5 * torch.randn_like(param))
            elif arch in MOE_ARCHS + MOE_LAYOUT_ARCHS and name.endswith("gate.weight"):
                # Routers, and Qwen2-MoE's shared expert gate (so its sigmoid is far
                # from one constant).
                param.copy_(0.5 * torch.randn_like(param))
            elif arch == "gpt_oss" and name.endswith(("sinks", "router.weight")):
                param.copy_(torch.randn_like(param) * (1.0 if name.endswith("sinks")
                                                       else 0.5))
            elif arch == "gpt_oss" and name.endswith(("gate_up_proj", "down_proj")):
                param.copy_(0.2 * torch.randn_like(param))
            elif arch in ("qwen2_moe", "gpt_oss") and name.endswith(("bias", "_bias")):
                param.copy_(0.1 * torch.randn_like(param))  # HF inits biases at 0
    if dtype == "bfloat16":
        model = model.to(torch.bfloat16)
    os.makedirs(path, exist_ok=True)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **kwargs)
    return os.fspath(path)


def segmented_rows(seq: int):
    """(docs, ids, positions, segment_ids) of three documents, 9 and 11 tokens sharing
    row 0 and one of `seq` tokens filling row 1, for the segmented-row parity tests."""
    import numpy as np

    docs = [np.random.RandomState(10 + n).randint(1, 512, n).astype(np.int32)
            for n in (9, 11, seq)]
    ids, seg, pos = (np.zeros((3, seq), np.int32) for _ in range(3))
    ids[0, :9], seg[0, :9], pos[0, :9] = docs[0], 1, np.arange(9)
    ids[0, 9:20], seg[0, 9:20], pos[0, 9:20] = docs[1], 2, np.arange(11)
    ids[1], seg[1], pos[1] = docs[2], 1, np.arange(seq)
    return docs, ids, pos, seg


def actx_config(path):
    """The actx model config of the checkpoint saved in `path` (its config.json, read by
    the families)."""
    import json

    from actx.workers.model import families

    with open(os.path.join(path, "config.json")) as f:
        return families.config_from_hf(json.load(f))


def checkpoint_maker(tmp_path_factory):
    """get(arch, **overrides) -> a tiny checkpoint's directory, each (arch, overrides) made
    once (a module-scoped fixture's body: checkpoints take seconds to write)."""
    made: dict = {}

    def get(arch: str, **kwargs) -> str:
        key = (arch, tuple(sorted(kwargs.items())))
        if key not in made:
            made[key] = make_tiny_checkpoint(tmp_path_factory.mktemp(arch), arch, **kwargs)
        return made[key]

    return get


def load_hf_model(path: str | os.PathLike):
    """The float32, eager-attention PyTorch model of checkpoint `path`, in eval mode (a
    multimodal Gemma 3 checkpoint loads whole; `decoder` finds its text tower)."""
    import json

    import torch
    import transformers

    with open(os.path.join(path, "config.json")) as f:
        arch = json.load(f)["architectures"][0]
    auto = getattr(transformers, arch) if arch == "Gemma3ForConditionalGeneration" \
        else transformers.AutoModelForCausalLM
    model = auto.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def decoder(model):
    """The decoder stack (embeddings, layers, final norm) of an HF causal or multimodal
    model."""
    inner = getattr(model, "model", None) or getattr(model, "transformer", None) \
        or model.gpt_neox
    return getattr(inner, "language_model", inner)


def _layers(model):
    inner = decoder(model)
    return inner.h if hasattr(inner, "h") else inner.layers


def hf_hooks(model, input_ids, position_ids=None, attention_mask=None) -> dict:
    """Every actx hook of `model` on `input_ids` ([b, t] int), as float32 numpy.

    attention_mask: [b, t] padding mask, or a prepared additive [b, 1, t, t] float mask
    (`band_mask`), which HF applies as is.

    Keys as actx names: embed, layers.{i}.{resid_pre,attn_out,resid_mid,mlp_out,
    resid_post}, final_norm. resid_post of the last layer is taken before the final norm
    (HF's hidden_states[-1] is after it and becomes final_norm). A mixture of experts adds
    layers.{i}.{router_logits,expert_ids,expert_weights}: what its router module
    (`mlp.gate`) returns, [b, t, experts] and [b, t, k] (ids int32, in torch.topk's order).
    """
    import numpy as np
    import torch

    if isinstance(attention_mask, dict):
        # One prepared 4D mask per layer type (Gemma's local and global layers).
        mask_tensor = {kind: torch.as_tensor(np.asarray(m, np.float32))
                       for kind, m in attention_mask.items()}
    elif attention_mask is not None and np.ndim(attention_mask) == 4:
        # A prepared 4D mask (HF uses it as is): additive float, 0 = attend.
        mask_tensor = torch.as_tensor(np.asarray(attention_mask, np.float32))
    elif attention_mask is not None:
        mask_tensor = torch.as_tensor(attention_mask, dtype=torch.long)
    else:
        mask_tensor = None
    captured: dict[str, torch.Tensor] = {}
    handles = []
    layers = _layers(model)
    parallel = getattr(model.config, "use_parallel_residual", False)
    for i, layer in enumerate(layers):
        # What is added to the residual stream: after Gemma's post-norms.
        post_attn = getattr(layer, "post_feedforward_layernorm", None) and \
            layer.post_attention_layernorm
        post_mlp = getattr(layer, "post_feedforward_layernorm", None)
        attention = getattr(layer, "self_attn", None) or getattr(layer, "attn", None) \
            or layer.attention
        handles.append((post_attn or attention).register_forward_hook(
            lambda mod, args, out, i=i: captured.__setitem__(
                f"layers.{i}.attn_out", out[0] if isinstance(out, tuple) else out)))
        handles.append((post_mlp or layer.mlp).register_forward_hook(
            lambda mod, args, out, i=i: captured.__setitem__(
                f"layers.{i}.mlp_out", out[0] if isinstance(out, tuple) else out)))
        handles.append(layer.register_forward_hook(
            lambda mod, args, out, i=i: captured.__setitem__(
                f"layers.{i}.resid_post", out[0] if isinstance(out, tuple) else out)))
        router = getattr(layer.mlp, "gate", None) or getattr(layer.mlp, "router", None)
        if router is not None and hasattr(router, "top_k"):
            handles.append(router.register_forward_hook(
                lambda mod, args, out, i=i: captured.update({
                    f"layers.{i}.router_logits": out[0], f"layers.{i}.expert_weights": out[1],
                    f"layers.{i}.expert_ids": out[2]})))
    try:
        with torch.no_grad():
            out = model(input_ids=torch.as_tensor(input_ids, dtype=torch.long),
                        position_ids=None if position_ids is None
                        else torch.as_tensor(position_ids, dtype=torch.long),
                        attention_mask=mask_tensor,
                        output_hidden_states=True)
    finally:
        for handle in handles:
            handle.remove()
    hidden = out.hidden_states
    num_layers = len(layers)
    result = {"embed": hidden[0], "final_norm": hidden[-1]}
    for i in range(num_layers):
        result[f"layers.{i}.resid_pre"] = hidden[i] if i == 0 else captured[
            f"layers.{i - 1}.resid_post"]
        for point in ("attn_out", "mlp_out", "resid_post"):
            result[f"layers.{i}.{point}"] = captured[f"layers.{i}.{point}"]
        if not parallel:  # a parallel block (GPT-NeoX) has no resid_mid
            result[f"layers.{i}.resid_mid"] = (result[f"layers.{i}.resid_pre"]
                                               + captured[f"layers.{i}.attn_out"])
        for point in ("router_logits", "expert_ids", "expert_weights"):
            if f"layers.{i}.{point}" in captured:  # [b * t, ...] -> [b, t, ...]
                flat = captured[f"layers.{i}.{point}"]
                result[f"layers.{i}.{point}"] = flat.reshape(*hidden[0].shape[:2], -1)
    return {k: v.detach().numpy().astype(np.int32) if k.endswith("expert_ids")
            else v.detach().float().numpy() for k, v in result.items()}


def context_mask(model, length: int, max_context: int):
    """What HF must be given to show a document of `length` tokens what actx shows it with
    `max_context`: None where HF's own masks already do (the document fits), else a band
    mask per layer window: one for models whose layers share a window, a mask per layer
    type for models with local and global layers (Gemma)."""
    config = getattr(model.config, "text_config", model.config)
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or []
    if "sliding_attention" not in layer_types and getattr(config, "model_type", "") in (
            "qwen2", "qwen3"):
        window = None if not getattr(config, "use_sliding_window", False) else window
    if "sliding_attention" in layer_types and "full_attention" in layer_types:
        if length <= max_context:
            return None
        return {"full_attention": band_mask(length, max_context),
                "sliding_attention": band_mask(length, min(window or max_context,
                                                           max_context))}
    effective = min(max_context, window or max_context)
    return band_mask(length, effective) if length > effective else None


def band_mask(length: int, window: int | None):
    """Additive [1, 1, length, length] float mask: causal, and query p sees keys > p - window
    (every key before it when window is None): HF run with a sliding window."""
    import numpy as np

    q = np.arange(length)[:, None]
    k = np.arange(length)[None, :]
    allowed = (k <= q) & ((q - k < window) if window is not None else True)
    return np.where(allowed, 0.0, np.finfo(np.float32).min).astype(np.float32)[None, None]


def make_answering_checkpoint(path: str | os.PathLike, answer_id: int, end_id: int,
                              **overrides) -> str:
    """A tiny Qwen2 (Qwen's 151,936 ids) whose greedy answer to any prompt is `answer_id`
    then `end_id`: a model that answers, for tests of what is done with answers.

    Every embedding row leans on one direction u, `answer_id`'s on -u; the LM head maps u
    to `answer_id` and -u to `end_id`. The blocks keep their small random weights, so the
    activations are a real forward pass's, only dominated by the embedding."""
    import torch
    import transformers

    config = tiny_config("qwen2", vocab_size=151936, tie_word_embeddings=False, **overrides)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                          attn_implementation="eager")
    with torch.no_grad():
        embed = model.get_input_embeddings().weight
        u = torch.nn.functional.normalize(torch.randn(embed.shape[1]), dim=0)
        embed.add_(u)
        embed[answer_id] -= 2 * u
        head = model.get_output_embeddings().weight
        head[answer_id] = 20 * u
        head[end_id] = -20 * u
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    return os.fspath(path)
