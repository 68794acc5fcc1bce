"""One extraction's view of a run's store (schemas.extraction says what extractions are).

`ExtractionStore` puts the extraction's own keys (layout.EXTRACTION_KEYS, heartbeats among
them: a status per extraction shows the hosts at work on it) under its prefix and leaves
the shared ones (tokens, manifest, docs, logs) where they are, so the commit rule, the
numerics record and their readers keep one definition each. It knows only the store and
the layout: the run directory (schemas.run_dir) and the job lease read through it.
"""

from __future__ import annotations

from actx.schemas import layout
from actx.schemas import store as store_lib


class ExtractionStore(store_lib.ObjectStore):
    """The run's store as one extraction sees it (see the module docstring). The default
    extraction's view is the run's store itself (`view` returns it unchanged)."""

    def __init__(self, base: store_lib.ObjectStore, name: str):
        super().__init__(base.location)
        self.base = base
        self.name = layout.check_extraction_name(name)
        self.PARALLEL_LISTING = base.PARALLEL_LISTING
        self.STAMP_NS = base.STAMP_NS
        self.STAMPS_IN_VISIBLE_ORDER = base.STAMPS_IN_VISIBLE_ORDER
        self._prefix = layout.extraction_prefix(name)

    def _key(self, key: str) -> str:
        return layout.extraction_key(self.name, key)

    def _unkey(self, key: str) -> str:
        return key[len(self._prefix):] if key.startswith(self._prefix) else key

    def read(self, key):
        return self.base.read(self._key(key))

    def write(self, key, data):
        self.base.write(self._key(key), data)

    def create(self, key, data):
        return self.base.create(self._key(key), data)

    def list(self, prefix=""):
        return [self._unkey(k) for k in self.base.list(self._key(prefix))]

    def list_split(self, prefix, boundaries):
        return [self._unkey(k) for k in self.base.list_split(
            self._key(prefix), [self._key(b) for b in boundaries])]

    def existing(self, prefix, keys, boundaries):
        found = self.base.existing(self._key(prefix), [self._key(k) for k in keys],
                                   [self._key(b) for b in boundaries])
        return {self._unkey(k) for k in found}

    def delete(self, key):
        self.base.delete(self._key(key))

    def exists(self, key):
        return self.base.exists(self._key(key))

    def size(self, key):
        return self.base.size(self._key(key))

    def read_range(self, key, start, end):
        return self.base.read_range(self._key(key), start, end)

    def check_reachable(self):
        self.base.check_reachable()

    def read_many(self, keys, max_parallel=32):
        return self.base.read_many([self._key(k) for k in keys], max_parallel)

    def write_with_summary(self, key, data, summary):
        self.base.write_with_summary(self._key(key), data, summary)

    def list_summaries(self, prefix):
        found = self.base.list_summaries(self._key(prefix))
        return None if found is None else {self._unkey(k): v for k, v in found.items()}

    def list_stamps(self, prefix):
        # The base's: one listing on GCS (the default would read every object).
        return {self._unkey(k): v for k, v in self.base.list_stamps(self._key(prefix)).items()}

    def parse_json(self, key, data):
        return self.base.parse_json(self._key(key), data)

    def delete_prefix(self, prefix):
        return self.base.delete_prefix(self._key(prefix))


def view(store: store_lib.ObjectStore, name: str) -> store_lib.ObjectStore:
    """The store as extraction `name` sees it ("" or None: the default, `store` itself)."""
    if not name:
        return store
    if isinstance(store, ExtractionStore):
        store = store.base
    return ExtractionStore(store, name)


def named(store: store_lib.ObjectStore) -> list[str]:
    """The run's named extractions, sorted (one listing of a few small objects)."""
    if isinstance(store, ExtractionStore):
        store = store.base
    start = len(layout.EXTRACTION_NAMES_PREFIX)
    return sorted(key[start:-len(".json")] for key in store.list(layout.EXTRACTION_NAMES_PREFIX)
                  if key.endswith(".json"))


def names(store: store_lib.ObjectStore) -> list[str]:
    """Every extraction of the run: "" (the default, at the root) first when it is in use,
    then the named ones. The default is in use unless the run has named extractions and
    the default has written nothing (a run prepared for named models only)."""
    others = named(store)
    # The first worker writes actx.json before any data: one read, no listing; where it
    # is gone (deleted by hand: `actx verify --repair` rebuilds it), the default's markers
    # say it is in use (one listing, of an empty prefix in a run of named models only).
    default_used = (not others or store.exists(layout.ACTIVATIONS_INFO_KEY)
                    or bool(store.list_names(layout.COMMITS_PREFIX)))
    return ([""] if default_used else []) + others
