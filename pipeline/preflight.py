"""What `actx prepare` would refuse in a spec's inputs, found before any work and without
Apache Beam: the entry point `actx submit`'s and `actx prepare`'s pre-flight and the dry
run's counts call (deploy/preflight.py, deploy/dry_run.py). A refusal then comes back in
the time it takes to read the tokenizer, not to import Beam.
"""

from __future__ import annotations

from actx.pipeline import fileio
from actx.pipeline import tokenize
from actx.schemas import errors
from actx.schemas import runspec as runspec_lib
from actx.schemas import store as store_lib
from actx.schemas import store_errors
from actx.schemas import tokenizer_identity
from actx.schemas import uri as uri_lib


def expand_sources(spec: runspec_lib.RunSpec) -> list[tuple[int, str]]:
    """(source_index, file) for every input file, sorted; raises on a missing path."""
    files = []
    for s, source in enumerate(spec.sources):
        found = []
        for path in source.paths:
            try:
                found += fileio.expand_path(path)
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
                fileio.expand_path(path)
            except fileio.InputError as e:
                missing.append(f"source {spec.source_name(s)!r}: {e}")
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
    try:  # a chat template it does not have, BOS asked of a tokenizer without one
        tokenize.rules(loaded, spec)
    except errors.UserError as e:
        problems.append(str(e))
    return problems, missing, files
