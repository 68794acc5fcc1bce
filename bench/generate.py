"""Generation throughput with activations: actx's continuous batching (workers.generate.generator)
vs HF transformers `generate(output_hidden_states=True, return_dict_in_generate=True)`.

Builds a random-init checkpoint (Qwen2 by default; shape flags as bench/forward.py), makes
`--prompts` prompts of lengths spread over [--prompt-len / 2, --prompt-len], and has both
generate `--new-tokens` greedy tokens for each (no stop token, so both write the same
number of tokens): actx on `--batch` slots capturing up to 4 resid_post hooks of every prompt
and generated token, HF in batches of `--batch` left-padded prompts returning every
layer's hidden states. With --temperature above 0 both sample, with the same top-k and
top-p (their texts then differ: each draws from its own random streams). Prints generated
tokens/s (median over --iters runs, after a warm-up run that compiles) and the ratio.

  python bench/generate.py              # modest CPU default, about a minute
  SMALL=1 python bench/generate.py      # tiny shapes, seconds (a smoke run)
  python bench/generate.py --qwen05b --prompts 64 --new-tokens 256   # for a GPU
  python bench/generate.py --vocab 151936 --temperature 1 --top-k 50  # sampling, Qwen's ids
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

# Run as a script from anywhere: the repo root holds `tests.hf_models`.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402

SMALL = dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=512,
             batch=4, prompts=8, prompt_len=16, new_tokens=8, iters=1)


def _parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_model_args(p, batch=8)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=64, help="the longest prompt")
    p.add_argument("--new-tokens", type=int, default=32, help="max_new_tokens")
    p.add_argument("--prefill-len", type=int, default=64, help="actx's prefill rows")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="above 0: both sample (with --top-k, --top-p) instead of greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--attention", default="default",
                   help="comma-separated generation attentions to time in turn: default "
                        "(generate_step.attention_for's choice), xla, pallas")
    args = p.parse_args()
    if os.environ.get("SMALL"):
        for name, value in SMALL.items():
            setattr(args, name, value)
    return common.apply_presets(args)


def main() -> None:
    args = _parse_args()
    import jax
    import numpy as np

    from tests import hf_models
    from actx.workers.generate import generator as generate, step as generate_step
    from actx.workers.model import capture
    from actx.workers.model import decoder as model_lib

    rng = np.random.RandomState(0)
    lengths = rng.randint(max(1, args.prompt_len // 2), args.prompt_len + 1, args.prompts)
    prompts = [rng.randint(3, args.vocab, n).astype(np.int32) for n in lengths]
    generated = args.prompts * args.new_tokens
    every = max(1, args.layers // 4)
    four = ",".join(f"layers.{i}.resid_post" for i in range(args.layers - 1, -1, -every)[:4])
    print(f"device={jax.devices()[0].platform} arch={args.arch} dtype={args.dtype} "
          f"hidden={args.hidden} layers={args.layers} heads={args.heads}/{args.kv_heads} "
          f"vocab={args.vocab} prompts={args.prompts} of {lengths.min()}-{lengths.max()} "
          f"tokens, {args.new_tokens} new tokens each, batch={args.batch} iters={args.iters}"
          + (f", sampling: temperature={args.temperature:g} top_k={args.top_k} "
             f"top_p={args.top_p:g}" if args.temperature > 0 else ", greedy"))
    print(f"actx hooks: {four}")
    results = {}
    with tempfile.TemporaryDirectory() as ckpt:
        overrides = common.checkpoint_overrides(args)
        overrides["max_position_embeddings"] = max(
            overrides["max_position_embeddings"], args.prompt_len + args.new_tokens)
        hf_models.make_tiny_checkpoint(ckpt, args.arch, **overrides)
        model = model_lib.load_pretrained(ckpt, dtype=args.dtype)
        samples = {}
        for attention in args.attention.split(","):
            gen = generate.Generator(
                model, generate_step.load_lm_head(ckpt, model),
                capture.CaptureSpec.parse(four, dtype=args.dtype),
                generate.GenerateConfig(max_new_tokens=args.new_tokens,
                                        temperature=args.temperature, top_k=args.top_k,
                                        top_p=args.top_p), slots=args.batch,
                max_length=args.prompt_len + args.new_tokens,
                prefill_len=min(args.prefill_len, args.prompt_len),
                attention=None if attention == "default" else attention)

            def run_actx():
                samples[attention] = gen.run(prompts)

            seconds = common.median_seconds(run_actx, args.iters)
            assert sum(len(s.generated_ids) for s in samples[attention]) == generated
            name = gen.attention if attention != "default" else f"default = {gen.attention}"
            label = (f"actx generate ({name} attention, {args.batch} slots, "
                     f"{len(four.split(','))} hooks)")
            results[label] = generated / seconds
        if len(samples) > 1 and args.temperature == 0:  # the greedy ids, against the first's
            first, *others = samples.values()
            for attention, other in zip(list(samples)[1:], others):
                same = sum(np.array_equal(a.generated_ids, b.generated_ids)
                           for a, b in zip(first, other))
                # In bfloat16 a random-init model's logits are near-ties over the whole
                # vocabulary: one rounding flips an argmax and the rest of the text with
                # it, so the length of the common start says more than whole-text equality.
                agree = [int(np.argmin(np.append(a.generated_ids == b.generated_ids, False)))
                          for a, b in zip(first, other)]
                print(f"greedy ids of {attention} equal {list(samples)[0]}'s for {same} of "
                      f"{len(first)} prompts; the same first tokens: median "
                      f"{int(np.median(agree))} of {args.new_tokens}, first token equal for "
                      f"{sum(c > 0 for c in agree)} of {len(first)}")
        if not args.skip_hf:
            results["HF generate (output_hidden_states)"] = _hf_rate(
                ckpt, args, prompts, generated, next(iter(samples.values())))
    for label, rate in results.items():
        print(f"{label:40s} {rate:10,.1f} generated tokens/s")
    if not args.skip_hf:
        hf_rate = results["HF generate (output_hidden_states)"]
        for label, rate in results.items():
            if label.startswith("actx"):
                print(f"ratio {label} / HF: {rate / hf_rate:.2f}x")


def _hf_rate(ckpt, args, prompts, generated, ours) -> float:
    """HF generate in batches of args.batch left-padded prompts, every layer's hidden
    states returned; checks its greedy text equals actx's (float32)."""
    import numpy as np
    import torch
    import transformers

    device = "cuda" if torch.cuda.is_available() else "cpu"
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        ckpt, dtype=getattr(torch, args.dtype),
        attn_implementation="eager" if args.arch == "gemma2" else "sdpa").to(device).eval()
    batches = []
    for start in range(0, len(prompts), args.batch):
        group = prompts[start:start + args.batch]
        width = max(len(p) for p in group)
        ids = np.zeros((len(group), width), np.int64)
        mask = np.zeros((len(group), width), np.int64)
        for i, p in enumerate(group):
            ids[i, width - len(p):], mask[i, width - len(p):] = p, 1
        batches.append((torch.as_tensor(ids, device=device),
                        torch.as_tensor(mask, device=device)))
    texts = []

    def run():
        texts.clear()
        with torch.no_grad():
            for ids, mask in batches:
                sampling = (dict(do_sample=True, temperature=args.temperature,
                                 top_k=args.top_k or None, top_p=args.top_p)
                            if args.temperature > 0 else dict(do_sample=False))
                out = hf.generate(ids, attention_mask=mask, max_new_tokens=args.new_tokens,
                                  **sampling,
                                  eos_token_id=None, pad_token_id=0,
                                  output_hidden_states=True, return_dict_in_generate=True)
                texts.extend(out.sequences[:, ids.shape[1]:].cpu().numpy())
        if device == "cuda":
            torch.cuda.synchronize()

    rate = generated / common.median_seconds(run, args.iters)
    if args.dtype == "float32" and args.temperature == 0:
        same = sum(np.array_equal(t, s.generated_ids) for t, s in zip(texts, ours))
        print(f"HF's greedy text equals actx's for {same} of {len(ours)} prompts (left "
              f"padding moves HF's numbers by float rounding)")
    return rate


if __name__ == "__main__":
    main()
