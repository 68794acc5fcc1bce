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
- the architecture and where TransformerLens's model of it differs: the checkpoint's
  config.json read as a worker reads it (workers.preflight.recorded_model_facts), where it
  can be read; else unknown, as in runs written before they were recorded.

- the checkpoint digest and the numerics of the first attempt: the earliest-written of
  those markers that records them (markers do since 0.3.0: each records its own attempt's;
  the first attempt's are the record's), or where none does (an earlier actx's), the
  first committed partition's marker after them that does.

Where no marker read records them (markers an earlier worker wrote), they are left unknown
(None, as in runs written before they were recorded), so a later worker is not refused for
them; the rebuild is recorded in the run's changes with what it could not know. The data
itself is judged by verify against the markers, as always.
"""

from __future__ import annotations

from actx.schemas import activations_info as info_lib
from actx.schemas import commit as commit_lib
from actx.schemas import layout
from actx.schemas import quantised

# Markers tried for the arrays' names and types: the first that reads as this run's.
MARKERS_TRIED = 8

# What a rebuilt record may not know (see `unknown`).
MAY_BE_UNKNOWN = ("model_digest", "numerics")


def unknown(info: info_lib.ActivationsInfo) -> list[str]:
    """The fields of a rebuilt record the run did not keep (left None), as the run's change
    record says."""
    return [field for field in MAY_BE_UNKNOWN if getattr(info, field) is None]


def rebuild(store, spec, committed: list[int]) -> tuple[info_lib.ActivationsInfo | None, str]:
    """(the record rebuilt, "") from the run's store (an extraction's view), its spec and
    its committed partitions; (None, why not) where the run does not keep enough."""
    markers = [m for m in commit_lib.readable_markers(store, committed[:MARKERS_TRIED])
               if m.fingerprint == spec.fingerprint]
    if not markers:
        return None, (f"none of the first {min(len(committed), MARKERS_TRIED)} committed "
                      f"partitions' markers can be read as this run's")
    marker = markers[0]
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
    from actx.workers import preflight as workers_preflight  # reads config.json; no jax

    architecture, transformer_lens_differs = workers_preflight.recorded_model_facts(spec)
    # The first attempt's: that of the earliest marker that says (a worker that took the
    # record over before any commit wrote every marker after it). Where those markers are
    # an earlier actx's (a run it began), the first later one that records them.
    def records(m: commit_lib.CommitMarker) -> bool:
        return m.fingerprint == spec.fingerprint and (
            m.model_digest is not None or m.numerics is not None)

    first = min(filter(records, markers), key=lambda m: m.created_at, default=None) or next(
        filter(records, commit_lib.readable_markers(store, committed[MARKERS_TRIED:])), None)
    return info_lib.ActivationsInfo(
        fingerprint=spec.fingerprint, dtype=capture, hooks=hooks, hook_dtypes=hook_dtypes or None,
        model_digest=first and first.model_digest, numerics=first and first.numerics,
        architecture=architecture, transformer_lens_differs=transformer_lens_differs,
        quantisation_version=quantised.FORMAT_VERSION if quantised.is_quantised(capture)
        else None), ""
