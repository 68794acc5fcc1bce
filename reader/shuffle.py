"""The global shuffle: one seeded permutation of every valid token, split across processes.

Valid tokens (segment_ids > 0, without the tokens reader.masks.TokenFilter leaves out) of
the chosen committed partitions are indexed in row-major order; epoch e of seed s visits
them in the order of `np.random.default_rng([s, e]).permutation`. Global step k of the
permutation is the slice [k*G, (k+1)*G) with G = batch_size * process_count, and process
p takes the p-th batch_size block of it, so P trainers together see exactly what one
trainer with batch G would, disjointly. The order depends only on the seed, the epoch and
the set of tokens, so a job resumes at any step by recomputing it.

Memory: 12 bytes per valid token (int64 coordinate + uint32 permutation position) plus
4 for the token id: ~16 GB per billion tokens. Runs larger than one host's memory should
be read through `partitions=` subsets (e.g. one range per epoch segment).
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

import numpy as np

from actx.reader import masks as masks_lib
from actx.reader import snapshot


@dataclasses.dataclass(frozen=True)
class TokenIndex:
    """Valid tokens in row-major order: flat = row * seq_len + col, ascending."""

    flat: np.ndarray  # int64 [n]
    input_ids: np.ndarray  # int32 [n]
    seq_len: int
    partitions: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.flat)

    def coords(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(rows, cols) of the tokens at index positions."""
        flat = self.flat[positions]
        return flat // self.seq_len, flat % self.seq_len


def build_index(run: snapshot.RunSnapshot, partitions: Iterable[int] | None = None,
                exclude_bos: bool = False, exclude_special: bool = False,
                hooks: tuple[str, ...] = (), whole_document: bool = False,
                exclude: Iterable[str] | None = None,
                outlier_factor: float = masks_lib.DEFAULT_OUTLIER_FACTOR) -> TokenIndex:
    """Indexes the valid tokens of committed partitions (default: all committed), without
    the tokens of the `exclude` masks (reader.masks).

    Reads only token arrays (4 bytes per position each, and the norms of "outlier"), one
    partition at a time.
    """
    ids = run.committed_ids(partitions, hooks)
    keep = masks_lib.token_filter(run, hooks, exclude, exclude_bos=exclude_bos,
                                  exclude_special=exclude_special,
                                  whole_document=whole_document,
                                  outlier_factor=outlier_factor, partitions=ids)
    sources = keep.sources(run)
    seq_len = run.seq_len
    flats, token_ids = [], []
    for pid in ids:
        part = run.partitions[pid]
        futures = [a[part.row_start:part.row_stop].read() for a in sources]
        values = [f.result() for f in futures]
        local = np.flatnonzero(keep.keep(values).reshape(-1))
        flats.append(local + part.row_start * seq_len)
        token_ids.append(values[1].reshape(-1)[local])
    flat = np.concatenate(flats) if flats else np.zeros(0, np.int64)
    ids_arr = np.concatenate(token_ids) if token_ids else np.zeros(0, np.int32)
    return TokenIndex(flat.astype(np.int64), ids_arr.astype(np.int32), seq_len, ids)


def continued_shares(before: int, tokens: int, process_count: int) -> np.ndarray:
    """Bounds [process_count + 1] of the processes' shares of `tokens` tokens that continue
    an epoch after `before` tokens (of every process): process p reads [bounds[p],
    bounds[p + 1]), the shares laid in process order, each process holding every
    `process_count`-th token of the epoch so far in count (the first processes one more
    where it does not divide). So however the epoch is cut into ranges, the processes'
    tokens so far differ by at most one, and a data-parallel job's processes run out
    together (reader.streaming.follow's windows)."""
    p = np.arange(process_count, dtype=np.int64)

    def held(total: int) -> np.ndarray:  # of the first `total` tokens, each process's count
        return (total + process_count - 1 - p) // process_count

    return np.concatenate([[0], np.cumsum(held(before + tokens) - held(before))])


@dataclasses.dataclass(frozen=True)
class ShufflePlan:
    """Which index positions process `process_index` reads at each global step.

    drop_last: drop the tail of each epoch that does not fill a global batch (every
      process then gets the same number of equal batches, as lockstep trainers need).
      Without it the epoch ends with one short step whose tokens are split as evenly as
      possible across processes, so every token is read exactly once per epoch.
    """

    num_tokens: int
    batch_size: int
    seed: int = 0
    process_index: int = 0
    process_count: int = 1
    drop_last: bool = True
    shuffle: bool = True
    # A following reader's window may hold no token (reader.streaming.follow): no error.
    allow_empty: bool = False
    # A following reader's window in its first epoch: this process reads positions
    # [start, stop) of the window's order (continued_shares), cut into batches of
    # batch_size, instead of its block of each global step.
    share: tuple[int, int] | None = None

    def __post_init__(self):
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {self.batch_size}")
        if not 0 <= self.process_index < self.process_count:
            raise ValueError(f"process_index {self.process_index} must be in "
                             f"[0, process_count={self.process_count})")
        if self.steps_per_epoch == 0 and not self.allow_empty:
            raise ValueError(
                f"{self.num_tokens} tokens do not fill one global batch of "
                f"{self.global_batch} (batch_size {self.batch_size} x {self.process_count} "
                f"processes); use a smaller batch or drop_last=False")

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.process_count

    @property
    def steps_per_epoch(self) -> int:
        if self.share is not None:
            return -(-(self.share[1] - self.share[0]) // self.batch_size)
        full, rest = divmod(self.num_tokens, self.global_batch)
        return full + (1 if rest and not self.drop_last else 0)

    @property
    def tokens_per_epoch(self) -> int:
        """Tokens this process reads in an epoch (all but the last step hold batch_size)."""
        steps = self.steps_per_epoch
        if not steps:
            return 0
        _, lo, hi = self.step_slice(steps - 1)
        return (steps - 1) * self.batch_size + hi - lo

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The permutation of index positions for one epoch (uint32 when it fits)."""
        dtype = np.uint32 if self.num_tokens < 2**32 else np.int64
        order = np.arange(self.num_tokens, dtype=dtype)
        if self.shuffle:
            np.random.default_rng([self.seed, epoch]).shuffle(order)
        return order

    def step_slice(self, step: int) -> tuple[int, int, int]:
        """(epoch, start, stop): this process's slice of the epoch order at a global step."""
        epoch, k = divmod(step, self.steps_per_epoch)
        if self.share is not None:
            lo = self.share[0] + k * self.batch_size
            return epoch, lo, min(lo + self.batch_size, self.share[1])
        g0 = k * self.global_batch
        g1 = min(g0 + self.global_batch, self.num_tokens)
        if g1 - g0 == self.global_batch:
            lo = g0 + self.process_index * self.batch_size
            return epoch, lo, lo + self.batch_size
        # The short last step: array_split-like even split of the remainder.
        bounds = np.linspace(g0, g1, self.process_count + 1).astype(np.int64)
        return epoch, int(bounds[self.process_index]), int(bounds[self.process_index + 1])


class OrderCache:
    """Keeps the current epoch's permutation, recomputing it only when the epoch changes."""

    def __init__(self, plan: ShufflePlan):
        self.plan = plan
        self._epoch = None
        self._order = None

    def positions(self, step: int) -> tuple[int, np.ndarray]:
        """(epoch, index positions) of this process's batch at a global step."""
        epoch, lo, hi = self.plan.step_slice(step)
        if epoch != self._epoch:
            self._order, self._epoch = self.plan.epoch_order(epoch), epoch
        return epoch, self._order[lo:hi].astype(np.int64)
