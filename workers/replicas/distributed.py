"""Joining the hosts of one replica, and the few host-level collectives a worker needs.

Hosts of a replica run the same jitted program in lockstep, so every decision that changes
control flow (which partition next, whether to stop) is agreed through a collective.
A one-host replica needs none of this and never calls `jax.distributed`.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import time

import numpy as np

from actx.workers.replicas.stop import Preempted


@dataclasses.dataclass(frozen=True)
class ProcessGroup:
    """coordinator: "host:port" of process 0 (None: auto-detect, as on a TPU pod slice)."""

    num_processes: int = 1
    process_id: int = 0
    coordinator: str | None = None

    @classmethod
    def from_env(cls, coordinator: str | None = None, num_processes: int | None = None,
                 process_id: int | None = None) -> "ProcessGroup":
        """Flags win over ACTX_COORDINATOR / ACTX_NUM_PROCESSES / ACTX_PROCESS_ID."""
        env = os.environ
        return cls(
            num_processes=int(num_processes if num_processes is not None
                              else env.get("ACTX_NUM_PROCESSES", 1)),
            process_id=int(process_id if process_id is not None
                           else env.get("ACTX_PROCESS_ID", 0)),
            coordinator=coordinator or env.get("ACTX_COORDINATOR") or None,
        )

    def initialize(self) -> None:
        import jax

        if self.num_processes <= 1:
            return
        # Only the CPU client reads this (TPU/GPU use their own collectives); asking for the
        # backend here would initialise it too early, so it is set unconditionally.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        # JAX's preemption service installs its own SIGTERM handler over this process's
        # (workers.main's stop signals): a multi-host worker then ignored Slurm's scancel,
        # time limit or failed node and a TPU pod's stop, extracting on until SIGKILL.
        # The hosts agree on a stop themselves (workers.replicas.stop).
        jax.config.update("jax_enable_preemption_service", False)
        jax.distributed.initialize(
            coordinator_address=self.coordinator, num_processes=self.num_processes,
            process_id=self.process_id)


def process_count() -> int:
    import jax

    return jax.process_count()


def broadcast_ints(values: list[int]) -> list[int]:
    """Process 0's list of ints, on every process (the others' arguments are ignored)."""
    if process_count() == 1:
        return list(values)
    from jax.experimental import multihost_utils

    n = int(multihost_utils.broadcast_one_to_all(np.int32(len(values))))
    data = np.zeros(max(1, n), np.int32)
    if len(values) == n:
        data[:n] = values
    return [int(v) for v in np.asarray(multihost_utils.broadcast_one_to_all(data))[:n]]


def max_int(value: int) -> int:
    """The largest of every process's value, on every process."""
    if process_count() == 1:
        return value
    from jax.experimental import multihost_utils

    return int(np.asarray(multihost_utils.process_allgather(np.int32(value))).max())


def any_process(flag: bool) -> bool:
    """True on every process if it is True on any (e.g. one host got SIGTERM)."""
    if process_count() == 1:
        return flag
    from jax.experimental import multihost_utils

    return bool(np.asarray(multihost_utils.process_allgather(np.int32(flag))).any())


def allgather_uint32(values: np.ndarray) -> np.ndarray:
    """[processes, *values.shape]; every process passes the same shape."""
    if process_count() == 1:
        return values[None]
    from jax.experimental import multihost_utils

    # Bit-cast to int32: exact, and int32 is available whatever jax_enable_x64 says.
    gathered = multihost_utils.process_allgather(values.astype(np.uint32).view(np.int32))
    return np.ascontiguousarray(np.asarray(gathered, dtype=np.int32)).view(np.uint32)


_sequence_names = itertools.count()


class LeaderSequence:
    """A sequence of ints that process 0 chooses one at a time and every process reads in
    the same order, through jax.distributed's key-value store rather than a device
    collective, so a planning thread may take the next value while the main thread runs the
    replica's steps (the work-stealing partition choice, which claims partitions in storage
    as it goes). A negative value ends the sequence.

    Every process creates its sequences in the same order (the name is a counter). `next()`
    does not block on another process once the steps run: elsewhere than on process 0 it
    returns None while the value is not yet chosen, and the caller asks again later (the
    hosts of a replica run their steps in lockstep, so one that waited here for the leader,
    while the leader still had rows of its own to plan, would stall them all); only the
    first value, chosen before any step, is waited for (every value, with `blocking`: for
    callers with no steps to run between values). Process 0 chooses `LOOKAHEAD` values
    ahead of its own use, so hosts whose work runs out sooner seldom find nothing. When its
    choice fails, process 0 publishes the error, and the others raise it rather than wait.
    `choose` may return None: nothing to choose yet (work sharing: another replica's
    partitions may come free later); nothing is published and every process reads None,
    except for a value waited for, which process 0 waits for (`wait()` between tries).

    A SIGTERM while a value is waited for is the replica's, on whichever host it lands
    (`stop`: this process's event): the hosts have nothing in hand and no step to agree at,
    so a host stopped there asks process 0 through the store, and process 0, stopped itself
    (`wait()` raises Preempted) or asked, publishes the stop; every host raises Preempted.
    A host that left alone would leave the others to hang at their next collective.
    """

    LOOKAHEAD = 2
    _ERROR = "error: "
    _STOP = "stop: "
    POLL_MS = 2_000  # how often a host waiting for a value looks at its own SIGTERM

    def __init__(self, choose, wait=lambda: time.sleep(1.0), stop=None, blocking=False):
        self._choose = choose
        self._wait = wait
        self._stop = stop
        self._blocking = blocking
        self._name = f"actx/sequence/{next(_sequence_names)}"
        self._index = 0  # the next value this process reads
        self._chosen: list[int] = []  # process 0: the values published so far
        self._stop_asked = False

    def next(self) -> int | None:
        import jax
        from jax._src import distributed as jax_distributed  # the store has no public API

        client = jax_distributed.global_state.client
        if jax.process_index() == 0:
            while (len(self._chosen) <= self._index + self.LOOKAHEAD
                   and not (self._chosen and self._chosen[-1] < 0)):
                key = f"{self._name}/{len(self._chosen)}"
                try:
                    value = self._choose()
                    while value is None and self._waited_for(len(self._chosen)):
                        self._wait()
                        self._raise_if_another_stopped(client)
                        value = self._choose()
                except BaseException as e:
                    said = (f"{self._STOP}{e}" if isinstance(e, Preempted)
                            else f"{self._ERROR}{type(e).__name__}: {e}")
                    client.key_value_set(key, said)
                    raise
                if value is None:  # nothing yet: asked again at a later step
                    break
                client.key_value_set(key, str(int(value)))
                self._chosen.append(int(value))
            if self._index < len(self._chosen):
                value = self._chosen[self._index]
            elif self._chosen[-1] < 0:
                value = self._chosen[-1]
            else:
                return None
        else:
            key = f"{self._name}/{self._index}"
            try:
                # A value waited for: before the first, no host has a step to run, and the
                # leader chooses it before anything else. Later ones are not (but blocking).
                text = (self._wait_for(client, key) if self._waited_for(self._index)
                        else client.key_value_try_get(key))
            except Exception as e:
                if "NOT_FOUND" in str(e):
                    return None
                raise
            if text.startswith(self._STOP):
                raise Preempted(text[len(self._STOP):])
            if text.startswith(self._ERROR):
                raise RuntimeError(f"the replica's leader (process 0) failed to choose the "
                                   f"next partition: {text[len(self._ERROR):]}")
            value = int(text)
        if value >= 0:
            self._index += 1
        return value

    def _waited_for(self, index: int) -> bool:
        """Whether the value at `index`, when it is the one needed now, is waited for."""
        return index == self._index and (index == 0 or self._blocking)

    def _raise_if_another_stopped(self, client) -> None:
        """Process 0, waiting: raises Preempted where another host asked to stop."""
        try:
            host = client.key_value_try_get(f"{self._name}/stop")
        except Exception as e:
            if "NOT_FOUND" in str(e):
                return
            raise
        raise Preempted(f"stopped while waiting for work (nothing was in hand): process "
                        f"{host} of the replica was sent SIGTERM")

    def _wait_for(self, client, key: str) -> str:
        import jax

        while True:
            if self._stop is not None and self._stop.is_set() and not self._stop_asked:
                client.key_value_set(f"{self._name}/stop", str(jax.process_index()),
                                     allow_overwrite=True)  # two hosts may ask at once
                self._stop_asked = True
            try:
                return client.blocking_key_value_get(
                    key, self.POLL_MS if self._stop is not None else 10_000)
            except Exception as e:  # a deadline: ask again (the leader may list for long)
                if "DEADLINE_EXCEEDED" not in str(e):
                    raise
