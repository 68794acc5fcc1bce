"""Small objects of a run (JSON specs, manifests, markers, heartbeats, rejects).

One interface over local disk, GCS and process memory, with the one operation the commit
rule needs: a create-only write that the store itself refuses when the object exists.
Object stores have no atomic rename, so create-only is how a marker is made exactly once.
Bulk arrays go through tensorstore (see `schemas.layout`), not through this module.
"""

from __future__ import annotations

import abc
import concurrent.futures
import hashlib
import json
import os
import threading
import uuid
from typing import Any

from actx.schemas import errors
from actx.schemas import store_errors
from actx.schemas import uri as uri_lib

StoreError = store_errors.StoreError


class ObjectStore(abc.ABC):
    """Keys are '/'-separated paths relative to the store's root location."""

    # Whether `list_split` lists key ranges in parallel (worth computing boundaries for).
    PARALLEL_LISTING = False

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

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Deletes an object; a missing object is not an error."""

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
            raise ValueError(f"{self.location.join(key)}: not valid JSON ({e}); the object "
                             f"is damaged: rewrite it or delete it") from e

    def write_json(self, key: str, obj: Any) -> None:
        self.write(key, dumps(obj))

    def create_json(self, key: str, obj: Any) -> bool:
        return self.create(key, dumps(obj))

    def delete_prefix(self, prefix: str) -> int:
        keys = self.list(prefix)
        for key in keys:
            self.delete(key)
        return len(keys)


def dumps(obj: Any) -> bytes:
    """Canonical JSON bytes: sorted keys and a trailing newline, so reruns compare equal."""
    return (json.dumps(obj, sort_keys=True, indent=1) + "\n").encode()


class LocalStore(ObjectStore):
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
                os.link(tmp, self._path(key))
            return True
        except FileExistsError:
            return False
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

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

    def list(self, prefix: str = "") -> list[str]:
        keys = self._kv.list().result()
        return sorted(k.decode() for k in keys if k.decode().startswith(prefix))

    def delete(self, key: str) -> None:
        self._kv.write(key, None).result()


# The custom metadata key of `write_with_summary` on GCS.
SUMMARY_METADATA_KEY = "actx-summary"


class GcsStore(ObjectStore):
    """GCS through google-cloud-storage; create-only uses ifGenerationMatch=0 (412 if present)."""

    PARALLEL_LISTING = True

    def __init__(self, location: uri_lib.Location):
        super().__init__(location)
        with store_errors.translated(str(location), location.bucket):
            self._bucket = _gcs_client().bucket(location.bucket)
        self._kv = None  # tensorstore's view of the same location, for read_many

    def _name(self, key: str) -> str:
        return f"{self.location.path}/{key}" if self.location.path else key

    @store_errors.gcs_errors
    def read(self, key: str) -> bytes | None:
        from google.api_core import exceptions

        try:
            return self._bucket.blob(self._name(key)).download_as_bytes(
                **store_errors.read_options())
        except exceptions.NotFound:
            return None

    @store_errors.gcs_errors
    def size(self, key: str) -> int | None:
        blob = self._bucket.get_blob(self._name(key), **store_errors.read_options())
        return None if blob is None else blob.size

    @store_errors.gcs_errors
    def read_range(self, key: str, start: int, end: int) -> bytes:
        if end <= start:
            return b""
        return self._bucket.blob(self._name(key)).download_as_bytes(
            start=start, end=end - 1, **store_errors.read_options())  # GCS: end inclusive

    @store_errors.gcs_errors
    def write(self, key: str, data: bytes) -> None:
        self._bucket.blob(self._name(key)).upload_from_string(data, **store_errors.write_options())

    @store_errors.gcs_errors
    def create(self, key: str, data: bytes) -> bool:
        from google.api_core import exceptions

        try:
            self._bucket.blob(self._name(key)).upload_from_string(
                data, if_generation_match=0, **store_errors.write_options())
            return True
        except exceptions.PreconditionFailed:
            pass
        # A request that GCS applied but whose response was lost is retried, and the retry
        # meets the object it wrote: 412. The object holding exactly these bytes is that
        # case (what this module's callers create carries its writer's attempt id, so
        # another writer's object differs); anything else is another writer's, which won.
        if self.read(key) == bytes(data):
            store_errors.log.warning("%s: create-only write answered 412, but the object "
                                     "holds exactly the bytes written: an earlier try of "
                                     "this write was applied and its response lost",
                                     self.location.join(key))
            return True
        return False

    def read_many(self, keys: list[str], max_parallel: int = 32) -> list[bytes | None]:
        """All reads issued at once through tensorstore's gcs driver (C++ requests, no GIL,
        its `gcs_request_concurrency` limit): 512 heartbeats cost about a quarter less
        than the same reads from Python threads. `max_parallel` < 2 reads one by one."""
        if len(keys) < 2 or max_parallel < 2:
            return [self.read(key) for key in keys]
        if self._kv is None:
            from actx.schemas import ts_context

            self._kv = ts_context.open_kvstore(self.location.kvstore(directory=True))
        futures = [self._kv.read(key) for key in keys]
        results = [f.result() for f in futures]
        return [bytes(r.value) if r.state == "value" else None for r in results]

    # GCS answers at most this many items a page, whatever maxResults asks; we ask more.
    GCS_PAGE_ITEMS = 1000
    PAGE_ASK = 5000

    def _list_page(self, prefix: str, fields: str, start: str | None, end: str | None,
                   token: str | None) -> tuple[list[dict], str | None]:
        """One objects.list page under `prefix` (names relative to the store), with only
        `fields` of each item, and the next page's token. Straight from the JSON API:
        list_blobs builds a Blob per item (a third of a listing's time at 15k markers), and
        these callers want a name and a field or two. Asking for more than GCS's 1,000 a
        page lets a server that allows it answer in fewer round trips."""
        root = f"{self.location.path}/" if self.location.path else ""
        params = {"prefix": root + prefix, "maxResults": self.PAGE_ASK,
                  "fields": f"items({fields}),nextPageToken"}
        if start is not None:
            params["startOffset"] = root + start
        if end is not None:
            params["endOffset"] = root + end
        if token:
            params["pageToken"] = token
        page = self._bucket.client._connection.api_request(
            method="GET", path=f"/b/{self.location.bucket}/o", query_params=params,
            **store_errors.read_options())
        items = page.get("items", [])
        for item in items:
            item["name"] = item["name"][len(root):]
        return items, page.get("nextPageToken")

    def _list_items(self, prefix: str, fields: str, start: str | None = None,
                    end: str | None = None, token: str | None = None) -> list[dict]:
        """Every page of `_list_page`, one after another."""
        items = []
        while True:
            page, token = self._list_page(prefix, fields, start, end, token)
            items += page
            if not token:
                return items

    @store_errors.gcs_errors
    def _list_range(self, prefix: str, start: str | None, end: str | None) -> list[str]:
        # Names only: full metadata is ~850 bytes per object.
        return [item["name"] for item in self._list_items(prefix, "name", start, end)]

    def list(self, prefix: str = "") -> list[str]:
        return sorted(self._list_range(prefix, None, None))

    @store_errors.gcs_errors
    def check_reachable(self, key: str = "") -> None:
        # A missing object reads as None, a missing bucket too; a listing tells them apart.
        root = f"{self.location.path}/" if self.location.path else ""
        list(self._bucket.client.list_blobs(self._bucket, prefix=root, max_results=1,
                                            fields="items(name)", **store_errors.read_options()))

    @store_errors.gcs_errors
    def write_with_summary(self, key: str, data: bytes, summary: str) -> None:
        blob = self._bucket.blob(self._name(key))
        blob.metadata = {SUMMARY_METADATA_KEY: summary}  # sent with the data, one request
        blob.upload_from_string(data, **store_errors.write_options())

    @store_errors.gcs_errors
    def list_summaries(self, prefix: str) -> dict[str, str | None]:
        return {item["name"]: (item.get("metadata") or {}).get(SUMMARY_METADATA_KEY)
                for item in self._list_items(prefix, "name,metadata")}

    @store_errors.gcs_errors
    def list_stamps(self, prefix: str) -> dict[str, tuple[int, str]]:
        return {item["name"]: (int(item.get("size") or 0), str(item.get("generation")))
                for item in self._list_items(prefix, "name,size,generation")}

    @store_errors.gcs_errors
    def list_split(self, prefix: str, boundaries: list[str]) -> list[str]:
        """The first page first: when it is the only one (up to 1,000 markers) the listing
        is one request. Otherwise the rest of the key space, past the page's last name, is
        cut at the boundaries beyond it and listed in parallel; a server that answered more
        than GCS's 1,000 items a page (an emulator) is followed page by page instead, as
        each of its requests costs the same however narrow."""
        first, token = self._list_page(prefix, "name", None, None, None)
        names = [item["name"] for item in first]
        if not token:
            return sorted(names)
        if len(first) > self.GCS_PAGE_ITEMS or not boundaries:
            return sorted(names + [item["name"] for item in
                                   self._list_items(prefix, "name", token=token)])
        last = max(names)  # startOffset is inclusive: `last` comes back and is dropped
        cuts = [last, *sorted(b for b in boundaries if b > last), None]
        ranges = list(zip(cuts[:-1], cuts[1:]))
        with concurrent.futures.ThreadPoolExecutor(min(16, len(ranges))) as pool:
            pages = pool.map(lambda r: self._list_range(prefix, *r), ranges)
            return sorted(set(names).union(*pages))

    def delete_prefix(self, prefix: str) -> int:
        # One request per object: a failed prepare's token store (thousands of shards)
        # is cleared in parallel.
        keys = self.list(prefix)
        with concurrent.futures.ThreadPoolExecutor(max(1, min(16, len(keys)))) as pool:
            list(pool.map(self.delete, keys))
        return len(keys)

    @store_errors.gcs_errors
    def delete(self, key: str) -> None:
        from google.api_core import exceptions

        try:
            self._bucket.blob(self._name(key)).delete(**store_errors.read_options())
        except exceptions.NotFound:
            pass


_CLIENT = None
_CLIENT_LOCK = threading.Lock()


class MissingInstall(errors.UserError, ImportError):
    """A gs:// location where google-cloud-storage is not installed: one line naming the
    extra that installs it (an ImportError still, for the `except ImportError` that had
    it)."""


def _gcs_client():
    global _CLIENT
    with _CLIENT_LOCK:
        if _CLIENT is None:
            try:
                from google.cloud import storage
            except ImportError as e:
                from actx.schemas import version

                raise MissingInstall(
                    f"gs:// locations need google-cloud-storage, which is not installed here "
                    f"({e}): pip install '{version.DISTRIBUTION}[gcs]'") from None
            if os.environ.get("STORAGE_EMULATOR_HOST"):
                from google.auth.credentials import AnonymousCredentials

                _CLIENT = storage.Client(project="actx-emulator", credentials=AnonymousCredentials())
            else:
                _CLIENT = _client_without_project_if_none(storage)
            # Parallel reads and listings: the default pool keeps 10 connections per host.
            import requests.adapters

            adapter = requests.adapters.HTTPAdapter(pool_connections=4, pool_maxsize=64)
            _CLIENT._http.mount("https://", adapter)
            _CLIENT._http.mount("http://", adapter)
        return _CLIENT


def _client_without_project_if_none(storage):
    """A client with the environment's project, or with none: reading and writing objects
    needs no project, and `gcloud auth application-default login` writes user credentials
    that name none (google-cloud-storage then refuses to build a client: "Project was not
    passed and could not be determined from the environment")."""
    try:
        return storage.Client()
    except OSError as e:
        if "Project was not passed" not in str(e):
            raise
        return storage.Client(project=None)  # explicitly none: bucket operations only


def reset_gcs_client() -> None:
    """Forgets the cached client (tests that restart the emulator call this)."""
    global _CLIENT
    with _CLIENT_LOCK:
        _CLIENT = None


def open_store(location: "str | os.PathLike | uri_lib.Location | ObjectStore") -> ObjectStore:
    """The store at `location`; a store passed in is returned as it is, so that code handed
    an opened run's store never opens it again (a GCS client per open)."""
    if isinstance(location, ObjectStore):
        return location
    loc = uri_lib.parse(location)
    if loc.scheme == "gs":
        return GcsStore(loc)
    if loc.scheme == "memory":
        return MemoryStore(loc)
    return LocalStore(loc)
