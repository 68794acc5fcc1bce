"""The interface of every object store (local disk, GCS, process memory): small objects of
a run read, written, created only if absent, listed; and the canonical JSON they hold.

The stores themselves are `schemas.store` (local disk, memory, and `open_store`, which picks
one by location) and `schemas.gcs_store`; both import this module, and it imports neither.
"""

from __future__ import annotations

import abc
import hashlib
import json
from typing import Any

from actx.schemas import errors
from actx.schemas import uri as uri_lib


class ObjectStore(abc.ABC):
    """Keys are '/'-separated paths relative to the store's root location."""

    # Whether `list_split` lists key ranges in parallel (worth computing boundaries for).
    PARALLEL_LISTING = False
    # What `list_stamps`' versions tell of when an object was created: STAMP_NS, the
    # nanoseconds of the store's clock a unit of a version is where versions are times of
    # the write (a local file's modification time: 1, a GCS generation: 1,000), taken a
    # little before the object can be seen; STAMPS_IN_VISIBLE_ORDER, versions counted up
    # in the order objects appear (memory://). Neither: versions say no order (a digest).
    STAMP_NS: int | None = None
    STAMPS_IN_VISIBLE_ORDER = False

    def __init__(self, location: uri_lib.Location):
        self.location = location

    @abc.abstractmethod
    def read(self, key: str) -> bytes | None:
        """The object's bytes, or None when it does not exist."""

    @abc.abstractmethod
    def write(self, key: str, data: bytes) -> None:
        """Writes (or overwrites) an object; durable when this returns."""

    @abc.abstractmethod
    def create(self, key: str, data: bytes) -> bool:
        """Writes only if `key` does not exist. Returns False when it already existed (a
        retried request that meets exactly `data`, its own lost write, counts as written)."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """Keys under `prefix` (recursively), sorted. Names only: no object metadata."""

    def list_names(self, folder: str) -> list[str]:
        """The names (not keys) of the objects directly in `folder` (a prefix ending in
        "/"), in no particular order: what a caller that parses names needs, without the
        keys and the sorting of `list`."""
        return [key[len(folder):] for key in self.list(folder) if "/" not in key[len(folder):]]

    def list_split(self, prefix: str, boundaries: list[str]) -> list[str]:
        """`list(prefix)`, which a store may cut at the sorted key `boundaries` into ranges
        listed in parallel (GCS pages 1,000 names per request, one page after another)."""
        return self.list(prefix)

    def existing(self, prefix: str, keys: list[str], boundaries: list[str]) -> set[str]:
        """Which of `keys` (each under `prefix`) exist: one listing of `prefix`, cut at
        `boundaries` as `list_split` (local disk looks at each key instead: a stat each
        costs less than walking a folder per object)."""
        wanted = set(keys)
        return {k for k in self.list_split(prefix, boundaries) if k in wanted}

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Deletes an object; a missing object is not an error."""

    def temporaries(self, prefix: str) -> list[str]:
        """The temporary files of writes that never finished (a process killed between
        writing `<key>.tmp-<id>` and moving it in place) whose key starts with `prefix`,
        as paths; never listed as keys, never read. Only local disk has them."""
        return []

    def clear_temporaries(self, prefix: str) -> int:
        """Deletes `temporaries(prefix)`; how many. A write of the same key in flight in
        another process then finds its temporary gone: `create` answers False (the key
        exists by then, see commit_lib.commit), so call it only once the key exists."""
        return 0

    def exists(self, key: str) -> bool:
        return self.read(key) is not None

    def size(self, key: str) -> int | None:
        """The object's size in bytes, or None when it does not exist."""
        data = self.read(key)
        return None if data is None else len(data)

    def read_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of an object (fewer at its end), without reading the rest
        where the store can (a checkpoint's safetensors headers, before any work)."""
        return (self.read(key) or b"")[start:end]

    def check_reachable(self) -> None:
        """Raises StoreError when the store itself (a bucket, not one object) is missing or
        refuses this account; called when an expected object is missing, to say which."""

    def read_many(self, keys: list[str], max_parallel: int = 32) -> list[bytes | None]:
        """`read` of each key, in order; stores with a round trip per read run them in
        parallel."""
        return [self.read(key) for key in keys]

    def write_with_summary(self, key: str, data: bytes, summary: str) -> None:
        """`write`, with `summary` (a short string, under 4 KB) attached where the store can
        return it in a listing (GCS custom metadata); elsewhere a plain `write`."""
        self.write(key, data)

    def list_summaries(self, prefix: str) -> dict[str, str | None] | None:
        """Keys under `prefix` with the summary each was written with (None: written
        without one), in one listing; None where the store has no summaries (read the
        objects instead, which is as cheap on local disk)."""
        return None

    def list_stamps(self, prefix: str) -> dict[str, tuple[int, str]]:
        """Keys under `prefix` with (size, version), the version changing whenever the
        object is rewritten (a GCS generation, a local file's modification time): what a
        cache of something read from the objects is checked against, in one listing on GCS."""
        stamps = {}
        for key in self.list(prefix):
            data = self.read(key)
            if data is not None:
                stamps[key] = (len(data), hashlib.sha256(data).hexdigest()[:16])
        return stamps

    def read_json(self, key: str) -> Any:
        data = self.read(key)
        return None if data is None else self.parse_json(key, data)

    def parse_json(self, key: str, data: bytes) -> Any:
        """`data` (the bytes of `key`) parsed as JSON; the error names the object."""
        try:
            return json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DamagedObjectError(f"{self.location.join(key)}: not valid JSON ({e}); the "
                                     f"object is damaged: rewrite it or delete it",
                                     key=key, what=f"not valid JSON ({e})") from e

    def write_json(self, key: str, obj: Any) -> None:
        self.write(key, dumps(obj))

    def create_json(self, key: str, obj: Any) -> bool:
        return self.create(key, dumps(obj))

    def delete_prefix(self, prefix: str) -> int:
        keys = self.list(prefix)
        for key in keys:
            self.delete(key)
        return len(keys)


class DamagedObjectError(errors.UserError, ValueError):
    """An object of the run that is not valid JSON: the message names it (a command that
    meets it where it cannot go on says so in one line, exit 2). `key`: the object's key
    in the store that read it; `what`: the damage alone, for a caller's own advice."""

    def __init__(self, message: str, key: str = "", what: str = ""):
        super().__init__(message)
        self.key = key
        self.what = what or message


def dumps(obj: Any) -> bytes:
    """Canonical JSON bytes: sorted keys and a trailing newline, so reruns compare equal."""
    return (json.dumps(obj, sort_keys=True, indent=1) + "\n").encode()
