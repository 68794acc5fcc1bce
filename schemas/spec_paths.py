"""A config file's relative paths made absolute against the file's folder, so that a
config means the same from any working directory and run.json records where the data was.

Apart from `schemas.runspec` because it works on the spec as read from a file (a dict),
before any RunSpec exists: what `actx submit` and `actx prepare` do to a config first.
"""

from __future__ import annotations


def absolute_paths(spec_data: dict, base_dir: str) -> dict:
    """`spec_data` (a RunSpec as a dict, as read from a config file) with its relative local
    paths (sources' paths, model.path, tokenizer.path) made absolute against `base_dir`, so
    a config means the same from any working directory and run.json records where the data
    was. URIs (gs://, memory://) and empty paths stay as they are."""
    import copy
    import os

    def absolute(path):
        if not isinstance(path, str) or not path or "://" in path or os.path.isabs(path):
            return path
        return os.path.normpath(os.path.join(base_dir, path))

    out = copy.deepcopy(spec_data)
    for source in out.get("sources") or ():
        if isinstance(source, dict) and isinstance(source.get("paths"), list):
            source["paths"] = [absolute(p) for p in source["paths"]]
    for part in ("model", "tokenizer"):
        if isinstance(out.get(part), dict) and "path" in out[part]:
            out[part]["path"] = absolute(out[part]["path"])
    return out
