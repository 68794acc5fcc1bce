"""What a prepare read: each input file's path and size, recorded in prepare/inputs.json.

`actx submit` skips the prepare of a run already prepared for its spec: the spec names
paths, not their contents, so a user who changed the inputs under the same config (a new
file in the folder, a file rewritten) would be told "skipping" and get the old tokens
without a word. `changes` compares the record with the inputs now (one listing, as the
pre-flight's) and says what differs; a run prepared before the record existed has none,
and nothing is said. Sizes, not contents: reading terabytes to skip a prepare would cost
more than the prepare; a rewrite of the same size goes unseen, and the docs say so.
No Beam here.
"""

from __future__ import annotations

from actx.pipeline import fileio
from actx.pipeline import preflight
from actx.schemas import layout

# Files named in what `changes` says before "and N more".
SHOWN = 5


def current(spec) -> list[list]:
    """[source index, path, size in bytes] of every input file, in the sources' order."""
    return [[s, path, size] for s, files in enumerate(preflight.source_file_sizes(spec))
            for path, size in files]


def record(store, files: list[list]) -> None:
    """Writes what `current` gave when the prepare read its inputs."""
    store.write_json(layout.PREPARE_INPUTS_KEY, {"version": 1, "files": files})


def changes(store, spec) -> str:
    """What differs between the recorded inputs and those the spec names now, in words;
    "" where nothing differs, the run keeps no record (prepared before it existed), or
    the inputs cannot be listed now (the extraction does not read them)."""
    try:
        recorded = store.read_json(layout.PREPARE_INPUTS_KEY)
        now = current(spec)
    except (ValueError, fileio.InputError, OSError):
        return ""
    if not isinstance(recorded, dict) or not isinstance(recorded.get("files"), list):
        return ""
    before = {(s, path): size for s, path, size in recorded["files"]}
    after = {(s, path): size for s, path, size in now}
    said = [f"{path} is new" for (_, path) in sorted(after.keys() - before.keys())]
    said += [f"{path} is gone" for (_, path) in sorted(before.keys() - after.keys())]
    said += [f"{key[1]} is {after[key]:,} bytes, was {before[key]:,}"
             for key in sorted(before.keys() & after.keys()) if after[key] != before[key]]
    if not said:
        return ""
    more = f" and {len(said) - SHOWN} more" if len(said) > SHOWN else ""
    return "; ".join(said[:SHOWN]) + more
