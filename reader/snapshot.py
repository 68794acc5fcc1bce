"""A run's snapshot: its hooks, shapes, dtypes and committed partitions, and random access.

The bottom of the reader: every other reader module reads through a `RunSnapshot`, and
`reader.run.Run` (the front door, `open_run`) adds the hand-over methods on top of it.
A snapshot is taken at open time: the set of committed partitions (commit
markers) is listed once, so a training job sees one fixed data set (and one shuffle
order) however many partitions commit while it runs; `refresh()` takes a new snapshot, and
a reader that follows a live run (reader.streaming.follow) hands it its own listings
(`observe_committed`).
Rows of uncommitted partitions are never read, whatever data exists for them.
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Any, Iterable, Sequence

import numpy as np
import tensorstore as ts

from actx.reader import errors
from actx.reader import shard_presence
from actx.schemas import absent_shards
from actx.schemas import activations_info as info_lib
from actx.schemas import advice
from actx.schemas import commit as commit_lib
from actx.schemas import config as config_lib
from actx.schemas import hook_aliases
from actx.schemas import layout
from actx.schemas import manifest as manifest_lib
from actx.schemas import quantised
from actx.schemas import runspec as runspec_lib
from actx.schemas import store as store_lib
from actx.schemas import ts_context


@dataclasses.dataclass(frozen=True)
class HookInfo:
    """One activation array: shape [total_rows, seq_len, hidden] and the dtype reads return
    by default: the stored dtype, or float32 for a float8 hook (`stored_dtype`
    float8_e4m3fn: its values are read dequantised, schemas.quantised)."""

    name: str
    shape: tuple[int, int, int]
    dtype: str
    partitions: tuple[int, ...]  # committed partitions whose marker lists this hook
    stored_dtype: str | None = None  # where it differs from `dtype` (a float8 hook)

    @property
    def quantised(self) -> bool:
        """Whether the hook is stored as float8 values with per-token scales."""
        return self.stored_dtype is not None and quantised.is_quantised(self.stored_dtype)

    @property
    def hidden(self) -> int:
        return self.shape[2]


class PendingRead:
    """A hook's read in flight (`RunSnapshot.read_async`): its values, and a float8 hook's
    scales, dequantised when the result is taken."""

    def __init__(self, values, scales=None, dtype: str | None = None):
        self._values, self._scales, self._dtype = values, scales, dtype

    def result(self) -> np.ndarray:
        if self._scales is None:
            return self._values.result()
        return quantised.dequantise(self._values.result(), self._scales.result(), self._dtype)


class RunSnapshot:
    """A run directory opened for reading (`reader.run.Run` adds the hand-over methods;
    build one with `reader.open_run`)."""

    def __init__(self, store: store_lib.ObjectStore, spec: runspec_lib.RunSpec,
                 manifest: manifest_lib.Manifest, extraction: str = ""):
        # A named extraction's store is its view (schemas.extraction): its own markers,
        # actx.json and statistics; its arrays' keys go through `stored_key`.
        self.extraction = extraction
        self.store = store
        self.location = store.location
        self.spec = spec
        self.manifest = manifest
        self._row_starts = [p.row_start for p in manifest.partitions]
        self._arrays: dict[str, Any] = {}
        self.refresh()

    # -- what the run holds ---------------------------------------------------------

    def refresh(self) -> None:
        """Re-lists commit markers (the snapshot of what is readable).

        One listing, no marker reads: every partition of a run holds the same hooks (the
        workers refuse anything else, see activations/actx.json), so the hook names come
        from that one object.
        """
        self.committed = tuple(sorted(commit_lib.committed_partitions(self.store)))
        self._committed_set = frozenset(self.committed)
        self._hooks_cache = None
        self._info = None
        # A new snapshot checks its partitions' objects anew (a repaired partition may
        # have been extracted again since).
        self._presence = shard_presence.ShardPresence(
            self.store, self.location, self.spec.layout.rows_per_shard, self.total_rows)
        self._presence.observe(self.committed)

    def observe_committed(self, committed) -> None:
        """Takes `committed` (ids a caller listed itself: a follower's one listing per
        poll, reader.streaming.follow) as the snapshot, without listing again. The hooks
        are read once, on the first commit: every partition holds the same ones."""
        self.committed = tuple(sorted(set(committed)))
        self._committed_set = frozenset(self.committed)
        self._presence.observe(self.committed)
        if self._hooks_cache is not None:
            self._hooks_cache = {h: dataclasses.replace(i, partitions=self.committed)
                                 for h, i in self._hooks_cache.items()}

    @property
    def seq_len(self) -> int:
        return self.manifest.seq_len

    @property
    def total_rows(self) -> int:
        return self.manifest.total_rows

    @property
    def partitions(self) -> tuple[manifest_lib.Partition, ...]:
        return self.manifest.partitions

    @property
    def committed_partitions(self) -> tuple[manifest_lib.Partition, ...]:
        return tuple(self.manifest.partitions[p] for p in self.committed)

    @property
    def uncommitted_partitions(self) -> tuple[manifest_lib.Partition, ...]:
        done = set(self.committed)
        return tuple(p for p in self.manifest.partitions if p.id not in done)

    @property
    def hooks(self) -> dict[str, HookInfo]:
        """The run's hooks, readable in every committed partition (none before a commit)."""
        if self._hooks_cache is None:
            infos = {}
            for hook in self._hook_names():
                arr = self.open_array(layout.activation_array_key(hook))
                stored = str(arr.dtype.numpy_dtype)
                infos[hook] = (HookInfo(hook, tuple(arr.shape), quantised.read_dtype(None),
                                        self.committed, stored)
                               if quantised.is_quantised(stored) else
                               HookInfo(hook, tuple(arr.shape), stored, self.committed))
            self._hooks_cache = infos
        return self._hooks_cache

    def _hook_names(self) -> list[str]:
        if not self.committed:
            return []
        try:
            info = self._info = info_lib.read_info(self.store)
        except info_lib.DamagedInfoError as e:  # says what rebuilds it
            raise errors.NotARunError(f"{self.location}: {e}") from None
        except config_lib.ConfigError as e:
            raise errors.NotARunError(
                f"{self.location}: {e}; run `{advice.verify(self.location)}`") from None
        if info is None:
            # Workers create it before writing any data, so a commit without it is damage.
            raise errors.NotARunError(
                f"{self.location.join(layout.ACTIVATIONS_INFO_KEY)}: missing, but "
                f"{len(self.committed)} partition(s) are committed (their activations were "
                f"removed?); `{advice.repair(self.location)}` turns them back into pending "
                f"(where their arrays stand, it rebuilds it and keeps those whose data checks "
                f"out), then "
                f"`{advice.rerun(self.location)}` extracts them again")
        # A generating run's ids are stored beside the hooks, not one of them (reader.masks)
        return sorted(h for h in info.hooks if h != layout.GENERATED_IDS)

    def require_commits(self) -> None:
        """Raises NothingCommittedError when no partition is committed: every reading
        entry point says this same thing, rather than an empty result or another fault."""
        if self.committed:
            return
        if not self.partitions:
            raise errors.NothingCommittedError(
                f"{self.location}: the run holds no data: its prepare accepted no document "
                f"(see {self.location.join(layout.REJECTS_PREFIX)}); prepare it again with "
                f"inputs that pass")
        raise errors.NothingCommittedError(
            f"{self.location}: nothing is committed yet (0 of {len(self.partitions)} "
            f"partitions), so no activation is readable; `{advice.status(self.location)}` "
            f"shows the extraction's progress, `{advice.rerun(self.location)}` extracts them; "
            f"then "
            f"reopen the run (or call run.refresh())")

    @property
    def architecture(self) -> str | None:
        """The model's HF architecture as the workers recorded it (activations/actx.json;
        None in runs written before it was, and for Flax models)."""
        self.hooks  # reads the record
        return None if self._info is None else self._info.architecture

    @property
    def transformer_lens_differs(self) -> str | None:
        """Why TransformerLens's model of this run's checkpoint is not HF's, where the
        workers recorded one (schemas.hook_aliases.model_difference); else None."""
        self.hooks  # reads the record
        return None if self._info is None else self._info.transformer_lens_differs

    def resolve_hook(self, name: str) -> str:
        """The stored name of hook `name`: itself, or the actx hook a TransformerLens name
        ("blocks.8.hook_resid_pre") equals on this run's model (schemas.hook_aliases).
        Raises hook_aliases.HookAliasError (a ValueError) naming it where none is equal."""
        if not hook_aliases.is_transformer_lens(name) or name in self.hooks:
            return name
        # A record without the architecture was written before actx read any LayerNorm
        # family (every family it read then is RMSNorm, whose values are TransformerLens's),
        # or by a Flax model, whose hooks are its own module paths.
        return hook_aliases.to_actx(name, self.architecture, self.transformer_lens_differs)

    def resolve_hooks(self, hooks: Sequence[str]) -> tuple[str, ...]:
        """`resolve_hook` of each."""
        return tuple(self.resolve_hook(h) for h in hooks)

    def hook(self, name: str) -> HookInfo:
        """The HookInfo of `name` (a TransformerLens name: of the actx hook it equals,
        `resolve_hook`); UnknownHookError (listing the hooks) when absent."""
        self.require_commits()
        name = self.resolve_hook(name)
        infos = self.hooks
        if name not in infos:
            raise errors.UnknownHookError(
                f"{self.location}: no committed activations for hook {name!r}; available: "
                f"{', '.join(infos) or '(none: no partition is committed yet)'} (the run's "
                f"`hooks` names them)")
        return infos[name]

    # -- checks -------------------------------------------------------------------

    def partition_of_row(self, row: int) -> manifest_lib.Partition:
        if not 0 <= row < self.total_rows:
            raise IndexError(f"row {row} is outside the run (0..{self.total_rows - 1})")
        return self.manifest.partitions[bisect.bisect_right(self._row_starts, row) - 1]

    def check_rows(self, start: int, stop: int, hooks: Sequence[str] = ()) -> None:
        """Refuses a row range that touches an uncommitted partition, or an unknown hook."""
        self.require_commits()
        if not 0 <= start < stop <= self.total_rows:
            raise IndexError(f"rows [{start}, {stop}) are outside the run "
                             f"(0..{self.total_rows})")
        first = self.partition_of_row(start).id
        last = self.partition_of_row(stop - 1).id
        committed = self._committed_set
        for pid in range(first, last + 1):
            if pid not in committed:
                raise errors.UncommittedPartitionError(
                    f"{self.location}: partition {pid} ({layout.partition_name(pid)}, rows "
                    f"{self.partitions[pid].row_start}..{self.partitions[pid].row_stop - 1}) "
                    f"is not committed; finish it with `{advice.rerun(self.location)}` and "
                    f"reopen the run")
        self.require_stored(hooks, self.partitions[first:last + 1])

    def committed_ids(self, partitions: Iterable[int] | None = None,
                      hooks: Sequence[str] = ()) -> tuple[int, ...]:
        """`partitions` (default: all committed), checked to be committed with `hooks`
        stored (`require_stored`)."""
        self.require_commits()
        ids = self.committed if partitions is None else tuple(sorted(set(partitions)))
        for pid in ids:
            part = self.manifest.partition(pid)
            self.check_rows(part.row_start, part.row_stop)
        self.require_stored(hooks, [self.partitions[p] for p in ids])
        return ids

    def require_stored(self, hooks: Sequence[str],
                       parts: Sequence[manifest_lib.Partition]) -> None:
        """Refuses (errors.LostDataError) to read `hooks` in committed `parts` whose stored
        objects are gone, which would read as zeros (reader.shard_presence); an unknown
        hook raises UnknownHookError. One listing per array at its first check."""
        arrays = []
        for hook in hooks:
            info = self.hook(hook)
            arrays.append(info.name)
            if info.quantised:
                arrays.append(quantised.scale_array(info.name))
        if arrays and self.spec.generate is not None:
            arrays.append(layout.GENERATED_IDS)  # the masks and token ids read it
        # Only arrays in the layout the check knows: one object per rows_per_shard whole
        # rows (layout.activation_array; every actx writer's). Another would be refused
        # whole for keys it does not have, a wrong refusal.
        arrays = [a for a in arrays if self._one_object_per_shard_rows(a)]
        if arrays and parts:
            self._presence.check(arrays, parts, self._row_nbytes, self._unreached)

    def _one_object_per_shard_rows(self, array: str) -> bool:
        arr = self.open_array(layout.activation_array_key(array))
        return tuple(arr.chunk_layout.write_chunk.shape) == (
            self.spec.layout.rows_per_shard, *arr.shape[1:])

    def _row_nbytes(self, array: str) -> int:
        return absent_shards.row_nbytes(self.open_array(layout.activation_array_key(array)))

    def _unreached(self, part: manifest_lib.Partition) -> np.ndarray | None:
        """In a generating run, per row of `part`: whether it holds no token the model
        computed (schemas.absent_shards.unreached_rows); None in any other run."""
        if self.spec.generate is None:
            return None
        lo, hi = part.row_start, part.row_stop
        valid = self.token_array("segment_ids")[lo:hi].read().result() > 0
        ids = self.open_array(layout.activation_array_key(layout.GENERATED_IDS))[
            lo:hi].read().result()[..., 0]
        return absent_shards.unreached_rows(ids, valid)

    # -- arrays -------------------------------------------------------------------

    def open_array(self, key: str, context: ts.Context | None = None):
        """The array at `key`, opened once in the process-wide context, or anew in
        `context` (a child of it, e.g. with other GCS limits) when given."""
        if context is None and key in self._arrays:
            return self._arrays[key]
        spec = layout.array_spec(self.location, self.stored_key(key))
        try:
            # The process-wide context: memory:// runs exist only in it, and its cache
            # pool keeps shard indexes between gathers.
            array = ts_context.strict_if_checksummed(
                ts.open(spec, open=True, read=True,
                        context=context or ts_context.get()).result(),
                spec, context)
        except ValueError as e:
            from actx.schemas import errors as schemas_errors

            cause = ValueError(str(e).split(" [tensorstore_spec=")[0])  # not the spec
            what = f"{self.location.join(self.stored_key(key))}: cannot be opened " \
                   f"({schemas_errors.first_line(cause, 300)})"
            if key.startswith(f"{layout.ACTIVATIONS_GROUP}/") and self.committed:
                # Committed data whose array is gone or damaged: what finishes the run.
                loc = self.location
                what += (f"; committed partitions cannot be read there: "
                         f"`{advice.verify(loc)}` names what is wrong, "
                         f"`{advice.repair(loc)}` then `{advice.rerun(loc)}` writes it again")
            elif key.startswith(f"{layout.TOKENS_GROUP}/"):
                # The token store gone or damaged after prepare: the same tokens again.
                what += (f"; the token store was damaged after prepare: "
                         f"`{advice.reprepare(self.location)}` writes the same tokens "
                         f"again (what is committed stays)")
            raise FileNotFoundError(what) from e
        if context is None:
            self._arrays[key] = array
        return array

    def stored_key(self, key: str) -> str:
        """`key` (of the default layout) where this run's extraction stores it."""
        return layout.extraction_key(self.extraction, key)

    def open_call(self) -> str:
        """The `actx.open_run(...)` call that opens this run (and extraction), as advice
        names it: it runs as printed."""
        named = f", extraction={self.extraction!r}" if self.extraction else ""
        return f"actx.open_run({str(self.location)!r}{named})"

    def activation_array(self, hook: str):
        """The tensorstore array of a hook (no commit checks: callers check rows); a
        TransformerLens name reads the hook it equals (`resolve_hook`). A float8 hook's
        holds its stored values: `scale_array` has their scales."""
        return self.open_array(layout.activation_array_key(self.hook(hook).name))

    def scale_array(self, hook: str):
        """The tensorstore array of a float8 hook's per-token scales [rows, seq_len, 1]
        (schemas.quantised), None for a hook stored in another dtype."""
        info = self.hook(hook)
        if not info.quantised:
            return None
        return self.open_array(layout.activation_array_key(quantised.scale_array(info.name)))

    def read_dtype(self, hooks: Sequence[str], dtype: str | None) -> str | None:
        """The dtype reads of `hooks` return when asked for `dtype` (None: as stored):
        float32 or bfloat16 for a float8 hook, refusing by name any dtype a float8 hook
        cannot be read as (schemas.quantised.read_dtype)."""
        if any(self.hook(h).quantised for h in hooks):
            return quantised.read_dtype(dtype, f"{self.location}: ")
        return dtype

    def read_async(self, hook: str, index, dtype: str | None = None) -> "PendingRead":
        """Starts reading hook's activations at `index` (a function indexing a tensorstore
        array: a slice, or vindex; no commit checks); `.result()` waits for them, dequantised
        for a float8 hook (values and scales read together)."""
        values = index(self.activation_array(hook)).read()
        scales = self.scale_array(hook)
        if scales is None:
            return PendingRead(values)
        return PendingRead(values, index(scales).read(), self.read_dtype([hook], dtype))

    def _read(self, hook: str, index, dtype: str | None = None) -> np.ndarray:
        return self.read_async(hook, index, dtype).result()

    def token_array(self, name: str):
        if name not in layout.ALL_TOKEN_ARRAYS:
            raise KeyError(f"unknown token array {name!r}; known: "
                           f"{', '.join(layout.ALL_TOKEN_ARRAYS)}")
        return self.open_array(layout.token_array_key(name))

    # -- random access ------------------------------------------------------------

    def rows(self, hook: str, start: int, stop: int) -> np.ndarray:
        """Activations [stop - start, seq_len, hidden] of whole rows, padding included
        (use `token_rows("segment_ids", ...)`: 0 marks padding); float32 for a float8
        hook (dequantised)."""
        self.check_rows(start, stop, [hook])
        return self._read(hook, lambda a: a[start:stop])

    def token_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """A token or ARC array (layout.ALL_TOKEN_ARRAYS) over rows [start, stop)."""
        self.check_rows(start, stop)
        return self.token_array(name)[start:stop].read().result()

    def tokens(self, hook: str, row: int, col_start: int = 0,
               col_stop: int | None = None) -> np.ndarray:
        """Activations [n, hidden] of columns [col_start, col_stop) of one row."""
        col_stop = self.seq_len if col_stop is None else col_stop
        self.check_rows(row, row + 1, [hook])
        return self._read(hook, lambda a: a[row, col_start:col_stop])

    def gather(self, hooks: Sequence[str], rows: np.ndarray,
               cols: np.ndarray) -> dict[str, np.ndarray]:
        """Activations [n, hidden] per hook at the tokens (rows[i], cols[i]).

        All reads are issued before any is awaited, so tensorstore fetches and decodes
        the chunks of every hook concurrently, each needed chunk once per read. Keyed by
        the stored names (a TransformerLens name resolved).
        """
        self.require_commits()
        hooks = self.resolve_hooks(hooks)
        rows = np.asarray(rows, np.int64)
        cols = np.asarray(cols, np.int64)
        self.committed_ids(self._partitions_of_rows(rows), hooks)
        futures = {h: self.activation_array(h).vindex[rows, cols].read() for h in hooks}
        scales = {h: a.vindex[rows, cols].read() for h in hooks
                  if (a := self.scale_array(h)) is not None}
        return {h: f.result() if h not in scales
                else quantised.dequantise(f.result(), scales[h].result())
                for h, f in futures.items()}

    def gather_tokens(self, names: Sequence[str], rows: np.ndarray,
                      cols: np.ndarray) -> dict[str, np.ndarray]:
        """Token or ARC arrays at the tokens (rows[i], cols[i])."""
        self.require_commits()
        for pid in self._partitions_of_rows(rows):
            part = self.partitions[pid]
            self.check_rows(part.row_start, part.row_stop)
        futures = {n: self.token_array(n).vindex[np.asarray(rows), np.asarray(cols)].read()
                   for n in names}
        return {n: f.result() for n, f in futures.items()}

    def token_ids(self, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        """The id of each token (rows[i], cols[i]): tokens/input_ids, and in a generating
        run the id the model wrote where it wrote one (its reserved room holds the pad id
        in tokens/input_ids; docs/generate.md)."""
        ids = self.gather_tokens(["input_ids"], rows, cols)["input_ids"]
        if self.spec.generate is None or len(ids) == 0:
            return ids
        generated = self.open_array(layout.activation_array_key(layout.GENERATED_IDS)).vindex[
            np.asarray(rows), np.asarray(cols), 0].read().result()
        return np.where(generated >= 0, generated, ids).astype(ids.dtype)

    def _partitions_of_rows(self, rows: np.ndarray) -> set[int]:
        if len(rows) == 0:
            return set()
        idx = np.searchsorted(np.asarray(self._row_starts), np.unique(rows), side="right") - 1
        return set(int(i) for i in np.unique(idx))

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.location}, {len(self.committed)}/"
                f"{len(self.partitions)} partitions committed, hooks={list(self.hooks)})")
