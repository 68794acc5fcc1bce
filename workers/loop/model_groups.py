"""Several extractions of one run at once in one worker process (`models_at_once`): each
model in device memory beside the others, each extraction's loop on a thread of its own.

Which models go together is decided by measurement, not by a guess: the next model is
loaded beside those already loaded, and kept there only when the device's memory holds
the loaded weights (the backend's `bytes_in_use`) plus every loop's working set
(`working_bytes`: KV cache and the steps' outputs in flight) within 90% of its
`bytes_limit`; a load that runs out of device memory counts as not fitting. A model that
does not fit is let go at once and waits for the next group. A backend that does not report
its memory (the CPU) holds whatever the host holds.

The loops run on threads only within a one-host replica: a multi-host replica's loops
agree through collectives, and two loops' collectives in one process could interleave in
another order on each host. There, and with `models_at_once: 1`, extractions run one after
another (workers.main).

Each extraction keeps its own store view, heartbeats, markers and numerics record
(schemas.extraction), so the bytes are those of each model alone; the XLA programs of two
models share the devices and run in whichever order they are dispatched.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import threading
from typing import TYPE_CHECKING, Any, Protocol

from actx.schemas import errors
from actx.schemas import layout
from actx.schemas import quantised

if TYPE_CHECKING:  # no JAX before a model loads (workers.main imports this module)
    from actx.schemas import manifest as manifest_lib
    from actx.schemas import runspec, worker_options
    from actx.workers.loop import schedule
    from actx.workers.model import loaded as loaded_model
    from actx.workers.loop.progress import Progress

log = logging.getLogger("actx.worker")


class Footprint(Protocol):
    """What decides a loaded worker's device memory beyond its weights (`working_bytes`):
    `runner.Worker` is one."""

    opts: worker_options.WorkerOptions  # batch_size, steps_in_flight
    mesh: Any  # jax.sharding.Mesh: the batch's split over devices
    manifest: manifest_lib.Manifest  # seq_len
    spec: runspec.RunSpec  # the capture's dtype
    loaded: loaded_model.LoadedModel  # the hooks' widths, the KV cache


class Member(Footprint, Protocol):
    """A loaded worker of a group: its footprint, and the identity its heartbeats carry
    while it waits (`_beat_while_waiting`); `workers.main` runs it and stops it."""

    extraction: str
    store: Any  # schemas.extraction_store.ExtractionStore
    heartbeat_writer: Any
    progress: Progress
    host: str
    attempt: str
    topo: schedule.Topology


def working_bytes(worker: Footprint) -> int:
    """Device bytes one worker's loop holds beyond its weights, per device: its KV cache
    (long documents) and the outputs of the steps in flight (and the one being handled)."""
    from actx.workers.model import sharding

    opts, loaded = worker.opts, worker.loaded
    slots = opts.batch_size // max(1, sharding.axis_size(worker.mesh, "batch"))
    seq_len = worker.manifest.seq_len
    dtype = worker.spec.capture.dtype
    # A float8 step's outputs: one byte a value and a float32 scale per token and hook.
    per_token = (sum(loaded.hooks.values()) * layout.ITEMSIZE[dtype]
                 + (4 * len(loaded.hooks) if quantised.is_quantised(dtype) else 0))
    outputs = slots * seq_len * per_token * (opts.steps_in_flight + 1)
    cache = (0 if loaded.max_context is None
             else loaded.fn.cache_bytes_per_device(opts.batch_size, seq_len))
    return outputs + cache


@dataclasses.dataclass(frozen=True)
class Fit:
    """Whether loaded workers fit on the device together, and the figures that said so."""

    fits: bool
    detail: str


def fit(jax, workers: list[Footprint]) -> Fit:
    """Whether `workers`, all loaded, can run their loops at once (see the module's doc)."""
    from actx.workers.attention import kv_cache  # JAX: only once models load
    from actx.workers.loop import admission  # JAX: only once models load

    stats = admission.device_memory_stats(jax)
    limit, in_use = stats.get("bytes_limit"), stats.get("bytes_in_use")
    if not limit or in_use is None:
        return Fit(True, "the device does not report its memory")
    need = in_use + sum(working_bytes(w) for w in workers)
    gib = 1 << 30
    return Fit(need <= kv_cache.DEVICE_FRACTION * limit,
               f"{need / gib:.2f} GiB needed (weights loaded {in_use / gib:.2f} GiB, the loops' "
               f"working sets {(need - in_use) / gib:.2f} GiB) of {limit / gib:.2f} GiB")


def _out_of_memory(e: BaseException) -> bool:
    return "RESOURCE_EXHAUSTED" in str(e) or "out of memory" in str(e).lower()


def _beat_while_waiting(like: Member, message: str, name: str | None = None):
    """A heartbeat for an extraction of this process whose loop does not run yet, so that
    status and `--wait` see a live host, not a silent one: `like` itself, loaded and
    waiting for the rest of its group (its own writer, which its session takes over), or
    extraction `name`, waiting for its turn (in `like`'s identity: every extraction of a
    process has the process's host name)."""
    from actx.schemas import extraction_store
    from actx.workers.loop import progress

    if name is None:
        store, writer, beat = like.store, like.heartbeat_writer, like.progress
        attempt = like.attempt
    else:
        store = extraction_store.view(getattr(like.store, "base", like.store), name)
        writer, beat, attempt = None, progress.Progress(), f"{like.attempt}-waiting"
    beat.update(phase=message)
    thread = progress.HeartbeatThread(store, like.host, like.topo.replica,
                                      like.topo.host_index, attempt, beat,
                                      like.heartbeat_s, writer=writer, job=like.opts.job)
    thread.start()
    return thread


def extract_at_once(opts, names: list[str], sigint, load, run) -> int:
    """Extracts `names` in groups of up to `opts.models_at_once` that fit together, each
    group's loops at once; `load(opts, sigint)` gives a worker or an exit code,
    `run(worker, sigint)` runs one. Returns the worst exit code. As one after another
    does, it stops after a group with a failure, and a model that is refused while
    loading stops the job after the models loaded before it have run."""
    import jax

    if jax.process_count() > 1:
        log.info("models_at_once=%d: this replica has %d hosts, whose loops agree through "
                 "collectives; the extractions run one after another", opts.models_at_once,
                 jax.process_count())
        group_size = 1
    else:
        group_size = opts.models_at_once
    pending = list(names)
    waiting: dict[str, object] = {}  # heartbeats of the extractions that wait their turn
    try:
        while pending:
            group, refused = _load_group(opts, pending[:group_size], sigint, load, waiting)
            pending = pending[len(group):]
            if not group:
                return refused
            for name in pending:  # whoever waits says so (and after whom) while it runs
                if name in waiting:
                    waiting.pop(name).stop(final_beat=False)
                waiting[name] = _beat_while_waiting(
                    group[0], f"waiting: runs after {_shown(group)}", name)
            code = _run_group(group, sigint, run)
            _let_go(group, sigint)
            if code != 0 or sigint.received.is_set():
                return code
            if refused:
                return refused
        return 0
    finally:
        for thread in waiting.values():
            thread.stop(final_beat=False)


def _load_group(opts, names: list[str], sigint, load, waiting: dict
                ) -> tuple[list[Member], int]:
    """Loads the models of `names` one by one while they fit beside the ones before; (the
    loaded workers, the exit code of a load that was refused or stopped, else 0)."""
    import jax

    group: list[Member] = []
    beats: list = []  # the loaded models' heartbeats while the next one loads
    try:
        for name in names:
            if name in waiting:  # its own worker beats from now on
                waiting.pop(name).stop(final_beat=False)
            try:
                loaded = load(dataclasses.replace(opts, extraction=name), sigint)
            except Exception as e:  # noqa: BLE001 - out of device memory: not beside these
                if not group or not _out_of_memory(e):
                    raise
                log.info("extraction %r does not fit beside %s (%s); it runs after them",
                         name, _shown(group), errors.first_line(e))
                break
            if isinstance(loaded, int):  # refused, or stopped while loading
                if sigint.received.is_set():
                    _let_go(group, sigint)
                return group, loaded
            if group:
                found = fit(jax, [*group, loaded])
                if not found.fits:
                    log.info("extraction %r does not fit beside %s (%s); it runs after them",
                             name, _shown(group), found.detail)
                    del loaded
                    break
            group.append(loaded)
            beats.append((_beat_while_waiting(loaded, "loaded; waiting for the models "
                                                      "loaded beside it"),
                          loaded.progress, loaded.progress.phase))
            del loaded  # the group holds it; nothing else may when the group lets go
        return group, 0
    finally:
        for thread, progress, phase in beats:  # each session takes over its writer
            thread.stop(final_beat=False)
            progress.update(phase=phase)
        gc.collect()  # a model let go (or a failed load's arrays) leaves the device now


def _shown(group: list[Member]) -> str:
    return ", ".join(repr(w.extraction or "default") for w in group)


def _let_go(group: list[Member], sigint) -> None:
    """The group's models go before the next group loads."""
    sigint.workers = []
    group.clear()
    gc.collect()


def _run_group(group: list[Member], sigint, run) -> int:
    """Runs the group's loops, one thread each (the first on this thread); the worst exit
    code. A loop that fails leaves the others to finish: their partitions commit. A second
    stop signal while this thread waits for the others stops the process now."""
    sigint.workers = list(group)  # a stop signal ends every loop at its next step
    if len(group) == 1:
        return run(group[0], sigint)
    log.info("extracting %s at once", _shown(group))
    codes: list = [None] * len(group)
    raised: list[BaseException] = []

    def one(i: int) -> None:
        try:
            codes[i] = run(group[i], sigint)
        except KeyboardInterrupt:  # this thread, between signals' checks: a stop
            codes[i] = sigint.received.exit_code
        except BaseException as e:  # noqa: BLE001 - raised again on this thread below
            codes[i] = 1
            raised.append(e)

    threads = [threading.Thread(target=one, args=(i,), daemon=True,
                                name=f"extraction-{group[i].extraction or 'default'}")
               for i in range(1, len(group))]
    for t in threads:
        t.start()
    try:
        one(0)
        for t in threads:
            t.join()
    except KeyboardInterrupt:  # the second signal: the loops' threads end with the process
        return sigint.received.exit_code
    if raised:
        raise raised[0]
    return max(codes, key=lambda c: (c != 0, c or 0))
