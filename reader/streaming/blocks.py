"""The plan of the streaming shuffle: row blocks, their owner process, and buffers per epoch.

A block is a contiguous range of `block_rows` rows inside one committed partition (the
last block of a partition may be shorter). Blocks are what the stream reads, each with one
sequential read per hook, so `block_rows` a multiple of the inner chunk rows (ideally
`rows_per_shard`: one stored object) decodes nothing it does not return.

Who reads what: every process computes the same table (valid tokens per block, from the
token arrays) and the same assignment of blocks to processes: blocks in the order of a
seed-only permutation, each to the process with the fewest tokens so far. The assignment
is fixed across epochs, so every process has the same number of tokens every epoch (the
loads differ by at most one block) and lockstep trainers get the same step count each
epoch. A following stream's window (reader.streaming.follow) is split by tokens instead
(`shares`): the blocks in the same permutation are laid end to end and each process takes
its range of their tokens (reader.shuffle.continued_shares), a block at a range's edge
read by both processes, each keeping its part; so the processes' first epochs hold equal
counts of tokens over any number of windows. Each epoch permutes the process's own blocks
again and cuts them into buffers of at most `buffer_rows` rows; the stream permutes the
valid tokens inside each buffer.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

import numpy as np

from actx.reader import masks as masks_lib
from actx.reader import snapshot


@dataclasses.dataclass(frozen=True)
class BlockTable:
    """The run's blocks in row order: rows [row_start[i], row_stop[i]) of partition[i],
    holding tokens[i] valid tokens."""

    row_start: np.ndarray  # int64 [n_blocks]
    row_stop: np.ndarray  # int64 [n_blocks]
    partition: np.ndarray  # int32 [n_blocks]
    tokens: np.ndarray  # int64 [n_blocks]
    block_rows: int
    partitions: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.row_start)

    @property
    def total_tokens(self) -> int:
        return int(self.tokens.sum())


def count_blocks(run: snapshot.RunSnapshot, block_rows: int,
                 partitions: Iterable[int] | None = None,
                 exclude_bos: bool = False, exclude_special: bool = False,
                 hooks: tuple[str, ...] = (), whole_document: bool = False,
                 token_filter: "masks_lib.TokenFilter | None" = None) -> BlockTable:
    """Valid tokens per block of the chosen committed partitions (default: all committed).

    Reads segment_ids and input_ids once (8 bytes per position; token arrays are stored one
    object per partition), and what `token_filter` (default: from the flags) needs, and
    keeps only one count per block.
    """
    if block_rows < 1:
        raise ValueError(f"block_rows must be positive, got {block_rows}")
    ids = run.committed_ids(partitions, hooks)
    if token_filter is None:
        token_filter = masks_lib.token_filter(run, hooks, exclude_bos=exclude_bos,
                                              exclude_special=exclude_special,
                                              whole_document=whole_document, partitions=ids)
    sources = token_filter.sources(run)
    starts, stops, parts, counts = [], [], [], []
    for pid in ids:
        part = run.partitions[pid]
        futures = [a[part.row_start:part.row_stop].read() for a in sources]
        per_row = token_filter.keep([f.result() for f in futures]).sum(axis=1)
        lo = np.arange(part.row_start, part.row_stop, block_rows, dtype=np.int64)
        hi = np.minimum(lo + block_rows, part.row_stop)
        # Per-block sums of the per-row counts (reduceat over each block's first row).
        counts.append(np.add.reduceat(per_row, lo - part.row_start).astype(np.int64))
        starts.append(lo)
        stops.append(hi)
        parts.append(np.full(len(lo), pid, np.int32))

    def cat(xs, dtype):
        return np.concatenate(xs).astype(dtype) if xs else np.zeros(0, dtype)

    return BlockTable(cat(starts, np.int64), cat(stops, np.int64), cat(parts, np.int32),
                      cat(counts, np.int64), block_rows, ids)


def assign_blocks(table: BlockTable, seed: int, process_count: int) -> np.ndarray:
    """Owner process of each block (int32 [n_blocks]); the same on every process.

    Greedy over a seeded permutation: each block goes to the process with the fewest
    tokens so far (lowest index on ties), so loads differ by at most one block's tokens
    and a process's blocks are spread over the whole run, not one contiguous range.
    """
    owner = np.empty(len(table), np.int32)
    loads = np.zeros(process_count, np.int64)
    for b in _block_order(table, seed):
        p = int(np.argmin(loads))
        owner[b] = p
        loads[p] += table.tokens[b]
    return owner


def _block_order(table: BlockTable, seed: int) -> np.ndarray:
    """The seed-only permutation of the table's blocks that the processes are dealt in."""
    return np.random.default_rng([seed, 0x0B10C]).permutation(len(table))


def shared_blocks(table: BlockTable, seed: int, start: int, stop: int
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(blocks ascending, first kept token of each, end of its kept tokens) of the tokens
    [start, stop) of the table's blocks laid end to end in the seeded order; a block's
    kept tokens are a range of its valid tokens in row order. Blocks without a token
    in the range are not read."""
    order = _block_order(table, seed)
    ends = np.cumsum(table.tokens[order])
    begins = ends - table.tokens[order]
    mine = (begins < stop) & (ends > start) & (table.tokens[order] > 0)
    blocks, begins, ends = order[mine], begins[mine], ends[mine]
    first = np.maximum(start - begins, 0)
    last = np.minimum(stop, ends) - begins
    by_row = np.argsort(blocks)
    return blocks[by_row], first[by_row], last[by_row]


@dataclasses.dataclass(frozen=True)
class Buffer:
    """One buffer of an epoch: blocks (indices into the table) read together, and the
    offset of its first token in the process's epoch stream."""

    index: int
    blocks: np.ndarray  # int64 [k]
    rows: int  # rows held (sum of the blocks' rows)
    tokens: int  # valid tokens held
    stream_start: int


class StreamPlan:
    """Blocks, buffers and steps of one process, for every epoch.

    batch_size: tokens per batch on this process; buffer_rows: rows one buffer holds.
    drop_last: every process runs floor(min load / batch_size) steps per epoch (the same
      count everywhere, as lockstep trainers need) and the rest of each epoch's stream is
      dropped (different tokens each epoch, since the block order changes). Without it the
      epoch ends with one short batch and every token is read exactly once; processes may
      then run different step counts.
    allow_empty: a process with no token is no error (steps_per_epoch 0: nothing to read).
    shares: bounds [process_count + 1] of each process's range of the table's tokens (a
      following stream's window: see the module docstring), instead of whole blocks;
      `kept_first` and `kept_stop` then say which of a block's valid tokens are this
      process's.
    """

    def __init__(self, table: BlockTable, batch_size: int, buffer_rows: int, seed: int = 0,
                 process_index: int = 0, process_count: int = 1, drop_last: bool = True,
                 allow_empty: bool = False, shares: np.ndarray | None = None):
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if not 0 <= process_index < process_count:
            raise ValueError(f"process_index {process_index} must be in "
                             f"[0, process_count={process_count})")
        if buffer_rows < table.block_rows:
            raise ValueError(f"the buffer ({buffer_rows} rows) must hold at least one block "
                             f"({table.block_rows} rows); raise buffer_tokens or lower "
                             f"block_rows")
        self.table = table
        self.batch_size = batch_size
        self.buffer_rows = buffer_rows
        self.seed = seed
        self.process_index = process_index
        self.process_count = process_count
        self.drop_last = drop_last
        # Of each block, the range of its valid tokens (in row order) this process reads.
        self.kept_first = np.zeros(len(table), np.int64)
        self.kept_stop = table.tokens.copy()
        if shares is None:
            owner = assign_blocks(table, seed, process_count)
            self.loads = np.bincount(owner, weights=table.tokens,
                                     minlength=process_count).astype(np.int64)
            self.my_blocks = np.flatnonzero(owner == process_index)
        else:
            if drop_last:
                raise ValueError("a share of tokens is read whole: drop_last must be False")
            self.my_blocks, first, stop = shared_blocks(
                table, seed, int(shares[process_index]), int(shares[process_index + 1]))
            self.kept_first[self.my_blocks], self.kept_stop[self.my_blocks] = first, stop
            self.loads = np.diff(shares).astype(np.int64)
        self.tokens_per_epoch = int(self.loads[process_index])
        if drop_last:
            self.steps_per_epoch = int(self.loads.min()) // batch_size
        else:
            self.steps_per_epoch = -(-self.tokens_per_epoch // batch_size)
        # A following stream's window may hold no token of this process (allow_empty):
        # it reads nothing from it, where a stream of its own would be useless.
        if self.steps_per_epoch == 0 and not allow_empty:
            raise ValueError(
                f"process {process_index} of {process_count} has {int(self.loads.min())} "
                f"tokens, less than one batch of {batch_size}; use a smaller batch_size, "
                f"fewer processes or drop_last=False")

    def buffers(self, epoch: int) -> list[Buffer]:
        """This process's buffers of one epoch, in stream order."""
        order = self.my_blocks[
            np.random.default_rng([self.seed, epoch, self.process_index]).permutation(
                len(self.my_blocks))]
        rows = (self.table.row_stop - self.table.row_start)[order]
        buffers, i, start = [], 0, 0
        while i < len(order):
            j, held = i + 1, int(rows[i])
            while j < len(order) and held + rows[j] <= self.buffer_rows:
                held, j = held + int(rows[j]), j + 1
            tokens = int(self.kept_tokens(order[i:j]).sum())
            buffers.append(Buffer(len(buffers), order[i:j], held, tokens, start))
            i, start = j, start + tokens
        return buffers

    @property
    def num_tokens(self) -> int:
        """Valid tokens of the table, every process's (as shuffle.ShufflePlan's)."""
        return self.table.total_tokens

    def kept_tokens(self, blocks: np.ndarray) -> np.ndarray:
        """The tokens this process reads of each of `blocks`."""
        return self.kept_stop[blocks] - self.kept_first[blocks]

    def keep(self, blocks: np.ndarray, valid: np.ndarray, block_starts: np.ndarray
             ) -> np.ndarray:
        """Of `valid` (ascending positions of the valid tokens of `blocks` read one after
        another, block i's from block_starts[i]), those this process reads."""
        first, stop = self.kept_first[blocks], self.kept_stop[blocks]
        if not (first.any() or (stop != self.table.tokens[blocks]).any()):
            return valid
        at = np.searchsorted(valid, block_starts)
        return np.concatenate([valid[a + f:a + s] for a, f, s in zip(at, first, stop)])

    def locate(self, step: int) -> tuple[int, int]:
        """(epoch, offset of the step's first token in that epoch's stream)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        epoch, k = divmod(step, self.steps_per_epoch)
        return epoch, k * self.batch_size

    def batch_tokens(self, step: int) -> int:
        """Tokens in the batch at a step (batch_size, or less at a drop_last=False end)."""
        _, offset = self.locate(step)
        return min(self.batch_size, self.tokens_per_epoch - offset)

    def buffer_order(self, epoch: int, buffer: Buffer, n_valid: int) -> np.ndarray:
        """The permutation of a buffer's valid tokens (seeded by epoch, process, buffer)."""
        rng = np.random.default_rng([self.seed, epoch, self.process_index, buffer.index, 1])
        return rng.permutation(n_valid)
