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
reader.streaming.stream (`run.stream`: shuffled row blocks + a permuted buffer) reads at about
sequential speed but is not a global permutation; training should use it. When the
selected tokens fit in memory, `in_memory=True` here loads their activations once with
sequential reads (padding dropped) and gathers each batch from RAM: the same exact order,
at memory speed.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Sequence

import numpy as np

from actx.reader import formats
from actx.reader import options as options_lib
from actx.reader import prefetch as prefetch_lib
from actx.reader import snapshot
from actx.reader import shuffle as shuffle_lib


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


@dataclasses.dataclass(frozen=True)
class ExactOptions:
    """run.batches' own keywords.

    shuffle: False reads in row-major order (evaluation, statistics).
    in_memory: load the valid tokens' activations (n_tokens x hidden per hook, stored
      dtype) with one sequential pass first, then serve batches from RAM; same order.
    """

    shuffle: bool = True
    in_memory: bool = False


class TokenBatches:
    """An iterable of `Batch`es over a run's committed valid tokens.

    Built by `run.batches(hooks, batch_size, **keywords)`, which sorts the keywords into
    the option groups: `tokens`, `order`, `output` (reader.options, shared with
    run.stream) and `exact` (ExactOptions, its own).
    hooks: one hook or several (every batch holds the same tokens for each).
    batch_size: tokens per batch on this process.

    Use as an iterator, ideally in a `with` block so the prefetch thread stops on exit.
    """

    def __init__(self, run: snapshot.RunSnapshot, hooks: "str | Sequence[str]",
                 batch_size: int, *,
                 tokens: options_lib.TokenOptions = options_lib.TokenOptions(),
                 order: options_lib.OrderOptions = options_lib.OrderOptions(),
                 output: options_lib.OutputOptions = options_lib.OutputOptions(),
                 exact: ExactOptions = ExactOptions(), _window: bool = False,
                 _window_after: int | None = None):
        # _window: one window of a following reader (reader.streaming.follow), which may
        # hold no token of this process; _window_after: a window of its first epoch, after
        # that many tokens (of every process): each process reads its share of the
        # window's order (shuffle.continued_shares), not its block of each global step.
        self.run = run
        self.hooks = options_lib.hook_names(hooks, run)
        for hook in self.hooks:
            run.hook(hook)
        self.index = shuffle_lib.build_index(run, tokens.partitions, tokens.exclude_bos,
                                             tokens.exclude_special, self.hooks,
                                             tokens.whole_document, tokens.exclude,
                                             tokens.outlier_factor)
        bounds = None if _window_after is None else shuffle_lib.continued_shares(
            _window_after, len(self.index), order.process_count)
        share = None if bounds is None else (int(bounds[order.process_index]),
                                             int(bounds[order.process_index + 1]))
        self.plan = shuffle_lib.ShufflePlan(len(self.index), batch_size, order.seed,
                                            order.process_index, order.process_count,
                                            order.drop_last, exact.shuffle,
                                            allow_empty=_window, share=share)
        self.framework = output.checked_framework
        self.dtype = run.read_dtype(self.hooks, output.dtype)  # a float8 hook: dequantised
        self.sharding = output.sharding
        self.normalizers = formats.normalizers(run, self.hooks, output.normalize,
                                               tokens.left_out())
        self.start_step = order.start_step
        self.stop_step = (None if order.epochs is None
                          else order.epochs * self.plan.steps_per_epoch)
        self.prefetch = output.prefetch
        self._prefetcher = prefetch_lib.Prefetcher(self._produce, max(1, output.prefetch),
                                                   "actx-reader-prefetch")
        self._memory = self._load_all() if exact.in_memory else None

    def _load_all(self) -> dict[str, np.ndarray]:
        """Activations [n_tokens, hidden] of every indexed token, one stored object at a
        time (sequential reads), in index order."""
        seq_len, flat = self.index.seq_len, self.index.flat
        block = self.run.spec.layout.rows_per_shard
        out = {h: np.empty((len(flat), self.run.hook(h).hidden),
                           formats.numpy_dtype(self.run.hook(h).dtype)) for h in self.hooks}
        for pid in self.index.partitions:
            part = self.run.partitions[pid]
            for lo in range(part.row_start, part.row_stop, block):
                hi = min(lo + block, part.row_stop)
                a, b = np.searchsorted(flat, [lo * seq_len, hi * seq_len])
                if a == b:
                    continue
                futures = {h: self.run.read_async(h, lambda a: a[lo:hi]) for h in self.hooks}
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
        return self._prefetcher.thread

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
