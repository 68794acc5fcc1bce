"""The minimal JAX extraction script: the ceiling an extraction tool could reach (issue 49).

What a researcher who knows JAX would write in an afternoon to get a Qwen2's hidden states:
the checkpoint's tensors read straight from its safetensors, a plain jitted forward (one
Python loop over the layers, `jax.nn.dot_product_attention` with its causal mask, which
takes the backend's fused attention where it has one), returning the residual stream after
the requested layers. The executable writes them to pinned host memory where the backend
has it, and the script copies each step's outputs into preallocated numpy buffers while
the next step runs. No storage, no packing, no segments, no cache: every row is one
document from its first token. actx's end to end is reported as a ratio of this rate.

It shares nothing with actx's model code, so `bench/forward.py --minimal-jax` also checks it
against actx's hooks on the same inputs (max abs difference printed), and
tests/test_bench_minimal_jax.py checks it against HF transformers.
"""

from __future__ import annotations

import json
import os
import time
from typing import Sequence

import numpy as np


def load_params(checkpoint: str, dtype: str) -> tuple[dict, dict]:
    """(params, config) of a Qwen2 checkpoint directory: per-layer tensors stacked in
    Python lists, linear weights transposed to [in, out]."""
    import jax.numpy as jnp
    from safetensors.numpy import load_file

    with open(os.path.join(checkpoint, "config.json")) as f:
        config = json.load(f)
    tensors: dict[str, np.ndarray] = {}
    for name in sorted(os.listdir(checkpoint)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(checkpoint, name)))
    cast = lambda x: jnp.asarray(x, dtype=dtype)  # noqa: E731
    layers = []
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        layers.append({
            "ln1": cast(tensors[p + "input_layernorm.weight"]),
            "ln2": cast(tensors[p + "post_attention_layernorm.weight"]),
            **{f"w{x}": cast(tensors[p + f"self_attn.{x}_proj.weight"].T) for x in "qkvo"},
            **{f"b{x}": cast(tensors[p + f"self_attn.{x}_proj.bias"]) for x in "qkv"},
            **{x: cast(tensors[p + f"mlp.{x}_proj.weight"].T) for x in ("gate", "up", "down")},
        })
    return {"embed": cast(tensors["model.embed_tokens.weight"]), "layers": layers,
            "norm": cast(tensors["model.norm.weight"])}, config


def make_forward(config: dict, layers: Sequence[int], attention: str | None = None):
    """forward(params, ids [batch, seq]) -> the residual stream after each of `layers`
    (the last layer's before the final norm), each [batch, seq, hidden]. attention:
    `jax.nn.dot_product_attention`'s implementation (None: its default, "cudnn": the fused
    cuDNN kernel, GPUs and half precision only)."""
    import jax
    import jax.numpy as jnp

    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    eps, theta = config["rms_norm_eps"], config.get("rope_theta", 10000.0)
    wanted = sorted(set(layers))

    def rms(x, w):
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
        return w * x32.astype(x.dtype)

    def rope(x, cos, sin):  # x [b, t, n, d]; rotate-half, as Qwen2
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        rotated = jnp.concatenate([-x2, x1], axis=-1)
        return (x.astype(jnp.float32) * cos + rotated.astype(jnp.float32) * sin).astype(x.dtype)

    def forward(params, ids):
        b, t = ids.shape
        inv_freq = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
        angles = jnp.arange(t, dtype=jnp.float32)[:, None] * inv_freq[None, :]
        angles = jnp.concatenate([angles, angles], axis=-1)
        cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]
        x = params["embed"][ids]
        out = []
        for i, p in enumerate(params["layers"][:wanted[-1] + 1]):
            h = rms(x, p["ln1"])
            q = (h @ p["wq"] + p["bq"]).reshape(b, t, heads, head_dim)
            k = (h @ p["wk"] + p["bk"]).reshape(b, t, kv_heads, head_dim)
            v = (h @ p["wv"] + p["bv"]).reshape(b, t, kv_heads, head_dim)
            attn = jax.nn.dot_product_attention(rope(q, cos, sin), rope(k, cos, sin), v,
                                                is_causal=True, implementation=attention)
            x = x + attn.reshape(b, t, heads * head_dim) @ p["wo"]
            h = rms(x, p["ln2"])
            x = x + (jax.nn.silu(h @ p["gate"]) * (h @ p["up"])) @ p["down"]
            if i in wanted:
                out.append(x)
        return [out[wanted.index(i)] for i in layers]

    return forward


def final_norm(params: dict, config: dict, x):
    """The model's final RMSNorm (HF's last hidden state is the last layer's after it)."""
    import jax
    import jax.numpy as jnp

    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True)
                              + config["rms_norm_eps"])
    return params["norm"] * x32.astype(x.dtype)


def jitted(config: dict, layers: Sequence[int], attention: str | None = None):
    """The jitted forward, its outputs in pinned host memory where the backend has that
    kind apart from device memory (GPU, TPU; on the CPU device memory is host memory)."""
    import jax

    device = jax.devices()[0]
    kinds = {m.kind for m in device.addressable_memories()}
    if device.platform != "cpu" and "pinned_host" in kinds:
        out = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
        return jax.jit(make_forward(config, layers, attention), out_shardings=out), \
            "pinned_host"
    return jax.jit(make_forward(config, layers, attention)), "device"


def tokens_per_s(params: dict, config: dict, ids_steps: Sequence[np.ndarray],
                 layers: Sequence[int], rounds: int = 3,
                 attention: str | None = None) -> tuple[float, str]:
    """Tokens/s of the minimal script (`load_params`' params and config) over `ids_steps`
    ([batch, seq] int32 each): each step's outputs copied into preallocated host buffers
    while the next step runs. Median over `rounds` timed passes after one warm-up pass;
    returns (rate, where the outputs land)."""
    import statistics

    import jax

    fn, memory = jitted(config, layers, attention)
    batch, seq = ids_steps[0].shape
    buffers = [np.empty((batch, seq, config["hidden_size"]), params["embed"].dtype)
               for _ in layers]
    placed = [jax.device_put(ids) for ids in ids_steps]

    def one_pass() -> float:
        start = time.perf_counter()
        previous = None
        for ids in placed:
            outs = fn(params, ids)  # dispatched: runs while the previous step is copied
            if previous is not None:
                for buffer, x in zip(buffers, previous):
                    np.copyto(buffer, np.asarray(x))
            previous = outs
        for buffer, x in zip(buffers, previous):
            np.copyto(buffer, np.asarray(x))
        return time.perf_counter() - start

    one_pass()
    seconds = statistics.median(one_pass() for _ in range(rounds))
    return len(ids_steps) * batch * seq / seconds, memory
