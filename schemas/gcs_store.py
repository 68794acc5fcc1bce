"""The GCS object store: google-cloud-storage behind `store.ObjectStore`, and its one client.

Apart from `schemas.store` because it is the one store with a third-party library, a
process-wide client (with its connection pool and its emulator switch) and per-request
options; local disk and memory need none of that. `store.open_store` returns a `GcsStore`
for a gs:// location.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading

from actx.schemas import errors
from actx.schemas import store_errors
from actx.schemas import uri as uri_lib
from actx.schemas.object_store import ObjectStore

# The custom metadata key of `write_with_summary` on GCS.
SUMMARY_METADATA_KEY = "actx-summary"


class GcsStore(ObjectStore):
    """GCS through google-cloud-storage; create-only uses ifGenerationMatch=0 (412 if present)."""

    PARALLEL_LISTING = True
    STAMP_NS = 1000  # a generation: microseconds of GCS's clock when the object was written

    def __init__(self, location: uri_lib.Location):
        super().__init__(location)
        with store_errors.translated(str(location), location.bucket):
            self._bucket = gcs_client().bucket(location.bucket)
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


def gcs_client():
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
