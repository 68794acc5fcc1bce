"""Inputs for the attention over a row and its slots' cached rows (workers.attention.dispatch):
slots holding given depths of one document's earlier rows in the ring-buffer cache, and a
row that continues it. Shared by tests/test_cached_attention.py and
bench/cached_attention.py."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from actx.workers.attention import dispatch as attention, key_ranges


def make_inputs(rng, b, t, n, k, h, blocks, depths, dtype, ptr, window):
    """Slot s holds depths[s] blocks of its document (the newest at ring block ptr - 1)
    and its row continues that document for its first tokens (then another document),
    or starts a new one where it holds nothing. `mask`, `cpos`, `qpos` and `cont` say
    what each query sees as masks (the reference's terms); `lo`/`hi` say the same as key
    intervals over [cache in document order, row] (what the attention takes)."""
    cap = blocks * t
    q = rng.normal(size=(b, t, n, h)).astype(np.float32)
    kr = rng.normal(size=(b, t, k, h)).astype(np.float32)
    vr = rng.normal(size=(b, t, k, h)).astype(np.float32)
    ck = rng.normal(size=(b, cap, k, h)).astype(np.float32)
    cv = rng.normal(size=(b, cap, k, h)).astype(np.float32)
    cpos = np.full((b, cap), -1, np.int32)
    qpos = np.zeros((b, t), np.int32)
    seg = np.ones((b, t), np.int32)
    cont = np.zeros((b, t), bool)
    for s, d in enumerate(depths):
        first = int(rng.integers(t // 4, t + 1))  # tokens of the row's first document
        seg[s, first:] = 2
        for j in range(1, d + 1):
            at = ((ptr - j) % blocks) * t
            cpos[s, at:at + t] = (d - j) * t + np.arange(t)
        qpos[s, :first] = d * t + np.arange(first)
        qpos[s, first:] = np.arange(t - first)
        cont[s, :first] = d > 0
    mask = np.asarray(attention.attention_mask(jnp.asarray(seg), window))
    lo, hi = key_ranges.key_ranges(jnp.asarray(seg), jnp.asarray(cont),
                                   key_ranges.held_keys(jnp.asarray(cpos)), cap)
    cast = (lambda x: jnp.asarray(x, dtype))
    return dict(q=cast(q), kr=cast(kr), vr=cast(vr), mask=jnp.asarray(mask), ck=cast(ck),
                cv=cast(cv), cpos=jnp.asarray(cpos), qpos=jnp.asarray(qpos),
                cont=jnp.asarray(cont), lo=key_ranges.windowed(lo, hi, window), hi=hi)
