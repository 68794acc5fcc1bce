"""A worker's progress and its heartbeat thread (`workers/<host>.json`).

The loop updates a `Progress` under its lock; a daemon thread turns it into a heartbeat
every few seconds (never more often than GCS allows one object to be rewritten).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Callable

from actx.schemas import errors
from actx.schemas import heartbeat as heartbeat_lib
from actx.schemas import request_budget
from actx.workers.replicas import choice_policy

log = logging.getLogger("actx.worker")


class Progress:
    """What the heartbeat reports; written by the loop, read by the heartbeat thread."""

    def __init__(self):
        self.lock = threading.Lock()
        self.state = "starting"
        self.partition: int | None = None
        self.held: tuple[int, ...] = ()  # given to this process, not yet done
        self.step = 0
        self.steps = 0
        self.tokens_done = 0
        self.partitions_done = 0
        self.tokens_left = 0
        self.started = self.created = time.monotonic()
        # The steady-state rate counts from the first tokens on: what came before (loading
        # weights, compiling the step, the first step itself) is start-up, not throughput.
        self.first_tokens_at: float | None = None
        self.first_tokens = 0
        self.message = ""
        # What the worker does before its first tokens (loading weights, compiling, the
        # first step): shown as the heartbeat's message until tokens flow.
        self.phase = ""
        # Work sharing between replicas (workers.replicas.choice_policy): replica -> partitions
        # taken from its list; taker -> own partitions it took first; why this host idles.
        self.stolen_from: dict[str, int] = {}
        self.given_up: dict[str, int] = {}
        self.idle_reason = ""
        # The running heartbeat thread's write out of turn (set while one runs): `hold`
        # asks for it once, at this process's first claim.
        self.beat_now: Callable[[], None] | None = None
        self._claimed_any = False
        # Silences: when a beat last reached the store (`awake_time`, taken as its
        # `updated_at` was) and how often two came further apart than `silent_after_s`
        # (the heartbeat thread's: two and a half of its intervals). A process frozen
        # (SIGSTOP), on a machine that slept, or cut off from its store that long may have
        # looked dead to the other attempts, which take a dead attempt's partitions over
        # (`Worker.taken_over` finds out which).
        self.beat_written_at: float | None = None
        self.silent_after_s = float("inf")
        self._silences = self._silences_asked = 0
        self._silence_asked_at: float | None = None  # the last beat of a silence asked of
        # For this long after a silence every beat written is told too: a taker may claim
        # from a heartbeat listing read during the silence, after the first looks.
        self.watch_after_silence_s = 0.0
        self._watch_until = float("-inf")
        self._beats = self._beats_asked = 0

    def wrote_beat(self, at: float) -> None:
        """Records a beat written (`at`: `awake_time()` when its content was taken)."""
        with self.lock:
            if self.beat_written_at is not None and at - self.beat_written_at > self.silent_after_s:
                self._silences += 1
                self._watch_until = max(self._watch_until, at + self.watch_after_silence_s)
            self.beat_written_at = at
            self._beats += 1

    def was_silent(self) -> bool:
        """Whether this process's heartbeats were silent longer than `silent_after_s`: once
        for a silence under way (no beat for that long now), once more for each gap
        between two beats written (the first after a freeze comes only once the
        heartbeat thread runs again), and once for each beat written in the
        `watch_after_silence_s` after either."""
        now = awake_time()
        with self.lock:
            silent = self._silences > self._silences_asked
            self._silences_asked = self._silences
            if (not silent and self.beat_written_at is not None
                    and now - self.beat_written_at > self.silent_after_s
                    and self._silence_asked_at != self.beat_written_at):
                silent, self._silence_asked_at = True, self.beat_written_at
                self._watch_until = max(self._watch_until, now + self.watch_after_silence_s)
            silent = silent or (self._beats > self._beats_asked and now < self._watch_until)
            self._beats_asked = self._beats
        return silent

    def hold(self, pid: int) -> None:
        """Adds partition `pid`, just claimed, to those this process holds. The first is
        named in a heartbeat at once, not at the next interval (up to ~20 s on a pod): a
        replica's first partition holds its longest chains (`choice_policy.own_order`), and
        a host that dies before a heartbeat names it (an out-of-memory first step is the
        usual way) leaves it to be found by a look in the run's tail, redone last, ending
        the run late. Named, the live replicas take it over as soon as this host's
        heartbeat goes stale (`Chooser._take_over_the_dead`). One write a process."""
        with self.lock:
            self.held = (*self.held, pid)
            first, self._claimed_any = not self._claimed_any, True
            beat_now = self.beat_now
        if first and beat_now is not None:
            beat_now()

    def update(self, **fields) -> None:
        with self.lock:
            for name, value in fields.items():
                setattr(self, name, value)

    def steady_rate(self, now: float) -> float:
        """Tokens per second since the first tokens (0.0 until tokens came after them:
        no steady rate yet, which status shows as an ETA still estimating). Caller holds
        the lock."""
        if self.first_tokens_at is None or self.tokens_done <= self.first_tokens:
            return 0.0
        return (self.tokens_done - self.first_tokens) / max(1e-6, now - self.first_tokens_at)

    def say_phase(self, phase: str) -> None:
        """A start-up phase: in the heartbeat until the first tokens, and in the log."""
        with self.lock:
            if self.tokens_done == 0:
                self.phase = phase
        log.info("%s", phase)

    def add_tokens(self, tokens: int) -> None:
        """Counts a step's output handled, with `tokens` of this host's rows in it. A host
        of a multi-host replica may store no row of a step (its shards of the partition
        are empty) and still ran it: start-up is over either way."""
        with self.lock:
            if tokens and self.first_tokens_at is None:
                self.first_tokens_at, self.first_tokens = time.monotonic(), tokens
            self.tokens_done += tokens
            self.tokens_left = max(0, self.tokens_left - tokens)
            if self.phase:
                self.phase = ""
                log.info("first step done after %.1fs: extracting",
                         time.monotonic() - self.created)


def awake_time() -> float:
    """Seconds on a clock that goes on while the machine sleeps (CLOCK_BOOTTIME, where the
    system has it; monotonic elsewhere): the others judge this host's heartbeats by the
    wall clock, which a suspended machine's monotonic clock does not follow."""
    boottime = getattr(time, "CLOCK_BOOTTIME", None)
    return time.clock_gettime(boottime) if boottime is not None else time.monotonic()


# Replicas named per counter in a heartbeat: its summary must stay within GCS's 8 KB of
# metadata however many replicas a stealing host took from; the rest add up under "more".
MAX_NAMED_REPLICAS = 16


def _largest(counts: dict[str, int]) -> dict[str, int]:
    if len(counts) <= MAX_NAMED_REPLICAS:
        return dict(counts)
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    kept = dict(ranked[:MAX_NAMED_REPLICAS - 1])
    kept["more"] = sum(n for _, n in ranked[MAX_NAMED_REPLICAS - 1:])
    return kept


class HeartbeatThread:
    """Writes `progress` as this host's heartbeat every `interval_s` until stopped."""

    def __init__(self, store, host: str, replica: int, process_index: int, attempt: str,
                 progress: Progress, interval_s: float,
                 writer: heartbeat_lib.HeartbeatWriter | None = None, job: str = ""):
        # A writer passed on from an earlier thread (the start-up's) keeps its history and
        # its one-write-per-interval pace.
        self.writer = writer or heartbeat_lib.HeartbeatWriter(store, host,
                                                              min_interval_s=interval_s)
        self._identity = dict(host=host, replica=replica, process_index=process_index,
                              attempt=attempt, machine=heartbeat_lib.this_machine(),
                              pid=os.getpid(), job=job)
        self._progress = progress
        self._interval_s = interval_s
        # More than a beat missed (the writer may space beats up to two intervals apart,
        # after a forced one), less than the three after which the others call it dead.
        progress.silent_after_s = 2.5 * max(interval_s, self.writer.min_interval_s)
        # As long as another host may still act on a listing that showed this one dead.
        progress.watch_after_silence_s = request_budget.stale_after_s(
            choice_policy.STALE_AFTER_S, interval_s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="actx-heartbeat")
        self._write_lock = threading.Lock()  # the final beat never races the thread's

    def start(self) -> None:
        """Writes the first beat here: a run this host cannot write at all (a bucket that
        refuses, a full or read-only disk) ends the worker at once with the store's one-line
        error. Later beats go on the thread, where a missed one must not stop extraction."""
        self.beat(force=True, raise_user_errors=True)
        self._progress.beat_now = self._beat_now
        self._thread.start()

    def _beat_now(self) -> None:
        self.beat(force=True)

    def _loop(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.beat(force=False)

    def beat(self, force: bool, raise_user_errors: bool = False) -> None:
        p = self._progress
        with p.lock:
            taken_at = awake_time()
            rate = p.steady_rate(time.monotonic())
            hb = heartbeat_lib.Heartbeat(
                **self._identity, state=p.state, updated_at=time.time(),
                partition=p.partition, step=p.step, steps=p.steps, tokens_done=p.tokens_done,
                tokens_per_s=round(rate, 1),
                eta_s=round(p.tokens_left / rate, 1) if rate > 0 else None,
                partitions_done=p.partitions_done, message=p.message or p.phase,
                held=p.held, stolen_from=_largest(p.stolen_from),
                given_up=_largest(p.given_up), idle_reason=p.idle_reason,
                interval_s=self._interval_s)
        with self._write_lock:
            try:
                if self.writer.beat(hb, force=force):
                    p.wrote_beat(taken_at)
            except errors.UserError:
                if raise_user_errors:
                    raise
                log.warning("heartbeat write failed: %s", sys.exc_info()[1])
            except Exception as e:  # a missed heartbeat must not stop extraction
                log.warning("heartbeat write failed: %s", e)

    def stop(self, final_beat: bool = True) -> None:
        """Stops the thread and writes the final state (unless another thread of the same
        writer takes over)."""
        self._stop.set()
        with self._progress.lock:
            if self._progress.beat_now == self._beat_now:
                self._progress.beat_now = None
        self._thread.join(timeout=30)
        if final_beat:
            self.beat(force=True)
