"""A mixture-of-experts MLP (Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral, gpt-oss) as pure
functions.

`route` picks each token's k experts as HF does: router logits in the compute dtype (plus
the router's bias: gpt-oss), softmax in float32, `top_k`, the family's renormalisation
(gpt-oss: the top k of the logits, then their softmax), and the weights cast to the
compute dtype unless the family keeps them in float32 (Mixtral). Exactly equal
probabilities go to the lower expert id first; torch.topk orders such ties by its sort
algorithm instead (tests/test_moe.py shows both). A tie on the k-th place may keep another
expert than HF does; the output is the same only when the tied experts are identical.

`experts` runs only the chosen experts, grouped: the (token, choice) pairs are sorted by
expert, and either each projection is one `jax.lax.ragged_dot` over the groups
("ragged"), or each expert's rows are padded to whole blocks and a scan runs one
expert's matmuls per block ("blocked"); neither loops over experts in Python. "dense"
runs every expert on every token as one einsum and keeps the chosen outputs. The experts'
gated unit is the family's (`swiglu`, gpt-oss's `clamped_swiglu`), with biases where the
experts have them (gpt-oss).
bench/moe_experts.py times the three against HF. All add a token's k outputs in ascending
expert id, as HF's per-expert `index_add_` does, so the sum rounds as HF's does.
"""

from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp

IMPLEMENTATIONS = ("ragged", "blocked", "dense")
# "blocked": rows per block; each expert's rows are padded to whole blocks (128 was the
# fastest of 32-256 on the CPU in bench/moe_experts.py).
BLOCK_ROWS = 128


def default_implementation() -> str:
    """"blocked" on the CPU, where XLA lowers ragged_dot as masked dense matmuls (4x slower
    than blocked in bench/moe_experts.py at 8 experts, top 2); "ragged" elsewhere
    (accelerator lowerings of ragged_dot; not measured against "blocked" yet)."""
    return "blocked" if jax.default_backend() == "cpu" else "ragged"


def route(h_btd: jax.Array, router_ed: jax.Array, cfg, router_bias_e: jax.Array | None = None
          ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(router logits [b, t, e] in the compute dtype, chosen expert ids [b, t, k] int32
    best first, their weights [b, t, k]). router_bias_e: added to the logits (gpt-oss);
    cfg.softmax_after_topk: the weights are the softmax of the k chosen logits (gpt-oss),
    not the chosen entries of the softmax over all experts."""
    logits_bte = jnp.einsum("btd,ed->bte", h_btd, router_ed)
    if router_bias_e is not None:
        logits_bte = logits_bte + router_bias_e
    if getattr(cfg, "softmax_after_topk", False):
        top_btk, ids_btk = jax.lax.top_k(logits_bte, cfg.experts_per_token)
        weights_btk = jax.nn.softmax(top_btk.astype(jnp.float32), axis=-1)
    else:
        probs_bte = jax.nn.softmax(logits_bte.astype(jnp.float32), axis=-1)
        weights_btk, ids_btk = jax.lax.top_k(probs_bte, cfg.experts_per_token)
        if cfg.norm_topk_prob:
            weights_btk = weights_btk / jnp.sum(weights_btk, axis=-1, keepdims=True)
    if not cfg.router_weights_fp32:
        weights_btk = weights_btk.astype(logits_bte.dtype)
    return logits_bte, ids_btk.astype(jnp.int32), weights_btk


def swiglu(activation):
    """The experts' gated unit: activation(gate) * up (SwiGLU)."""
    return lambda gate, up: activation(gate) * up


def clamped_swiglu(alpha: float, limit: float):
    """gpt-oss's gated unit: gate clamped above at `limit`, up to [-limit, limit], then
    (up + 1) * gate * sigmoid(alpha * gate)."""
    def glu(gate, up):
        gate = jnp.minimum(gate, limit)
        up = jnp.clip(up, -limit, limit)
        return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))
    return glu


def experts(h_btd: jax.Array, ids_btk: jax.Array, weights_btk: jax.Array,
            p: Mapping[str, jax.Array], glu, impl: str = "ragged") -> jax.Array:
    """The weighted sum of each token's chosen experts [b, t, d]; glu(gate, up) is the
    experts' gated unit (`swiglu`, `clamped_swiglu`); biases where p has
    expert_{gate,up}_bias_lef and expert_down_bias_led."""
    if impl == "dense":
        y_btkd = _chosen_dense(h_btd, ids_btk, p, glu)
    elif impl in ("ragged", "blocked"):
        y_btkd = _chosen_grouped(h_btd, ids_btk, p, glu, impl)
    else:
        raise ValueError(f"expert matmuls {impl!r}: one of {', '.join(IMPLEMENTATIONS)}")
    # HF: expert output * weight in the promoted dtype, cast to the hidden dtype, added.
    y_btkd = (y_btkd * weights_btk[..., None]).astype(h_btd.dtype)
    # HF adds a token's experts in ascending expert id (one index_add_ per expert).
    by_id_btk = jnp.argsort(ids_btk, axis=-1, stable=True)
    y_btkd = jnp.take_along_axis(y_btkd, by_id_btk[..., None], axis=2)
    out_btd = y_btkd[:, :, 0]
    for j in range(1, y_btkd.shape[2]):  # k adds (not a loop over experts)
        out_btd = out_btd + y_btkd[:, :, j]
    return out_btd


def _biases(p):
    """(gate [e, f], up [e, f], down [e, d]) biases, or Nones where the experts have none."""
    if "expert_gate_bias_lef" not in p:
        return None, None, None
    return p["expert_gate_bias_lef"], p["expert_up_bias_lef"], p["expert_down_bias_led"]


def _chosen_grouped(h_btd, ids_btk, p, glu, impl: str) -> jax.Array:
    """Each (token, choice)'s expert output [b, t, k, d], with the pairs sorted by expert
    and each expert's matmuls on its own rows only."""
    b, t, d = h_btd.shape
    k = ids_btk.shape[-1]
    num_experts = p["router_weight_led"].shape[0]
    flat_ids = ids_btk.reshape(b * t * k)
    order = jnp.argsort(flat_ids, stable=True)  # (token, choice) pairs grouped by expert
    x_md = h_btd.reshape(b * t, d)[order // k]
    sizes = jnp.bincount(flat_ids, length=num_experts).astype(jnp.int32)
    mlp = _ragged_mlp if impl == "ragged" else _blocked_mlp
    y_md = mlp(x_md, sizes, p, glu)
    back = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    return y_md[back].reshape(b, t, k, d)


def _ragged_mlp(x_md, sizes, p, glu) -> jax.Array:
    """One `jax.lax.ragged_dot` per projection over the groups."""
    gate_mf = jax.lax.ragged_dot(x_md, p["expert_gate_ledf"], sizes)
    up_mf = jax.lax.ragged_dot(x_md, p["expert_up_ledf"], sizes)
    gate_b, up_b, down_b = _biases(p)
    if gate_b is not None:
        expert_m = jnp.repeat(jnp.arange(sizes.shape[0]), sizes,
                              total_repeat_length=x_md.shape[0])
        gate_mf, up_mf = gate_mf + gate_b[expert_m], up_mf + up_b[expert_m]
    y_md = jax.lax.ragged_dot(glu(gate_mf, up_mf), p["expert_down_lefd"], sizes)
    return y_md if down_b is None else y_md + down_b[expert_m]


def _blocked_mlp(x_md, sizes, p, glu) -> jax.Array:
    """Each expert's rows padded to whole blocks of BLOCK_ROWS, then a scan over the
    blocks, each one expert's three matmuls (FLOPs within E * BLOCK_ROWS rows of the
    grouped ideal; where ragged_dot is lowered as masked dense matmuls, on the CPU, this
    is the faster form)."""
    m, d = x_md.shape
    num_experts = sizes.shape[0]
    rows = min(BLOCK_ROWS, max(m, 1))
    padded = (sizes + rows - 1) // rows * rows
    pad_end = jnp.cumsum(padded)
    pad_start = pad_end - padded
    start = jnp.cumsum(sizes) - sizes
    expert_m = jnp.repeat(jnp.arange(num_experts), sizes, total_repeat_length=m)
    dest_m = pad_start[expert_m] + jnp.arange(m) - start[expert_m]
    blocks = -(-(m + num_experts * (rows - 1)) // rows)
    x_pd = jnp.zeros((blocks * rows, d), x_md.dtype).at[dest_m].set(x_md)
    block_expert = jnp.minimum(
        jnp.searchsorted(pad_end, jnp.arange(blocks) * rows, side="right"), num_experts - 1)

    gate_edf, up_edf, down_efd = (jnp.asarray(p[n]) for n in (
        "expert_gate_ledf", "expert_up_ledf", "expert_down_lefd"))
    gate_b, up_b, down_b = _biases(p)

    def one_block(_, xs):
        x_rd, e = xs
        gate = x_rd @ gate_edf[e]
        up = x_rd @ up_edf[e]
        if gate_b is not None:
            gate, up = gate + gate_b[e], up + up_b[e]
        y = glu(gate, up) @ down_efd[e]
        return None, (y if down_b is None else y + down_b[e])

    _, y_brd = jax.lax.scan(one_block, None, (x_pd.reshape(blocks, rows, d), block_expert))
    return y_brd.reshape(blocks * rows, -1)[dest_m]


def _chosen_dense(h_btd, ids_btk, p, glu) -> jax.Array:
    """Every expert on every token, then the chosen ones (one-hot, exact) [b, t, k, d]."""
    gate_btef = jnp.einsum("btd,edf->btef", h_btd, p["expert_gate_ledf"])
    up_btef = jnp.einsum("btd,edf->btef", h_btd, p["expert_up_ledf"])
    gate_b, up_b, down_b = _biases(p)
    if gate_b is not None:
        gate_btef, up_btef = gate_btef + gate_b, up_btef + up_b
    y_bted = jnp.einsum("btef,efd->bted", glu(gate_btef, up_btef), p["expert_down_lefd"])
    if down_b is not None:
        y_bted = y_bted + down_b
    one_hot_btke = jax.nn.one_hot(ids_btk, y_bted.shape[2], dtype=y_bted.dtype)
    return jnp.einsum("btke,bted->btkd", one_hot_btke, y_bted,
                      precision=jax.lax.Precision.HIGHEST)
