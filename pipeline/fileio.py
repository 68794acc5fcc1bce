"""Input file discovery and reading for local paths and gs:// (files, directories, globs).

Local paths go through the OS (glob); gs:// through google-cloud-storage (the client of
`schemas.store`), which honours STORAGE_EMULATOR_HOST, so the same code reads from GCS in
production and from fake-gcs-server in tests. Expansion happens in the driver, before any
work starts, so a missing path or an empty glob is a clear error up front.
"""

from __future__ import annotations

import fnmatch
import glob
import io
import os

from actx.schemas import errors
from actx.schemas import gcs_store
from actx.schemas import store_errors
from actx.schemas import uri as uri_lib

# Files a directory expands to: data files by their extension, in any case. Files whose
# extension names a format actx cannot read (UNREADABLE_EXTENSIONS: compressed, CSV, ...)
# are listed too, so that the source is refused before any work (pipeline.preflight's
# format_problem) rather than read without them; any other file (README.md, LICENSE) is
# skipped, and named to the caller that asks (`expand_path_sizes`'s `skipped`). Hidden
# files ("." or "_" first: .gitattributes, _SUCCESS) are skipped unnamed.
DATA_EXTENSIONS = (".parquet", ".jsonl", ".ndjson", ".json", ".txt")
UNREADABLE_EXTENSIONS = (".csv", ".tsv", ".xlsx", ".xls", ".xml", ".html", ".htm", ".pdf",
                         ".docx", ".gz", ".bz2", ".xz", ".zst", ".zip", ".tar", ".arrow",
                         ".feather", ".avro", ".orc", ".pkl", ".npy", ".npz")
_GLOB_CHARS = "*?["


class InputError(errors.UserError, ValueError):
    """An input path is missing, matches nothing, or cannot be used."""


def is_glob(path: str) -> bool:
    """Whether `path` is a glob (it holds *, ? or [)."""
    return any(c in path for c in _GLOB_CHARS)


def _in_directory(name: str) -> bool | None:
    """Whether a directory's file `name` is listed (True), skipped and named (False), or
    skipped unnamed (None: a hidden file)."""
    base = name.rsplit("/", 1)[-1]
    if base.startswith((".", "_")):
        return None
    return base.lower().endswith(DATA_EXTENSIONS + UNREADABLE_EXTENSIONS)


def _directory_files(names, skipped: list[str] | None) -> list:
    """The names of a directory's files it expands to; the others, hidden files aside,
    appended to `skipped` (when given)."""
    listed = []
    for name in names:
        verdict = _in_directory(name)
        if verdict:
            listed.append(name)
        elif verdict is False and skipped is not None:
            skipped.append(name)
    return listed


def _gcs_bucket(loc: uri_lib.Location):
    return gcs_store.gcs_client().bucket(loc.bucket)  # the project's one configured client


def expand_path(path: str, skipped: list[str] | None = None) -> list[str]:
    """The sorted files that `path` (file, directory or glob; local or gs://) names.
    skipped: gets a directory's files that are neither data nor a format refused by name
    (README.md), for the caller to say."""
    return [name for name, _ in expand_path_sizes(path, skipped)]


def expand_path_sizes(path: str, skipped: list[str] | None = None
                      ) -> list[tuple[str, int]]:
    """`expand_path`'s files with their sizes in bytes (from the same listing on gs://)."""
    if path.startswith("gs://"):
        loc = uri_lib.parse(path)
        # No credentials, no network, no access: one line naming the path and the fix.
        with store_errors.translated(path, loc.bucket):
            return _expand_gcs(path, loc, skipped)
    local = os.path.abspath(os.path.expanduser(path[len("file://"):] if path.startswith("file://") else path))
    if is_glob(local):
        files = sorted(f for f in glob.glob(local, recursive=True) if os.path.isfile(f))
        if not files:
            raise InputError(f"{path}: glob matches no files; check the pattern")
    elif os.path.isfile(local):
        files = [local]
    elif os.path.isdir(local):
        named: list[str] = []
        files = sorted(_directory_files(
            (os.path.join(d, f) for d, _, names in os.walk(local) for f in names), named))
        if skipped is not None:
            skipped += sorted(named)
        if not files:
            raise InputError(f"{path}: directory holds no data files ({', '.join(DATA_EXTENSIONS)})")
    else:
        raise InputError(f"{path}: no such file or directory")
    return [(f, os.path.getsize(f)) for f in files]


def _expand_gcs(path: str, loc: uri_lib.Location, skipped: list[str] | None
                ) -> list[tuple[str, int]]:
    bucket = _gcs_bucket(loc)
    if is_glob(loc.path):
        prefix = loc.path[:min(loc.path.find(c) for c in _GLOB_CHARS if c in loc.path)]
        blobs = {b.name: b.size or 0 for b in bucket.list_blobs(prefix=prefix)
                 if fnmatch.fnmatchcase(b.name, loc.path)}
        kind = "glob"
    else:
        blobs = {b.name: b.size or 0 for b in bucket.list_blobs(prefix=loc.path)}
        if loc.path in blobs:
            return [(path, blobs[loc.path])]
        inside = [n for n in blobs if n.startswith(loc.path.rstrip("/") + "/")]
        named: list[str] = []
        listed = set(_directory_files(inside, named))
        blobs = {n: size for n, size in blobs.items() if n in listed}
        if skipped is not None:
            skipped += [f"gs://{loc.bucket}/{n}" for n in sorted(named)]
        kind = "path"
    if not blobs:
        raise InputError(f"{path}: {'glob matches no objects' if kind == 'glob' else 'no such object or prefix'}"
                         f" in bucket {loc.bucket}; check the path")
    return sorted((f"gs://{loc.bucket}/{n}", size) for n, size in blobs.items())


class _GcsReader(io.RawIOBase):
    """A seekable read-only file over one GCS object: each read is one ranged GET, so a
    work unit reads only its own bytes (parquet footers, row groups, blocks of lines)."""

    def __init__(self, blob):
        self.blob, self.pos = blob, 0
        self.blob.reload()  # its size, and a clear error now if it is missing
        self.size = self.blob.size

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def readinto(self, buffer) -> int:
        n = min(len(buffer), self.size - self.pos)
        if n <= 0:
            return 0
        data = self.blob.download_as_bytes(start=self.pos, end=self.pos + n - 1)
        buffer[:len(data)] = data
        self.pos += len(data)
        return len(data)


def open_input(path: str):
    """A seekable binary file over `path` (local or gs://); reads fetch only what they ask."""
    if path.startswith("gs://"):
        loc = uri_lib.parse(path)
        return io.BufferedReader(_GcsReader(_gcs_bucket(loc).blob(loc.path)),
                                 buffer_size=1 << 20)
    return open(path, "rb")


def file_size(f) -> int:
    """Bytes in an open input file (leaves its position at the end)."""
    return f.seek(0, io.SEEK_END)


def read_range(f, start: int, stop: int) -> bytes:
    f.seek(start)
    return f.read(stop - start)


def read_bytes(path: str) -> bytes:
    """The whole file (prepare itself reads work units: `pipeline.units`)."""
    if path.startswith("gs://"):
        loc = uri_lib.parse(path)
        return _gcs_bucket(loc).blob(loc.path).download_as_bytes()
    with open(path, "rb") as f:
        return f.read()


def exists(path: str) -> bool:
    if path.startswith("gs://"):
        loc = uri_lib.parse(path)
        return _gcs_bucket(loc).blob(loc.path).exists()
    return os.path.exists(path)
