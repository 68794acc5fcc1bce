"""What the benchmark scripts share: model-shape flags, the Qwen2.5-0.5B preset, timing."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Callable

QWEN05B = dict(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, vocab=151936,
               batch=16, seq=2048)
# Gemma 2 2B: 8 heads of 256 (4 kv heads) at hidden 2304, a different balance from Qwen.
GEMMA2_2B = dict(arch="gemma2", hidden=2304, layers=26, heads=8, kv_heads=4, head_dim=256,
                 intermediate=9216, vocab=256000, batch=8, seq=2048)
# Llama-3.1-8B layer shapes (32 heads of 128, 8 kv heads, hidden 4096); `--layers` fewer
# where memory or time demand it.
LLAMA8B = dict(arch="llama3", hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128,
               intermediate=14336, vocab=128256, batch=8, seq=2048)
# What a bench's random checkpoint of `arch` gets beyond the shape flags: the real models'
# attention settings (tests.hf_models' tiny defaults are for tests).
ARCH_OVERRIDES = {"gemma2": dict(sliding_window=4096, query_pre_attn_scalar=256,
                                 attn_logit_softcapping=50.0),
                  "llama3": dict(rope_scaling={
                      "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})}


# The tests.hf_models architectures a bench may build (`--arch`).
ARCHS = ("qwen2", "llama3", "mistral", "qwen3", "gemma2", "gemma3", "phi3", "olmo2",
         "qwen3_moe", "olmoe", "mixtral")
# Mixtures of experts: each one's config field for the expert count and whether its
# experts' width is `moe_intermediate_size` (else `intermediate_size`).
MOE_FIELDS = {"qwen3_moe": ("num_experts", True), "olmoe": ("num_experts", False),
              "mixtral": ("num_local_experts", False)}


def checkpoint_overrides(args: argparse.Namespace) -> dict:
    """Config fields for `tests.hf_models.make_tiny_checkpoint` from the shape flags."""
    out = dict(hidden_size=args.hidden, num_hidden_layers=args.layers,
               num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
               intermediate_size=args.intermediate, vocab_size=args.vocab,
               max_position_embeddings=max(args.seq, 8192))
    if args.head_dim:
        out["head_dim"] = args.head_dim
    if args.arch in MOE_FIELDS:
        experts_field, own_width = MOE_FIELDS[args.arch]
        width = getattr(args, "moe_intermediate", None) or args.intermediate
        out.update({experts_field: args.experts, "num_experts_per_tok": args.experts_per_token,
                    ("moe_intermediate_size" if own_width else "intermediate_size"): width})
    return {**out, **ARCH_OVERRIDES.get(args.arch, {})}


def add_model_args(p: argparse.ArgumentParser, batch: int) -> None:
    """Flags for a random-init Qwen2 of any shape, plus the --qwen05b preset."""
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--batch", type=int, default=batch)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16")
    p.add_argument("--arch", default="qwen2", choices=ARCHS,
                   help="tests.hf_models architecture")
    p.add_argument("--experts", type=int, default=8,
                   help="mixtures of experts (qwen3_moe, olmoe, mixtral): experts per layer")
    p.add_argument("--experts-per-token", type=int, default=2,
                   help="mixtures of experts: the k experts each token is routed to")
    p.add_argument("--moe-intermediate", type=int, default=None,
                   help="mixtures of experts: each expert's width (default: --intermediate)")
    p.add_argument("--head-dim", type=int, default=None, help="default: hidden / heads")
    p.add_argument("--qwen05b", action="store_true",
                   help="Qwen2.5-0.5B shapes, batch 16 x seq 2048, bfloat16")
    p.add_argument("--llama8b", action="store_true",
                   help="Llama-3.1-8B layer shapes, batch 8 x seq 2048, bfloat16")
    p.add_argument("--gemma2-2b", action="store_true",
                   help="Gemma 2 2B shapes (26 layers, 8 heads of 256, hidden 2304), batch "
                        "8 x seq 2048, bfloat16")
    p.add_argument("--skip-hf", action="store_true", help="do not time HF PyTorch")
    add_flash_tiles_arg(p)


def add_flash_tiles_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--flash-tiles", default=None, metavar="BQ,BK,WARPS,STAGES",
                   help="the GPU attention kernel's query/key tiles, warps and stages "
                        "(default: workers.attention.ranged_flash_gpu's)")


def set_flash_tiles(tiles: tuple[int, int, int, int]) -> None:
    """Sets workers.attention.ranged_flash_gpu's (block_q, block_k, num_warps, num_stages)."""
    from actx.workers.attention import ranged_flash_gpu as kernel

    kernel.BLOCK_Q, kernel.BLOCK_K, kernel.NUM_WARPS, kernel.NUM_STAGES = tiles


def apply_flash_tiles(spec: str | None) -> None:
    """`set_flash_tiles` from "BQ,BK,WARPS,STAGES" (None: keep the module's)."""
    if spec:
        set_flash_tiles(tuple(int(x) for x in spec.split(",")))


def apply_presets(args: argparse.Namespace,
                  argv: list[str] | None = None) -> argparse.Namespace:
    """--qwen05b / --llama8b / --gemma2-2b set the preset's shapes, except those given on the command
    line (`--qwen05b --seq 1024` keeps seq 1024)."""
    given = {a.split("=")[0] for a in (sys.argv[1:] if argv is None else argv)
             if a.startswith("--")}
    for preset, values in ((args.qwen05b, QWEN05B),
                           (getattr(args, "llama8b", False), LLAMA8B),
                           (getattr(args, "gemma2_2b", False), GEMMA2_2B)):
        if not preset:
            continue
        for name, value in values.items():
            if "--" + name.replace("_", "-") not in given:
                setattr(args, name, value)
        args.dtype = args.dtype or "bfloat16"
    args.dtype = args.dtype or "float32"
    apply_flash_tiles(getattr(args, "flash_tiles", None))
    return args


def median_seconds(run: Callable[[], object], iters: int) -> float:
    """Median wall time of `run` over `iters` calls, after one warm-up call."""
    run()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def hf_extraction_tokens_per_s(hf, ids, layers: list[int], iters: int) -> tuple[float, str]:
    """HF transformers as an expert's extraction script runs it: `hf` (a causal LM, on the
    GPU where there is one) forward with output_hidden_states, then the hidden states of
    `layers` copied into preallocated (pinned, on a GPU) host buffers, non-blocking, with
    one synchronisation. ids: [batch, seq] numpy. Returns (tokens/s, a label)."""
    import torch

    device = next(hf.parameters()).device
    ids_pt = torch.as_tensor(ids, dtype=torch.long, device=device)
    pinned = device.type == "cuda"
    hidden = hf.config.hidden_size
    buffers = [torch.empty((*ids.shape, hidden), dtype=hf.dtype, pin_memory=pinned)
               for _ in layers]

    def run():
        with torch.no_grad():
            states = hf.model(input_ids=ids_pt, output_hidden_states=True).hidden_states
            # hidden_states[i + 1] is layer i's output (resid_post; the last one after the
            # final norm, the same bytes to move).
            for buf, layer in zip(buffers, layers):
                buf.copy_(states[layer + 1], non_blocking=pinned)
        if pinned:
            torch.cuda.synchronize()

    label = f"HF extraction ({len(layers)} layers -> {'pinned ' if pinned else ''}host)"
    return ids.size / median_seconds(run, iters), label
