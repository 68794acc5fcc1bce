"""Writes a host's activations as whole zarr shards, off the critical path.

Rows of a host's slice arrive batch by batch, in any order (a long document's rows go
through one batch slot, step after step); they are assembled in host memory into
blocks of `rows_per_shard` rows, and each complete block is written by a bounded thread
pool as one stored object. Whole-shard writes mean no read-modify-write of an object and
no object shared between two writes, and the pool's bound is the backpressure that keeps
host memory bounded when storage is slower than the chips.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import threading
import time

import numpy as np

from actx.schemas import advice
from actx.schemas import commit as commit_lib
from actx.schemas import errors
from actx.schemas import layout as layout_lib
from actx.schemas import quantised
from actx.schemas import runspec as runspec_lib
from actx.schemas import store_errors
from actx.schemas import ts_context
from actx.workers.write import metadata
from actx.schemas import uri as uri_lib
from actx.workers.loop import faults
from actx.workers.write import block_copy


# Where finish() returns a token array's block checksums: "tokens/input_ids" (no hook's
# name holds a "/": each is an array directly under activations/).
TOKENS_PREFIX = "tokens/"


class TakenOver(Exception):
    """A partition's blocks were left unwritten: another attempt took it over while this
    process was silent (`PartitionWriter`'s skip_if said so). It is not committed here."""


@dataclasses.dataclass
class _Block:
    """One stored object's rows, per hook: filled row by row, or, when one step's output
    covers the whole block, that output's rows themselves (no copy)."""

    start_row: int
    rows: int
    data: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    filled_by_hook: dict[str, int] = dataclasses.field(default_factory=dict)
    # Hooks whose data is a buffer of the pool's (given back once the block is durable).
    pooled: list[str] = dataclasses.field(default_factory=list)
    # The token rows the model read for these rows (token array name -> [rows, seq_len]):
    # checksummed beside the activations, so the commit marker records what they were
    # computed on (schemas.commit's token_checksums); never written.
    tokens: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)


class ActivationArrays:
    """The run's activation arrays: created if absent by the process that writes the run's
    metadata (`workers.write.metadata`), opened by the others once their zarr.json is
    there."""

    def __init__(self, run: uri_lib.Location, hooks: dict[str, int], total_rows: int,
                 seq_len: int, dtype: str, layout: runspec_lib.LayoutSpec,
                 hook_dtypes: dict[str, str] | None = None, store=None,
                 wait_s: float = metadata.WAIT_S, writer_gone=lambda: None):
        """hook_dtypes: hook -> its dtype where it is not `dtype` (int32 expert ids). A
        float8 `dtype` adds each float8 hook's scale array (schemas.quantised).
        store: the run's store as `run` locates it (an extraction's view), given to a
        process that does not write the metadata: it waits up to `wait_s` for each array's
        zarr.json (or until `writer_gone()` says why it will not come), then opens the
        array, checked against the metadata it would have written (None: this process
        creates what is absent)."""
        self.layout = layout
        self.run = run
        self.arrays = {}
        stored = quantised.stored_arrays(
            hooks, {hook: (hook_dtypes or {}).get(hook, dtype) for hook in hooks})
        # Each array's stored data type, as commit markers record it.
        self.dtypes = {name: array_dtype for name, (_, array_dtype) in stored.items()}
        for name, (width, array_dtype) in sorted(stored.items()):
            array = layout_lib.activation_array(name, total_rows, seq_len, width, array_dtype,
                                                layout)
            spec = array.spec(run, create=True)
            if store is not None:
                key = f"{array.key}/zarr.json"
                metadata.wait_for(lambda: store.read(key), str(run.join(key)),
                                  str(store.location), wait_s, writer_gone)
                del spec["create"]  # open only, with the metadata as a check
            self.arrays[name] = ts_context.open_array(spec)


class PartitionWriter:
    """Collects one host's rows of one partition and writes them as whole shards.

    `finish()` waits until every write is durable and returns the crc32c of each block,
    per hook, in row order, and per token array the model read (given with the rows) under
    `TOKENS_PREFIX` + its name; only then may the partition be committed.
    """

    def __init__(self, arrays: ActivationArrays, slice_rows: tuple[int, int],
                 pool: "WriterPool", skip_if=None):
        """skip_if: asked before each block is written; True leaves it unwritten (the
        partition was taken over by another attempt, whose rows stand), and `finish()`
        then raises TakenOver."""
        self._arrays = arrays
        self._skip_if = skip_if
        self._skipped = 0
        self.finished = False  # every write done: none comes from this writer any more
        self._lo, self._hi = slice_rows
        self._pool = pool
        self._rows_per_shard = arrays.layout.rows_per_shard
        self._blocks: dict[int, _Block] = {}
        self._futures: list[tuple[int, concurrent.futures.Future]] = []

    @property
    def dtypes(self) -> dict[str, str]:
        """Each hook's stored dtype."""
        return self._arrays.dtypes

    def _block_for(self, row: int) -> _Block:
        start = self._lo + ((row - self._lo) // self._rows_per_shard) * self._rows_per_shard
        block = self._blocks.get(start)
        if block is None:
            block = self._blocks[start] = _Block(start, min(self._rows_per_shard,
                                                            self._hi - start))
        return block

    def add(self, first_row: int, acts: dict[str, np.ndarray],
            tokens: dict[str, np.ndarray] | None = None) -> None:
        """Adds consecutive rows starting at `first_row` (hook -> [rows, seq, hidden]);
        tokens: the token rows they were computed from (name -> [rows, seq_len])."""
        n = next(iter(acts.values())).shape[0]
        self.add_slots(tuple(range(first_row, first_row + n)), (True,) * n,
                       {hook: [(0, values)] for hook, values in acts.items()}, tokens)

    def add_slots(self, rows: tuple[int, ...], write: tuple[bool, ...],
                  pieces: dict[str, list[tuple[int, np.ndarray]]],
                  tokens: dict[str, np.ndarray] | None = None) -> None:
        """Adds a step's output: slot j holds row rows[j], stored where write[j].
        tokens: the step's token arrays the model read (name -> [slots, seq_len]), whose
        rows' checksums the marker records with the block's.

        pieces: per hook, the step's per-device shards as (first slot, array) pieces, in
        host memory. Slots that hold consecutive rows of one block form a run, and each run
        is one bulk copy into its block; a run that is a whole block is not copied at all:
        the block holds those rows of the step's output (kept alive until written).
        """
        for row, keep in zip(rows, write):
            if keep and not self._lo <= row < self._hi:
                raise ValueError(f"row {row} is outside this host's slice {self._lo}..{self._hi}")
        runs_by_piece: dict[tuple[int, int], list[tuple[_Block, int, int, int]]] = {}
        touched: dict[int, _Block] = {}
        copies: list[tuple[np.ndarray, np.ndarray]] = []
        for hook, hook_pieces in pieces.items():
            for offset, values in hook_pieces:
                key = (offset, values.shape[0])
                if key not in runs_by_piece:
                    runs_by_piece[key] = self._runs(rows, write, offset, values.shape[0])
                for block, first, slot, count in runs_by_piece[key]:
                    self._put(block, hook, first, values[slot - offset:slot - offset + count],
                              copies)
                    touched[block.start_row] = block
        # The one host-side copy of these rows, all runs at once, over the pool's threads.
        self._pool.copier.copy(copies)
        if tokens:
            # The slots' runs, as the activations' one piece of every slot made them.
            runs = runs_by_piece.get((0, len(rows))) or self._runs(rows, write, 0, len(rows))
            for block, first, slot, count in runs:
                for name, values in tokens.items():
                    if name not in block.tokens:
                        block.tokens[name] = np.empty((block.rows,) + values.shape[1:],
                                                      values.dtype)
                    block.tokens[name][first:first + count] = values[slot:slot + count]
        for block in touched.values():
            if all(block.filled_by_hook.get(h, 0) == block.rows for h in self._arrays.arrays):
                del self._blocks[block.start_row]
                block.data = {h: block.data[h] for h in self._arrays.arrays}  # hook order
                self._futures.append((block.start_row, self._pool.submit(
                    self._write, block, nbytes=sum(d.nbytes for d in block.data.values()))))

    def _runs(self, rows, write, offset: int, n: int) -> list[tuple[_Block, int, int, int]]:
        """(block, first row's index in the block, first slot, count) of each run of slots
        in [offset, offset + n) holding consecutive rows of one block."""
        runs: list[list] = []
        for slot in range(offset, min(offset + n, len(rows))):
            if not write[slot]:
                continue
            row = rows[slot]
            last = runs[-1] if runs else None
            if (last is not None and last[2] + last[3] == slot
                    and last[0].start_row + last[1] + last[3] == row
                    and row < last[0].start_row + last[0].rows):
                last[3] += 1
            else:
                block = self._block_for(row)
                runs.append([block, row - block.start_row, slot, 1])
        return [tuple(r) for r in runs]

    def _put(self, block: _Block, hook: str, first: int, values: np.ndarray,
             copies: list[tuple[np.ndarray, np.ndarray]]) -> None:
        """Puts `values` as rows `first`.. of `block`'s `hook`: the values themselves where
        they are the whole block, else a (destination, values) pair added to `copies`."""
        target = self._arrays.arrays[hook]
        dtype = target.dtype.numpy_dtype
        count = values.shape[0]
        if (first == 0 and count == block.rows and hook not in block.data
                and values.dtype == dtype and values.flags.c_contiguous):
            block.data[hook] = values  # the whole block from one step: no copy
        else:
            if hook not in block.data:
                block.data[hook] = self._pool.buffers.take(
                    (block.rows,) + tuple(target.shape[1:]), dtype)
                block.pooled.append(hook)
            copies.append((block.data[hook][first:first + count], values))
        block.filled_by_hook[hook] = block.filled_by_hook.get(hook, 0) + count

    def _write(self, block: _Block) -> dict[str, str]:
        sums = {TOKENS_PREFIX + name: commit_lib.array_checksum(rows)
                for name, rows in block.tokens.items()}
        writes = []
        skipped = False
        for hook, data in block.data.items():
            if data.dtype == np.float16:
                _check_float16_range(hook, data, block.start_row)
            sums[hook] = commit_lib.array_checksum(data)
            # Asked just before each object's write (a thread frozen between the two may
            # still write it once resumed: the window is kept that short).
            if self._skip_if is not None:
                _log_object_write(hook, block.start_row // self._rows_per_shard, ".asked")
                if self._skip_if():
                    skipped = True
                    break
            arr = self._arrays.arrays[hook]
            # Logged before the call, which may take milliseconds: a thread frozen inside it
            # had begun the write before the freeze.
            _log_object_write(hook, block.start_row // self._rows_per_shard)
            writes.append(arr[block.start_row:block.start_row + block.rows].write(data))
            if len(writes) == 1 and faults.enabled():
                writes[0].result()  # a crash point with one array of the block durable
                faults.maybe_crash("write")
        for hook, w in zip(block.data, writes):
            try:
                w.result()
            except ValueError as e:
                error = _store_error(self._arrays.run, hook, block, e)
                if error is e:
                    raise
                raise error from e
        # Durable: tensorstore no longer reads the buffers (it may until the write commits).
        for hook in block.pooled:
            self._pool.buffers.give(block.data[hook])
        if skipped:
            self._skipped += 1
            return {}
        return sums

    def finish(self) -> dict[str, list[str]]:
        if self._blocks:
            missing = sorted(self._blocks)
            raise RuntimeError(f"blocks starting at rows {missing} were never completed")
        # Every name on every host (a host without rows too): the hosts of a replica
        # gather them in one collective of one shape.
        per_hook: dict[str, list[str]] = {
            name: [] for name in (*self._arrays.arrays,
                                  *(TOKENS_PREFIX + n for n in commit_lib.MODEL_INPUTS))}
        try:
            for _, future in sorted(self._futures, key=lambda item: item[0]):
                for hook, crc in future.result().items():
                    per_hook[hook].append(crc)
        finally:
            concurrent.futures.wait([future for _, future in self._futures])
        # Asked once more with every block written: a partition taken since the last
        # block's write is not committed here either.
        taken = self._skip_if is not None and self._skip_if()
        self.finished = True
        if self._skipped or taken:
            raise TakenOver(f"{self._skipped} block(s) left unwritten" if self._skipped
                            else "taken once its blocks were written")
        return per_hook


class BlockBuffers:
    """Block buffers to fill again once written, by shape and dtype.

    A fresh buffer of a block's size is fresh memory from the kernel: its first writes
    fault in every page. On the development machine 235 MB of rows (one step of 4 hooks at
    Qwen2.5-0.5B shapes) took 222 ms to copy into a fresh buffer and 29-32 ms into one
    filled before; on the H100's host, `continue` runs (rows scattered over blocks, so
    copied) spent 101 ms a step copying against 11 ms with `truncate` (bench/RESULTS.md).
    At most `max_free_bytes` wait here; past that a written buffer is freed.
    """

    def __init__(self, max_free_bytes: int):
        self._max_free_bytes = max_free_bytes
        self._free: dict[tuple, list[np.ndarray]] = {}
        self._free_bytes = 0
        self._lock = threading.Lock()
        self.reused = 0  # buffers handed out again (tests, benchmarks)

    def take(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        with self._lock:
            free = self._free.get((shape, np.dtype(dtype)))
            if free:
                buffer = free.pop()
                self._free_bytes -= buffer.nbytes
                self.reused += 1
                return buffer
        return np.empty(shape, dtype)

    def give(self, buffer: np.ndarray) -> None:
        with self._lock:
            if self._free_bytes + buffer.nbytes <= self._max_free_bytes:
                self._free.setdefault((buffer.shape, buffer.dtype), []).append(buffer)
                self._free_bytes += buffer.nbytes


class WriterPool:
    """A thread pool bounded by bytes in flight: `submit` blocks while the blocks already
    queued or being written hold `max_pending_bytes` (always admitting one), so host memory
    stays bounded however slow storage is. Written blocks' buffers wait in `buffers` (up to
    half that bound) for the next blocks of this host, across partitions. Rows are copied
    into blocks by `copier`'s threads (`workers.write.block_copy`)."""

    def __init__(self, threads: int = 4, max_pending_bytes: int = 2 << 30,
                 copy_threads: int | None = None):
        self.buffers = BlockBuffers(max_pending_bytes // 2)
        self.copier = block_copy.BlockCopier(copy_threads)
        self._executor = concurrent.futures.ThreadPoolExecutor(threads, "actx-writer")
        self._max_pending_bytes = max_pending_bytes
        self._pending_bytes = 0
        self._room = threading.Condition()
        self.wait_s = 0.0  # time the producer spent blocked: storage is the bottleneck
        self.busy_s = 0.0  # time the threads spent in writes (checksums included)
        self.bytes_written = 0

    def submit(self, fn, *args, nbytes: int = 0) -> concurrent.futures.Future:
        t0 = time.perf_counter()
        with self._room:
            while self._pending_bytes and self._pending_bytes + nbytes > self._max_pending_bytes:
                self._room.wait()
            self._pending_bytes += nbytes
        self.wait_s += time.perf_counter() - t0
        future = self._executor.submit(self._timed, fn, *args)
        future.add_done_callback(lambda f: self._release(nbytes, f))
        return future

    def _timed(self, fn, *args):
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            with self._room:
                self.busy_s += time.perf_counter() - start

    def _release(self, nbytes: int, future: concurrent.futures.Future) -> None:
        with self._room:
            self._pending_bytes -= nbytes
            if future.exception() is None:
                self.bytes_written += nbytes
            self._room.notify_all()

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True)
        self.copier.shutdown()


def _store_error(run: uri_lib.Location, hook: str, block: _Block, e: ValueError):
    """tensorstore's error after its retries ran out (429s, 5xx, dropped connections) as
    one line naming the block; a refusal (a bucket that takes no writes, a full disk) as
    the store's one line; other errors (bugs) unchanged."""
    refused = store_errors.from_tensorstore(e)
    if refused is not e:
        return refused
    reason = str(e).split(" [tensorstore_spec=")[0]
    if "retry attempts failed" not in reason and not reason.startswith(
            ("UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED")):
        return e
    return store_errors.StoreError(
        f"{run.join(layout_lib.activation_array_key(hook))}: writing rows {block.start_row}-"
        f"{block.start_row + block.rows - 1} failed after tensorstore's retries ({reason}); "
        f"nothing of the partition was committed, `{advice.rerun(run)}` redoes it")


class OutOfRangeError(errors.UserError, ValueError):
    """A hook stored in float16 whose values the model computed beyond its range."""


def _check_float16_range(hook: str, data: np.ndarray, start_row: int) -> None:
    """Refuses a block of float16 values that are not finite: the model computed values
    past float16's range (±65,504; some models' residual streams reach it), which the
    cast stores as infinities, a plausible-looking wrong activation. Before any write,
    so nothing of the partition is committed."""
    finite = np.isfinite(data)
    if finite.all():
        return
    rows = np.flatnonzero(~finite.reshape(finite.shape[0], -1).all(axis=1)) + start_row
    raise OutOfRangeError(
        f"{hook}: {int((~finite).sum()):,} value(s) in rows {rows[0]}..{rows[-1]} are not "
        f"finite as float16 (whose range is ±65,504: the model computed larger values "
        f"there, or values not finite), and nothing of the partition was committed. Store "
        f"the hooks in bfloat16 (as many bytes, float32's range) or float32: "
        f"capture.dtype, in a new run directory or as a named extraction (`extractions:`) "
        f"of this one")


def _log_object_write(hook: str, shard_index: int, suffix: str = "") -> None:
    """Test instrumentation: with ACTX_WRITE_LOG set, record which process wrote which
    stored object (one O_APPEND line each), so tests can show one writer per object; in
    the file + ".asked", each object a fenced writer asked about before its write (a
    thread frozen between the two writes it once resumed: the fence cannot tell)."""
    path = os.environ.get("ACTX_WRITE_LOG")
    if path:
        line = f"{os.getpid()} {layout_lib.activation_shard_key(hook, shard_index)}\n"
        with open(path + suffix, "a") as f:
            f.write(line)
