"""Shuffled batches of valid token activations, prefetched by a background thread.

Reading: a batch of B tokens in global-permutation order touches up to B different rows,
and the smallest decodable unit of an activation array is an inner chunk of
[chunk_rows, chunk_tokens, hidden] (LayoutSpec; chunk_tokens 0 is the whole row). An exact
global shuffle therefore reads (and decompresses) about chunk_rows * chunk_tokens * hidden
values per token returned; the read is one tensorstore `vindex` gather per hook, which
fetches each needed chunk once and issues all fetches concurrently (nothing here depends
on the chunk shape: tensorstore maps coordinates to chunks). This buys an exact,
reproducible, host-splittable order (what the tests and multi-host trainers need) at the
price of read amplification, measured by bench/read.py against sequential bandwidth
(`--chunk-tokens` shows what smaller inner chunks save). The two-level shuffle of
reader.stream (`run.stream`: shuffled row blocks + a permuted buffer) reads at about
sequential speed but is not a global permutation; training should use it. When the
selected tokens fit in memory, `in_memory=True` here loads their activations once with
sequential reads (padding dropped) and gathers each batch from RAM: the same exact order,
at memory speed.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Literal, Sequence

import numpy as np

from reader import formats
from reader import masks as masks_lib
from reader import prefetch as prefetch_lib
from reader import run as run_lib
from reader import shuffle as shuffle_lib


@dataclasses.dataclass
class Batch:
    """One process's batch at a global step.

    acts: per hook, activations [n, hidden] (numpy, jax or torch as asked).
    rows / cols: where each token lives in the run (numpy int64 [n]);
    input_ids: its token id (numpy int32 [n]). Row i of every array is the same token.
    """

    step: int
    epoch: int
    acts: dict[str, Any]
    rows: np.ndarray
    cols: np.ndarray
    input_ids: np.ndarray

    def __len__(self) -> int:
        return len(self.rows)


class TokenBatches:
    """An iterable of `Batch`es over a run's committed valid tokens.

    hooks: one hook or several (every batch holds the same tokens for each).
    batch_size: tokens per batch on this process.
    seed / epochs: permutation seed; epochs to run (None: forever).
    start_step: global step to begin at (resume: the step after the last one trained).
    process_index / process_count: this trainer's share (disjoint across processes).
    drop_last: see `shuffle.ShufflePlan`.
    exclude_bos / exclude_special: leave out tokens with the BOS id (anywhere in a row, also
      mid-row in concat packing) / the tokenizer's special tokens.
    exclude: token masks to leave out (reader.masks.REASONS: "special", "bos", "padding",
      "doc_boundary", "outlier"); outlier_factor: the "outlier" limit, in medians.
    whole_document: only tokens that attended to their whole document up to themselves
      (tokens/context_start == 0; see README, "What each token sees").
    partitions: committed partitions to use (default: all committed at open time).
    prefetch: batches read ahead by a background thread (0: read in the caller's thread).
    framework: "numpy", "jax" or "torch"; as_jax=True is framework="jax".
    sharding: with framework="jax", a `jax.sharding.Sharding` of the global batch (see
      `formats.convert`): device-ready arrays for a sharded trainer.
    dtype: cast activations (e.g. "float32"); None keeps the stored dtype.
    normalize: None, "standardize" or "unit_mean_norm" with the statistics stored by
      `run.compute_stats` (float32 output; see `formats.Normalizer`).
    shuffle: False reads in row-major order (evaluation, statistics).
    in_memory: load the valid tokens' activations (n_tokens x hidden per hook, stored
      dtype) with one sequential pass first, then serve batches from RAM; same order.

    Use as an iterator, ideally in a `with` block so the prefetch thread stops on exit.
    """

    def __init__(self, run: run_lib.Run, hooks: "str | Sequence[str]", batch_size: int, *,
                 seed: int = 0, epochs: int | None = 1, start_step: int = 0,
                 process_index: int = 0, process_count: int = 1, drop_last: bool = True,
                 exclude_bos: bool = False, exclude_special: bool = False,
                 whole_document: bool = False, exclude: Sequence[str] | None = None,
                 outlier_factor: float = masks_lib.DEFAULT_OUTLIER_FACTOR,
                 partitions: Sequence[int] | None = None, prefetch: int = 2,
                 framework: Literal["numpy", "jax", "torch"] = "numpy",
                 as_jax: bool = False, dtype: str | None = None, shuffle: bool = True,
                 in_memory: bool = False, sharding: Any = None,
                 normalize: str | None = None):
        self.run = run
        self.hooks = (hooks,) if isinstance(hooks, str) else tuple(hooks)
        if not self.hooks:
            raise ValueError("hooks: name at least one hook")
        for hook in self.hooks:
            run.hook(hook)
        self.index = shuffle_lib.build_index(run, partitions, exclude_bos, exclude_special,
                                             self.hooks, whole_document, exclude,
                                             outlier_factor)
        self.plan = shuffle_lib.ShufflePlan(len(self.index), batch_size, seed, process_index,
                                            process_count, drop_last, shuffle)
        self.framework = formats.check_framework("jax" if as_jax else framework)
        self.dtype = dtype
        self.sharding = sharding
        self.normalizers = formats.normalizers(run, self.hooks, normalize)
        self.start_step = start_step
        self.stop_step = None if epochs is None else epochs * self.plan.steps_per_epoch
        self.prefetch = prefetch
        self._prefetcher = prefetch_lib.Prefetcher(self._produce, max(1, prefetch),
                                                   "actx-reader-prefetch")
        self._memory = self._load_all() if in_memory else None

    def _load_all(self) -> dict[str, np.ndarray]:
        """Activations [n_tokens, hidden] of every indexed token, one stored object at a
        time (sequential reads), in index order."""
        seq_len, flat = self.index.seq_len, self.index.flat
        block = self.run.spec.layout.rows_per_shard
        out = {h: np.empty((len(flat), self.run.hook(h).hidden),
                           self.run.activation_array(h).dtype.numpy_dtype) for h in self.hooks}
        for pid in self.index.partitions:
            part = self.run.partitions[pid]
            for lo in range(part.row_start, part.row_stop, block):
                hi = min(lo + block, part.row_stop)
                a, b = np.searchsorted(flat, [lo * seq_len, hi * seq_len])
                if a == b:
                    continue
                futures = {h: self.run.activation_array(h)[lo:hi].read() for h in self.hooks}
                for h, f in futures.items():
                    values = f.result()
                    out[h][a:b] = values.reshape(-1, values.shape[-1])[flat[a:b] - lo * seq_len]
        return out

    @property
    def steps_per_epoch(self) -> int:
        return self.plan.steps_per_epoch

    def __len__(self) -> int:
        if self.stop_step is None:
            raise TypeError("endless (epochs=None) batches have no length")
        return max(0, self.stop_step - self.start_step)

    def read_step(self, step: int, order: shuffle_lib.OrderCache | None = None) -> Batch:
        """The batch at one global step (random access; the iterator calls this)."""
        order = order or shuffle_lib.OrderCache(self.plan)
        epoch, positions = order.positions(step)
        rows, cols = self.index.coords(positions)
        if self._memory is not None:
            acts = {h: m[positions] for h, m in self._memory.items()}
        else:
            acts = self.run.gather(self.hooks, rows, cols)
        acts = {h: self.normalizers[h](a) if self.normalizers else a for h, a in acts.items()}
        acts = {h: formats.convert(a, self.framework, self.dtype, self.sharding)
                for h, a in acts.items()}
        return Batch(step, epoch, acts, rows, cols, self.index.input_ids[positions])

    def _steps(self) -> Iterator[int]:
        step = self.start_step
        while self.stop_step is None or step < self.stop_step:
            yield step
            step += 1

    def _produce(self) -> Iterator[Batch]:
        """Batches in step order (the prefetch thread runs this; see prefetch.Prefetcher)."""
        order = shuffle_lib.OrderCache(self.plan)
        for step in self._steps():
            yield self.read_step(step, order)

    @property
    def _thread(self):
        """The prefetch thread while one runs (None once closed)."""
        return self._prefetcher._thread

    def __iter__(self) -> Iterator[Batch]:
        if self.prefetch <= 0:
            yield from self._produce()
            return
        yield from self._prefetcher

    def close(self, timeout: float = 30.0) -> None:
        """Stops the prefetch thread (idempotent).

        The thread stops at its next queue hand-over (at most one batch read away); this
        waits up to `timeout` seconds for it, then leaves it to finish that read on its own
        (it is a daemon thread and puts nothing more once stopped).
        """
        self._prefetcher.close(timeout)

    def __enter__(self) -> "TokenBatches":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
