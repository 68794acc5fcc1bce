"""What a batch is handed over as: numpy, JAX arrays on a sharding, or torch tensors, and
the optional per-hook normalisation with the run's stored statistics.

jax and torch are imported only when asked for, so numpy readers never load them.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any, Literal

import numpy as np

from actx.reader import stored_stats
from actx.schemas import quantised

Framework = Literal["numpy", "jax", "torch"]
FRAMEWORKS = ("numpy", "jax", "torch")
NORMALIZE_MODES = ("standardize", "sqrt_d_mean_norm")
# Earlier names still accepted: "unit_mean_norm" never gave a mean norm of 1 but of
# sqrt(hidden), which is what its new name says.
NORMALIZE_ALIASES = {"unit_mean_norm": "sqrt_d_mean_norm"}


def check_framework(framework: str) -> str:
    if framework not in FRAMEWORKS:
        raise ValueError(f"framework must be 'numpy', 'jax' or 'torch', got {framework!r}")
    return framework


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of a dtype name, bfloat16 (ml_dtypes) included."""
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def dequantised(acts: dict, dtype: str | None) -> dict:
    """A batch's arrays with each float8 hook's values times its scales (read beside them
    under `<hook>.scale`, schemas.quantised), in `dtype` (None: float32); the scales
    themselves dropped. Unchanged where no hook is float8."""
    scales = [name for name in acts if quantised.is_scale_array(name)]
    if not scales:
        return acts
    out = {name: a for name, a in acts.items() if name not in scales}
    for name in scales:
        hook = name[:-len(quantised.SCALE_SUFFIX)]
        out[hook] = _dequantise_rows(out[hook], acts[name], dtype or "float32")
    return out


# Rows per piece when a batch is dequantised on several threads (numpy's take and multiply
# let go of the GIL), and the threads: what one thread did was the stream's bottleneck.
_ROWS_PER_PIECE = 512
_POOL: list = []


def _dequantise_rows(values: np.ndarray, scale: np.ndarray, dtype: str) -> np.ndarray:
    pieces = min(os.cpu_count() or 1, len(values) // _ROWS_PER_PIECE)
    if pieces <= 1:
        return quantised.dequantise(values, scale, dtype)
    if not _POOL:
        import concurrent.futures

        _POOL.append(concurrent.futures.ThreadPoolExecutor(
            os.cpu_count() or 1, thread_name_prefix="actx-reader-dequantise"))
    out = np.empty(values.shape, numpy_dtype(dtype))
    bounds = np.linspace(0, len(values), pieces + 1).astype(int)
    list(_POOL[0].map(lambda lo, hi: quantised.dequantise(values[lo:hi], scale[lo:hi], dtype,
                                                          out=out[lo:hi]),
                      bounds[:-1], bounds[1:]))
    return out


def convert(array: np.ndarray, framework: str, dtype: str | None,
            sharding: Any = None) -> Any:
    """numpy -> the requested framework.

    sharding (jax only): a `jax.sharding.Sharding` for the global batch; each process
    passes its own rows (`jax.make_array_from_process_local_data`), so with P processes the
    global array has P x the local rows, laid out on the devices the sharding names.
    """
    if dtype is not None and array.dtype != numpy_dtype(dtype):
        array = array.astype(numpy_dtype(dtype))
    if framework == "numpy":
        return array
    if framework == "jax":
        import jax

        if sharding is not None:
            return jax.make_array_from_process_local_data(sharding, array)
        return jax.numpy.asarray(array)
    if framework == "torch":
        try:
            import torch
        except ImportError as e:
            raise ImportError("framework='torch' needs torch installed") from e
        if array.dtype.name == "bfloat16":  # torch cannot take ml_dtypes arrays directly
            return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(np.ascontiguousarray(array))
    raise ValueError(f"framework must be 'numpy', 'jax' or 'torch', got {framework!r}")


@dataclasses.dataclass(frozen=True)
class Normalizer:
    """x -> (x - shift) * scale per hidden dimension, in float32.

    "standardize": zero mean and unit variance per dimension.
    "sqrt_d_mean_norm": x times one scalar per hook, sqrt(hidden) / (the run's mean L2 norm
      of the hook), so that the mean L2 norm becomes sqrt(hidden), not 1: the usual SAE
      input scaling (SAELens's normalize_activations="expected_average_only_in"); no
      shift. "unit_mean_norm" is its earlier name, still accepted.
    """

    shift_d: np.ndarray | None  # float32 [hidden]
    scale_d: np.ndarray  # float32 [hidden] or scalar

    @classmethod
    def from_stats(cls, stats, mode: str) -> "Normalizer":
        if mode == "standardize":
            std = np.sqrt(stats.var)
            # A constant dimension keeps its (shifted) value instead of dividing by zero.
            scale = np.where(std > 0, 1.0 / np.where(std > 0, std, 1.0), 1.0)
            return cls(stats.mean.astype(np.float32), scale.astype(np.float32))
        mode = NORMALIZE_ALIASES.get(mode, mode)
        if mode == "sqrt_d_mean_norm":
            hidden = len(stats.mean)
            return cls(None, np.float32(np.sqrt(hidden) / stats.mean_norm))
        raise ValueError(f"normalize must be one of {', '.join(NORMALIZE_MODES)} or None, "
                         f"got {mode!r}")

    def __call__(self, x_nd: np.ndarray) -> np.ndarray:
        out = x_nd.astype(np.float32)
        if self.shift_d is not None:
            out -= self.shift_d
        out *= self.scale_d
        return out


def normalizers(run, hooks: tuple[str, ...], mode: str | None,
                served: frozenset[str] = frozenset()) -> dict[str, Normalizer]:
    """One Normalizer per hook from the run's stored statistics ({} when mode is None).

    The statistics are those `run.compute_stats` stored (reader.stats); a hook without
    them raises a ReaderError that says how to compute them. `served`: what the reader
    leaves out (stored_stats.left_out); statistics that count other tokens (a stream
    without BOS normalised by statistics of every token, whose first tokens' norms are
    often orders of magnitude above the rest) scale by the wrong amount: a warning says
    so, with the call that computes them over the tokens it serves.
    """
    if mode is None:
        return {}
    mode = NORMALIZE_ALIASES.get(mode, mode)
    if mode not in NORMALIZE_MODES:
        raise ValueError(f"normalize must be one of {', '.join(NORMALIZE_MODES)} or None, "
                         f"got {mode!r}")
    stats = {h: stored_stats.load_stats(run, h, served, wanted=hooks) for h in hooks}
    differ = [h for h, s in stats.items() if s.left_out() != served]
    if differ:
        warnings.warn(_other_tokens(differ, stats[differ[0]].left_out(), served, mode),
                      StatisticsOfOtherTokens, stacklevel=4)
    return {h: Normalizer.from_stats(s, mode) for h, s in stats.items()}


class StatisticsOfOtherTokens(UserWarning):
    """normalize= scales by statistics of other tokens than the reader serves."""


def _other_tokens(hooks: list[str], counted: frozenset[str], served: frozenset[str],
                  mode: str) -> str:
    def named(names) -> str:
        return ", ".join(sorted(names)) or "none but padding"

    call = stored_stats.compute_call(hooks, served)
    return (f"normalize={mode!r}: the statistics of {', '.join(map(repr, hooks))} leave out "
            f"{named(counted)}, this reader leaves out {named(served)}: its values are "
            f"scaled by statistics of other tokens. run.compute_stats({call}) computes them "
            f"over the tokens it serves")


def hand_over(batch, normalizers: dict, framework: str, dtype: str | None, sharding=None):
    """A stream's batch as the user asked for it: each hook normalised (where
    `normalizers` has it) and converted (`convert`); the batch itself, its acts replaced.
    A float8 hook's values, read with their scales, are dequantised first (`dequantised`);
    handed over as JAX arrays without normalisation, on the device, after the copy of one
    byte a value (`_dequantised_on_device`)."""
    if framework == "jax" and not normalizers and any(
            quantised.is_scale_array(name) for name in batch.acts):
        batch.acts = _dequantised_on_device(batch.acts, dtype, sharding)
        return batch
    acts = dequantised(batch.acts, dtype)
    if normalizers:
        acts = {h: normalizers[h](a) for h, a in acts.items()}
    batch.acts = {h: convert(a, framework, dtype, sharding) for h, a in acts.items()}
    return batch


_ON_DEVICE: dict = {}


def _dequantised_on_device(acts: dict, dtype: str | None, sharding) -> dict:
    """JAX arrays of a batch whose float8 hooks go to the device as they are stored (one
    byte a value, and their scales) and are multiplied there, in `dtype` (float32 when
    None): the host copies half the bytes of bfloat16 and converts nothing."""
    import jax
    import jax.numpy as jnp

    wanted = dtype or "float32"
    if wanted not in _ON_DEVICE:
        _ON_DEVICE[wanted] = jax.jit(lambda v, s: (v.astype(jnp.float32) * s).astype(wanted))
    out = {}
    for name, array in acts.items():
        if quantised.is_scale_array(name):
            continue
        scale_name = quantised.scale_array(name)
        if scale_name not in acts:
            out[name] = convert(array, "jax", dtype, sharding)
            continue
        values = convert(array, "jax", None, sharding)
        scales = convert(acts[scale_name], "jax", None, sharding)
        out[name] = _ON_DEVICE[wanted](values, scales)
    return out
