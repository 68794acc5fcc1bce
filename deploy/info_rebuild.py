"""A damaged or lost activations/actx.json, rebuilt for `actx verify` (`--repair` writes it).

The record (schemas.activations_info) says what a run's activations are. All of it but two
fields is kept elsewhere in the run, and is taken from there:
- fingerprint and capture dtype: run.json (the extraction's spec);
- the stored arrays and their data types: a commit marker (`dtypes`; its checksums name the
  same arrays, which verify checks for every marker); the hooks are those arrays but a
  float8 hook's scales, and a hook stored in another type than the capture's (a mixture's
  int32 expert ids) is a `hook_dtypes` entry;
- each hook's width: its array's zarr.json (the last axis);
- the float8 scales' format: the one this actx writes (there has been one);
- the architecture: the checkpoint's config.json, where it can be read; a Phi-3's, whose
  TransformerLens model differs for some checkpoints only, is said to differ (the reader
  then refuses TransformerLens names past the embedding rather than guess).

The checkpoint digest and the numerics of the first attempt are not kept anywhere else:
they are left unknown (None, as in runs written before they were recorded), so a later
worker is not refused for them, and the rebuild is recorded in the run's changes with
what it could not know. The data itself is judged by verify against the markers, as
always.
"""

from __future__ import annotations

from actx.schemas import activations_info as info_lib
from actx.schemas import commit as commit_lib
from actx.schemas import hook_aliases
from actx.schemas import layout
from actx.schemas import quantised
from actx.schemas import store as store_lib

# Markers tried for the arrays' names and types: the first that reads as this run's.
MARKERS_TRIED = 8

# What the rebuilt record cannot know, as the run's change record says.
UNKNOWN = ("model_digest", "numerics")


def rebuild(store, spec, committed: list[int]) -> tuple[info_lib.ActivationsInfo | None, str]:
    """(the record rebuilt, "") from the run's store (an extraction's view), its spec and
    its committed partitions; (None, why not) where the run does not keep enough."""
    marker = None
    for pid in committed[:MARKERS_TRIED]:
        try:
            found = commit_lib.read_marker(store, pid)
        except ValueError:  # damaged: verify says so of its partition
            continue
        if found is not None and found.fingerprint == spec.fingerprint:
            marker = found
            break
    if marker is None:
        return None, (f"none of the first {min(len(committed), MARKERS_TRIED)} committed "
                      f"partitions' markers can be read as this run's")
    capture = spec.capture.dtype
    hooks, hook_dtypes = {}, {}
    for name, dtype in sorted(marker.dtypes.items()):
        if quantised.is_scale_array(name):
            continue
        key = f"{layout.activation_array_key(name)}/zarr.json"
        try:
            shape = (store.read_json(key) or {}).get("shape")
        except (ValueError, AttributeError):  # not JSON, or not an object
            shape = None
        if not (isinstance(shape, list) and len(shape) == 3 and isinstance(shape[-1], int)):
            return None, f"array {name}'s {key} is gone or damaged (its width is not known)"
        hooks[name] = shape[-1]
        if dtype != quantised.stored_dtype(capture):
            hook_dtypes[name] = dtype
    architecture = None if spec.model.flax else _architecture(spec.model.path)
    return info_lib.ActivationsInfo(
        fingerprint=spec.fingerprint, dtype=capture, hooks=hooks, hook_dtypes=hook_dtypes or None,
        architecture=architecture,
        transformer_lens_differs=_transformer_lens_differs(architecture),
        quantisation_version=quantised.FORMAT_VERSION if quantised.is_quantised(capture)
        else None), ""


def _architecture(model_path: str) -> str | None:
    """`architectures[0]` of the checkpoint's config.json; None where it cannot be read."""
    try:  # the checkpoint's directory, not the run
        config = store_lib.open_store(model_path).read_json("config.json")
    except Exception:  # noqa: BLE001 - gone, unreachable or damaged: not known
        return None
    names = config.get("architectures") if isinstance(config, dict) else None
    return names[0] if isinstance(names, list) and names and isinstance(names[0], str) else None


def _transformer_lens_differs(architecture: str | None) -> str | None:
    """Only some Phi-3 checkpoints differ from TransformerLens's model (partial rotary,
    rope_scaling: schemas.hook_aliases.model_difference); which one this run's was is not
    rebuilt, so a Phi-3 is taken to differ."""
    if hook_aliases.model_difference(architecture, rope_type="not known") is None:
        return None
    return ("activations/actx.json was rebuilt without the checkpoint's RoPE settings; "
            "TransformerLens's Phi-3 differs from HF's for some checkpoints, so its names are "
            "not taken past the embedding")
