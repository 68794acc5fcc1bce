"""A mixture of experts' MLP alone: actx's three forms of the expert matmuls (`ragged`:
`jax.lax.ragged_dot` over the expert groups; `blocked`: each expert's rows padded to blocks,
one expert per block in a scan; `dense`: every expert on every token) against HF's
per-expert loop (Qwen3-MoE's experts), on the same weights and routing, in the same run;
prints tokens/s and the ratios.

    python bench/moe_experts.py --experts 8 --top-k 2 --hidden 256 --width 512 --tokens 4096
    python bench/moe_experts.py --experts 128 --top-k 8 --hidden 1024 --width 768 \
        --tokens 4096 --dtype bfloat16      # Qwen3-30B-A3B's expert shapes, narrower

Which form is faster depends on experts / k and the backend: the dense form does
experts / k times the FLOPs of the grouped one but runs as plain einsums.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import common  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--width", type=int, default=512, help="each expert's MLP width")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--block-rows", type=int, default=None,
                   help="the blocked form's rows per block (workers.model.moe.BLOCK_ROWS)")
    p.add_argument("--skip-hf", action="store_true")
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from actx.workers.model import moe

    if args.block_rows:
        moe.BLOCK_ROWS = args.block_rows
    class Cfg:
        experts_per_token, norm_topk_prob, router_weights_fp32 = args.top_k, True, False

    rng = np.random.default_rng(0)
    e, d, f = args.experts, args.hidden, args.width
    dtype = jnp.dtype(args.dtype)
    weights = {"router_weight_led": rng.normal(0, 0.5, (e, d)),
               "expert_gate_ledf": rng.normal(0, d ** -0.5, (e, d, f)),
               "expert_up_ledf": rng.normal(0, d ** -0.5, (e, d, f)),
               "expert_down_lefd": rng.normal(0, f ** -0.5, (e, f, d))}
    params = {k: jnp.asarray(v, dtype) for k, v in weights.items()}
    h = jnp.asarray(rng.normal(0, 1, (1, args.tokens, d)), dtype)

    def run(impl):
        def mlp(p, h):
            _, ids, w = moe.route(h, p["router_weight_led"], Cfg)
            return moe.experts(h, ids, w, p, moe.swiglu(jax.nn.silu), impl)
        fn = jax.jit(mlp)
        return lambda: fn(params, h).block_until_ready()

    print(f"device={jax.devices()[0].platform} experts={e} top_k={args.top_k} hidden={d} "
          f"width={f} tokens={args.tokens} dtype={args.dtype} block_rows={moe.BLOCK_ROWS}")
    rates = {}
    for impl in moe.IMPLEMENTATIONS:
        rates[impl] = args.tokens / common.median_seconds(run(impl), args.iters)
        print(f"actx {impl:<8} {rates[impl]:>14,.0f} tokens/s")
    for impl in ("ragged", "blocked"):
        print(f"ratio {impl} / dense: {rates[impl] / rates['dense']:.2f}x")
    if args.skip_hf:
        return
    import torch
    import transformers

    config = transformers.Qwen3MoeConfig(hidden_size=d, num_experts=e,
                                         num_experts_per_tok=args.top_k,
                                         moe_intermediate_size=f, norm_topk_prob=True)
    block = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(config)
    tdtype = getattr(torch, args.dtype)
    with torch.no_grad():
        block.gate.weight.copy_(torch.as_tensor(weights["router_weight_led"]))
        block.experts.gate_up_proj.copy_(torch.as_tensor(np.concatenate(
            [weights["expert_gate_ledf"], weights["expert_up_ledf"]], -1).transpose(0, 2, 1)))
        block.experts.down_proj.copy_(torch.as_tensor(
            weights["expert_down_lefd"].transpose(0, 2, 1)))
    block = block.to(tdtype).eval()
    h_pt = torch.tensor(np.asarray(h.astype(jnp.float32))).to(tdtype)

    def hf():
        with torch.no_grad():
            block(h_pt)

    hf_rate = args.tokens / common.median_seconds(hf, args.iters)
    print(f"HF PyTorch {hf_rate:>14,.0f} tokens/s (Qwen3MoeSparseMoeBlock)")
    for impl, rate in rates.items():
        print(f"ratio actx {impl} / HF: {rate / hf_rate:.2f}x")


if __name__ == "__main__":
    main()
