"""Shuffled training batches at the speed of sequential reads: a two-level shuffle.

Level one (reader.blocks): each epoch visits this process's row blocks in a new seeded
order, `buffer_tokens` positions (a few blocks) at a time. Level two: the valid tokens of
each buffer are permuted and cut into batches; a batch may take the tail of one buffer and
the head of the next. Tensorstore reads and decodes the next `prefetch_buffers` buffers on
its own threads (decoding is parallel across inner chunks; `reads_in_flight` blocks at a
time, reader.read_window), each block with one request per hook, decoded straight into a
reused buffer (ts.array over numpy memory). Each returned token is then copied once into
its batch (reader.gather, on `gather_threads` threads): by reader.row_copy's C kernel,
which reads the buffer in order and scatters the rows into the buffer's batches (2-3 x
numpy's gather, which reads at random and is the fallback where no C compiler is at hand;
`copy_path` says which). So the stored bytes are decoded once and copied once, whatever
the batch size. A buffer's batches are handed over once its copies are done, while the
next buffer's copies run and the one after it is read. Each buffer is loaded on a thread
of its own (its reads queued, a mapped hook's shard files mapped, its permuted order
worked out once its token rows arrive), and JAX batches are copied to the device on
another, so the thread that cuts batches does little else (`producer_seconds` says where
its time goes). A local hook stored without a codec is not decoded at all
(reader.mapped_hook, `map_shards`): the buffer's shard files are mapped, a background
thread pages the next buffer in (reader.mapped_region), and each token is copied once,
from the page cache straight into its batch.

The trade (stated, and measured by bench/read.py with reader.mixing): a batch holds
tokens of at most two consecutive buffers, i.e. of at most 2 * buffer_tokens /
(block_rows * seq_len) blocks, so of fewer documents and partitions than an exact global
shuffle (run.batches) would give it. A larger buffer or smaller blocks mix better; memory
is (prefetch_buffers + 1) * buffer_tokens * hidden * itemsize per hook (page cache mapped
for a mapped hook), plus the batches of about two buffers (one handed over, one being
copied into: 2 * buffer_tokens * hidden * itemsize, in batch arrays that are reused) and
prefetch more (twice prefetch with JAX), and the decode memory of `reads_in_flight` blocks.

Every valid token is read exactly once per epoch (drop_last=False; with drop_last the
tail of each epoch's stream is dropped, see blocks.StreamPlan), processes read disjoint
blocks, and the order depends only on the seed, the epoch, the process split and the
sizes, so `state(batch)` / `resume=` restart at any step.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import time
from typing import Any, Iterator, Sequence

import numpy as np
import tensorstore as ts

from reader import array_pool
from reader import blocks as blocks_lib
from reader import formats
from reader import masks as masks_lib
from reader import gather as gather_lib
from reader import mapped_hook
from reader import prefetch as prefetch_lib
from reader import read_window
from reader import row_copy
from reader import run as run_lib
from reader.batches import Batch
from reader.errors import ReaderError
from reader.read_contexts import default_file_io_mode, read_contexts
from schemas import layout

# Positions per buffer: 0.47 GB per hook and buffer at hidden 896 in bfloat16, 2.1 GB at
# 4096; two buffers are read into (prefetch_buffers=1) and about two are in batches.
DEFAULT_BUFFER_TOKENS = 1 << 18
STATE_VERSION = 1
# Block reads in flight on local or memory runs: with tensorstore's read(), more than two
# made its read memory fault in anew (bench/read.py's store: 4k page faults per epoch at
# 2, 40k at 4, 79k at 8) for no faster epoch.
DEFAULT_LOCAL_READS = 2


@dataclasses.dataclass
class _Loaded:
    """A buffer whose reads were issued: per hook the array its tokens are copied from."""

    epoch: int
    buffer: blocks_lib.Buffer
    skip: int  # tokens of its permuted order already consumed before a resume
    # hook -> (source [n, hidden], row of each buffer token in it or None: the same);
    # a decoded hook's source is its slot [buffer_rows * seq_len, hidden].
    sources: dict
    reads: read_window.ReadGroup  # the reads that decode the blocks into the sources
    tokens: list  # futures of (segment_ids, input_ids) per block
    run_rows: np.ndarray  # int64 [rows]: the run row of each slot row
    order: Any = None  # its _Order, once loaded


@dataclasses.dataclass
class _Order:
    """What each token of a buffer's permuted order is, for the whole buffer at once (a
    batch then takes slices: fewer, larger numpy calls on the thread that cuts)."""

    rows: np.ndarray  # int64: run row
    cols: np.ndarray  # int64: column
    input_ids: np.ndarray  # int32
    source_rows: dict  # hook -> int64: row of the hook's source array (numpy copy)
    # The native copy reads each hook's source in order instead: the source row of each
    # valid token (ascending slot position) and its index in the buffer's stream.
    valid_rows: dict | None = None
    stream_index: np.ndarray | None = None


class ShuffledStream:
    """An iterable of `Batch`es: streaming two-level shuffle of a run's valid tokens.

    hooks: one hook or several (every batch holds the same tokens for each).
    batch_size: tokens per batch on this process.
    buffer_tokens: positions (rows * seq_len, padding included) one buffer holds; rounded
      down to whole blocks, at least one block.
    block_rows: rows per read (default: the layout's rows_per_shard, one stored object);
      smaller blocks (a multiple of layout.chunk_rows) mix better for the same buffer.
    seed / epochs / start_step: order seed; epochs to run (None: forever); global step to
      begin at. resume: a dict from `state(batch)`; checked against these settings.
    process_index / process_count: this trainer's share (disjoint blocks).
    drop_last: see blocks.StreamPlan (True: equal step counts on every process).
    exclude / outlier_factor / exclude_bos / exclude_special / whole_document /
      partitions: which tokens, as in run.batches (exclude: reader.masks.REASONS).
    prefetch_buffers: buffers read ahead (memory: see the module docstring);
    prefetch: batches cut ahead by the background thread.
    framework / as_jax / sharding / dtype / normalize: output format (reader.formats); a
      sharding must divide every batch, so keep drop_last=True (no short last batch).
    gcs_request_concurrency: concurrent GCS requests for this stream's reads (None: the
      process-wide setting, schemas.ts_context).
    reads_in_flight: block reads (one block of one hook each) decoding at a time (None:
      2, each decoded in parallel over its inner chunks; 16 for gs://, where each request
      waits longer); their decode memory is about reads_in_flight * block_rows * seq_len *
      hidden * itemsize.
    file_io_mode: how tensorstore reads local files it decodes (see read_contexts; None:
      default_file_io_mode, memmap for local runs; no effect on gs://).
    gather_threads: threads copying tokens into batches (None: reader.gather's default, a
      quarter of the cores while tensorstore decodes, one per core when all is mapped).
    map_shards: copy the tokens of a local hook stored without a codec straight from its
      mapped shard files (reader.mapped_hook) instead of decoding them first; anything
      else is decoded by tensorstore. `read_paths` says which each hook got, and why.
    native_copy: copy tokens into batches with reader.row_copy's C kernel (each buffer read
      in order, its rows scattered into the batches) where it can be built here, else
      with numpy's gather; `copy_path` says which, and why. The bytes are the same.
    """

    def __init__(self, run: run_lib.Run, hooks: "str | Sequence[str]", batch_size: int, *,
                 buffer_tokens: int = DEFAULT_BUFFER_TOKENS, block_rows: int | None = None,
                 seed: int = 0, epochs: int | None = 1, start_step: int = 0,
                 resume: dict | None = None, process_index: int = 0,
                 process_count: int = 1, drop_last: bool = True, exclude_bos: bool = False,
                 exclude_special: bool = False, partitions: Sequence[int] | None = None,
                 whole_document: bool = False, exclude: Sequence[str] | None = None,
                 outlier_factor: float = masks_lib.DEFAULT_OUTLIER_FACTOR,
                 prefetch_buffers: int = 1, prefetch: int = 2,
                 framework: formats.Framework = "numpy", as_jax: bool = False,
                 sharding: Any = None, dtype: str | None = None,
                 normalize: str | None = None, gcs_request_concurrency: int | None = None,
                 reads_in_flight: int | None = None, file_io_mode: str | None = None,
                 gather_threads: int | None = None, map_shards: bool = True,
                 native_copy: bool = True):
        self.run = run
        self.hooks = (hooks,) if isinstance(hooks, str) else tuple(hooks)
        if not self.hooks:
            raise ValueError("hooks: name at least one hook")
        lay = run.spec.layout
        block_rows = lay.rows_per_shard if block_rows is None else block_rows
        if block_rows < 1 or block_rows % lay.chunk_rows:
            raise ValueError(f"block_rows ({block_rows}) must be a positive multiple of the "
                             f"layout's chunk_rows ({lay.chunk_rows}), or a read would "
                             f"decode rows it does not return")
        buffer_rows = buffer_tokens // run.seq_len // block_rows * block_rows
        if buffer_rows < block_rows:
            raise ValueError(f"buffer_tokens ({buffer_tokens}) holds less than one block of "
                             f"{block_rows} rows x {run.seq_len} tokens; raise it to at "
                             f"least {block_rows * run.seq_len}")
        ids = run.committed_ids(partitions, self.hooks)
        self._filter = masks_lib.token_filter(
            run, self.hooks, exclude, exclude_bos=exclude_bos, exclude_special=exclude_special,
            whole_document=whole_document, outlier_factor=outlier_factor, partitions=ids)
        table = blocks_lib.count_blocks(run, block_rows, ids, hooks=self.hooks,
                                        token_filter=self._filter)
        self.plan = blocks_lib.StreamPlan(table, batch_size, buffer_rows, seed,
                                          process_index, process_count, drop_last)
        self._settings = {
            "fingerprint": run.spec.fingerprint, "hooks": list(self.hooks),
            "partitions": list(table.partitions), "batch_size": batch_size,
            "buffer_rows": buffer_rows, "block_rows": block_rows, "seed": seed,
            "process_index": process_index, "process_count": process_count,
            "drop_last": drop_last, "exclude_bos": exclude_bos,
            "exclude_special": exclude_special, "whole_document": whole_document}
        if self._filter.exclude:  # only then: states saved before masks existed still load
            self._settings["exclude"] = list(self._filter.exclude)
            if "outlier" in self._filter.exclude:
                self._settings["outlier_factor"] = outlier_factor
        if resume is not None:
            start_step = self._check_resume(resume)
        self.start_step = start_step
        self.stop_step = None if epochs is None else epochs * self.plan.steps_per_epoch
        self.prefetch_buffers = max(0, prefetch_buffers)
        if reads_in_flight is None:
            reads_in_flight = 16 if run.location.scheme == "gs" else DEFAULT_LOCAL_READS
        read_window.ReadWindow(reads_in_flight)  # checks it now, not in the thread
        self.reads_in_flight = reads_in_flight
        self.framework = formats.check_framework("jax" if as_jax else framework)
        self.sharding, self.dtype = sharding, dtype
        self.normalizers = formats.normalizers(run, self.hooks, normalize)
        if file_io_mode is None:
            file_io_mode = default_file_io_mode(run)
        self.file_io_mode = file_io_mode
        acts_context, tokens_context = read_contexts(gcs_request_concurrency, file_io_mode)
        self._acts = {h: run._open(layout.activation_array_key(h), acts_context)
                      for h in self.hooks}
        # Where the thread that cuts batches spent its time (seconds, summed over the
        # iterations): busy (everything but handing batches over), of which waiting for
        # block reads and token rows, and waiting for the gather threads' copies. Busy
        # close to the wall time: the cutting limits the stream; mostly waiting for
        # reads: the storage or the decode does.
        self.producer_seconds = {"busy": 0.0, "read_wait": 0.0, "copy_wait": 0.0}
        self._mapped, self.read_paths = {}, {}
        for h in self.hooks:
            plain, why = (mapped_hook.plain_layout(run, h, self._acts[h]) if map_shards
                          else (None, "map_shards=False"))
            if plain is not None:
                self._mapped[h] = mapped_hook.MappedHook(run, h, self._acts[h], plain)
            self.read_paths[h] = "mapped" if plain is not None else f"decoded: {why}"
        if gather_threads is None:
            gather_threads = gather_lib.default_threads(len(self._mapped) < len(self.hooks))
        self.gather_threads = gather_threads
        gather_lib.Gather(gather_threads).close()  # checks it now, not in the thread
        self._copy_rows, why = (row_copy.kernel() if native_copy
                                else (None, "native_copy=False"))
        self.copy_path = why if self._copy_rows is not None else f"numpy: {why}"
        self._tokens = self._filter.sources(run, tokens_context)
        self._prefetch_depth = max(1, prefetch)
        self._prefetch_in_thread = prefetch > 0
        # JAX arrays: the copy to the device (synchronous for host memory, ~6 GB/s on an
        # H100 host, as long as cutting the batches) gets a thread of its own, so the next
        # batch is cut meanwhile.
        self._convert_in_thread = self._prefetch_in_thread and self.framework == "jax"
        self._prefetcher = prefetch_lib.Prefetcher(
            self._convert_ahead if self._convert_in_thread else self._produce_converted,
            self._prefetch_depth, "actx-reader-stream")

    # -- what the stream is -------------------------------------------------------

    @property
    def steps_per_epoch(self) -> int:
        return self.plan.steps_per_epoch

    @property
    def blocks_per_buffer(self) -> int:
        return self.plan.buffer_rows // self.plan.table.block_rows

    def __len__(self) -> int:
        if self.stop_step is None:
            raise TypeError("endless (epochs=None) streams have no length")
        return max(0, self.stop_step - self.start_step)

    def state(self, batch: Batch) -> dict:
        """What to save to resume after `batch` (pass it back as `resume=`)."""
        return {"version": STATE_VERSION, "next_step": batch.step + 1, **self._settings}

    def _check_resume(self, state: dict) -> int:
        wrong = {k: (state.get(k), v) for k, v in self._settings.items() if state.get(k) != v}
        if state.get("version") != STATE_VERSION or "next_step" not in state:
            raise ValueError(f"resume: not a stream state of version {STATE_VERSION} "
                             f"(got keys {sorted(state)}); save it with stream.state(batch)")
        if wrong:
            raise ValueError("resume: the saved state was made with other settings, so the "
                             "order would differ: " + "; ".join(
                                 f"{k} saved {a!r}, now {b!r}" for k, (a, b) in wrong.items())
                             + ". Open the stream with the saved settings.")
        return int(state["next_step"])

    # -- reading ------------------------------------------------------------------

    def _work(self) -> Iterator[tuple[int, blocks_lib.Buffer, int]]:
        """(epoch, buffer, tokens to skip) of every buffer the steps need, in order."""
        plan, step = self.plan, self.start_step
        while self.stop_step is None or step < self.stop_step:
            epoch, offset = plan.locate(step)
            last = (epoch + 1) * plan.steps_per_epoch
            if self.stop_step is not None:
                last = min(last, self.stop_step)
            end = min(plan.tokens_per_epoch, (last - epoch * plan.steps_per_epoch)
                      * plan.batch_size)
            for buf in plan.buffers(epoch):
                lo, hi = buf.stream_start, buf.stream_start + buf.tokens
                if hi > offset and lo < end:
                    yield epoch, buf, max(0, offset - lo)
            step = last

    def _new_slot(self) -> dict[str, np.ndarray]:
        return {h: np.empty((self.plan.buffer_rows, self.run.seq_len, a.shape[2]),
                            a.dtype.numpy_dtype)
                for h, a in self._acts.items() if h not in self._mapped}

    def _issue(self, epoch: int, buf: blocks_lib.Buffer, skip: int,
               slot: dict[str, np.ndarray], window: read_window.ReadWindow) -> _Loaded:
        """Queues the reads of one buffer, each block decoded into its rows of the slot
        or its shard files mapped (the token rows, a few bytes per position, are read at
        once)."""
        table = self.plan.table
        targets = {h: ts.array(a, copy=False, write=True) for h, a in slot.items()}
        group, tokens, run_rows, at = read_window.ReadGroup(), [], [], 0
        blocks = [(int(table.row_start[b]), int(table.row_stop[b])) for b in buf.blocks]
        for lo, hi in blocks:
            for h, target in targets.items():
                window.add(group, functools.partial(target[at:at + hi - lo].write,
                                                    self._acts[h][lo:hi]))
            tokens.append([t[lo:hi].read() for t in self._tokens])
            run_rows.append(np.arange(lo, hi, dtype=np.int64))
            at += hi - lo
        sources = {h: (a.reshape(-1, a.shape[2]), None) for h, a in slot.items()}
        for h, hook_reads in self._mapped.items():
            loaded = hook_reads.load(blocks, window, group)
            sources[h] = (loaded.source, loaded.row_of)
        window.pump()
        return _Loaded(epoch, buf, skip, {h: sources[h] for h in self.hooks}, group, tokens,
                       np.concatenate(run_rows))

    def _read_error(self, loaded: _Loaded, error: Exception) -> ReaderError:
        parts = sorted({int(p) for p in self.plan.table.partition[loaded.buffer.blocks]})
        loc = self.run.location
        return ReaderError(
            f"{self.run.location}: reading activations of partitions {parts} failed: "
            f"{error}. The stored data is damaged or unreadable: `actx verify {loc}` "
            f"names the partitions; `actx verify {loc} --repair`, then `actx rerun {loc}`, "
            f"writes them again.")

    def _load(self, epoch: int, buf: blocks_lib.Buffer, skip: int,
              slot: dict[str, np.ndarray], window: read_window.ReadWindow) -> _Loaded:
        """A buffer's reads queued and its order worked out (on the stream's loading
        thread, while the buffer before it is cut)."""
        loaded = self._issue(epoch, buf, skip, slot, window)
        loaded.order = self._order(loaded)
        return loaded

    def _order(self, loaded: _Loaded) -> _Order:
        """The buffer's permuted order (needs its token rows, not its activations), and
        where each hook's copy reads: in stream order for numpy's gather, in source order
        (with each token's stream index) for the native copy."""
        valid, perm, input_ids = self._permuted(loaded)
        order = valid[perm]
        # take(mode="clip"): no temporary (see reader.gather); in range by construction.
        result = _Order(loaded.run_rows.take(order // self.run.seq_len, mode="clip"),
                        np.remainder(order, self.run.seq_len),
                        input_ids.take(order, mode="clip"), {})
        if self._copy_rows is None:
            result.source_rows = {h: order if row_of is None else row_of.take(order, mode="clip")
                                  for h, (_, row_of) in loaded.sources.items()}
        else:
            result.stream_index = np.empty(len(perm), np.int64)
            result.stream_index[perm] = np.arange(len(perm))
            result.valid_rows = {h: valid if row_of is None else row_of.take(valid, mode="clip")
                                 for h, (_, row_of) in loaded.sources.items()}
        return result

    def _permuted(self, loaded: _Loaded) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(flat slot positions of the valid tokens, ascending; the buffer's permutation of
        them; input_ids [rows*T])."""
        values = [np.concatenate([f[i].result() for f in loaded.tokens])
                  for i in range(len(self._tokens))]
        inp = values[1]
        valid = np.flatnonzero(self._filter.keep(values))
        if len(valid) != loaded.buffer.tokens:
            raise RuntimeError(
                f"{self.run.location}: rows {loaded.run_rows[0]}..{loaded.run_rows[-1]} hold "
                f"{len(valid)} valid tokens now but {loaded.buffer.tokens} when the stream "
                f"was opened; the token arrays changed under the reader: reopen the run")
        return valid, self.plan.buffer_order(loaded.epoch, loaded.buffer, len(valid)), \
            inp.reshape(-1)

    def _copy(self, loaded: _Loaded, pieces: list, gather: gather_lib.Gather) -> list:
        """Starts copying a buffer's tokens into the batches cut from it; `pieces` are
        (first stream index, tokens, batch, first row in the batch), in stream order.
        Returns the copies' futures (none: copied already, on this thread)."""
        if not pieces:
            return []
        order, copies = loaded.order, []
        if self._copy_rows is None:  # numpy: gather each piece in stream order
            for pos, take, batch, fill in pieces:
                for h, (source, _) in loaded.sources.items():
                    copies += gather.submit(source, order.source_rows[h][pos:pos + take],
                                            batch.acts[h][fill:fill + take])
            return copies
        # Native: read the buffer in source order, each token to its batch row's address.
        lo, hi = pieces[0][0], pieces[-1][0] + pieces[-1][1]  # the stream indices cut
        index = order.stream_index
        used = None if lo == 0 and hi == len(index) else np.flatnonzero(
            (index >= lo) & (index < hi))  # a resumed buffer, or an epoch cut short
        at = index if used is None else index[used] - lo
        first = np.array([pos - lo for pos, _, _, _ in pieces], np.int64)
        lengths = np.array([take for _, take, _, _ in pieces], np.int64)
        piece_of = np.repeat(np.arange(len(pieces)), lengths)  # of each stream index
        row_in_batch = np.arange(hi - lo, dtype=np.int64) - np.repeat(first, lengths) + \
            np.repeat(np.array([fill for _, _, _, fill in pieces], np.int64), lengths)
        for h, (source, _) in loaded.sources.items():
            row_bytes = source.shape[1] * source.itemsize
            bases = np.array([batch.acts[h].ctypes.data for _, _, batch, _ in pieces],
                             np.int64)
            address = (bases[piece_of] + row_in_batch * row_bytes)[at]
            rows = order.valid_rows[h] if used is None else order.valid_rows[h][used]
            copies += gather.submit_rows(self._copy_rows, source, rows, address)
        return copies

    def _produce(self) -> Iterator[Batch]:
        """Batches in step order. Each buffer is cut into batches (their token rows and
        ids filled at once) and its activations copied into them on the gather threads;
        a buffer's batches are handed over once its copies are done, while the next
        buffer's copies run and the one after it is read (`prefetch_buffers` ahead)."""
        plan = self.plan
        # Buffers are reused round-robin: allocated once per iteration, freed with it.
        slots = [self._new_slot() for _ in range(self.prefetch_buffers + 1)]
        work = self._work()
        # Futures of the buffers loading or loaded, not yet cut, in order (see _load).
        loads: collections.deque[concurrent.futures.Future] = collections.deque()
        # Buffers cut whose copies may still read their slot: (loaded, copies).
        held: collections.deque[tuple[_Loaded, list]] = collections.deque()
        window = read_window.ReadWindow(self.reads_in_flight)
        gather = gather_lib.Gather(self.gather_threads)
        # Buffers load on a thread of their own, while the buffer before them is cut:
        # mapping shard files and working out the order is per-buffer work that would
        # otherwise stall the cutting, which bounds the stream on a host with many cores.
        loader = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="actx-reader-load")
        issued = 0

        def top_up():
            nonlocal issued
            while len(loads) + len(held) < len(slots):
                item = next(work, None)
                if item is None:
                    return
                # Its slot is free: the copies out of the buffer that held it are done.
                loads.append(loader.submit(self._load, *item,
                                           slot=slots[issued % len(slots)], window=window))
                issued += 1

        seconds = self.producer_seconds

        def hand_over(batch: Batch) -> Iterator[Batch]:
            nonlocal busy_since
            window.pump()  # the next buffer's reads go on while batches are handed over
            seconds["busy"] += time.perf_counter() - busy_since
            yield batch
            busy_since = time.perf_counter()

        # The newest buffer's copies run on while the one before it is handed over,
        # unless its slot is the only one (then the next read waits for them). Measured
        # on bench/read.py's no-codec store against copying and handing over in turn:
        # about 7% faster, for one more buffer of batches in memory (peak RSS 445 -> 540
        # MB there).
        keep_copying = 1 if len(slots) > 1 else 0
        copied_through = -1  # the copies of every buffer cut up to this one are done

        def release(keep: int) -> None:
            """Waits for the copies of all but the newest `keep` buffers cut, and frees the
            slots of those whose copies are done (their next reads may start)."""
            nonlocal copied_through
            while held and (len(held) > keep or all(c.done() for c in held[0][1])):
                t0 = time.perf_counter()
                for copy in held[0][1]:
                    copy.result()
                seconds["copy_wait"] += time.perf_counter() - t0
                held.popleft()  # its slot takes a read; mapped files unmap when unused
                copied_through += 1

        # Batches of about two buffers (one handed over, one being copied into) and those
        # queued beyond the pool, per hook (with the conversion thread, its queue too).
        queued = self._prefetch_depth * (2 if self._convert_in_thread else 1)
        per_buffer = -(-plan.buffer_rows * self.run.seq_len // plan.batch_size) + 1
        pool = array_pool.ArrayPool((2 * per_buffer + queued + 3) * len(self.hooks))
        ready: collections.deque[tuple[Batch, int]] = collections.deque()  # (batch, last buffer)
        step, fill, out, cut = self.start_step, 0, None, 0
        busy_since = time.perf_counter()
        try:
            top_up()
            while loads:
                release(keep=len(held))
                top_up()
                t0 = time.perf_counter()
                loaded = loads.popleft().result()
                try:
                    window.wait(loaded.reads)
                except ValueError as e:  # how tensorstore reports a failed read
                    raise self._read_error(loaded, e) from e
                order = loaded.order
                seconds["read_wait"] += time.perf_counter() - t0
                pieces, pos = [], loaded.skip
                while (pos < len(order.rows)
                       and (self.stop_step is None or step < self.stop_step)):
                    epoch, _ = plan.locate(step)
                    if epoch != loaded.epoch:
                        break
                    if out is None:
                        n = plan.batch_tokens(step)
                        out = Batch(step, epoch, {h: pool.empty((n, f.shape[1]), f.dtype)
                                                  for h, (f, _) in loaded.sources.items()},
                                    np.empty(n, np.int64), np.empty(n, np.int64),
                                    np.empty(n, np.int32))
                    take = min(len(out) - fill, len(order.rows) - pos)
                    part, into = slice(pos, pos + take), slice(fill, fill + take)
                    pieces.append((pos, take, out, fill))
                    out.rows[into] = order.rows[part]
                    out.cols[into] = order.cols[part]
                    out.input_ids[into] = order.input_ids[part]
                    fill, pos = fill + take, pos + take
                    if fill == len(out):
                        ready.append((out, cut))
                        step, fill, out = step + 1, 0, None
                held.append((loaded, self._copy(loaded, pieces, gather)))
                del loaded, order, pieces
                cut += 1
                release(keep=keep_copying)
                top_up()
                while ready and ready[0][1] <= copied_through:
                    yield from hand_over(ready.popleft()[0])
            release(keep=0)
            while ready:
                yield from hand_over(ready.popleft()[0])
            seconds["busy"] += time.perf_counter() - busy_since
        finally:
            # A stopped stream leaves no write into a freed slot or batch: no load queues
            # reads after the window is cancelled (one under way has its reads dropped),
            # and the copies under way finish before the buffers and batches may go.
            window.cancel()
            loader.shutdown(wait=True, cancel_futures=True)
            gather.close()

    def _produce_converted(self) -> Iterator[Batch]:
        batches = self._produce()
        try:
            for batch in batches:
                yield self._convert(batch)
        finally:
            batches.close()

    def _convert_ahead(self) -> Iterator[Batch]:
        """Batches cut on a thread of their own while this one converts the last."""
        cut = prefetch_lib.Prefetcher(self._produce, self._prefetch_depth,
                                      "actx-reader-stream-cut")
        try:
            for batch in cut:
                yield self._convert(batch)
        finally:
            cut.close()

    def _convert(self, batch: Batch) -> Batch:
        acts = batch.acts
        if self.normalizers:
            acts = {h: self.normalizers[h](a) for h, a in acts.items()}
        batch.acts = {h: formats.convert(a, self.framework, self.dtype, self.sharding)
                      for h, a in acts.items()}
        return batch

    def __iter__(self) -> Iterator[Batch]:
        if not self._prefetch_in_thread:
            yield from self._produce_converted()
            return
        yield from self._prefetcher

    def close(self, timeout: float = 30.0) -> None:
        """Stops the background thread (idempotent); see prefetch.Prefetcher.close."""
        self._prefetcher.close(timeout)

    def __enter__(self) -> "ShuffledStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
