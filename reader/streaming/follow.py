"""Training while a run extracts: a stream that follows a live run's commits.

`run.stream(..., follow=True)` reads partitions as they commit and ends when the run is
complete (every partition, or every one of `partitions=`, committed).

The order. The partitions are taken in the order they committed: one listing of
commits/ per poll gives each marker's version (a GCS generation, a local modification
time: schemas.commit.committed_in_order), and what a poll finds new is appended to the
stream's commit order in that order, once it is settled: a version is the time of the
marker's write, which is seen a little later (a GCS upload's end, a local file linked in
place after its write), so a marker listed now may still be followed by one with an
earlier time. A partition joins the order once its marker's time is `settle_s` behind
the store's clock (the later of the newest marker's time and this machine's clock), or
once every partition is committed; on memory:// versions count the writes in the order
they are seen, and settle at once. So every reader of the run, whenever it lists, builds
the same order: the processes of a data-parallel job cut the same windows. The order is
cut into windows of `window_partitions` partitions (the last window holds what is left when the run is
complete); each window is read as a stream of its own (reader.streaming.stream: the
two-level shuffle over its partitions, seeded by the seed and the window's index; or with
`exact`, run.batches' permutation), each process reading its share of the window's
tokens (shuffle.continued_shares: the shares continue the count of the windows before, so
the processes' tokens so far differ by at most one, and a data-parallel job's processes
take as many batches), and the windows' tokens are cut into batches of `batch_size` one
after another (each token copied once more, from its window's batch into the stream's).
So the first epoch holds every token of the run exactly once (its last batch may be short),
and its order depends only on the seed, the settings and the commit order. The stream
records that order (`commit_order`, and in every `state(batch)`), so a resumed stream
takes the same windows and the same next batch, and a recorded order replays the stream
(`commit_order=`) once the run is complete. Later epochs are full shuffles of the
complete run (ShuffledStream's epochs, seeded by the seed).

Waiting. While the next window has not committed, the follower lists commits/ once per
`poll_s` (one listing per interval, however large the run; nothing is read per
partition but its data). After `stall_s` without a new commit it reads the run's phase
from the heartbeats (schemas.run_phase: what `actx status` says) and logs it, with the
dead hosts and status's advice, every `stall_s`; after `wait_timeout_s` it raises
RunStalledError saying the same. An epoch never ends early: only a complete run ends
the first one. A run that stops and is rerun continues the same stream: its markers are
create-only, so what committed keeps its place in the order.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import threading
import time
from typing import Iterator, Sequence

import numpy as np

from actx.reader import batches as batches_lib
from actx.reader import errors
from actx.reader import formats
from actx.reader import masks as masks_lib
from actx.reader import options as options_lib
from actx.reader import prefetch as prefetch_lib
from actx.reader import snapshot
from actx.reader.batches import Batch
from actx.reader.streaming import stream as stream_lib
from actx.reader.streaming.state import StreamSettings, StreamState
from actx.schemas import advice
from actx.schemas import commit as commit_lib
from actx.schemas import run_phase

log = logging.getLogger("actx.reader.follow")


@dataclasses.dataclass(frozen=True)
class FollowOptions:
    """How a stream follows a live run (run.stream's keywords; see the module docstring).

    follow: read partitions as they commit, until the run is complete.
    window_partitions: partitions shuffled together in the first epoch (a larger window
      mixes more and waits for more commits before its first batch).
    poll_s: seconds between listings of commits/ while the stream waits for commits.
    stall_s: after this long without a new commit, the run's phase, dead hosts and
      status's advice are read and logged (logger "actx.reader.follow"), again every
      stall_s; `waiting` holds the last such line.
    wait_timeout_s: after this long without a new commit, RunStalledError (None: wait
      for ever, still logging every stall_s).
    commit_order: a recorded order (`stream.commit_order`, or a saved state's) to take
      the partitions in: replays a stream; partitions it does not name follow it.
    settle_s: how far behind the store's clock a marker's time must be before its
      partition joins the order (see the module docstring): longer than a marker takes
      from its write to being seen, and than the clocks of this machine and the store's
      differ.
    """

    follow: bool = False
    window_partitions: int = 4
    poll_s: float = 10.0
    stall_s: float = run_phase.DEFAULT_STALE_AFTER_S
    wait_timeout_s: float | None = 3600.0
    commit_order: Sequence[int] | None = None
    settle_s: float = 30.0

    def check(self) -> None:
        if self.window_partitions < 1:
            raise ValueError(f"window_partitions must be >= 1, got {self.window_partitions}")
        if not self.poll_s > 0 or not self.stall_s > 0:
            raise ValueError(f"poll_s ({self.poll_s}) and stall_s ({self.stall_s}) must be "
                             f"positive")
        if not self.settle_s >= 0:
            raise ValueError(f"settle_s must be 0 or more, got {self.settle_s}")
        if self.wait_timeout_s is not None and self.wait_timeout_s <= self.settle_s:
            raise ValueError(f"wait_timeout_s ({self.wait_timeout_s:g}) must be longer than "
                             f"settle_s ({self.settle_s:g}): commits settle before they are "
                             f"read")
        if self.wait_timeout_s is not None and not self.wait_timeout_s > 0:
            raise ValueError(f"wait_timeout_s must be positive or None, got "
                             f"{self.wait_timeout_s}")


class _Stopped(Exception):
    """The stream was closed while it waited for commits."""


class CommitFollower:
    """The order in which a run's partitions committed, as one reader sees it, and the
    wait for more. At most one listing of commits/ per `poll_s`."""

    def __init__(self, runs: "snapshot.RunSnapshot | Sequence[snapshot.RunSnapshot]",
                 wanted: "Sequence[int] | None", options: FollowOptions,
                 stop: threading.Event, recorded: Sequence[int] = ()):
        # Several runs: extractions of one run read together (reader.aligned); a partition
        # joins the order once committed in every one, when the last of them committed.
        self.runs = (runs,) if isinstance(runs, snapshot.RunSnapshot) else tuple(runs)
        run = self.runs[0]
        self.run, self.options, self.stopped = run, options, stop
        n = len(run.partitions)
        if wanted is not None:
            outside = sorted(p for p in set(wanted) if not 0 <= p < n)
            if outside:
                raise ValueError(f"partitions: {outside} are not partitions of {run.location} "
                                 f"(0..{n - 1})")
        self.wanted = None if wanted is None else frozenset(wanted)
        self.total = n if self.wanted is None else len(self.wanted)
        self.order: list[int] = [int(p) for p in recorded
                                 if self.wanted is None or p in self.wanted]
        if len(set(self.order)) != len(self.order):
            raise ValueError(f"commit_order names a partition twice: {list(recorded)}")
        self.listings = 0  # listings of commits/ so far (the cost: one per poll_s at most)
        self.committed = len(self.order)  # partitions wanted with a marker, at the last poll
        self.waiting = ""  # why the last wait took long (phase, dead hosts, advice)
        self.waits: collections.deque[str] = collections.deque(maxlen=100)  # the last ones
        self._last_poll = -math.inf
        self._lock = threading.Lock()

    @property
    def complete(self) -> bool:
        return len(self.order) >= self.total

    def poll(self) -> int:
        """Lists commits/ once; appends the partitions new to the order (in the order they
        committed, those settled: see the module docstring) and returns how many, or how
        many were committed since the last listing where more (those still settling: the
        run moves)."""
        stamps = [commit_lib.committed_stamps(r.store) for r in self.runs]
        common = set(stamps[0]).intersection(*stamps[1:])
        when = {p: max(s[p] for s in stamps) for p in common}
        listed = sorted(common, key=lambda p: (when[p], p))
        self.listings += 1
        self._last_poll = time.monotonic()
        committed = set(listed)
        missing = [p for p in self.order if p not in committed]
        if missing:
            raise errors.UncommittedPartitionError(
                f"{self.run.location}: the recorded commit order names partitions "
                f"{missing[:5]} that have no commit marker (markers are never removed: is "
                f"this the run the order was recorded on?); "
                f"`{advice.status(self.run.location)}` shows what is committed")
        seen = set(self.order)
        new = [p for p in listed if p not in seen and (self.wanted is None or p in self.wanted)]
        before, self.committed = self.committed, len(seen | set(new))
        if self.committed < self.total:
            settled = self._settled(when)
            new = [p for p in new if when[p] <= settled]
        self.order += new
        for run, listing in zip(self.runs, stamps):
            run.observe_committed(listing)
        return max(len(new), self.committed - before)

    def _settled(self, when: dict[int, int]) -> float:
        """The latest marker version whose partition may join the order now: no marker
        written before it can still appear (None of the store's versions: none until the
        run is complete)."""
        store = self.run.store
        if store.STAMPS_IN_VISIBLE_ORDER:
            return math.inf
        if store.STAMP_NS is None:
            return -math.inf
        now = max(max(when.values(), default=0), time.time_ns() / store.STAMP_NS)
        return now - self.options.settle_s * 1e9 / store.STAMP_NS

    def _sleep(self, seconds: float) -> None:
        if self.stopped.wait(max(0.0, seconds)):
            raise _Stopped()

    def wait_for(self, n: int) -> None:
        """Returns once the order holds at least `n` partitions or the run is complete;
        raises RunStalledError after wait_timeout_s without a new commit."""
        with self._lock:
            opts = self.options
            since = last_word = time.monotonic()
            while len(self.order) < n and not self.complete:
                self._sleep(self._last_poll + opts.poll_s - time.monotonic())
                if self.poll():
                    since = last_word = time.monotonic()
                    continue
                now = time.monotonic()
                waited = now - since
                timed_out = opts.wait_timeout_s is not None and waited >= opts.wait_timeout_s
                if timed_out or (waited >= opts.stall_s and now - last_word >= opts.stall_s):
                    last_word = now
                    self.waiting = self._why(waited)
                    self.waits.append(self.waiting)
                    if timed_out:
                        raise errors.RunStalledError(
                            f"{self.waiting}; gave up after wait_timeout_s="
                            f"{opts.wait_timeout_s:g}. Nothing was skipped: open the stream "
                            f"again with resume=stream.state(last_batch) once the run moves "
                            f"(or raise wait_timeout_s)")
                    log.warning("%s", self.waiting)

    def _why(self, waited: float) -> str:
        """What the run's heartbeats say while the stream waits."""
        said = []
        for run in self.runs:  # each extraction's workers beat in its own workers/
            named = f"extraction {run.extraction or '(default)'}: " if len(self.runs) > 1 else ""
            try:
                said.append(named + run_phase.read_phase(run.store, self.complete).words())
            except Exception as e:  # noqa: BLE001 -- the wait goes on; say what was unreadable
                said.append(f"{named}the heartbeats could not be read ({type(e).__name__}: {e})")
        words = "; ".join(said)
        return (f"{self.run.location}: following the run, no new commit in the {waited:.1f} s "
                f"this stream has waited "
                f"({self.committed} of {self.total} partitions committed"
                + (f", {self.committed - len(self.order)} of them joining the order once "
                   f"settled (settle_s={self.options.settle_s:g})"
                   if self.committed > len(self.order) else "")
                + f", waiting for the next window); {words}")


def window_seed(seed: int, window: int) -> int:
    """The seed of one window's shuffle: from the stream's seed and the window's index."""
    return int(np.random.SeedSequence([seed, window, 0xF0110]).generate_state(1)[0])


class _CachedArrays:
    """The run as the windows' streams see it: arrays opened once for all windows (each
    window's stream would open them again: a metadata read per hook and window)."""

    def __init__(self, run: snapshot.RunSnapshot):
        self._run = run
        self._opened: dict[str, object] = {}

    def __getattr__(self, name):
        return getattr(self._run, name)

    def open_array(self, key: str, context=None):
        if context is None:
            return self._run.open_array(key)
        if key not in self._opened:
            self._opened[key] = self._run.open_array(key, context)
        return self._opened[key]


class _Cutter:
    """Cuts the tokens of consecutive windows into batches of batch_size."""

    def __init__(self, batch_size: int, step: int):
        self.batch_size, self.step = batch_size, step
        self.out: Batch | None = None
        self.fill = 0

    def add(self, batch: Batch, skip: int = 0) -> Iterator[Batch]:
        pos, n = skip, len(batch)
        while pos < n:
            if self.out is None:
                self.out = self._empty(batch, self.batch_size)
            take = min(self.batch_size - self.fill, n - pos)
            self._copy(batch, pos, take)
            pos += take
            if self.fill == self.batch_size:
                yield self._hand_over()

    def flush(self) -> Iterator[Batch]:
        """The short last batch of the epoch, if any tokens are left."""
        if self.out is not None and self.fill:
            out, n = self.out, self.fill
            yield self._hand_over(Batch(out.step, out.epoch, {h: a[:n] for h, a in out.acts.items()},
                                        out.rows[:n], out.cols[:n], out.input_ids[:n]))

    def _empty(self, like: Batch, n: int) -> Batch:
        return Batch(self.step, 0, {h: np.empty((n, a.shape[1]), a.dtype)
                                    for h, a in like.acts.items()},
                     np.empty(n, np.int64), np.empty(n, np.int64), np.empty(n, np.int32))

    def _copy(self, batch: Batch, pos: int, take: int) -> None:
        out, into, part = self.out, slice(self.fill, self.fill + take), slice(pos, pos + take)
        for h, a in batch.acts.items():
            out.acts[h][into] = a[part]
        out.rows[into], out.cols[into] = batch.rows[part], batch.cols[part]
        out.input_ids[into] = batch.input_ids[part]
        self.fill += take

    def _hand_over(self, batch: Batch | None = None) -> Batch:
        batch = batch or self.out
        self.out, self.fill, self.step = None, 0, self.step + 1
        return batch


class FollowStream:
    """An iterable of `Batch`es over a live run: its first epoch from partitions as they
    commit, every token once, its later epochs full shuffles of the complete run (see the
    module docstring). Built by `run.stream(hooks, batch_size, follow=True, ...)`, or by
    `run.batches(..., follow=True)` (`exact`: each window an exact permutation)."""

    def __init__(self, run: snapshot.RunSnapshot, hooks: "str | Sequence[str]",
                 batch_size: int, *,
                 tokens: options_lib.TokenOptions = options_lib.TokenOptions(),
                 order: options_lib.OrderOptions = options_lib.OrderOptions(),
                 output: options_lib.OutputOptions = options_lib.OutputOptions(),
                 reads: stream_lib.ReadOptions = stream_lib.ReadOptions(),
                 follow: FollowOptions = FollowOptions(follow=True),
                 resume: "StreamState | dict | None" = None,
                 follower: "CommitFollower | None" = None,
                 exact: "batches_lib.ExactOptions | None" = None):
        # follower: one shared by the streams of several extractions (reader.aligned), so
        # they take the same windows; by default the stream's own. exact: each window read
        # as run.batches reads (an exact permutation of the window's tokens,
        # batches.ExactOptions) instead of the two-level shuffle.
        follow.check()
        self.run = run
        self.hooks = options_lib.hook_names(hooks)
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if not 0 <= order.process_index < order.process_count:
            raise ValueError(f"process_index {order.process_index} must be in "
                             f"[0, process_count={order.process_count})")
        excluded = tuple(masks_lib.check_exclude(tokens.exclude))
        if "outlier" in excluded:
            raise ValueError(
                "exclude: 'outlier' needs the token norms of every partition read "
                "(compute_stats), which partitions committed later lack; follow without "
                "it, or once the run is complete run compute_stats and stream it")
        self.batch_size, self.tokens, self.order, self.reads = batch_size, tokens, order, reads
        self.follow_options = follow
        self.exact = exact
        buffer_rows, block_rows = (None, None) if exact is not None else \
            stream_lib._buffer_rows(run, reads.buffer_tokens, reads.block_rows)
        self.settings = StreamSettings(
            run.spec.fingerprint, self.hooks,
            None if tokens.partitions is None else tuple(sorted(set(tokens.partitions))),
            batch_size, buffer_rows, block_rows, order.seed, order.process_index,
            order.process_count, order.drop_last, tokens.exclude_bos, tokens.exclude_special,
            tokens.whole_document, excluded or None, None,
            follow_window=follow.window_partitions,
            follow_split="tokens" if order.process_count > 1 else None)
        state = None if resume is None else StreamState.parse(resume)
        recorded = (state.commit_order if state is not None and state.commit_order is not None
                    else follow.commit_order or ())
        if follower is None:
            follower = CommitFollower(run, tokens.partitions, follow, threading.Event(),
                                      recorded)
            follower.poll()
        self.follower = follower
        self.start_step = order.start_step if state is None else state.check(self.settings)
        self.framework = output.checked_framework
        self.sharding, self.dtype = output.sharding, output.dtype
        self._dtype_checked = False
        # Statistics as stored now (compute_stats on what had committed: its record says
        # which partitions), the same for the whole stream.
        self.normalizers = formats.normalizers(run, self.hooks, output.normalize,
                                               tokens.left_out())
        self._view = _CachedArrays(run)
        # Steps of the first epoch: known once the run is complete and its windows read.
        self.first_epoch_steps: int | None = None
        self.windows_read = 0
        self._prefetch = output.prefetch
        self._prefetcher = prefetch_lib.Prefetcher(self._produce_converted,
                                                   max(1, output.prefetch),
                                                   "actx-reader-follow")

    # -- what the stream is -------------------------------------------------------

    @property
    def commit_order(self) -> tuple[int, ...]:
        """The partitions in the order they committed, as this stream saw them so far:
        pass it as `commit_order=` to replay the stream."""
        return tuple(self.follower.order)

    @property
    def waiting(self) -> str:
        """Why the stream last waited long for a commit ("" when it never did)."""
        return self.follower.waiting

    @property
    def waits(self) -> list[str]:
        """What the stream said each time it waited long, oldest first (the last 100)."""
        return list(self.follower.waits)

    @property
    def listings(self) -> int:
        """Listings of commits/ so far."""
        return self.follower.listings

    def resume_state(self, batch: Batch) -> StreamState:
        """Where to resume after `batch`, with the commit order seen so far."""
        return StreamState(batch.step + 1, self.settings, commit_order=self.commit_order)

    def state(self, batch: Batch) -> dict:
        """What to save to resume after `batch` (pass it back as `resume=`)."""
        return self.resume_state(batch).to_dict()

    # -- reading ------------------------------------------------------------------

    def _window_stream(self, ids: Sequence[int], seed: int, start_step: int,
                       epochs: int | None = 1, drop_last: bool = False,
                       after: int | None = None):
        """A reader of partitions `ids` alone (a ShuffledStream, or a TokenBatches with
        `exact`), numpy out, in this thread. after: a window of the first epoch, after that
        many tokens of every process: the processes share its tokens so that their counts
        so far stay within one of each other."""
        o = self.order
        tokens = dataclasses.replace(self.tokens, partitions=tuple(ids))
        order = options_lib.OrderOptions(seed, epochs, start_step, o.process_index,
                                         o.process_count, drop_last)
        output = options_lib.OutputOptions(prefetch=0)
        if self.exact is not None:
            return batches_lib.TokenBatches(self._view, self.hooks, self.batch_size,
                                            tokens=tokens, order=order, output=output,
                                            exact=self.exact, _window=True,
                                            _window_after=after)
        return stream_lib.ShuffledStream(self._view, self.hooks, self.batch_size,
                                         tokens=tokens, order=order, output=output,
                                         reads=self.reads, _window=True,
                                         _window_after=after)

    def _first_epoch(self) -> Iterator[Batch]:
        """The first epoch's batches from the start step on; sets first_epoch_steps."""
        size, width = self.batch_size, self.follow_options.window_partitions
        target = self.start_step * size  # tokens of the epoch before the start step
        done, every, k = 0, 0, 0  # tokens so far: this process's, every process's
        cutter = _Cutter(size, self.start_step)
        while True:
            self.follower.wait_for((k + 1) * width)
            ids = self.follower.order[k * width:(k + 1) * width]
            if not ids:
                break
            stream = self._window_stream(ids, window_seed(self.order.seed, k), 0,
                                         after=every)
            n = stream.plan.tokens_per_epoch
            window_tokens = stream.plan.num_tokens  # every process's
            if n and done + n > target:
                skip = max(0, target - done)
                if skip >= size:
                    stream.close()
                    stream = self._window_stream(ids, window_seed(self.order.seed, k),
                                                 skip // size, after=every)
                try:
                    first = True
                    for batch in stream:
                        yield from cutter.add(batch, skip % size if first else 0)
                        first = False
                finally:
                    stream.close()
            else:
                stream.close()
            done, every, k = done + n, every + window_tokens, k + 1
            self.windows_read = k
        self.first_epoch_steps = -(-done // size)
        if target < done:
            yield from cutter.flush()

    def _later_epochs(self) -> Iterator[Batch]:
        """Full shuffles of the complete run, numbered after the first epoch."""
        epochs = self.order.epochs
        if epochs is not None and epochs <= 1:
            return
        first = self.first_epoch_steps
        stream = self._window_stream(self.follower.order, self.order.seed,
                                     max(0, self.start_step - first),
                                     None if epochs is None else epochs - 1,
                                     self.order.drop_last)
        if not stream.plan.steps_per_epoch:  # no token here (or none fills a batch)
            stream.close()
            return
        try:
            for batch in stream:
                batch.step += first
                batch.epoch += 1
                yield batch
        finally:
            stream.close()

    def _produce(self) -> Iterator[Batch]:
        try:
            yield from self._first_epoch()
            yield from self._later_epochs()
        except _Stopped:
            return

    def _convert(self, batch: Batch) -> Batch:
        if not self._dtype_checked:  # a float8 hook's dtypes: known once one committed
            self.dtype = self._view.read_dtype(self.hooks, self.dtype)
            self._dtype_checked = True
        return formats.hand_over(batch, self.normalizers, self.framework, self.dtype,
                                 self.sharding)

    def _produce_converted(self) -> Iterator[Batch]:
        for batch in self._produce():
            yield self._convert(batch)

    def __iter__(self) -> Iterator[Batch]:
        if self._prefetch <= 0:
            yield from self._produce_converted()
            return
        yield from self._prefetcher

    def close(self, timeout: float = 30.0) -> None:
        """Stops the background thread, also while it waits for commits (idempotent)."""
        self.follower.stopped.set()
        self._prefetcher.close(timeout)

    def __enter__(self) -> "FollowStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
