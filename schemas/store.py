"""Small objects of a run (JSON specs, manifests, markers, heartbeats, rejects).

The stores of local disk and process memory, and `open_store`, which opens the one a
location names (gs://: `schemas.gcs_store`). Each implements `schemas.object_store`'s
interface, with the one operation the commit rule needs: a create-only write that the store
itself refuses when the object exists.
Object stores have no atomic rename, so create-only is how a marker is made exactly once.
Bulk arrays go through tensorstore (see `schemas.layout`), not through this module.
"""

from __future__ import annotations

import os
import uuid

from actx.schemas import gcs_store
from actx.schemas import store_errors
from actx.schemas import uri as uri_lib
# The interface every store implements, and the JSON they hold, as callers name them
# (`store.ObjectStore`, `store.dumps`); defined apart so that gcs_store need not import this.
from actx.schemas.object_store import ObjectStore, dumps  # noqa: F401


class LocalStore(ObjectStore):
    # A version is the file's modification time (ns): its temporary's write, before create
    # links it in place (a marker can be seen a little after its time).
    STAMP_NS = 1

    def _path(self, key: str) -> str:
        return os.path.join(self.location.path, *key.split("/"))

    def read(self, key: str) -> bytes | None:
        try:
            with open(self._path(key), "rb") as f:
                return f.read()
        except (FileNotFoundError, NotADirectoryError):
            return None

    def size(self, key: str) -> int | None:
        try:
            return os.stat(self._path(key)).st_size
        except (FileNotFoundError, NotADirectoryError):
            return None

    def read_range(self, key: str, start: int, end: int) -> bytes:
        with open(self._path(key), "rb") as f:
            f.seek(start)
            return f.read(max(0, end - start))

    def _write_temp(self, key: str, data: bytes) -> str:
        path = self._path(key)
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        with store_errors.local_write(path, tmp):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        return tmp

    def write(self, key: str, data: bytes) -> None:
        tmp = self._write_temp(key, data)
        with store_errors.local_write(self._path(key), tmp):
            os.replace(tmp, self._path(key))

    def create(self, key: str, data: bytes) -> bool:
        # link() fails if the target exists, and the target appears complete or not at all.
        tmp = self._write_temp(key, data)
        try:
            with store_errors.local_write(self._path(key), tmp):
                # The version is the mtime: taken now, after the write's fsync (which can
                # stall for seconds on a busy disk), right before the object is seen
                # (reader.streaming.follow orders markers by it).
                os.utime(tmp)
                os.link(tmp, self._path(key))
            return True
        except FileExistsError:
            return False
        except FileNotFoundError:
            # Our temporary was cleared by the process whose create of this key won
            # (clear_temporaries runs once the key exists): refused, as above.
            if os.path.exists(self._path(key)):
                return False
            raise
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def temporaries(self, prefix: str) -> list[str]:
        parts = prefix.split("/")
        directory = os.path.join(self.location.path, *parts[:-1])
        try:
            with os.scandir(directory) as entries:
                return sorted(e.path for e in entries if ".tmp-" in e.name
                              and e.name.split(".tmp-")[0].startswith(parts[-1]))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def clear_temporaries(self, prefix: str) -> int:
        removed = 0
        for path in self.temporaries(prefix):
            try:
                os.unlink(path)
                removed += 1
            except FileNotFoundError:  # its writer finished or cleared it meanwhile
                pass
        return removed

    def list(self, prefix: str = "") -> list[str]:
        root = self.location.path
        parts = [p for p in prefix.split("/") if p]
        base = os.path.join(root, *parts) if parts else root
        if os.path.isfile(base):
            return [prefix]
        if not os.path.isdir(base) or (prefix and not prefix.endswith("/")):
            parts = parts[:-1]  # a partial name: scan its directory, filter by prefix
        stack = [(os.path.join(root, *parts), "".join(p + "/" for p in parts))]
        keys = []
        while stack:  # scandir, not walk + relpath: 150k markers list in ~0.1 s
            directory, rel = stack.pop()
            try:
                entries = os.scandir(directory)
            except (FileNotFoundError, NotADirectoryError):
                continue
            inside = rel.startswith(prefix)  # every key here matches
            with entries:
                for entry in entries:
                    key = rel + entry.name
                    if entry.is_dir():
                        if inside or (key + "/").startswith(prefix) or prefix.startswith(key):
                            stack.append((entry.path, key + "/"))
                    elif ".tmp-" not in entry.name and (inside or key.startswith(prefix)):
                        keys.append(key)
        return sorted(keys)

    def existing(self, prefix: str, keys: list[str], boundaries: list[str]) -> set[str]:
        # A stat per key: 50k shard objects in 0.25 s, where list() walks two folders per
        # object (1.3 s).
        return {k for k in keys if os.path.isfile(self._path(k))}

    def list_names(self, folder: str) -> list[str]:
        # One scandir, no key strings, no sort: 90k commit markers in ~half list()'s time.
        try:
            with os.scandir(self._path(folder)) as entries:
                return [e.name for e in entries
                        if ".tmp-" not in e.name and not e.is_dir()]
        except (FileNotFoundError, NotADirectoryError):
            return []

    def list_stamps(self, prefix: str) -> dict[str, tuple[int, str]]:
        stamps = {}
        for key in self.list(prefix):
            try:
                st = os.stat(self._path(key))
            except (FileNotFoundError, NotADirectoryError):
                continue  # deleted since the listing
            stamps[key] = (st.st_size, str(st.st_mtime_ns))
        return stamps

    def delete(self, key: str) -> None:
        try:
            with store_errors.local_write(self._path(key)):
                os.unlink(self._path(key))
        except FileNotFoundError:
            pass


class MemoryStore(ObjectStore):
    """memory:// runs (the embedded default of notebooks and tests), process-local.

    Backed by tensorstore's memory kvstore in the process-wide context, so small objects
    and the zarr arrays of a memory run live in one store and list together.
    """

    # tensorstore's generation of a missing key: a write conditioned on it is create-only.
    _NO_VALUE = b"\x02"
    # The memory kvstore counts its writes, under its lock: a generation is the count at
    # the write, and a write is seen once made.
    STAMPS_IN_VISIBLE_ORDER = True

    def __init__(self, location: uri_lib.Location):
        super().__init__(location)
        from actx.schemas import ts_context

        self._kv = ts_context.open_kvstore(location.kvstore(directory=True))

    def read(self, key: str) -> bytes | None:
        result = self._kv.read(key).result()
        return bytes(result.value) if result.state == "value" else None

    def write(self, key: str, data: bytes) -> None:
        self._kv.write(key, bytes(data)).result()

    def create(self, key: str, data: bytes) -> bool:
        stamp = self._kv.write(key, bytes(data), if_equal=self._NO_VALUE).result()
        # A refused conditional write returns an empty generation.
        return bool(stamp.generation)

    def list_stamps(self, prefix: str) -> dict[str, tuple[int, str]]:
        stamps = {}
        for key in self.list(prefix):
            result = self._kv.read(key).result()
            if result.state == "value":  # generation: a flag byte, then the count (LE)
                count = int.from_bytes(bytes(result.stamp.generation)[1:], "little")
                stamps[key] = (len(result.value), str(count))
        return stamps

    def list(self, prefix: str = "") -> list[str]:
        keys = self._kv.list().result()
        return sorted(k.decode() for k in keys if k.decode().startswith(prefix))

    def delete(self, key: str) -> None:
        self._kv.write(key, None).result()



def open_store(location: "str | os.PathLike | uri_lib.Location | ObjectStore") -> ObjectStore:
    """The store at `location`; a store passed in is returned as it is, so that code handed
    an opened run's store never opens it again (a GCS client per open)."""
    if isinstance(location, ObjectStore):
        return location
    loc = uri_lib.parse(location)
    if loc.scheme == "gs":
        return gcs_store.GcsStore(loc)
    if loc.scheme == "memory":
        return MemoryStore(loc)
    return LocalStore(loc)
