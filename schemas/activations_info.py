"""`activations/actx.json`: what a run's activations are, written once (create-only) by the
first worker before any activation data, and checked by every later attempt.

Workers write it; status, verify, submit's summary and the reader read it through
`read_info`, so its fields have one definition.
"""

from __future__ import annotations

import dataclasses

from actx.schemas import advice
from actx.schemas import config as config_lib
from actx.schemas import layout
from actx.schemas import object_store
from actx.schemas import quantised

# The hook points of a mixture of experts' router, as stored (the `experts` hook stores
# two arrays, expert_ids and expert_weights; workers.model.families.base says what each is).
ROUTER_POINTS = ("router_logits", "expert_ids", "expert_weights")


@dataclasses.dataclass(frozen=True)
class Numerics:
    """What, besides the run spec, decides the bytes a step produces.

    platform / device_kind: the accelerator (e.g. "gpu", "NVIDIA H100 80GB HBM3").
    jax: the jax version.
    rows_per_device: batch rows each data-parallel device computes per step.
    model_parallel: size of the `model` mesh axis.
    attention: the attention implementation the step runs ("xla", "pallas_gpu",
      "pallas_tpu", "cudnn"; workers.attention.dispatch); None in records written before this
      field existed.
    """

    platform: str
    device_kind: str
    jax: str
    rows_per_device: int
    model_parallel: int
    attention: str | None = None

    def same_bytes_as(self, other: "Numerics | None") -> bool:
        """Whether a step under `other` rewrites the bytes a step under these wrote. A
        record without the attention field (older runs) says nothing about it."""
        if other is None:
            return False
        if self.attention is None or other.attention is None:
            return (dataclasses.replace(self, attention=None)
                    == dataclasses.replace(other, attention=None))
        return self == other


@dataclasses.dataclass(frozen=True)
class ActivationsInfo:
    """fingerprint: the run spec's fingerprint the activations belong to.
    dtype: the capture dtype of every hook array, except those in `hook_dtypes`; a float8
      dtype ("float8_e4m3") stores each such hook as float8 values and a float32
      `<hook>.scale` array beside them (schemas.quantised; since 0.4.0).
    hooks: hook name -> the last axis of its array (the hidden size; a mixture of
      experts' router_logits: the experts; expert_ids / expert_weights: the experts per
      token).
    model_digest: digest of the checkpoint the first attempt loaded (None in old runs).
    numerics: the first attempt's numerics (None in old runs).
    hook_dtypes: hook name -> its stored dtype where it is not `dtype` (expert_ids:
      "int32"); None where every hook is `dtype` (every run before mixtures of experts).
    architecture: the model's HF architecture (`architectures[0]`), which decides the
      TransformerLens names the reader accepts for its hooks (schemas.hook_aliases);
      None in runs written before it was recorded, and for Flax models.
    transformer_lens_differs: why TransformerLens's model of this checkpoint computes
      otherwise than HF's where only some checkpoints of its architecture do
      (schemas.hook_aliases.model_difference: a Phi-3 with partial rotary or rope_scaling),
      so the reader refuses TransformerLens names past the embedding; None elsewhere and in
      runs written before it was recorded.
    quantisation_version: in a float8 run, the version of its scales' format
      (schemas.quantised.FORMAT_VERSION; 1: one float32 scale per token and hook, absmax
      over the hidden axis / the type's largest finite value); None in every other run.
    """

    fingerprint: str
    dtype: str
    hooks: dict[str, int]
    model_digest: str | None = None
    numerics: Numerics | None = None
    hook_dtypes: dict[str, str] | None = None
    architecture: str | None = None
    quantisation_version: int | None = None
    transformer_lens_differs: str | None = None

    def identity(self) -> tuple:
        """What every attempt must share exactly (numerics may differ when allowed). The
        checkpoint digest is checked on its own: a record without one (written before it
        was recorded, or rebuilt: deploy.info_rebuild) does not know it."""
        return (self.fingerprint, self.dtype, self.hooks, self.hook_dtypes or {})

    def dtype_of(self, hook: str) -> str:
        """The stored data type of `hook`'s array (zarr's name: float8_e4m3fn for a
        float8_e4m3 capture)."""
        return quantised.stored_dtype((self.hook_dtypes or {}).get(hook, self.dtype))

    def arrays(self) -> dict[str, tuple[int, str]]:
        """Every stored activation array: name -> (last axis, stored data type); the
        hooks, and a float8 hook's scales (`<hook>.scale`, schemas.quantised)."""
        return quantised.stored_arrays(self.hooks, {h: self.dtype_of(h) for h in self.hooks})

    def is_quantised(self, hook: str) -> bool:
        """Whether `hook` is stored as float8 values with per-token scales."""
        return quantised.is_quantised(self.dtype_of(hook))

    def bytes_per_row(self, seq_len: int) -> int:
        """Stored activation bytes per token row, all arrays together (scales included)."""
        return seq_len * sum(layout.ITEMSIZE.get(dtype, 2) * width
                             for width, dtype in self.arrays().values())


class DamagedInfoError(config_lib.ConfigError):
    """The record is not JSON, or not a record (a field missing or of another type): what
    every command that needs it says, with the command that rebuilds it (`actx verify
    --repair`: deploy.info_rebuild) from what the run keeps besides. `what`: the damage
    alone (the key and how it is damaged), for a message of the caller's own."""

    def __init__(self, message: str, what: str):
        super().__init__(message)
        self.what = what


def read_info(store) -> ActivationsInfo | None:
    """The run's record, None before any worker wrote it. A damaged record raises
    DamagedInfoError; one with a field this actx does not know, or scales of a format it
    does not know (a newer actx's), ConfigError naming the key and field."""
    key = store.location.join(layout.extraction_key(getattr(store, "name", ""),
                                                    layout.ACTIVATIONS_INFO_KEY))
    try:
        data = store.read_json(layout.ACTIVATIONS_INFO_KEY)
    except object_store.DamagedObjectError as e:  # not JSON
        raise _damaged(store, f"{key}: not valid JSON ({e.__cause__ or e})") from e
    if data is None:
        return None
    if not isinstance(data, dict):
        raise _damaged(store, f"{key}: a JSON {type(data).__name__}, not a record")
    known = {f.name for f in dataclasses.fields(ActivationsInfo)}
    try:
        info = config_lib.from_dict(ActivationsInfo, data, f"{key}: ")
    except config_lib.ConfigError as e:
        if set(data) - known:  # a field a newer actx writes: said as it is
            raise
        raise _damaged(store, str(e)) from e
    version = info.quantisation_version
    if version is not None and version > quantised.FORMAT_VERSION:
        raise config_lib.ConfigError(
            f"{key}: quantisation_version "
            f"{version}: this actx reads float8 scales up to version "
            f"{quantised.FORMAT_VERSION}; install a newer actx (pip install -U actx-lm)")
    return info


def _damaged(store, what: str) -> DamagedInfoError:
    return DamagedInfoError(
        f"{what}: the run's record of what its activations are is damaged; "
        f"`{advice.repair(store.location)}` rebuilds it from run.json, the commit markers "
        f"and the arrays' metadata (partitions whose data does not check out become "
        f"pending again)", what)


def _record(info: ActivationsInfo) -> dict:
    """The record's JSON: `hook_dtypes` only where a hook has a dtype of its own, and
    `architecture` only where known, so such a run writes the record of earlier
    versions, byte for byte."""
    data = config_lib.to_dict(info)
    for optional in ("hook_dtypes", "architecture", "quantisation_version",
                     "transformer_lens_differs"):
        if not data.get(optional):
            data.pop(optional, None)
    return data


def create_info(store, info: ActivationsInfo) -> bool:
    """Writes the record unless one exists; True when this call wrote it. The record
    standing either way, the temporary files a process killed while creating it left
    beside it go (on local disk: a worker admitted by every process, as a Beam SDK
    worker is, may be killed in that moment), as a marker's do (schemas.commit)."""
    created = store.create_json(layout.ACTIVATIONS_INFO_KEY, _record(info))
    store.clear_temporaries(layout.ACTIVATIONS_INFO_KEY)
    return created


def replace_info(store, info: ActivationsInfo) -> None:
    """Overwrites the record: only while no partition is committed (workers/loop/admission)."""
    store.write_json(layout.ACTIVATIONS_INFO_KEY, _record(info))
