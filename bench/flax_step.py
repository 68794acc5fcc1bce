"""A user's Flax NNX model: actx's capture step vs the model's own jitted forward.

On one random-init decoder from tests/flax_models.py (segment ids and positions), times
(1) the model's own jitted call (`nnx.jit`, logits: what its author would run),
(2) the model's own jitted call under `nnx.capture`, returning its sown intermediates
    (every block's output and MLP output, every attention input) with the logits,
(3) actx's step (`workers.flax.step`) capturing `lm_head:output`: the same work as (1),
    so its ratio is the cost of capturing,
(4) actx's step capturing the hooks of (2) (XLA drops the LM head nothing needs),
(5) actx's step capturing `blocks.0:output` only (and the blocks after it),
on the same inputs; prints tokens/s (median over iterations) and ratios against (1).

  python bench/flax_step.py              # modest CPU default, ~1 minute
"""

from __future__ import annotations

import argparse
import os
import sys

# Run as a script from anywhere: the repo root holds `tests.flax_models`.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--mlp", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--iters", type=int, default=7)
    args = p.parse_args()

    import jax
    import numpy as np
    from flax import nnx

    from tests import flax_models
    from actx.workers.flax import step as flax_step

    model = flax_models.make_masked_decoder(d=args.hidden, heads=args.heads, mlp=args.mlp,
                                            layers=args.layers, vocab=args.vocab)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, args.vocab, (args.batch, args.seq)).astype(np.int32)
    pos = np.broadcast_to(np.arange(args.seq, dtype=np.int32), ids.shape).copy()
    seg = np.ones_like(ids)
    hooks = "blocks.*:output,blocks.*.mlp:output,blocks.*.attn:input"

    own = nnx.jit(lambda m, i, p, s: nnx.capture(m, nnx.Intermediate)(
        i, positions=p, segment_ids=s)[0])
    own_sown = nnx.jit(lambda m, i, p, s: nnx.capture(m, nnx.Intermediate)(
        i, positions=p, segment_ids=s))
    logits = flax_step.make_flax_extract_fn(model, "lm_head:output")
    all_hooks = flax_step.make_flax_extract_fn(model, hooks)
    first = flax_step.make_flax_extract_fn(model, "blocks.0:output")
    ways = {
        "own jitted forward (logits)": lambda: own(model, ids, pos, seg),
        "own forward + nnx.capture of the sown hooks": lambda: own_sown(model, ids, pos, seg),
        "actx step, lm_head:output (same work as 1)": lambda: logits(ids, pos, seg),
        f"actx step, {len(all_hooks.hook_names)} hooks": lambda: all_hooks(ids, pos, seg),
        "actx step, blocks.0:output only": lambda: first(ids, pos, seg),
    }
    tokens = args.batch * args.seq
    print(f"# {jax.devices()[0].device_kind}, d={args.hidden} layers={args.layers} "
          f"vocab={args.vocab}, batch {args.batch} x seq {args.seq}, float32")
    base = None
    for name, run in ways.items():
        seconds = common.median_seconds(lambda: jax.block_until_ready(run()), args.iters)
        base = base or seconds
        print(f"{name:48s} {tokens / seconds:12,.0f} tokens/s   x{base / seconds:5.2f}")


if __name__ == "__main__":
    main()
