"""What an HF config class gives a field that `config.json` leaves out, for the fields actx
reads: transformers 5's config classes are dataclasses whose defaults fill every absent
field, so a checkpoint whose config.json omits, say, `rms_norm_eps` or
`query_pre_attn_scalar` is HF's model only with HF's default (which is not one value
across families: 1e-5 or 1e-6; 256 or head_dim). `with_defaults` lays a config over its
architecture's defaults before the family reads it.

The table is data copied from transformers 5.25's classes (the class's field defaults,
and `default_theta` where it is not 10,000); tests/test_config_defaults.py checks it
against the installed transformers and checks that dropping any field of a config reads
the same model as HF's own completion of it. A field HF derives in `__post_init__`
(head_dim, layer_types, a missing num_key_value_heads) is derived by the family
reader, as HF does; a value written as null is kept null, as HF keeps it.
"""

from __future__ import annotations

from typing import Any, Mapping

DEFAULTS: dict[str, dict[str, Any]] = {
    "Qwen2ForCausalLM": {
        "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
        "hidden_act": "silu", "max_position_embeddings": 32768, "rms_norm_eps": 1e-06,
        "tie_word_embeddings": False, "use_sliding_window": False, "sliding_window": 4096,
        "max_window_layers": 28},
    "LlamaForCausalLM": {
        "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
        "num_hidden_layers": 32, "num_attention_heads": 32, "hidden_act": "silu",
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-06,
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False},
    "MistralForCausalLM": {
        "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "hidden_act": "silu", "max_position_embeddings": 131072, "rms_norm_eps": 1e-06,
        "tie_word_embeddings": False, "sliding_window": 4096},
    "Qwen3ForCausalLM": {
        "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
        "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-06, "tie_word_embeddings": False, "attention_bias": False,
        "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28},
    "Gemma2ForCausalLM": {
        "vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216,
        "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
        "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-06, "tie_word_embeddings": True,
        "attention_bias": False, "query_pre_attn_scalar": 256, "sliding_window": 4096,
        "attn_logit_softcapping": 50.0},
    "Gemma3ForCausalLM": {
        "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216,
        "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
        "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-06,
        "tie_word_embeddings": True, "attention_bias": False, "query_pre_attn_scalar": 256,
        "sliding_window": 4096, "use_bidirectional_attention": False},
    "Phi3ForCausalLM": {
        "vocab_size": 32064, "hidden_size": 3072, "intermediate_size": 8192,
        "num_hidden_layers": 32, "num_attention_heads": 32, "hidden_act": "silu",
        "max_position_embeddings": 4096, "original_max_position_embeddings": 4096,
        "rms_norm_eps": 1e-05, "tie_word_embeddings": False},
    "Olmo2ForCausalLM": {
        "vocab_size": 50304, "hidden_size": 4096, "intermediate_size": 11008,
        "num_hidden_layers": 32, "num_attention_heads": 32, "hidden_act": "silu",
        "max_position_embeddings": 2048, "tie_word_embeddings": False,
        "attention_bias": False, "rms_norm_eps": 1e-05},
    "Qwen3MoeForCausalLM": {
        "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
        "num_hidden_layers": 24, "num_attention_heads": 32, "num_key_value_heads": 4,
        "hidden_act": "silu", "max_position_embeddings": 32768, "rms_norm_eps": 1e-06,
        "tie_word_embeddings": False, "attention_bias": False, "use_sliding_window": False,
        "sliding_window": 4096, "decoder_sparse_step": 1, "moe_intermediate_size": 768,
        "num_experts_per_tok": 8, "num_experts": 128, "norm_topk_prob": False},
    "OlmoeForCausalLM": {
        "vocab_size": 50304, "hidden_size": 2048, "intermediate_size": 2048,
        "num_hidden_layers": 16, "num_attention_heads": 16, "hidden_act": "silu",
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-05,
        "tie_word_embeddings": False, "attention_bias": False, "num_experts_per_tok": 8,
        "num_experts": 64, "norm_topk_prob": False},
    "MixtralForCausalLM": {
        "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "hidden_act": "silu", "max_position_embeddings": 131072, "rms_norm_eps": 1e-05,
        "tie_word_embeddings": False, "num_experts_per_tok": 2, "num_local_experts": 8,
        "rope_theta": 1000000.0},
    "GPT2LMHeadModel": {
        "vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12,
        "n_head": 12, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-05,
        "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False, "add_cross_attention": False,
        "tie_word_embeddings": True},
    "GPTNeoXForCausalLM": {
        "vocab_size": 50432, "hidden_size": 6144, "num_hidden_layers": 44,
        "num_attention_heads": 64, "intermediate_size": 24576, "hidden_act": "gelu",
        "max_position_embeddings": 2048, "layer_norm_eps": 1e-05,
        "tie_word_embeddings": False, "use_parallel_residual": True, "attention_bias": True},
    "Qwen2MoeForCausalLM": {
        "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632,
        "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16,
        "hidden_act": "silu", "max_position_embeddings": 32768, "rms_norm_eps": 1e-06,
        "tie_word_embeddings": False, "use_sliding_window": False, "sliding_window": 4096,
        "max_window_layers": 28, "decoder_sparse_step": 1, "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632, "num_experts_per_tok": 4,
        "num_experts": 60, "norm_topk_prob": False, "qkv_bias": True},
    "GptOssForCausalLM": {
        "num_hidden_layers": 36, "num_local_experts": 128, "vocab_size": 201088,
        "hidden_size": 2880, "intermediate_size": 2880, "head_dim": 64,
        "num_attention_heads": 64, "num_key_value_heads": 8, "sliding_window": 128,
        "tie_word_embeddings": False, "hidden_act": "silu",
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "num_experts_per_tok": 4,
        "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "attention_bias": True,
        "rope_theta": 150000.0},
}


# transformers' `attribute_map`s of the mixtures: a config.json may name the experts
# either way (HF reads either), so a config that gives one takes no default for the other.
# (GPT-2's, n_embd for hidden_size and the like, are its family's `hf_names`.)
ALIASES: dict[str, dict[str, str]] = {
    "Qwen3MoeForCausalLM": {"num_experts": "num_local_experts"},
    "OlmoeForCausalLM": {"num_local_experts": "num_experts"},
    "MixtralForCausalLM": {"num_experts": "num_local_experts"},
    "GptOssForCausalLM": {"num_experts": "num_local_experts"},
}


def with_defaults(hf: Mapping[str, Any], arch: str,
                  names: Mapping[str, str] | None = None) -> dict[str, Any]:
    """`hf` over its architecture's HF defaults (the fields it has win, null included).
    names: the family's own names of common fields (`Family.hf_names`), aliases as
    ALIASES' are."""
    given = set(hf)
    for one, other in {**ALIASES.get(arch, {}), **(names or {})}.items():
        if one in hf or other in hf:
            given |= {one, other}
    return {**{k: v for k, v in DEFAULTS.get(arch, {}).items() if k not in given}, **hf}
