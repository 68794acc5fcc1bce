"""One layer's attention over a row and its slots' cached earlier rows, each way actx has.

  xla, slot by slot     XLA block visits bounded by the key intervals, one slot at a time
                        (the CPU default)
  xla, all slots        the same visits, all slots at once
  pallas gpu            the Pallas (Triton) flash kernel over per-query key intervals (the
                        default for half precision on GPU); on a GPU only
  pallas tpu            the Pallas (Mosaic) flash kernel, the ring walked by index maps (the
                        TPU default); on a TPU only
  fused (cudnn)         one cuDNN attention over [cache keys, row keys] with the dense mask
                        (the GPU's way before the kernels, now its fallback); GPU only
  rows alone            `attention` over the row only with the backend's choice (what
                        independent rows cost)

Prints which implementation this backend chooses (`attention.implementation_for`), then,
for slots that hold none, half or all of the cache's blocks, ms per call (median), the
error against a float32 dense reference (max abs, relative L2, over every query), and
whether slot 0's output is bit for bit the same when the other slots hold other keys and
depths (what reruns on other hosts rely on). `--interpret` adds the Pallas kernels off
their device (Pallas interpret mode: a correctness check, not a timing).

  python bench/cached_attention.py                      # Qwen2.5-0.5B heads, for a GPU
  python bench/cached_attention.py --batch 2 --seq 256 --blocks 2   # small, CPU
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench import common  # noqa: E402
from tests.cache_inputs import make_inputs  # noqa: E402
from actx.workers.attention import dispatch as attn  # noqa: E402


def reference(x, window):
    """Dense float32: softmax over [cache, row] keys with the combined mask, slot by slot."""
    f = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    seen = attn.cached_keys_seen(x["cpos"], x["qpos"], x["cont"], window)
    mask = jnp.concatenate([seen, x["mask"]], axis=-1)
    n, k = x["q"].shape[2], x["kr"].shape[2]

    @jax.jit
    def one(q, keys, values, m):  # [t, n, h], [s, k, h], [s, k, h], [t, s]
        keys, values = jnp.repeat(keys, n // k, axis=1), jnp.repeat(values, n // k, axis=1)
        logits = jnp.einsum("tnh,snh->nts", q, keys,
                            precision=jax.lax.Precision.HIGHEST) * q.shape[-1] ** -0.5
        p = jax.nn.softmax(jnp.where(m[None], logits, -jnp.inf), axis=-1)
        return jnp.einsum("nts,snh->tnh", p, values, precision=jax.lax.Precision.HIGHEST)

    keys = jnp.concatenate([f(x["ck"]), f(x["kr"])], axis=1)
    values = jnp.concatenate([f(x["cv"]), f(x["vr"])], axis=1)
    return np.stack([np.asarray(one(f(x["q"][s]), keys[s], values[s], mask[s]))
                     for s in range(x["q"].shape[0])])


def ways(b, backend, interpret):
    def cached(impl, **kw):
        return lambda x, ptr: attn.cached_attention(
            x["q"], x["kr"], x["vr"], x["lo"], x["hi"], x["ck"], x["cv"], ptr,
            implementation=impl, **kw)

    out = {"xla, slot by slot": cached("xla", slots_per_visit=1),
           "xla, all slots": cached("xla", slots_per_visit=b)}
    if backend == "gpu" or interpret:
        out["pallas gpu"] = cached("pallas_gpu")
    if backend == "tpu" or interpret:
        out["pallas tpu"] = cached("pallas_tpu")
    if backend == "gpu":
        out["fused (cudnn)"] = cached("cudnn")
    out["rows alone"] = lambda x, ptr: attn.attention(
        x["q"], x["kr"], x["vr"], x["lo"] - x["ck"].shape[1], x["hi"] - x["ck"].shape[1])
    return out


def timed(fn, args, iters):
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


# (block_q, block_k, num_warps, num_stages) tried by --sweep-tiles. On the H100 8 warps
# were slower in every case at head_dim 64 (bench/RESULTS.md), so one such choice only.
SWEEP = [(bq, bk, 4, st) for bq in (64, 128) for bk in (64, 128) for st in (2, 3)] + [
    (128, 64, 8, 3)]


def sweep_tiles(a, dtype) -> None:
    """ms per call of the GPU kernel for each tile choice, with none, half and all of the
    cache held and for rows alone; prints `best: BQ,BK,WARPS,STAGES`, the choice with the
    least time summed over the four."""
    from actx.workers.attention import ranged_flash_gpu as kernel

    rng = np.random.default_rng(0)
    shape = (a.batch, a.seq, a.heads, a.kv_heads, a.head_dim, a.blocks)
    ptr = jnp.int32(3 % a.blocks)
    inputs = {held: make_inputs(rng, *shape, [depth] * a.batch, dtype, int(ptr), a.window)
              for held, depth in (("none", 0), ("half", max(1, a.blocks // 2)),
                                  ("all", a.blocks))}
    print(f"{'tiles (bq,bk,warps,stages)':28s}" + "".join(
        f"{name:>10s}" for name in [*inputs, "alone", "sum"]))
    best = None
    for tiles in SWEEP:
        common.set_flash_tiles(tiles)
        cached = jax.jit(lambda x, ptr: kernel.ranged_attention(
            x["q"], x["kr"], x["vr"], x["lo"], x["hi"], x["ck"], x["cv"], ptr,
            scale=a.head_dim ** -0.5, block_len=a.seq))
        alone = jax.jit(lambda x: kernel.ranged_attention(
            x["q"], x["kr"], x["vr"], x["lo"] - x["ck"].shape[1], x["hi"] - x["ck"].shape[1],
            scale=a.head_dim ** -0.5))
        try:
            ms = [timed(cached, (x, ptr), a.iters) for x in inputs.values()]
            ms.append(timed(alone, (inputs["none"],), a.iters))
        except Exception as err:  # noqa: BLE001 - a choice that cannot compile is skipped
            print(f"{str(tiles):28s} fails: {type(err).__name__}: "
                  f"{str(err).splitlines()[0][:100] if str(err) else ''}")
            continue
        total = sum(ms)
        print(f"{str(tiles):28s}" + "".join(f"{m:10.3f}" for m in ms) + f"{total:10.3f}")
        if best is None or total < best[0]:
            best = (total, tiles)
    if best:
        print("best: " + ",".join(str(x) for x in best[1]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--heads", type=int, default=14)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--blocks", type=int, default=8, help="cache blocks (max_context / seq)")
    p.add_argument("--window", type=int, default=attn.NO_WINDOW)
    p.add_argument("--dtype", default=None, help="default: bfloat16 on GPU, else float32")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--interpret", action="store_true",
                   help="also the Pallas kernels of other devices, in interpret mode")
    p.add_argument("--sweep-tiles", action="store_true",
                   help="time the GPU kernel over tile choices instead (prints the best)")
    common.add_flash_tiles_arg(p)
    a = p.parse_args()
    common.apply_flash_tiles(a.flash_tiles)
    backend = jax.default_backend()
    dtype = jnp.dtype(a.dtype or ("bfloat16" if backend == "gpu" else "float32"))
    if a.sweep_tiles:
        return sweep_tiles(a, dtype)
    chosen = attn.implementation_for(dtype, a.seq, a.head_dim)
    print(f"device {jax.devices()[0].device_kind} ({backend}); batch {a.batch} x seq "
          f"{a.seq}, heads {a.heads}/{a.kv_heads} of {a.head_dim}, cache {a.blocks} blocks "
          f"({a.blocks * a.seq} keys), {dtype.name}, window {a.window}")
    print(f"implementation chosen here: {chosen} (preferred: "
          f"{attn.default_implementation(dtype)})")
    rng = np.random.default_rng(0)
    ptr = jnp.int32(3 % a.blocks)
    half = max(1, a.blocks // 2)
    scenarios = {"none held": [0] * a.batch,
                 f"{half} of {a.blocks} blocks": [half] * a.batch,
                 f"all {a.blocks} blocks": [a.blocks] * a.batch,
                 "mixed 0..all": [int(d) for d in rng.integers(0, a.blocks + 1, a.batch)]}
    fns = {name: jax.jit(f) for name, f in ways(a.batch, backend, a.interpret).items()}
    shape = (a.batch, a.seq, a.heads, a.kv_heads, a.head_dim, a.blocks)
    print(f"{'held':>16s}  {'way':18s} {'ms':>8s} {'max abs err':>12s} {'rel L2':>9s} "
          f"{'slot 0 same':>11s}")
    for label, depths in scenarios.items():
        x = make_inputs(rng, *shape, depths, dtype, int(ptr), a.window)
        # The same slot 0, other slots holding other keys and depths.
        other = make_inputs(np.random.default_rng(1), *shape,
                            [depths[0]] + [int(d) for d in
                                           rng.integers(0, a.blocks + 1, a.batch - 1)],
                            dtype, int(ptr), a.window)
        other = {name: v.at[0].set(x[name][0]) for name, v in other.items()}
        ref = reference(x, a.window)
        for name, fn in fns.items():
            ms = timed(fn, (x, ptr), a.iters)
            got = np.asarray(fn(x, ptr))
            if name == "rows alone":  # not the same computation: time only
                print(f"{label:>16s}  {name:18s} {ms:8.2f}")
                continue
            out = got.astype(np.float32)
            err = np.abs(out - ref)
            rel = np.linalg.norm(out - ref) / np.linalg.norm(ref)
            same = np.array_equal(np.asarray(fn(other, ptr)[0]), got[0])
            print(f"{label:>16s}  {name:18s} {ms:8.2f} {err.max():12.2e} {rel:9.2e} "
                  f"{str(same):>11s}")


if __name__ == "__main__":
    main()
