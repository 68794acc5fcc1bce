"""One buffer of a stream (reader.streaming.stream): its reads, its permuted order, and the copies
of its tokens into the batches cut from it.

A buffer's reads are queued (each block decoded into its rows of a reused slot, or a
mapped hook's shard files mapped: reader.storage.mapped_hook), its token rows read, and its
permuted order worked out once they arrive; then its tokens are copied into their
batches on the gather threads: by reader.storage.row_copy's C kernel in source order (each token
to its batch row's address), or by numpy's gather in stream order.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import numpy as np
import tensorstore as ts

from actx.reader.streaming import blocks as blocks_lib
from actx.reader.streaming import gather as gather_lib
from actx.reader import formats
from actx.reader import masks as masks_lib
from actx.reader.storage import read_window
from actx.reader import snapshot
from actx.reader.errors import ReaderError
from actx.schemas import advice
from actx.schemas import quantised


@dataclasses.dataclass
class Loaded:
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
    order: Any = None  # its Order, once loaded


@dataclasses.dataclass
class Order:
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



class BufferReader:
    """Loads a stream's buffers and copies their tokens into batches.

    acts: hook -> its activation array (opened in the stream's read context); mapped:
    hook -> reader.storage.mapped_hook.MappedHook for the hooks read from mapped shard files;
    tokens: the token arrays the filter needs (segment_ids, input_ids, ...);
    copy_rows: reader.storage.row_copy's kernel, or None for numpy's gather;
    dequantised: float8 hook -> the dtype (float32 or bfloat16) the native copy writes it
    into the batch in, dequantised with its scales (read as `<hook>.scale`, which then
    does not go into the batch); the other float8 hooks go into it as stored.
    """

    def __init__(self, run: snapshot.RunSnapshot, plan: blocks_lib.StreamPlan,
                 hooks: tuple[str, ...], acts: dict, mapped: dict, tokens: list,
                 token_filter: masks_lib.TokenFilter, copy_rows: Callable | None,
                 dequantised: dict[str, str] | None = None):
        self.run, self.plan, self.hooks = run, plan, hooks
        self.acts, self.mapped, self.tokens = acts, mapped, tokens
        self.token_filter, self.copy_rows = token_filter, copy_rows
        self.dequantised = dequantised or {}
        if self.dequantised and copy_rows is None:
            raise ValueError("dequantising in the copy needs the native row copy")
        self._scale_of = {quantised.scale_array(h): h for h in self.dequantised}

    def batch_arrays(self, sources: dict) -> dict[str, tuple[int, np.dtype]]:
        """What a batch holds of a buffer's `sources` (hook -> (source, row_of)): hook ->
        (values per token, dtype); a hook dequantised in the copy in its read dtype, its
        scales not at all."""
        arrays = {}
        for h, (source, _) in sources.items():
            if h in self._scale_of:
                continue
            dtype = (formats.numpy_dtype(self.dequantised[h]) if h in self.dequantised
                     else source.dtype)
            arrays[h] = (source.shape[1], dtype)
        return arrays

    def new_slot(self) -> dict[str, np.ndarray]:
        return {h: np.empty((self.plan.buffer_rows, self.run.seq_len, a.shape[2]),
                            a.dtype.numpy_dtype)
                for h, a in self.acts.items() if h not in self.mapped}

    def _issue(self, epoch: int, buf: blocks_lib.Buffer, skip: int,
               slot: dict[str, np.ndarray], window: read_window.ReadWindow) -> Loaded:
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
                                                    self.acts[h][lo:hi]))
            tokens.append([t[lo:hi].read() for t in self.tokens])
            run_rows.append(np.arange(lo, hi, dtype=np.int64))
            at += hi - lo
        sources = {h: (a.reshape(-1, a.shape[2]), None) for h, a in slot.items()}
        for h, hook_reads in self.mapped.items():
            loaded = hook_reads.load(blocks, window, group)
            sources[h] = (loaded.source, loaded.row_of)
        window.pump()
        return Loaded(epoch, buf, skip, {h: sources[h] for h in self.hooks}, group, tokens,
                       np.concatenate(run_rows))

    def read_error(self, loaded: Loaded, error: Exception) -> ReaderError:
        parts = sorted({int(p) for p in self.plan.table.partition[loaded.buffer.blocks]})
        loc = self.run.location
        return ReaderError(
            f"{self.run.location}: reading activations of partitions {parts} failed: "
            f"{error}. The stored data is damaged or unreadable: `{advice.verify(loc)}` "
            f"names the partitions; `{advice.repair(loc)}`, then `{advice.rerun(loc)}`, "
            f"writes them again.")

    def load(self, epoch: int, buf: blocks_lib.Buffer, skip: int,
              slot: dict[str, np.ndarray], window: read_window.ReadWindow) -> Loaded:
        """A buffer's reads queued and its order worked out (on the stream's loading
        thread, while the buffer before it is cut)."""
        loaded = self._issue(epoch, buf, skip, slot, window)
        loaded.order = self._order(loaded)
        return loaded

    def _order(self, loaded: Loaded) -> Order:
        """The buffer's permuted order (needs its token rows, not its activations), and
        where each hook's copy reads: in stream order for numpy's gather, in source order
        (with each token's stream index) for the native copy."""
        valid, perm, input_ids = self._permuted(loaded)
        order = valid[perm]
        # take(mode="clip"): no temporary (see reader.streaming.gather); in range by construction.
        result = Order(loaded.run_rows.take(order // self.run.seq_len, mode="clip"),
                        np.remainder(order, self.run.seq_len),
                        input_ids.take(order, mode="clip"), {})
        if self.copy_rows is None:
            result.source_rows = {h: order if row_of is None else row_of.take(order, mode="clip")
                                  for h, (_, row_of) in loaded.sources.items()}
        else:
            result.stream_index = np.empty(len(perm), np.int64)
            result.stream_index[perm] = np.arange(len(perm))
            result.valid_rows = {h: valid if row_of is None else row_of.take(valid, mode="clip")
                                 for h, (_, row_of) in loaded.sources.items()}
        return result

    def _permuted(self, loaded: Loaded) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(flat slot positions of the valid tokens, ascending; the buffer's permutation of
        them; input_ids [rows*T])."""
        values = [np.concatenate([f[i].result() for f in loaded.tokens])
                  for i in range(len(self.tokens))]
        inp = values[1]
        valid = np.flatnonzero(self.token_filter.keep(values))
        table, blocks = self.plan.table, loaded.buffer.blocks
        counted = int(table.tokens[blocks].sum())
        if len(valid) != counted:
            raise RuntimeError(
                f"{self.run.location}: rows {loaded.run_rows[0]}..{loaded.run_rows[-1]} hold "
                f"{len(valid)} valid tokens now but {counted} when the stream "
                f"was opened; the token arrays changed under the reader: reopen the run")
        rows = table.row_stop[blocks] - table.row_start[blocks]
        valid = self.plan.keep(blocks, valid, (np.cumsum(rows) - rows) * self.run.seq_len)
        return valid, self.plan.buffer_order(loaded.epoch, loaded.buffer, len(valid)), \
            inp.reshape(-1)

    def copy(self, loaded: Loaded, pieces: list, gather: gather_lib.Gather) -> list:
        """Starts copying a buffer's tokens into the batches cut from it; `pieces` are
        (first stream index, tokens, batch, first row in the batch), in stream order.
        Returns the copies' futures (none: copied already, on this thread)."""
        if not pieces:
            return []
        order, copies = loaded.order, []
        if self.copy_rows is None:  # numpy: gather each piece in stream order
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
        def source_rows(h: str) -> np.ndarray:
            return order.valid_rows[h] if used is None else order.valid_rows[h][used]

        for h, (source, _) in loaded.sources.items():
            if h in self._scale_of:  # applied in its hook's copy
                continue
            row_bytes = source.shape[1] * pieces[0][2].acts[h].itemsize  # as the batch holds it
            bases = np.array([batch.acts[h].ctypes.data for _, _, batch, _ in pieces],
                             np.int64)
            address = (bases[piece_of] + row_in_batch * row_bytes)[at]
            if h in self.dequantised:
                scales, _ = loaded.sources[quantised.scale_array(h)]
                copies += gather.submit_dequantise(
                    self.copy_rows.dequantise_rows, source, source_rows(h), address,
                    scales, source_rows(quantised.scale_array(h)), source.dtype.name,
                    self.dequantised[h] == "bfloat16")
                continue
            copies += gather.submit_rows(self.copy_rows, source, source_rows(h), address)
        return copies

