"""Shuffled training batches at the speed of sequential reads: a two-level shuffle.

Level one (reader.streaming.blocks): each epoch visits this process's row blocks in a new seeded
order, `buffer_tokens` positions (a few blocks) at a time. Level two: the valid tokens of
each buffer are permuted and cut into batches; a batch may take the tail of one buffer and
the head of the next. Tensorstore reads and decodes the next `prefetch_buffers` buffers on
its own threads (decoding is parallel across inner chunks; `reads_in_flight` blocks at a
time, reader.storage.read_window), each block with one request per hook, decoded straight into a
reused buffer (ts.array over numpy memory). Each returned token is then copied once into
its batch (reader.streaming.gather, on `gather_threads` threads): by reader.storage.row_copy's C kernel,
which reads the buffer in order and scatters the rows into the buffer's batches (2-3 x
numpy's gather, which reads at random and is the fallback where it was not built at install;
`copy_path` says which). So the stored bytes are decoded once and copied once, whatever
the batch size. A buffer's batches are handed over once its copies are done, while the
next buffer's copies run and the one after it is read. Each buffer is loaded on a thread
of its own (its reads queued, a mapped hook's shard files mapped, its permuted order
worked out once its token rows arrive), and JAX batches are copied to the device on
another, so the thread that cuts batches does little else (`producer_seconds` says where
its time goes). A local hook stored without a codec is not decoded at all
(reader.storage.mapped_hook, `map_shards`): the buffer's shard files are mapped, a background
thread pages the next buffer in (reader.storage.mapped_region), and each token is copied once,
from the page cache straight into its batch.

The trade (stated, and measured by bench/read.py with reader.streaming.mixing): a batch holds
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

import dataclasses
from typing import Iterator, Sequence

from actx.reader.streaming import blocks as blocks_lib
from actx.reader import formats
from actx.reader.streaming import gather as gather_lib
from actx.reader.storage import mapped_hook
from actx.reader import masks as masks_lib
from actx.reader import options as options_lib
from actx.reader import prefetch as prefetch_lib
from actx.reader.storage import read_window
from actx.reader.storage import row_copy
from actx.reader import shuffle as shuffle_lib
from actx.reader import snapshot
from actx.reader.streaming import buffers as stream_buffers
from actx.reader.streaming import pipeline as stream_pipeline
from actx.reader.batches import Batch
from actx.reader.storage.read_contexts import default_file_io_mode, read_contexts
from actx.reader.streaming.state import StreamSettings, StreamState
from actx.schemas import layout
from actx.schemas import quantised

# Positions per buffer: 0.47 GB per hook and buffer at hidden 896 in bfloat16, 2.1 GB at
# 4096; two buffers are read into (prefetch_buffers=1) and about two are in batches.
DEFAULT_BUFFER_TOKENS = 1 << 18
# Block reads in flight on local or memory runs: with tensorstore's read(), more than two
# made its read memory fault in anew (bench/read.py's store: 4k page faults per epoch at
# 2, 40k at 4, 79k at 8) for no faster epoch.
DEFAULT_LOCAL_READS = 2


@dataclasses.dataclass(frozen=True)
class ReadOptions:
    """How a stream reads: its buffers, reads and copies (run.stream's own keywords).

    buffer_tokens: positions (rows * seq_len, padding included) one buffer holds; rounded
      down to whole blocks, at least one block.
    block_rows: rows per read (default: the layout's rows_per_shard, one stored object);
      smaller blocks (a multiple of layout.chunk_rows) mix better for the same buffer.
    prefetch_buffers: buffers read ahead (memory: see the module docstring).
    gcs_request_concurrency: concurrent GCS requests for this stream's reads (None: the
      process-wide setting, schemas.ts_context).
    reads_in_flight: block reads (one block of one hook each) decoding at a time (None:
      2, each decoded in parallel over its inner chunks; 16 for gs://, where each request
      waits longer); their decode memory is about reads_in_flight * block_rows * seq_len *
      hidden * itemsize.
    file_io_mode: how tensorstore reads local files it decodes (see read_contexts; None:
      default_file_io_mode, memmap for local runs; no effect on gs://).
    gather_threads: threads copying tokens into batches (None: reader.streaming.gather's default, a
      quarter of the cores while tensorstore decodes, one per core when all is mapped).
    map_shards: copy the tokens of a local hook stored without a codec straight from its
      mapped shard files (reader.storage.mapped_hook) instead of decoding them first; anything
      else is decoded by tensorstore. `read_paths` says which each hook got, and why.
    native_copy: copy tokens into batches with reader.storage.row_copy's C kernel (each buffer read
      in order, its rows scattered into the batches) where it was built at install, else
      with numpy's gather; `copy_path` says which, and why. The bytes are the same. The C
      kernel also dequantises a float8 hook on the way (`dequantised_in_copy` names the
      hooks; not for JAX batches without normalisation, which are multiplied on the
      device); numpy dequantises the batch after its copy, the same values.
    """

    buffer_tokens: int = DEFAULT_BUFFER_TOKENS
    block_rows: int | None = None
    prefetch_buffers: int = 1
    gcs_request_concurrency: int | None = None
    reads_in_flight: int | None = None
    file_io_mode: str | None = None
    gather_threads: int | None = None
    map_shards: bool = True
    native_copy: bool = True


class ShuffledStream:
    """An iterable of `Batch`es: streaming two-level shuffle of a run's valid tokens.

    Built by `run.stream(hooks, batch_size, **keywords)`, which sorts the keywords into
    the option groups: `tokens`, `order`, `output` (reader.options, shared with
    run.batches) and `reads` (ReadOptions, the stream's own).
    hooks: one hook or several (every batch holds the same tokens for each).
    batch_size: tokens per batch on this process.
    resume: a `StreamState` or its dict form, from `state(batch)`; checked against these
      settings, and the stream starts right after that batch (instead of start_step).
    """

    def __init__(self, run: snapshot.RunSnapshot, hooks: "str | Sequence[str]",
                 batch_size: int, *,
                 tokens: options_lib.TokenOptions = options_lib.TokenOptions(),
                 order: options_lib.OrderOptions = options_lib.OrderOptions(),
                 output: options_lib.OutputOptions = options_lib.OutputOptions(),
                 reads: ReadOptions = ReadOptions(),
                 resume: "StreamState | dict | None" = None, _window: bool = False,
                 _window_after: int | None = None):
        # _window: one window of a following stream (reader.streaming.follow), which may
        # hold no token of this process, and whose arrays the follower opened once;
        # _window_after: a window of its first epoch, after that many tokens (of every
        # process): the processes share its tokens (shuffle.continued_shares), not blocks.
        self.run = run
        self.hooks = options_lib.hook_names(hooks, run)
        buffer_rows, block_rows = _buffer_rows(run, reads.buffer_tokens, reads.block_rows)
        ids = run.committed_ids(tokens.partitions, self.hooks)
        self._filter = masks_lib.token_filter(
            run, self.hooks, tokens.exclude, exclude_bos=tokens.exclude_bos,
            exclude_special=tokens.exclude_special, whole_document=tokens.whole_document,
            outlier_factor=tokens.outlier_factor, partitions=ids)
        table = blocks_lib.count_blocks(run, block_rows, ids, hooks=self.hooks,
                                        token_filter=self._filter)
        # One process reads every block, as a stream of the window's partitions would.
        shares = None if _window_after is None or order.process_count == 1 else \
            shuffle_lib.continued_shares(_window_after, table.total_tokens, order.process_count)
        self.plan = blocks_lib.StreamPlan(table, batch_size, buffer_rows, order.seed,
                                          order.process_index, order.process_count,
                                          order.drop_last, allow_empty=_window, shares=shares)
        excluded = tuple(self._filter.exclude)
        self.settings = StreamSettings(
            run.spec.fingerprint, self.hooks, tuple(table.partitions), batch_size,
            buffer_rows, block_rows, order.seed, order.process_index, order.process_count,
            order.drop_last, tokens.exclude_bos, tokens.exclude_special,
            tokens.whole_document,
            # Recorded only when used: states saved before masks existed still load.
            excluded or None, tokens.outlier_factor if "outlier" in excluded else None)
        self.start_step = (order.start_step if resume is None
                           else StreamState.parse(resume).check(self.settings))
        self.stop_step = (None if order.epochs is None
                          else order.epochs * self.plan.steps_per_epoch)
        self.framework = output.checked_framework
        self.sharding = output.sharding
        self.dtype = run.read_dtype(self.hooks, output.dtype)  # a float8 hook: dequantised
        self.normalizers = formats.normalizers(run, self.hooks, output.normalize,
                                               tokens.left_out())
        # Where the thread that cuts batches spent its time (seconds, summed over the
        # iterations): busy (everything but handing batches over), of which waiting for
        # block reads and token rows, and waiting for the gather threads' copies. Busy
        # close to the wall time: the cutting limits the stream; mostly waiting for
        # reads: the storage or the decode does.
        self.producer_seconds = {"busy": 0.0, "read_wait": 0.0, "copy_wait": 0.0}
        self._buffers = self._open_reads(reads)
        self._prefetch_depth = max(1, output.prefetch)
        self._prefetch_in_thread = output.prefetch > 0
        # JAX arrays: the copy to the device (synchronous for host memory, ~6 GB/s on an
        # H100 host, as long as cutting the batches) gets a thread of its own, so the next
        # batch is cut meanwhile.
        self._convert_in_thread = self._prefetch_in_thread and self.framework == "jax"
        self._prefetcher = prefetch_lib.Prefetcher(
            self._convert_ahead if self._convert_in_thread else self._produce_converted,
            self._prefetch_depth, "actx-reader-stream")

    def _open_reads(self, reads: ReadOptions) -> stream_buffers.BufferReader:
        """Sets up how the buffers are read and copied (each choice checked now, not in the
        thread): `read_paths` per hook, `copy_path`, the reads in flight and the threads."""
        run = self.run
        self.prefetch_buffers = max(0, reads.prefetch_buffers)
        reads_in_flight = reads.reads_in_flight
        if reads_in_flight is None:
            reads_in_flight = 16 if run.location.scheme == "gs" else DEFAULT_LOCAL_READS
        read_window.ReadWindow(reads_in_flight)  # checks it now, not in the thread
        self.reads_in_flight = reads_in_flight
        self.file_io_mode = (default_file_io_mode(run) if reads.file_io_mode is None
                             else reads.file_io_mode)
        acts_context, tokens_context = read_contexts(reads.gcs_request_concurrency,
                                                     self.file_io_mode)
        # A float8 hook's scales are read as one more array of the buffer and applied in
        # the copy of its values (`dequantised_in_copy`), or copied into the batch beside
        # them and applied when the batch is handed over (numpy's copy, JAX's device).
        read = self.hooks + tuple(quantised.scale_array(h) for h in self.hooks
                                  if run.hook(h).quantised)
        acts = {h: run.open_array(layout.activation_array_key(h), acts_context)
                for h in read}
        mapped = self._mapped = {}  # hook -> mapped_hook.MappedHook
        self.read_paths = {}
        for h in read:
            plain, why = (mapped_hook.plain_layout(run, h, acts[h]) if reads.map_shards
                          else (None, "map_shards=False"))
            if plain is not None:
                mapped[h] = mapped_hook.MappedHook(run, h, acts[h], plain)
            self.read_paths[h] = "mapped" if plain is not None else f"decoded: {why}"
        copy_rows, why = (row_copy.kernel() if reads.native_copy
                          else (None, "native_copy=False"))
        self.copy_path = why if copy_rows is not None else f"numpy: {why}"
        # The native copy dequantises a float8 hook on the way into the batch (one pass,
        # on the copy threads); JAX batches without normalisation keep its bytes and
        # scales, multiplied on the device (formats.hand_over: half the bytes to copy).
        on_device = self.framework == "jax" and not self.normalizers
        self.dequantised_in_copy = tuple(
            h for h in self.hooks if copy_rows is not None and not on_device
            and run.hook(h).quantised)
        gather_threads = reads.gather_threads
        if gather_threads is None:
            gather_threads = gather_lib.default_threads(len(mapped) < len(read),
                                                        bool(self.dequantised_in_copy))
        self.gather_threads = gather_threads
        gather_lib.Gather(gather_threads).close()  # checks it now, not in the thread
        return stream_buffers.BufferReader(
            run, self.plan, read, acts, mapped,
            self._filter.sources(run, tokens_context), self._filter, copy_rows,
            {h: self.dtype for h in self.dequantised_in_copy})

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

    def resume_state(self, batch: Batch) -> StreamState:
        """Where to resume after `batch` (pass it, or its `state` dict, as `resume=`)."""
        return StreamState(batch.step + 1, self.settings)

    def state(self, batch: Batch) -> dict:
        """What to save to resume after `batch` (pass it back as `resume=`): the JSON
        form of `resume_state(batch)`."""
        return self.resume_state(batch).to_dict()

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

    def _produce(self) -> Iterator[Batch]:
        """Batches in step order (reader.streaming.pipeline: `prefetch_buffers` buffers read
        ahead, each cut into batches and copied into them on the gather threads)."""
        # The batches the consumer may hold beyond the pipeline's two buffers' worth:
        # the prefetch queue (with the conversion thread, its queue too).
        queued = self._prefetch_depth * (2 if self._convert_in_thread else 1)
        pipeline = stream_pipeline.BufferPipeline(
            self._buffers, self._work(), self.start_step, self.stop_step,
            self.prefetch_buffers, self.reads_in_flight, self.gather_threads, queued,
            self.producer_seconds)
        yield from pipeline.batches()

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
        return formats.hand_over(batch, self.normalizers, self.framework, self.dtype,
                                 self.sharding)

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


def _buffer_rows(run: snapshot.RunSnapshot, buffer_tokens: int,
                 block_rows: int | None) -> tuple[int, int]:
    """(rows per buffer, rows per block), checked against the run's layout."""
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
    return buffer_rows, block_rows
