"""Compiles the attention kernels for one slot of the benchmark's shapes and prints the
whole error where one fails (`attention.implementation_for` logs only its first line
before falling back), then which implementation each dtype gets here.

  python bench/kernel_probe.py                 # Qwen2.5-0.5B heads, 1024-token rows
  python bench/kernel_probe.py --seq 128 --head-dim 32 --blocks 2   # small
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from actx.workers.attention import (dispatch as attention, ranged_flash_gpu, ranged_flash_tpu)  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--heads", type=int, default=14)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--blocks", type=int, default=8)
    a = p.parse_args()
    backend = jax.default_backend()
    print(f"jax {jax.__version__}, {backend}: {jax.devices()[0].device_kind}")
    kernels = {"gpu": ("pallas_gpu", ranged_flash_gpu),
               "tpu": ("pallas_tpu", ranged_flash_tpu)}
    if backend in kernels:
        name, module = kernels[backend]
        t, n, k, h = a.seq, a.heads, a.kv_heads, a.head_dim
        for dtype in (jnp.bfloat16, jnp.float16):
            q = jax.ShapeDtypeStruct((1, t, n, h), dtype)
            kv = jax.ShapeDtypeStruct((1, t, k, h), dtype)
            cache = jax.ShapeDtypeStruct((1, a.blocks * t, k, h), dtype)
            r = jax.ShapeDtypeStruct((1, t), jnp.int32)
            ptr = jax.ShapeDtypeStruct((), jnp.int32)
            fn = functools.partial(module.ranged_attention, scale=h ** -0.5, block_len=t)
            for label, args in (("rows alone", (q, kv, kv, r, r)),
                                ("with cache", (q, kv, kv, r, r, cache, cache, ptr))):
                t0 = time.perf_counter()
                try:
                    jax.jit(fn).lower(*args).compile()
                    print(f"{name} {jnp.dtype(dtype).name} {label}: compiles "
                          f"({time.perf_counter() - t0:.1f} s)")
                except Exception:  # noqa: BLE001 - the point is to print it whole
                    print(f"{name} {jnp.dtype(dtype).name} {label}: FAILS")
                    traceback.print_exc(file=sys.stdout)
    for dtype in (jnp.bfloat16, jnp.float32):
        print(f"implementation for {jnp.dtype(dtype).name}: "
              f"{attention.implementation_for(dtype, a.seq, a.head_dim)}")


if __name__ == "__main__":
    main()
