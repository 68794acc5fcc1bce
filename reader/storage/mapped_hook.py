"""The stream's reads of a hook stored without a codec on local disk: the buffer's shard
files are mapped side by side (reader.storage.mapped_region) and each token is copied once, from
the page cache straight into its batch, instead of decoded into a buffer and copied again.

A block whose shard file is refused by reader.storage.shard_files (or missing, or unreadable) is
decoded by tensorstore into anonymous memory of the same region, so one buffer may mix
both and the result is always what tensorstore (and zarr-python) would read.

As with tensorstore's own "memmap" file mode (reader.storage.read_contexts), a file cut short in
place while mapped would end the process (SIGBUS); committed objects are only ever
replaced whole (a new file renamed over the old one), which a mapping never sees.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Sequence

import numpy as np
import tensorstore as ts

from actx.reader.storage import mapped_region
from actx.reader.storage import read_window
from actx.reader.storage import shard_files
from actx.schemas import layout as layout_lib

# How many reasons a hook keeps for shard files it decoded instead (for diagnosis).
_MAX_REASONS = 4


def plain_layout(run, hook: str, array: ts.TensorStore
                 ) -> tuple[shard_files.PlainShards | None, str]:
    """(layout, "") where the hook's shard files can be mapped, else (None, why not)."""
    if run.location.scheme != "file":
        return None, f"{run.location.scheme}:// run (mapping is for local files)"
    if not mapped_region.available():
        return None, "this platform has no mapping support here (Linux x86-64/arm64 only)"
    key = run.stored_key(layout_lib.activation_array_key(hook))
    try:
        metadata = shard_files.read_metadata(run.location.join(key, "zarr.json").path)
        return shard_files.plain_shards(metadata, tuple(array.shape),
                                        np.dtype(array.dtype.numpy_dtype),
                                        array.fill_value), ""
    except shard_files.Refused as e:
        return None, str(e)


@dataclasses.dataclass
class Loaded:
    """One buffer of one hook: token (row in buffer * seq_len + column) -> row of `source`."""

    source: np.ndarray  # read-only [region rows, hidden]
    row_of: np.ndarray  # int64 [buffer rows * seq_len]


@dataclasses.dataclass
class _Shard:
    index: int
    fd: int
    nbytes: int
    first_rows: np.ndarray  # int64 [chunks per shard]; -1: not stored


class MappedHook:
    """Loads buffers of one hook by mapping its shard files (see the module docstring).

    mapped_blocks / decoded_blocks count the blocks read each way; refusals holds the
    first few reasons a shard file was decoded instead.
    """

    def __init__(self, run, hook: str, array: ts.TensorStore,
                 layout: shard_files.PlainShards):
        self.layout = layout
        self._array = array
        self._seq_len = layout.shape[1]
        self._path = lambda shard: run.location.join(
            run.stored_key(layout_lib.activation_shard_key(hook, shard))).path
        self._chunk_grid, self._inside_grid = layout.token_grids()
        self.mapped_blocks = self.decoded_blocks = 0
        self.refusals: list[str] = []
        self.disabled = ""  # why every block is decoded from now on ("": it is not)

    def _open_shard(self, index: int) -> _Shard | None:
        path = self._path(index)
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as e:  # a missing shard is all fill: tensorstore says so
            self._refuse(f"{path}: {e.strerror}")
            return None
        try:
            nbytes, index_bytes = shard_files.read_index(fd, self.layout)
            return _Shard(index, fd, nbytes,
                          shard_files.chunk_rows_in_file(self.layout, index_bytes, nbytes))
        except (shard_files.Refused, OSError) as e:
            os.close(fd)
            self._refuse(f"{path}: {e}")
            return None

    def _refuse(self, reason: str) -> None:
        if len(self.refusals) < _MAX_REASONS:
            self.refusals.append(reason)

    def load(self, blocks: Sequence[tuple[int, int]], window: read_window.ReadWindow,
             group: read_window.ReadGroup) -> Loaded:
        """Maps the shard files of `blocks` (row ranges, in buffer order); blocks that
        cannot be mapped are queued in `window` as tensorstore reads (part of `group`:
        wait for it before gathering)."""
        lay = self.layout
        for lo, hi in blocks:
            if not 0 <= lo < hi <= lay.shape[0]:
                raise ValueError(f"rows {lo}..{hi} are outside the array's {lay.shape[0]} rows")
        per_block: list[list[_Shard] | None] = []
        opened: list[_Shard] = []
        try:
            for lo, hi in blocks:
                shards = []
                for s in range(lo // lay.shard_rows, (hi - 1) // lay.shard_rows + 1):
                    shard = None if self.disabled else self._open_shard(s)
                    if shard is None:
                        shards = None
                        break
                    opened.append(shard)
                    shards.append(shard)
                per_block.append(shards)
            try:
                region = self._map_files(blocks, per_block)
            except OSError as e:  # e.g. a file system that cannot map: decode from now on
                self.disabled = f"mapping failed: {e}"
                self._refuse(self.disabled)
                per_block = [None] * len(blocks)
                region = self._map_files(blocks, per_block)
        finally:  # a mapping holds its file open by itself
            for shard in opened:
                os.close(shard.fd)
        return self._fill(region, blocks, per_block, window, group)

    def _map_files(self, blocks, per_block) -> mapped_region.Region:
        """A region of segment 0 (one token of the fill value), then per block its shard
        files, mapped, or memory for tensorstore to decode it into."""
        lay = self.layout
        sizes = [lay.row_bytes]
        for (lo, hi), shards in zip(blocks, per_block):
            sizes += ([s.nbytes for s in shards] if shards is not None
                      else [(hi - lo) * self._seq_len * lay.row_bytes])
        region = mapped_region.Region(sizes, lay.row_bytes)
        segment = 1
        for shards in per_block:
            for shard in shards or [None]:
                if shard is not None:
                    region.map_file(segment, shard.fd)
                segment += 1
        return region

    def _fill(self, region, blocks, per_block, window, group) -> Loaded:
        """Where each token of the buffer lies in `region`; queues the decodes."""
        lay, seq_len = self.layout, self._seq_len
        region.writable(0, lay.dtype)[:lay.hidden] = lay.fill
        fill_row = region.first_row[0]
        row_of = np.empty(sum(hi - lo for lo, hi in blocks) * seq_len, np.int64)
        segment, at = 1, 0
        for (lo, hi), shards in zip(blocks, per_block):
            out = row_of[at * seq_len:(at + hi - lo) * seq_len]
            if shards is None:  # decoded by tensorstore into anonymous memory
                memory = region.writable(segment, lay.dtype)
                target = ts.array(memory.reshape(hi - lo, seq_len, lay.hidden), copy=False,
                                  write=True)
                window.add(group, functools.partial(target.write, self._array[lo:hi]))
                out[:] = region.first_row[segment] + np.arange(len(out))
                segment += 1
                self.decoded_blocks += 1
            else:
                for shard in shards:
                    base = shard.index * lay.shard_rows
                    a, b = max(lo, base) - base, min(hi, base + lay.shard_rows) - base
                    first = shard.first_rows[self._chunk_grid[a:b]]
                    rows = np.where(first < 0, fill_row, region.first_row[segment] + first
                                    + self._inside_grid[a:b])
                    out[(base + a - lo) * seq_len:(base + b - lo) * seq_len] = rows.ravel()
                    segment += 1
                self.mapped_blocks += 1
            at += hi - lo
        region.page_in()
        return Loaded(region.rows(lay.dtype, lay.hidden), row_of)
