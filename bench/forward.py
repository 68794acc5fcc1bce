"""Forward-pass throughput: actx's jitted extract step vs HF transformers PyTorch.

Builds a random-init checkpoint (Qwen2 by default, `--arch gemma2` / `--gemma2-2b` for
Gemma 2) of the requested size with transformers, then times
(1) make_extract_fn with the final_norm hook only (forward only, no LM head),
(2) make_extract_fn with 4 resid_post hooks, and
(3) the HF PyTorch model with output_hidden_states=True (its base model, no LM head), and
(4) HF as an expert's extraction script runs it: the same forward, then the hidden states
    of the same 4 layers copied into preallocated pinned host buffers (non-blocking, one
    synchronisation), which is what actx replaces, and
(5) with --minimal-jax, the minimal JAX script (bench/minimal_jax.py): a plain jitted
    forward returning the same 4 layers into pinned host memory, copied into numpy buffers
    while the next step runs; the ceiling an extraction tool could reach (issue 49),
on the same inputs; prints tokens/s (median over iterations) and the ratios.

  python bench/forward.py                     # modest CPU default, ~1 minute
  python bench/forward.py --qwen05b --skip-hf # Qwen2.5-0.5B shapes, for a GPU
  python bench/forward.py --llama8b --layers 8 # Llama-3.1-8B layer shapes, for a GPU
  python bench/forward.py --gemma2-2b --layers 2 --batch 1 --seq 1024 --dtype float32
                                              # Gemma 2 2B layer shapes on a CPU
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

# Run as a script from anywhere: the repo root holds `tests.hf_models`.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402


def _parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_model_args(p, batch=4)
    p.add_argument("--iters", type=int, default=7)
    p.add_argument("--minimal-jax", action="store_true",
                   help="also time bench/minimal_jax.py (Qwen2 checkpoints) and check its "
                        "4 layers against actx's hooks")
    return common.apply_presets(p.parse_args())


def main() -> None:
    args = _parse_args()
    import jax
    import numpy as np
    import torch

    from tests import hf_models
    from actx.workers.model import capture, step
    from actx.workers.model import decoder as model_lib

    tokens = args.batch * args.seq
    ids = np.random.RandomState(0).randint(0, args.vocab, (args.batch, args.seq)).astype(
        np.int32)
    with tempfile.TemporaryDirectory() as ckpt:
        hf_models.make_tiny_checkpoint(ckpt, args.arch, **common.checkpoint_overrides(args))
        model = model_lib.load_pretrained(ckpt, dtype=args.dtype)
        if args.minimal_jax:
            from bench import minimal_jax

            minimal = minimal_jax.load_params(ckpt, args.dtype)
        hf = None
        if not args.skip_hf:
            import transformers

            # SDPA, on the GPU where there is one: HF's fastest built-in path, so the
            # baseline is a fair one (Gemma 2's soft-capping runs only eager in HF).
            hf = transformers.AutoModelForCausalLM.from_pretrained(
                ckpt, dtype=getattr(torch, args.dtype),
                attn_implementation="eager" if args.arch == "gemma2" else "sdpa").eval()

    print(f"device={jax.devices()[0].platform} ({len(jax.devices())} devices) "
          f"arch={args.arch} dtype={args.dtype} hidden={args.hidden} layers={args.layers} heads={args.heads}"
          f"/{args.kv_heads} mlp={args.intermediate} vocab={args.vocab} "
          f"batch={args.batch} seq={args.seq} iters={args.iters}")
    # Four resid_post hooks spread over the depth (the last layer always included).
    every = max(1, args.layers // 4)
    four = ",".join(f"layers.{i}.resid_post" for i in range(args.layers - 1, -1, -every)[:4])
    print(f"4 hooks: {four}")
    results = {}
    for label, hooks in (("actx forward (final_norm)", "final_norm"),
                         ("actx 4 resid_post hooks", four)):
        fn = step.make_extract_fn(model, capture.CaptureSpec.parse(hooks, dtype=args.dtype))
        ids_dev = jax.device_put(ids)
        seconds = common.median_seconds(lambda: jax.block_until_ready(fn(ids_dev)), args.iters)
        results[label] = tokens / seconds
        if hooks == four and args.minimal_jax:
            actx_four = {name: np.asarray(x, np.float32)
                         for name, x in jax.device_get(fn(ids_dev)).items()}
    if args.minimal_jax:
        layers = [int(name.split(".")[1]) for name in four.split(",")]
        rate, memory = minimal_jax.tokens_per_s(*minimal, [ids] * args.iters, layers)
        results[f"minimal JAX (4 layers -> {memory})"] = rate
        mine = minimal_jax.jitted(minimal[1], layers)[0](minimal[0], jax.numpy.asarray(ids))
        diff = max(float(np.max(np.abs(np.asarray(m, np.float32) - actx_four[name])))
                   for m, name in zip(mine, four.split(",")))
        print(f"minimal JAX vs actx hooks on the same ids: max |difference| {diff:.3g} "
              f"({args.dtype})")
    if hf is not None:
        torch_device = "cuda" if torch.cuda.is_available() else "cpu"
        hf = hf.to(torch_device)
        ids_pt = torch.as_tensor(ids, dtype=torch.long, device=torch_device)
        print(f"HF PyTorch on {torch_device}, {hf.config._attn_implementation} attention, "
              f"{args.dtype}")

        def run_hf():
            with torch.no_grad():
                hf.model(input_ids=ids_pt, output_hidden_states=True)
            if torch_device == "cuda":
                torch.cuda.synchronize()

        results["HF PyTorch (output_hidden_states)"] = tokens / common.median_seconds(
            run_hf, args.iters)
        layers = [int(name.split(".")[1]) for name in four.split(",")]
        rate, label = common.hf_extraction_tokens_per_s(hf, ids, layers, args.iters)
        results[label] = rate
    for label, tokens_per_s in results.items():
        print(f"{label:36s} {tokens_per_s:12,.0f} tokens/s")
    if hf is not None:
        hf_rate = results["HF PyTorch (output_hidden_states)"]
        hf_extraction = next(r for label, r in results.items()
                             if label.startswith("HF extraction"))
        for label, rate in results.items():
            if label.startswith("actx"):
                print(f"ratio {label} / HF: {rate / hf_rate:.2f}x; / HF extraction: "
                      f"{rate / hf_extraction:.2f}x")
    for label, rate in results.items():
        if args.minimal_jax and label.startswith("actx"):
            minimal_rate = next(r for name, r in results.items() if name.startswith("minimal"))
            print(f"ratio {label} / minimal JAX: {rate / minimal_rate:.2f}x")


if __name__ == "__main__":
    main()
