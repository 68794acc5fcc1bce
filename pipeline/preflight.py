"""What `actx prepare` would refuse in a spec's inputs, found before any work and without
Apache Beam: the entry point `actx submit`'s and `actx prepare`'s pre-flight and the dry
run's counts call (deploy/preflight.py, deploy/dry_run.py). A refusal then comes back in
the time it takes to read the tokenizer, not to import Beam. Also the record of the
input files a prepare read (prepare/inputs.json), which a submit that skips the prepare
compares with the inputs now.
"""

from __future__ import annotations

import os

from actx.pipeline import fileio
from actx.pipeline import tokenize
from actx.schemas import errors
from actx.schemas import layout
from actx.schemas import runspec as runspec_lib
from actx.schemas import store as store_lib
from actx.schemas import store_errors
from actx.schemas import tokenizer_identity
from actx.schemas import uri as uri_lib


def expand_sources(spec: runspec_lib.RunSpec, skipped: list[str] | None = None
                   ) -> list[tuple[int, str]]:
    """(source_index, file) for every input file, sorted; raises on a missing path.
    skipped: gets the files of the sources' directories that are not data (fileio)."""
    files = []
    for s, source in enumerate(spec.sources):
        found = []
        for path in source.paths:
            try:
                found += fileio.expand_path(path, skipped)
            except fileio.InputError as e:
                raise fileio.InputError(f"source {spec.source_name(s)!r}: {e}") from None
        files += [(s, f) for f in sorted(set(found))]
    return files


def source_file_sizes(spec: runspec_lib.RunSpec) -> list[list[tuple[str, int]]]:
    """Per source, its input files as `expand_sources` orders them, with their sizes in
    bytes (one listing on gs://): what a dry run counts or samples."""
    sizes = []
    for s, source in enumerate(spec.sources):
        found = {}
        for path in source.paths:
            try:
                found.update(fileio.expand_path_sizes(path))
            except fileio.InputError as e:
                raise fileio.InputError(f"source {spec.source_name(s)!r}: {e}") from None
        sizes.append(sorted(found.items()))
    return sizes


# What a prepare read, recorded in prepare/inputs.json (layout.PREPARE_INPUTS_KEY): each
# input file's source, path and size. `actx submit` skips the prepare of a run already
# prepared for its spec, and the spec names paths, not their contents: a user who changed
# the inputs under the same config (a file added to the folder, one rewritten) would be
# told "skipping" and keep the old tokens without a word. `inputs_changed` compares the
# record with the inputs now (one listing, as `source_file_sizes`). Sizes, not contents:
# reading terabytes to skip a prepare would cost more than the prepare; a rewrite of the
# same size goes unseen, and docs/faults.md says so.

# Changed files named before "and N more".
CHANGES_SHOWN = 5


def input_files(spec: runspec_lib.RunSpec) -> list[list]:
    """[source index, path, size in bytes] of every input file, in the sources' order."""
    return [[s, path, size] for s, files in enumerate(source_file_sizes(spec))
            for path, size in files]


def record_inputs(store, files: list[list]) -> None:
    """Writes what `input_files` gave when the prepare read its inputs."""
    store.write_json(layout.PREPARE_INPUTS_KEY, {"version": 1, "files": files})


def inputs_changed(store, spec: runspec_lib.RunSpec, recorded: dict | None = None) -> str:
    """What differs between the recorded inputs (prepare/inputs.json, or `recorded`, a
    record read before) and those the spec names now, in words; "" where nothing differs,
    the run keeps no record (prepared before it existed), or the comparison cannot be made
    (the inputs cannot be listed from here)."""
    try:  # advice only: whatever stops the comparison (an unreachable bucket, a record
        # of another shape) leaves the skip as it was
        if recorded is None:
            recorded = store.read_json(layout.PREPARE_INPUTS_KEY)
        if not isinstance(recorded, dict) or not isinstance(recorded.get("files"), list):
            return ""
        before = {(s, path): size for s, path, size in recorded["files"]}
        after = {(s, path): size for s, path, size in input_files(spec)}
    except Exception:  # noqa: BLE001
        return ""
    said = [f"{path} is new" for (_, path) in sorted(after.keys() - before.keys())]
    said += [f"{path} is gone" for (_, path) in sorted(before.keys() - after.keys())]
    said += [f"{key[1]} is {after[key]:,} bytes, was {before[key]:,}"
             for key in sorted(before.keys() & after.keys()) if after[key] != before[key]]
    if not said:
        return ""
    more = f" and {len(said) - CHANGES_SHOWN} more" if len(said) > CHANGES_SHOWN else ""
    return "; ".join(said[:CHANGES_SHOWN]) + more


def check_inputs(spec: runspec_lib.RunSpec
                 ) -> tuple[list[str], list[str], tokenizer_identity.TokenizerFiles | None]:
    """(problems, missing, the tokenizer's files) of the spec's inputs, before any work:
    every source path matches a file (else it is missing), and the tokenizer loads. One
    line per problem."""
    problems, missing = [], []
    reachable: set[str] = set()
    for s, source in enumerate(spec.sources):
        for path in source.paths:
            bucket = uri_lib.parse(path).bucket if path.startswith("gs://") else None
            if bucket and bucket not in reachable:  # unreachable: one StoreError, in bounds
                # An input's bucket, not the run: checked once before any work.
                store_lib.open_store(f"gs://{bucket}").check_reachable()
                reachable.add(bucket)
            try:
                found = fileio.expand_path(path)
            except fileio.InputError as e:
                missing.append(f"source {spec.source_name(s)!r}: {e}")
                continue
            problem = format_problem(source, found)
            if problem:
                problems.append(f"source {spec.source_name(s)!r}: {problem}")
    try:
        tokenize.check_tokenizer_path(spec.tokenizer.path)
    except tokenize.TokenizerError as e:
        missing.append(f"spec.tokenizer.path: {e}")
        return problems, missing, None
    try:
        loaded = tokenize.load_tokenizer(spec.tokenizer.path)
        files = tokenizer_identity.read_tokenizer(spec.tokenizer.path)
    except store_errors.StoreError:
        raise
    except Exception as e:  # a tokenizer that does not load
        problems.append(f"spec.tokenizer.path: {e}")
        return problems, missing, None
    try:  # a chat template it does not have or that cannot render ARC prompts, BOS asked
        # of a tokenizer without one
        tokenize.rules(loaded, spec)
        tokenize.check_arc_template(loaded, spec)
    except errors.UserError as e:
        problems.append(str(e))
    return problems, missing, files


def format_problem(source: runspec_lib.SourceSpec, files: list[str]) -> str:
    """Why a source's files cannot be read in its format ("" when they can), in one line
    naming the format expected: from each file's extension, and from the first bytes of
    the first file (one small read)."""
    from actx.pipeline import sources

    arc = source.kind == "arc"
    for path in files:
        fmt = sources.file_format(source, path)
        if arc and fmt in ("parquet", "txt"):
            return (f"{path}: format {fmt} cannot hold ARC tasks; expected format json (an "
                    f"ARC-AGI task file) or jsonl (one task object per line)")
        if source.format == "auto" and path.lower().endswith(fileio.UNREADABLE_EXTENSIONS):
            expected = ("json (an ARC-AGI task file) or jsonl (one task object per line)"
                        if arc else sources.FORMATS_READ)
            return (f"{path}: a {path.rsplit('.', 1)[-1]} file is not a format actx reads; "
                    f"expected {expected}: convert it, or set the source's format if the "
                    f"name misleads{_glob_instead(source, path, files)}")
    if not files:
        return ""
    path = files[0]
    fmt = sources.file_format(source, path)
    try:
        with fileio.open_input(path) as f:
            head = fileio.read_range(f, 0, 4096)
    except Exception:  # noqa: BLE001 - an unreadable file is prepare's reject, with its reason
        return ""
    if fmt in ("jsonl", "json", "txt") and head[:4] == b"PAR1":
        return (f"{path}: a parquet file (it starts with PAR1), read as {fmt} by "
                f"{'its name' if source.format == 'auto' else 'the source format'}; name it "
                f".parquet, or set the source's format to parquet")
    if source.text_field != "text" and all(sources.file_format(source, other) == "txt"
                                           for other in files):
        return (f"{path}: read as plain text (one document per line) by "
                f"{'its .txt name' if source.format == 'auto' else 'format txt'}, which "
                f"has no field for text_field {source.text_field!r} to name; if its lines "
                f"are JSON objects set the source's format to jsonl, else drop text_field")
    if fmt == "parquet" and head[:4] != b"PAR1":
        return (f"{path}: not a parquet file (it does not start with PAR1); expected format "
                f"parquet here, or set the source's format to what it is: jsonl, json or txt")
    if fmt == "jsonl" and sources.is_json_array(head):
        return (f"{path}: holds a JSON array, not JSON lines (one object per line); set the "
                f"source's format to json (or auto with a .json name), which reads arrays")
    return ""


def _glob_instead(source: runspec_lib.SourceSpec, path: str, files: list[str]) -> str:
    """For a file that a directory of the source's paths expanded to: how to name only the
    readable files instead (a glob, which lists what it matches whatever its format), as
    the end of a refusal's sentence; "" for a file named by a path or a glob."""
    def where(p: str) -> str:  # as fileio lists it: gs:// as given, local paths absolute
        if p.startswith("gs://"):
            return p.rstrip("/")
        return os.path.abspath(os.path.expanduser(p.removeprefix("file://")))

    directory = next((p for p in source.paths if not fileio.is_glob(p)
                      and path.startswith(where(p) + "/")), None)
    if directory is None:
        return ""
    listed = where(directory)
    readable = [f for f in files if f.startswith(listed + "/")
                and f.lower().endswith(fileio.DATA_EXTENSIONS)]
    ending = min(fileio.DATA_EXTENSIONS, key=lambda e: -sum(
        f.lower().endswith(e) for f in readable)) if readable else ".jsonl"
    root = directory.rstrip("/")
    nested = any("/" in f[len(listed) + 1:] for f in readable)
    # gs://: a glob's * matches "/" too (fnmatch); locally ** spans folders (glob).
    pattern = (f"{root}/**/*{ending}" if nested and not root.startswith("gs://")
               else f"{root}/*{ending}")
    return (f"; or, to read the directory without it, name the files to read with a glob "
            f"in the source's paths, e.g. {pattern!r}")
