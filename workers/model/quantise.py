"""Float8 quantisation of a step's outputs on the accelerator, before the copy to the host.

The rule is schemas.quantised's (one float32 scale per token: absmax over the hidden axis
/ the type's largest finite value; absmax 0 gives scale 1), applied inside the jitted step
so the device-to-host copy moves one byte a value. A quantised hook's output becomes its
float8 values and `<hook>.scale` [batch, seq, 1] float32.
"""

from __future__ import annotations

import jax.numpy as jnp

from actx.schemas import quantised
from actx.workers.model import capture


def compute_dtype(capture_dtype: str):
    """The dtype the forward hands its hooks over in: float32 for a float8 capture (its
    scales and rounding are computed from it), else the capture dtype itself."""
    return jnp.float32 if quantised.is_quantised(capture_dtype) else jnp.dtype(capture_dtype)


def quantise_hook(x_btd, capture_dtype: str):
    """(float8 values [b, t, d], float32 scales [b, t, 1]) of one hook's output."""
    fmt = quantised.format_of(capture_dtype)
    x = x_btd.astype(jnp.float32)
    absmax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    # Times the reciprocal, as XLA compiles a division by a constant: the same scale on
    # every backend and in numpy (schemas.quantised.quantise).
    scale = jnp.where(absmax > 0, absmax * jnp.float32(1 / fmt.max_finite), 1.0
                      ).astype(jnp.float32)
    # The division can round a token's largest value just past the top of the range;
    # clipping keeps it finite (e4m3fn has no infinity: past 448 is NaN).
    scaled = jnp.clip(x / scale, -fmt.max_finite, fmt.max_finite)
    return scaled.astype(jnp.dtype(fmt.stored)), scale


def quantise_outputs(outs: dict, capture_dtype: str) -> dict:
    """A step's {hook: array} with every float hook quantised (values, and its scales under
    `quantised.scale_array(hook)`); unchanged when the capture is not float8. Integer
    hooks (a mixture of experts' expert ids) stay as they are."""
    if not quantised.is_quantised(capture_dtype):
        return outs
    result = {}
    for name, x in outs.items():
        if jnp.issubdtype(x.dtype, jnp.integer):
            result[name] = x
            continue
        result[name], result[quantised.scale_array(name)] = quantise_hook(x, capture_dtype)
    return result


def output_names(hook_names, capture_dtype: str) -> list[str]:
    """The names a step returns for `hook_names`, sorted: a float8 capture adds each float
    hook's scale array."""
    names = list(hook_names)
    if quantised.is_quantised(capture_dtype):
        names += [quantised.scale_array(h) for h in hook_names
                  if capture.point_dtype(h.rsplit(".", 1)[-1], "float32") == "float32"]
    return sorted(names)
